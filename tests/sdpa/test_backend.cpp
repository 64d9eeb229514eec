// attn::select_backend (src/sdpa/backend.cpp): which backend each request takes, that a requested
// backend runs or says why it cannot, and that every backend computes the
// float64 reference's output and gradients.

#include "test_support.h"

#include "kernels/cpu/fused_attention.h"
#include "kernels/cpu/short_heads.h"
#include "kernels/cpu/tile_product.h"
#include "runtime/compat.h"
#include "sdpa/backend.h"

#include <attn/attn.h>

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iostream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

namespace {

using attn::AttentionBackend;
using attn::SDPAOptions;
using attn::select_backend;
using attn::testing::Tolerance;
using attn::testing::tolerance_for;

constexpr bool kLibTorch2 = TORCH_VERSION_MAJOR >= 2;

// Whether the CPU has `flag`, as Linux names it in /proc/cpuinfo: the
// features under which docs/BENCHMARKS.md ("Choosing the CPU backend") measured LibTorch's kernel
// faster (the library's rule keeps attn's kernel elsewhere). Read from the
// operating system, so that a build by any compiler expects the same.
bool cpu_has(const char* flag) {
  return attn::testing::linux_cpu_flags().count(flag) > 0;
}

constexpr bool kRuleMeasured = TORCH_VERSION_MAJOR > 2 ||
    (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 15);

using Inputs = attn::testing::QueryKeyValue;

// (B, H, L, D) = (2, 3, length, 16) query against as many keys, float32,
// from a fixed seed.
Inputs make_inputs(
    bool requires_grad = false,
    torch::ScalarType dtype = torch::kFloat,
    int64_t length = 40) {
  torch::manual_seed(7);
  const auto make = [&]() {
    return torch::randn({2, 3, length, 16}).to(dtype).requires_grad_(requires_grad);
  };
  return {make(), make(), make()};
}

// The longest float queries and keys that the batched kernel takes: as
// measured with LibTorch 2.15 and MKL, or 1.13 (and other versions) where
// the tiled kernel multiplies in attn's loops or, on other CPUs, in BLAS.
int64_t batched_longest() {
  return kRuleMeasured ||
          !attn::detail::tile_products_run(attn::testing::widest_loops(), torch::kFloat)
      ? 64
      : 32;
}

// Whether the fused kernel's short loops run here (attn's loops multiply:
// x86 with AVX-512 or AVX2).
bool short_loops() {
  return attn::detail::short_heads_run(attn::testing::widest_loops(), torch::kFloat, 1, 1);
}

// Whether the CPU's flags say attn's loops multiply bfloat16 in bfloat16
// (AMX, or AMD's AVX512-BF16), where `cpu-short-sequences` leaves
// bfloat16 to the fused kernels.
bool bf16_loops_here() {
  const bool amd = attn::testing::linux_cpuinfo_field("vendor_id") == "AuthenticAMD";
  return cpu_has("amx_bf16") || (amd && cpu_has("avx512_bf16"));
}

// Sequences longer than that, for the rules between the other backends.
constexpr int64_t kLong = 200;

// The capabilities print as ATTN_CPU_CAPABILITY takes them; asking for
// one beyond this CPU's is an error naming those it runs (ctest runs this
// again under ATTN_CPU_CAPABILITY=avx2, where avx512 is beyond).
TEST(CpuCapability, OneBeyondThisCpuIsAnErrorNamingThoseItRuns) {
  using attn::CpuCapability;
  std::ostringstream printed;
  printed << CpuCapability::portable << ' ' << CpuCapability::avx2 << ' ' << CpuCapability::avx512
          << ' ' << CpuCapability::avx512_bf16 << ' ' << CpuCapability::amx;
  EXPECT_EQ(printed.str(), "portable avx2 avx512 avx512_bf16 amx");
  const auto runs = attn::cpu_capabilities();
  ASSERT_FALSE(runs.empty());
  EXPECT_EQ(runs.front(), CpuCapability::portable);
  if (runs.back() == CpuCapability::amx) {
    GTEST_SKIP() << "this CPU runs every capability: none is beyond it";
  }
  std::string names;
  for (const auto capability : runs) {
    names += (names.empty() ? "" : ", ") + std::string(attn::cpu_capability_name(capability));
  }
  const auto beyond = static_cast<CpuCapability>(static_cast<int>(runs.back()) + 1);
  const auto q = torch::randn({1, 2, 4, 8});
  EXPECT_ATTN_ERROR(
      select_backend(q, q, q, SDPAOptions().cpu_capability(beyond)),
      std::string("scaled_dot_product_attention: cpu_capability ") +
          attn::cpu_capability_name(beyond) + " is beyond this CPU, which runs " + names);
}

TEST(Backend, NamesPrintAsTheDocsWriteThem) {
  std::ostringstream printed;
  printed << AttentionBackend::fused_cpu << ' ' << AttentionBackend::fused_cpu_weights << ' '
          << AttentionBackend::batched_cpu << ' ' << AttentionBackend::libtorch << ' '
          << AttentionBackend::math;
  EXPECT_EQ(printed.str(), "fused_cpu fused_cpu_weights batched_cpu libtorch math");
}

// The default call, with inputs that need gradients, at the lengths and
// head counts of common models: one of attn's CPU kernels (or LibTorch's
// where the rule measured it faster), never the math path, and no weights.
TEST(BackendSelection, TheDefaultCallTakesAFusedKernel) {
  for (const int64_t T : {128, 512, 2048}) {
    for (const bool causal : {false, true}) {
      const auto make = [&] { return torch::randn({2, 8, T, 64}).requires_grad_(); };
      const auto q = make(), k = make(), v = make();
      const auto options = SDPAOptions().is_causal(causal);
      const auto backend = select_backend(q, k, v, options);
      EXPECT_TRUE(
          backend == AttentionBackend::fused_cpu ||
          (T == 128 && backend == AttentionBackend::batched_cpu) ||
          (kRuleMeasured && backend == AttentionBackend::libtorch))
          << "T=" << T << " causal=" << causal << ": " << backend;
      EXPECT_FALSE(options.need_weights());
    }
  }
}

TEST(BackendSelection, WeightsForInferenceTakeTheWeightsKernel) {
  const auto in = make_inputs(false, torch::kFloat, kLong);
  const auto weights = SDPAOptions().need_weights(true);
  EXPECT_EQ(select_backend(in.q, in.k, in.v, weights), AttentionBackend::fused_cpu_weights);
  EXPECT_EQ(
      select_backend(in.q, in.k, in.v, SDPAOptions(weights).is_causal(true).window(5)),
      AttentionBackend::fused_cpu_weights);
}

TEST(BackendSelection, WeightsWithGradientsTakeTheBatchedKernel) {
  const auto in = make_inputs(/*requires_grad=*/true, torch::kFloat, kLong);
  const auto weights = SDPAOptions().need_weights(true);
  // The one CPU kernel whose weights are differentiable, not the math path.
  EXPECT_EQ(select_backend(in.q, in.k, in.v, weights), AttentionBackend::batched_cpu);
  // Where no CPU kernel returns them (dropout while training), the math
  // path, whose draw is torch::nn::MultiheadAttention's.
  EXPECT_EQ(
      select_backend(in.q, in.k, in.v, SDPAOptions(weights).dropout_p(0.1)),
      AttentionBackend::math);
  // Without grad mode nothing needs a gradient.
  torch::NoGradGuard no_grad;
  EXPECT_EQ(select_backend(in.q, in.k, in.v, weights), AttentionBackend::fused_cpu_weights);
}

TEST(BackendSelection, NoWeightsTakeTheFusedKernelWhereLibTorchIsNotFaster) {
  const auto in = make_inputs(/*requires_grad=*/true, torch::kFloat, kLong);
  const auto no_weights = SDPAOptions().need_weights(false);
  // On the CPU, masks, windows and offsets take attn's kernel, whatever the
  // version: LibTorch's kernel was not measured with them.
  const auto mask = torch::ones({kLong, kLong}, torch::kBool).tril();
  for (const auto& options :
       {SDPAOptions(no_weights).attn_mask(mask), SDPAOptions(no_weights).window(8),
        SDPAOptions(no_weights).is_causal(true).query_offset(3)}) {
    EXPECT_EQ(select_backend(in.q, in.k, in.v, options), AttentionBackend::fused_cpu);
  }
  // float64 is never LibTorch's here: its kernel is measured for float32.
  const auto d = make_inputs(true, torch::kDouble, kLong);
  EXPECT_EQ(select_backend(d.q, d.k, d.v, no_weights), AttentionBackend::fused_cpu);
}

// The measured rules of docs/BACKENDS.md, cpu-short-heads and
// cpu-short-sequences, in float32: without weights, heads of up to 128
// queries and 64 keys take the fused kernel's short loops where they
// run; with weights, up to
// batched_longest() queries and keys take the batched kernel, with or
// without gradients (and so do requests without weights where the short
// loops do not run); beyond either, the others, except weights with
// gradients, which only the batched kernel differentiates. (A window keeps LibTorch's
// kernel out of the choice.)
TEST(BackendSelection, ShortSequencesTakeTheShortLoopsOrTheBatchedKernel) {
  const auto lengths = [](int64_t L, int64_t S, bool grad) {
    return Inputs{
        torch::randn({2, 4, L, 16}).requires_grad_(grad),
        torch::randn({2, 4, S, 16}).requires_grad_(grad),
        torch::randn({2, 4, S, 16}).requires_grad_(grad)};
  };
  const int64_t longest = batched_longest(), beyond = longest + 1;
  for (const bool grad : {false, true}) {
    for (const bool need_weights : {false, true}) {
      const auto options = SDPAOptions().need_weights(need_weights).is_causal(true).window(1000);
      SCOPED_TRACE(
          std::string("grad=") + (grad ? "1" : "0") +
          " need_weights=" + (need_weights ? "1" : "0"));
      const auto short_choice = !need_weights && short_loops() ? AttentionBackend::fused_cpu
                                                               : AttentionBackend::batched_cpu;
      for (const auto& in :
           {lengths(1, 1, grad), lengths(20, 20, grad), lengths(longest, longest, grad),
            lengths(1, longest, grad)}) {
        EXPECT_EQ(select_backend(in.q, in.k, in.v, options), short_choice)
            << "L=" << in.q.size(2) << " S=" << in.k.size(2);
      }
      // Beyond them, weights with gradients still take the batched kernel
      // (the one CPU kernel that differentiates them); the rest do not.
      const bool weights_with_grad = need_weights && grad;
      for (const auto& in :
           {lengths(beyond, beyond, grad), lengths(1, beyond, grad), lengths(beyond, 1, grad)}) {
        EXPECT_EQ(
            select_backend(in.q, in.k, in.v, options) == AttentionBackend::batched_cpu,
            weights_with_grad)
            << "L=" << in.q.size(2) << " S=" << in.k.size(2);
      }
      // The short loops' bounds: 128 queries, 64 keys.
      if (!need_weights && short_loops()) {
        const auto at_bounds = lengths(128, 64, grad);
        EXPECT_EQ(
            select_backend(at_bounds.q, at_bounds.k, at_bounds.v, options),
            AttentionBackend::fused_cpu);
      }
    }
  }
  // Dropout while training: the fused kernel (its tiled loops), which
  // alone of the short kernels drops weights.
  const auto in = lengths(20, 20, true);
  EXPECT_EQ(
      select_backend(in.q, in.k, in.v, SDPAOptions().dropout_p(0.1)), AttentionBackend::fused_cpu);
}

// The rules' one table, docs/BACKENDS.md: its rows name the rules of
// sdpa/backend.cpp, with their backends, in the same order.
TEST(BackendRules, TheDocsTableIsTheCodesRulesInOrder) {
  std::ifstream docs(ATTN_DOCS_FOLDER "/BACKENDS.md");
  ASSERT_TRUE(docs.good()) << "cannot read " << ATTN_DOCS_FOLDER "/BACKENDS.md";
  const std::regex row("^\\| `([a-z0-9-]+)` \\| `([a-z_]+)` \\|.*");
  std::vector<std::string> documented;
  for (std::string line; std::getline(docs, line);) {
    std::smatch match;
    if (std::regex_match(line, match, row)) {
      documented.push_back(match[1].str() + " -> " + match[2].str());
    }
  }
  std::vector<std::string> coded;
  for (const auto& rule : attn::detail::backend_rules()) {
    coded.push_back(std::string(rule.name) + " -> " + attn::backend_name(rule.backend));
  }
  EXPECT_EQ(documented, coded);
}

// Every rule of the table decides some request of a grid that varies what
// the rules read (device aside: the CUDA rule where CUDA is present), and
// each choice is a backend that can compute the request.
TEST(BackendRules, EveryRuleDecidesSomeRequest) {
  std::map<std::string, int> decided;
  const auto request = [&](int64_t L, int64_t S, int64_t D, int64_t heads, torch::ScalarType dtype,
                           bool grad, const SDPAOptions& options) {
    const auto make = [&](int64_t T) {
      return torch::zeros({1, 1, T, D}, dtype).requires_grad_(grad).expand({heads, 1, T, D});
    };
    const auto q = make(L), k = make(S), v = make(S);
    const auto& rule = attn::detail::deciding_rule(
        {q, k, v, options, attn::detail::widest_cpu_level()});
    decided[rule.name] += 1;
    EXPECT_EQ(select_backend(q, k, v, options), rule.backend) << rule.name;
    EXPECT_EQ(attn::detail::unsupported_reason(rule.backend, q, k, v, options), "") << rule.name;
  };
  for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
    for (const int64_t T : {16, 100, 200, 2048}) {
      for (const int64_t heads : {2, 32}) {
        for (const bool grad : {false, true}) {
          for (const bool causal : {false, true}) {
            for (const bool need_weights : {false, true}) {
              const auto options = SDPAOptions().is_causal(causal).need_weights(need_weights);
              request(T, T, 64, heads, dtype, grad, options);
              request(T + 100, T, 16, heads, dtype, grad, options);
              request(T, T, 64, heads, dtype, grad, SDPAOptions(options).dropout_p(0.1));
            }
          }
        }
      }
    }
  }
  std::vector<std::pair<std::string, std::string>> unreachable;
  if (!kRuleMeasured || !(cpu_has("avx512f") || cpu_has("amx_bf16"))) {
    unreachable.emplace_back("cpu-libtorch-faster", "LibTorch before 2.15 or a CPU not measured");
  }
  if (!short_loops()) {
    unreachable.emplace_back("cpu-short-heads", "attn's vector loops do not run on this CPU");
  }
  unreachable.emplace_back("cuda-libtorch", "the grid is on the CPU");
  for (const auto& rule : attn::detail::backend_rules()) {
    const auto skipped = std::find_if(unreachable.begin(), unreachable.end(), [&](const auto& u) {
      return u.first == rule.name;
    });
    if (skipped != unreachable.end()) {
      std::cout << "[ NOTE     ] rule " << rule.name << " not expected here: " << skipped->second
                << "\n";
      continue;
    }
    EXPECT_GT(decided[rule.name], 0) << "no request of the grid was decided by " << rule.name;
  }
}

// Which loops run the fused kernel (the call's plan says: sdpa/plan.h):
// the short heads' within their bounds (128 queries, 64 keys; float,
// bfloat16 or float16) where they run, the tiled ones elsewhere.
TEST(BackendSelection, TheFusedKernelTakesTheShortLoopsWithinTheirBounds) {
  using attn::detail::FusedLoops;
  const auto loops = [](int64_t L, int64_t S, torch::ScalarType dtype) {
    const auto q = torch::zeros({1, 2, L, 8}, dtype), k = torch::zeros({1, 2, S, 8}, dtype);
    return attn::testing::plan_of(q, k, k, SDPAOptions().backend(AttentionBackend::fused_cpu))
        .kernel.fused_loops;
  };
  const auto within = short_loops() ? FusedLoops::short_heads : FusedLoops::tiled;
  EXPECT_EQ(loops(1, 1, torch::kFloat), within);
  EXPECT_EQ(loops(128, 64, torch::kFloat), within);
  EXPECT_EQ(loops(129, 64, torch::kFloat), FusedLoops::tiled);
  EXPECT_EQ(loops(128, 65, torch::kFloat), FusedLoops::tiled);
  EXPECT_EQ(loops(16, 16, torch::kDouble), FusedLoops::tiled);
  EXPECT_EQ(loops(128, 64, torch::kBFloat16), within);
  EXPECT_EQ(loops(64, 64, torch::kHalf), within);
}

// The measured rule of docs/BACKENDS.md, cpu-libtorch-faster: LibTorch's kernel where it was
// measured faster (LibTorch 2.15 on, AVX-512 or AMX CPUs), attn's elsewhere.
TEST(BackendSelection, WhereTheRuleWasMeasuredTheFasterKernelRuns) {
  const auto no_weights = SDPAOptions().need_weights(false);
  // B·H = 2 heads, or `heads` = B·H with B = heads / 8.
  const auto lengths = [](int64_t L, int64_t S, torch::ScalarType dtype, bool grad,
                          int64_t heads = 2) {
    const int64_t B = heads >= 8 ? heads / 8 : 1, H = heads / B;
    return Inputs{
        torch::randn({B, H, L, 8}, dtype).requires_grad_(grad),
        torch::randn({B, H, S, 8}, dtype).requires_grad_(grad),
        torch::randn({B, H, S, 8}, dtype).requires_grad_(grad)};
  };
  // `measured` where the rule was measured, `elsewhere` (attn's tiled
  // kernel unless given) on other versions.
  const auto expect = [&](const Inputs& in, const SDPAOptions& options, AttentionBackend measured,
                          AttentionBackend elsewhere = AttentionBackend::fused_cpu) {
    EXPECT_EQ(select_backend(in.q, in.k, in.v, options), kRuleMeasured ? measured : elsewhere)
        << "L=" << in.q.size(2) << " S=" << in.k.size(2) << " " << in.q.scalar_type()
        << (in.q.requires_grad() ? " grad" : "") << (options.is_causal() ? " causal" : "");
  };
  const auto causal = SDPAOptions(no_weights).is_causal(true);
  const bool avx512 = cpu_has("avx512f");
  const auto float32 = avx512 ? AttentionBackend::libtorch : AttentionBackend::fused_cpu;
  // Float32: LibTorch's kernel without a causal mask from 2048 keys with
  // 32 heads or more, and up to 64 keys where attn's short loops do not
  // run; attn's elsewhere.
  const auto short_float32 = short_loops() ? AttentionBackend::fused_cpu
      : avx512                             ? AttentionBackend::libtorch
                                           : AttentionBackend::batched_cpu;
  const auto short_elsewhere = short_loops() ? AttentionBackend::fused_cpu
      : batched_longest() >= 64              ? AttentionBackend::batched_cpu
                                             : AttentionBackend::fused_cpu;
  expect(
      lengths(32, 32, torch::kFloat, false), no_weights, short_float32,
      short_loops() ? AttentionBackend::fused_cpu : AttentionBackend::batched_cpu);
  expect(lengths(64, 64, torch::kFloat, true), causal, short_float32, short_elsewhere);
  expect(lengths(128, 128, torch::kFloat, false), no_weights, AttentionBackend::fused_cpu);
  // At head width 64, up to 128 keys without a causal mask: the batched
  // kernel, on every version.
  const auto wide_heads = [](int64_t T, bool grad) {
    const auto make = [&] { return torch::randn({1, 8, T, 64}).requires_grad_(grad); };
    return Inputs{make(), make(), make()};
  };
  const auto batched = AttentionBackend::batched_cpu;
  expect(wide_heads(128, true), no_weights, batched, batched);
  expect(wide_heads(96, false), no_weights, batched, batched);
  expect(wide_heads(128, true), causal, AttentionBackend::fused_cpu);
  expect(wide_heads(129, false), no_weights, AttentionBackend::fused_cpu);
  // In bfloat16, where the CPU's flags say attn's loops multiply it in
  // bfloat16 (AMX, or AMD's AVX512-BF16), the fused kernel's tiled loops
  // without weights and the weights kernel with weights for inference:
  // the batched kernel computes it in float. With weights and gradients,
  // and in float16 (which both compute in float), the batched kernel.
  const bool half_loops[] = {bf16_loops_here(), false};
  const torch::ScalarType half_dtypes[] = {torch::kBFloat16, torch::kHalf};
  for (size_t i = 0; i < 2; ++i) {
    const auto in = wide_heads(128, true);
    const auto half = [&](const torch::Tensor& t) {
      return t.detach().to(half_dtypes[i]).requires_grad_();
    };
    const Inputs low{half(in.q), half(in.k), half(in.v)};
    const auto expected = half_loops[i] ? AttentionBackend::fused_cpu : batched;
    expect(low, no_weights, expected, expected);
    expect(low, SDPAOptions().need_weights(true), batched, batched);
    const auto weights_kernel = half_loops[i] ? AttentionBackend::fused_cpu_weights : batched;
    for (const int64_t T : {32, 128}) {
      const auto inference = wide_heads(T, false);
      const Inputs no_grad{
          inference.q.to(half_dtypes[i]), inference.k.to(half_dtypes[i]),
          inference.v.to(half_dtypes[i])};
      expect(no_grad, SDPAOptions().need_weights(true), weights_kernel, weights_kernel);
    }
  }
  expect(lengths(1024, 1024, torch::kFloat, false, 32), no_weights, AttentionBackend::fused_cpu);
  expect(lengths(2048, 2048, torch::kFloat, false), no_weights, AttentionBackend::fused_cpu);
  expect(lengths(2048, 2048, torch::kFloat, false, 32), no_weights, float32);
  expect(lengths(2048, 2048, torch::kFloat, true, 32), no_weights, float32);
  expect(lengths(1024, 1024, torch::kFloat, false), causal, AttentionBackend::fused_cpu);
  expect(lengths(512, 512, torch::kFloat, true), causal, AttentionBackend::fused_cpu);
  // A value width other than the query's: LibTorch would hold the scores.
  const auto wide_value = Inputs{
      torch::randn({1, 2, kLong, 8}), torch::randn({1, 2, kLong, 8}),
      torch::randn({1, 2, kLong, 12})};
  expect(wide_value, no_weights, AttentionBackend::fused_cpu);
  // bfloat16 on CPUs with AMX: LibTorch's kernel for inference, attn's
  // (computing in bfloat16) for training.
  const bool amx = cpu_has("amx_bf16") && cpu_has("amx_tile");
  const auto bf16 = amx ? AttentionBackend::libtorch : AttentionBackend::fused_cpu;
  expect(lengths(128, 128, torch::kBFloat16, false), no_weights, bf16);
  expect(lengths(2048, 2048, torch::kBFloat16, false), causal, bf16);
  expect(lengths(512, 512, torch::kBFloat16, true), causal, AttentionBackend::fused_cpu);
  expect(lengths(2048, 2048, torch::kBFloat16, true), no_weights, AttentionBackend::fused_cpu);
  // Where LibTorch's kernel is not the faster, short sequences take the
  // short loops (computing half precision on each head's values widened
  // to float), or the batched kernel.
  const auto short_half = short_loops() ? AttentionBackend::fused_cpu
                                        : AttentionBackend::batched_cpu;
  expect(lengths(64, 64, torch::kBFloat16, true), no_weights, short_half, short_elsewhere);
  expect(lengths(64, 64, torch::kHalf, false), no_weights, short_half, short_elsewhere);
  expect(lengths(128, 128, torch::kBFloat16, true), no_weights, AttentionBackend::fused_cpu);
  expect(lengths(256, 256, torch::kBFloat16, true), no_weights, AttentionBackend::fused_cpu);
}

TEST(BackendSelection, DropoutWhileTrainingTakesTheFusedKernelOnItsTiledLoops) {
  for (const bool requires_grad : {false, true}) {
    for (const int64_t T : {int64_t{16}, int64_t{64}, int64_t{128}, kLong}) {
      SCOPED_TRACE(::testing::Message() << "T " << T << (requires_grad ? ", grad" : ""));
      const auto in = make_inputs(requires_grad, torch::kFloat, T);
      const auto dropout = SDPAOptions().dropout_p(0.1);
      EXPECT_EQ(select_backend(in.q, in.k, in.v, dropout), AttentionBackend::fused_cpu);
      EXPECT_EQ(
          select_backend(in.q, in.k, in.v, SDPAOptions(dropout).is_causal(true)),
          AttentionBackend::fused_cpu);
      // BERT's fine-tuning: a key-padding mask.
      const auto padding = (torch::arange(T) < T - 3).view({1, 1, 1, T});
      EXPECT_EQ(
          select_backend(in.q, in.k, in.v, SDPAOptions(dropout).attn_mask(padding)),
          AttentionBackend::fused_cpu);
      EXPECT_EQ(
          attn::testing::plan_of(in.q, in.k, in.v, SDPAOptions(dropout).attn_mask(padding))
              .kernel.fused_loops,
          attn::detail::FusedLoops::tiled);
    }
  }
  // Weights with dropout: the math path, whose draw is LibTorch's.
  const auto in = make_inputs();
  EXPECT_EQ(
      select_backend(in.q, in.k, in.v, SDPAOptions().dropout_p(0.1).need_weights(true)),
      AttentionBackend::math);
}

TEST(BackendSelection, AMaskThatNeedsAGradientTakesTheFusedKernelOrWithWeightsTheMathPath) {
  const auto in = make_inputs();
  const auto bias = torch::zeros({40, 40}).requires_grad_();
  EXPECT_EQ(
      select_backend(in.q, in.k, in.v, SDPAOptions().attn_mask(bias).need_weights(false)),
      AttentionBackend::fused_cpu);
  EXPECT_EQ(
      select_backend(in.q, in.k, in.v, SDPAOptions().attn_mask(bias).need_weights(true)),
      AttentionBackend::math);
  // Its gradient comes from the tiled loops, not the short heads'.
  EXPECT_EQ(
      attn::testing::plan_of(in.q, in.k, in.v, SDPAOptions().attn_mask(bias)).kernel.fused_loops,
      attn::detail::FusedLoops::tiled);
}

// A block mask runs on attn's CPU kernels, as the rules choose them for
// its request, and never on LibTorch's, which takes none; a bool mask's
// blocks are skipped by the tiled loops, where it runs.
TEST(BackendSelection, ABlockMaskTakesAttnsKernelsNeverLibTorchs) {
  const int64_t T = 512;
  const auto ids = torch::arange(T).div(100, "floor");
  const auto mask = attn::block_mask(attn::document_mask(ids), 1, 1, T, T);
  const auto options = SDPAOptions().block_mask(mask);
  for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
    const auto make = [&](bool grad) {
      return torch::randn({2, 8, T, 64}).to(dtype).requires_grad_(grad);
    };
    const auto q = make(true), k = make(true), v = make(true);
    const auto frozen = make(false);
    EXPECT_EQ(select_backend(q, k, v, options), AttentionBackend::fused_cpu) << dtype;
    EXPECT_EQ(select_backend(frozen, frozen, frozen, options), AttentionBackend::fused_cpu)
        << dtype;
    EXPECT_EQ(
        select_backend(frozen, frozen, frozen, SDPAOptions(options).need_weights(true)),
        AttentionBackend::fused_cpu_weights)
        << dtype;
    EXPECT_EQ(
        select_backend(q, k, v, SDPAOptions(options).need_weights(true)),
        AttentionBackend::batched_cpu)
        << dtype;
    EXPECT_ATTN_ERROR(
        select_backend(q, k, v, SDPAOptions(options).backend(AttentionBackend::libtorch)),
        attn::detail::kHasNativeAttention
            ? "backend libtorch was requested, but it takes no block_mask"
            : "backend libtorch was requested, but it needs LibTorch 2.0");
  }
  // Key padding as a bool mask: the fused kernel's tiled loops.
  const auto in = torch::randn({2, 8, T, 64});
  const auto padding = (torch::arange(T) < 400).view({1, 1, 1, T});
  EXPECT_EQ(
      select_backend(in, in, in, SDPAOptions().attn_mask(padding)), AttentionBackend::fused_cpu);
  EXPECT_EQ(
      attn::testing::plan_of(in, in, in, SDPAOptions().attn_mask(padding)).kernel.fused_loops,
      attn::detail::FusedLoops::tiled);
}

// Requests that only attn's backends run: half precision takes the one
// float32 takes, except bfloat16 where `cpu-short-sequences` leaves it to
// the fused kernels (the tiled loops, or the weights kernel for weights).
TEST(BackendSelection, HalfPrecisionOnAttnsBackendsChoosesAsFloat32Does) {
  for (const auto dtype : {torch::kBFloat16, torch::kHalf}) {
    const auto low = make_inputs(false, dtype);
    const auto in = make_inputs();
    for (const auto& options : {SDPAOptions().need_weights(true), SDPAOptions().window(4)}) {
      auto expected = select_backend(in.q, in.k, in.v, options);
      if (dtype == torch::kBFloat16 && bf16_loops_here() &&
          expected == AttentionBackend::batched_cpu) {
        expected = options.need_weights() ? AttentionBackend::fused_cpu_weights
                                          : AttentionBackend::fused_cpu;
      }
      EXPECT_EQ(select_backend(low.q, low.k, low.v, options), expected) << dtype;
    }
  }
}

TEST(BackendSelection, InvalidInputsGetTheFunctionsErrors) {
  const auto in = make_inputs();
  EXPECT_ATTN_ERROR(
      select_backend(in.q, in.k.narrow(-1, 0, 8), in.v), "key must be (..., S, E) with E == 16");
}

// ---------------------------------------------------------------------------
// Requested backends.

TEST(RequestedBackend, ThatCannotRunTheRequestSaysWhy) {
  const auto in = make_inputs();
  const auto ask = [](AttentionBackend backend) {
    return SDPAOptions().need_weights(true).backend(backend);
  };
  EXPECT_ATTN_ERROR(
      attn::scaled_dot_product_attention(in.q, in.k, in.v, ask(AttentionBackend::fused_cpu)),
      "scaled_dot_product_attention: backend fused_cpu was requested, but it returns no "
      "weights: set need_weights(false)");
  EXPECT_ATTN_ERROR(
      attn::scaled_dot_product_attention(
          in.q, in.k, in.v, ask(AttentionBackend::batched_cpu).need_weights(false).dropout_p(0.5)),
      "backend batched_cpu was requested, but it has no dropout, and dropout_p is 0.5 while "
      "training");
  const auto grad = make_inputs(/*requires_grad=*/true);
  EXPECT_ATTN_ERROR(
      attn::scaled_dot_product_attention(
          grad.q, grad.k, grad.v, ask(AttentionBackend::fused_cpu_weights)),
      "backend fused_cpu_weights was requested, but it is not differentiable, and "
      "the inputs require grad");
  const auto libtorch = ask(AttentionBackend::libtorch).need_weights(false);
  if (kLibTorch2) {
    EXPECT_ATTN_ERROR(
        attn::scaled_dot_product_attention(in.q, in.k, in.v, SDPAOptions(libtorch).scale(-0.5)),
        "backend libtorch was requested, but it takes only a positive scale, got -0.5");
    EXPECT_ATTN_ERROR(
        attn::scaled_dot_product_attention(
            in.q, in.k, in.v,
            SDPAOptions(libtorch).attn_mask(torch::zeros({40, 40}).requires_grad_())),
        "backend libtorch was requested, but it gives the attn_mask no gradient here, and it "
        "requires one");
  } else {
    EXPECT_ATTN_ERROR(
        attn::scaled_dot_product_attention(in.q, in.k, in.v, libtorch),
        std::string("backend libtorch was requested, but it needs LibTorch 2.0 or "
                    "later, and this is ") +
            TORCH_VERSION);
  }
}

// The reference's bias for N (L, S) score matrices: the causal mask, or
// none.
torch::Tensor reference_bias(bool causal, int64_t N, int64_t L, int64_t S) {
  if (!causal) {
    return {};
  }
  return attn::testing::additive_bias(attn::testing::band_mask(L, S, 0, /*causal=*/true, 0))
      .expand({N, L, S});
}

// Output and input gradients of `backend` against the float64 reference.
void expect_matches_reference(AttentionBackend backend, bool causal, torch::ScalarType dtype) {
  SCOPED_TRACE(
      std::string(attn::backend_name(backend)) + (causal ? " causal " : " ") +
      c10::toString(dtype));
  torch::manual_seed(3);
  const bool differentiable = backend != AttentionBackend::fused_cpu_weights;
  const auto in = make_inputs(differentiable, dtype);
  const auto options = SDPAOptions()
                           .is_causal(causal)
                           .need_weights(
                               backend == AttentionBackend::fused_cpu_weights ||
                               backend == AttentionBackend::math)
                           .backend(backend);
  ASSERT_EQ(select_backend(in.q, in.k, in.v, options), backend);
  const auto [out, weights] = attn::scaled_dot_product_attention(in.q, in.k, in.v, options);
  ASSERT_EQ(out.scalar_type(), dtype);

  const auto flat = [](const torch::Tensor& t) { return t.detach().flatten(0, 1); };
  const auto bias = reference_bias(causal, 6, 40, 40);
  const double scale = 0.25; // 1/sqrt(16)
  const auto [expected, expected_weights] = attn::testing::reference_attention(
      flat(in.q), flat(in.k), flat(in.v), bias, scale);
  const auto tolerance = tolerance_for(dtype);
  EXPECT_CLOSE(out.flatten(0, 1), expected, tolerance);
  if (weights.defined()) {
    EXPECT_CLOSE(weights.flatten(0, 1), expected_weights, tolerance);
  }
  if (!differentiable) {
    return;
  }
  const auto upstream = torch::randn_like(out);
  out.backward(upstream);
  const auto expected_grads = attn::testing::reference_attention_gradients(
      flat(in.q), flat(in.k), flat(in.v), bias, scale, flat(upstream));
  const torch::Tensor grads[] = {in.q.grad(), in.k.grad(), in.v.grad()};
  for (int i = 0; i < 3; ++i) {
    EXPECT_CLOSE(grads[i].flatten(0, 1), expected_grads[i], tolerance) << "input " << i;
  }
}

// float32 within 1e-5: sums of 40 terms of order 1, each off by float32
// rounding (6e-8); float64 within 1e-12 likewise.
TEST(RequestedBackend, EveryBackendMatchesTheFloat64Reference) {
  std::vector<AttentionBackend> backends = {
      AttentionBackend::fused_cpu, AttentionBackend::fused_cpu_weights,
      AttentionBackend::batched_cpu, AttentionBackend::math};
  if (kLibTorch2) {
    backends.push_back(AttentionBackend::libtorch);
  }
  for (const auto backend : backends) {
    for (const bool causal : {false, true}) {
      expect_matches_reference(backend, causal, torch::kFloat);
      expect_matches_reference(backend, causal, torch::kDouble);
    }
  }
}

// (N, T, F) on the CPU, detached: the reference's layout.
torch::Tensor flat_on_cpu(const torch::Tensor& t) {
  return t.detach().cpu().reshape({-1, t.size(-2), t.size(-1)});
}

// `out` = attention of q, k, v (leaves that require grad) under `bias`
// ((N, L, S) additive, float64, on the CPU) and `scale`: its value, and
// the gradients a random upstream gives q, k and v, against the float64
// reference in float64's tolerance.
void expect_output_and_gradients_match_reference(
    const torch::Tensor& q,
    const torch::Tensor& k,
    const torch::Tensor& v,
    const torch::Tensor& out,
    const torch::Tensor& bias,
    double scale) {
  const auto [expected, expected_weights] = attn::testing::reference_attention(
      flat_on_cpu(q), flat_on_cpu(k), flat_on_cpu(v), bias, scale);
  EXPECT_CLOSE(flat_on_cpu(out), expected, attn::testing::kFloat64Tolerance);
  const auto upstream = torch::randn_like(out);
  out.backward(upstream);
  const auto grads = attn::testing::reference_attention_gradients(
      flat_on_cpu(q), flat_on_cpu(k), flat_on_cpu(v), bias, scale, flat_on_cpu(upstream));
  EXPECT_CLOSE(flat_on_cpu(q.grad()), grads[0], attn::testing::kFloat64Tolerance);
  EXPECT_CLOSE(flat_on_cpu(k.grad()), grads[1], attn::testing::kFloat64Tolerance);
  EXPECT_CLOSE(flat_on_cpu(v.grad()), grads[2], attn::testing::kFloat64Tolerance);
}

// LibTorch's kernel behind attn's function on the shapes and options the
// function accepts: 2-d and 5-d inputs, a value width other than the
// query's, a custom scale, strided inputs, grouped queries in their trivial
// form; outputs and gradients against the float64 reference.
TEST(RequestedBackend, LibTorchMatchesTheReferenceOnEveryShapeItTakes) {
  if (!kLibTorch2) {
    GTEST_SKIP() << "LibTorch " << TORCH_VERSION << " has no at::scaled_dot_product_attention";
  }
  torch::manual_seed(11);
  struct Case {
    const char* name;
    torch::Tensor q, k, v;
    SDPAOptions options;
  };
  const auto rand = [](std::vector<int64_t> shape) { return torch::randn(shape, torch::kDouble); };
  const auto libtorch = SDPAOptions().need_weights(false).backend(AttentionBackend::libtorch);
  const Case cases[] = {
      {"2-d", rand({9, 8}), rand({11, 8}), rand({11, 8}), libtorch},
      {"5-d causal", rand({2, 2, 3, 10, 8}), rand({2, 2, 3, 10, 8}), rand({2, 2, 3, 10, 8}),
       SDPAOptions(libtorch).is_causal(true)},
      {"value width 5", rand({2, 7, 8}), rand({2, 9, 8}), rand({2, 9, 5}), libtorch},
      {"scale 0.3", rand({2, 7, 8}), rand({2, 9, 8}), rand({2, 9, 8}),
       SDPAOptions(libtorch).scale(0.3)},
      {"transposed", rand({2, 8, 7}).transpose(1, 2), rand({2, 8, 9}).transpose(1, 2),
       rand({2, 6, 9}).transpose(1, 2), libtorch},
      {"enable_gqa, equal heads", rand({1, 3, 6, 8}), rand({1, 3, 6, 8}), rand({1, 3, 6, 8}),
       SDPAOptions(libtorch).enable_gqa(true)},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const auto q = c.q.clone().requires_grad_(), k = c.k.clone().requires_grad_(),
               v = c.v.clone().requires_grad_();
    const auto [out, w] = attn::scaled_dot_product_attention(q, k, v, c.options);
    EXPECT_EQ(out.sizes().back(), v.size(-1));
    const auto bias = reference_bias(
        c.options.is_causal(), flat_on_cpu(q).size(0), q.size(-2), k.size(-2));
    const double scale = c.options.scale().value_or(
        1.0 / std::sqrt(static_cast<double>(q.size(-1))));
    expect_output_and_gradients_match_reference(q, k, v, out, bias, scale);
  }
}

// Masks, windows and causal bands that LibTorch's causal flag cannot say
// reach its kernel as one explicit mask; a query that sees no key gets a
// zero output and zero gradients there as on every backend (the float64
// reference defines them so), whatever LibTorch itself would give it. On
// CUDA such requests are the default choice.
void expect_libtorch_takes_every_mask(torch::Device device) {
  torch::manual_seed(13);
  auto some_rows_empty = torch::rand({2, 1, 6, 9}) > 0.4;
  some_rows_empty.select(2, 1).fill_(false);
  auto additive = torch::randn({6, 9}, torch::kDouble);
  additive[4].fill_(-attn::testing::kInf);
  struct Case {
    const char* name;
    std::vector<int64_t> batch;
    int64_t L, S;
    SDPAOptions options;
  };
  const SDPAOptions none;
  const Case cases[] = {
      {"bool mask with an empty row", {2, 3}, 6, 9, SDPAOptions(none).attn_mask(some_rows_empty)},
      {"float mask and window",
       {2, 3},
       6,
       9,
       SDPAOptions(none).attn_mask(additive).window(3).query_offset(2)},
      {"causal, L < S, negative offset",
       {2, 3},
       6,
       9,
       SDPAOptions(none).is_causal(true).query_offset(-2)},
      {"causal with an offset", {1, 2}, 7, 7, SDPAOptions(none).is_causal(true).query_offset(3)},
      {"5-d, bool mask and causal",
       {2, 2, 3},
       6,
       9,
       SDPAOptions(none).attn_mask(some_rows_empty[0]).is_causal(true)},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const auto shape = [&](int64_t T) {
      auto sizes = c.batch;
      sizes.insert(sizes.end(), {T, 8});
      return sizes;
    };
    const auto make = [&](int64_t T) {
      return torch::randn(shape(T), torch::kDouble).to(device).requires_grad_();
    };
    const auto q = make(c.L), k = make(c.S), v = make(c.S);
    auto options = c.options;
    if (options.attn_mask().defined()) {
      options.attn_mask(options.attn_mask().to(device));
    }
    if (device.is_cuda()) {
      EXPECT_EQ(select_backend(q, k, v, options), AttentionBackend::libtorch);
    }
    const auto [out, w] = attn::scaled_dot_product_attention(
        q, k, v, options.backend(AttentionBackend::libtorch));
    auto bias = attn::testing::additive_bias(attn::testing::band_mask(
        c.L, c.S, c.options.query_offset(), c.options.is_causal(), c.options.window().value_or(0)));
    if (c.options.attn_mask().defined()) {
      bias = bias + attn::testing::additive_bias(c.options.attn_mask());
    }
    auto scores_shape = out.sizes().vec();
    scores_shape.back() = c.S;
    expect_output_and_gradients_match_reference(
        q, k, v, out, flat_on_cpu(bias.expand(scores_shape)), 1.0 / std::sqrt(8.0));
  }
}

TEST(RequestedBackend, LibTorchTakesEveryMaskAndWindowAndZeroesRowsThatSeeNoKey) {
  if (!kLibTorch2) {
    GTEST_SKIP() << "LibTorch " << TORCH_VERSION << " has no at::scaled_dot_product_attention";
  }
  expect_libtorch_takes_every_mask(torch::kCPU);
}

TEST(RequestedBackend, OnCudaMaskedRequestsTakeLibTorchAndZeroRowsThatSeeNoKey) {
  if (!kLibTorch2) {
    GTEST_SKIP() << "LibTorch " << TORCH_VERSION << " has no at::scaled_dot_product_attention";
  }
  ATTN_SKIP_IF_UNAVAILABLE(torch::Device(torch::kCUDA));
  expect_libtorch_takes_every_mask(torch::kCUDA);
}

TEST(RequestedBackend, LibTorchIsRefusedBelow2OrRunsBFloat16As2Does) {
  const auto in = make_inputs(false, torch::kBFloat16);
  const auto options = SDPAOptions().need_weights(false).backend(AttentionBackend::libtorch);
  if (!kLibTorch2) {
    EXPECT_ATTN_ERROR(
        attn::scaled_dot_product_attention(in.q, in.k, in.v, options),
        "needs LibTorch 2.0 or later");
    return;
  }
  const auto [out, w] = attn::scaled_dot_product_attention(in.q, in.k, in.v, options);
  const auto [ours, w_ours] = attn::scaled_dot_product_attention(
      in.q, in.k, in.v, SDPAOptions(options).backend(AttentionBackend::fused_cpu));
  EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
  // Outputs below 3 in magnitude: a few bfloat16 ulps (2^-7 each) apart.
  EXPECT_CLOSE(out, ours, Tolerance{0.05});
}

} // namespace
