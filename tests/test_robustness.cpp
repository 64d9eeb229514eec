// Numerical robustness and reliability: huge scores, half precision,
// fully masked rows and empty sequences on every path, one module shared
// by several threads, run-to-run determinism, and the OpenBLAS thread
// setting under overlapping kernel calls.

#include "test_support.h"

#include "kernels/cpu/short_heads.h"
#include "kernels/cpu/tile_product.h"
#include "runtime/compat.h"
#include "runtime/threads.h"
#include "sdpa/backend.h"

#include <attn/backend.h>
#include <attn/threads.h>

#include <attn/functional.h>
#include <attn/modules/multi_head_attention.h>
#include <attn/modules/scaled_dot_product_attention.h>

#include <ATen/Parallel.h>
#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <limits>
#include <optional>
#include <sstream>
#include <thread>
#include <vector>

#ifndef _WIN32
#include <dlfcn.h>
#endif

namespace {

using attn::SDPAOptions;
using attn::testing::additive_bias;
using attn::testing::ThreadCount;
using attn::testing::Tolerance;

using attn::testing::kInf;

// The function's routes on the CPU, each backend asked for by name: the
// tiled kernel without weights (with and without a gradient; kept to it
// at short lengths by options()), the same kernel's short loops (its
// heads cut to their bounds, short_heads.h), the tiled kernel with
// weights (inference), the math path (weights with a gradient), and the
// batched kernel for short sequences in all four combinations. A test
// takes its lengths through queries() and keys().
struct Route {
  attn::AttentionBackend backend;
  bool need_weights;
  bool requires_grad;
  bool short_heads = false;
  int64_t queries(int64_t n) const {
    return short_heads ? std::min(n, attn::detail::kMaxShortQueries) : n;
  }
  int64_t keys(int64_t n) const {
    return short_heads ? std::min(n, attn::detail::kMaxShortKeys) : n;
  }
  std::string describe() const {
    std::ostringstream s;
    s << backend << (short_heads ? " (short heads)" : "") << " need_weights=" << need_weights
      << " requires_grad=" << requires_grad;
    return s.str();
  }
  // The route's options for L queries and S keys, at `capability` (unset:
  // the widest). The tiled routes keep to the tiled kernel at lengths the
  // short loops would take: at capability portable, the BLAS's products,
  // as on CPUs without AVX2.
  SDPAOptions options(
      int64_t L,
      int64_t S,
      c10::optional<attn::CpuCapability> capability = c10::nullopt) const {
    const auto loops = attn::detail::cpu_loops(
        capability ? attn::detail::cpu_level_of(*capability) : attn::detail::widest_cpu_level());
    if (backend == attn::AttentionBackend::fused_cpu && !short_heads &&
        attn::detail::short_heads_run(loops, torch::kFloat, L, S)) {
      capability = attn::CpuCapability::portable;
    }
    return SDPAOptions().backend(backend).need_weights(need_weights).cpu_capability(capability);
  }
};
const Route kRoutes[] = {
    {attn::AttentionBackend::fused_cpu, false, false},
    {attn::AttentionBackend::fused_cpu, false, true},
    {attn::AttentionBackend::fused_cpu, false, false, /*short_heads=*/true},
    {attn::AttentionBackend::fused_cpu, false, true, /*short_heads=*/true},
    {attn::AttentionBackend::fused_cpu_weights, true, false},
    {attn::AttentionBackend::math, true, true},
    {attn::AttentionBackend::batched_cpu, false, false},
    {attn::AttentionBackend::batched_cpu, false, true},
    {attn::AttentionBackend::batched_cpu, true, false},
    {attn::AttentionBackend::batched_cpu, true, true}};

bool all_finite(const torch::Tensor& t) {
  return torch::isfinite(t).all().item<bool>();
}

TEST(NumericalRobustness, ScoresOfMagnitude1e4GiveAFiniteExactSoftmaxOnEveryPath) {
  // Integer inputs with scale 1: scores up to ~2e4 are exact in float32, so
  // float32 must match the float64 reference as closely as at small scores.
  torch::manual_seed(11);
  for (const auto dtype : {torch::kFloat, torch::kDouble}) {
    for (const auto& route : kRoutes) {
      SCOPED_TRACE(route.describe() + " dtype=" + c10::toString(dtype));
      const int64_t L = route.queries(130), S = route.keys(600);
      const auto q =
          torch::randint(-100, 101, {2, L, 2}, dtype).requires_grad_(route.requires_grad);
      const auto k =
          torch::randint(-100, 101, {2, S, 2}, dtype).requires_grad_(route.requires_grad);
      const auto v = torch::randn({2, S, 3}, dtype).requires_grad_(route.requires_grad);
      const auto [out, weights] = attn::scaled_dot_product_attention(
          q, k, v, route.options(L, S).scale(1.0).is_causal(true));
      const auto causal = additive_bias(attn::testing::band_mask(L, S, 0, /*causal=*/true, 0));
      const auto [ref_out, ref_weights] = attn::testing::reference_attention(q, k, v, causal, 1.0);
      const auto tolerance = attn::testing::tolerance_for(dtype);
      ASSERT_TRUE(all_finite(out));
      EXPECT_CLOSE(out, ref_out, tolerance);
      if (route.need_weights) {
        EXPECT_CLOSE(weights, ref_weights, tolerance);
      }
      if (route.requires_grad) {
        const auto grads = torch::autograd::grad({out.sum()}, {q, k, v});
        for (const auto& grad : grads) {
          EXPECT_TRUE(all_finite(grad));
        }
      }
    }
  }
}

TEST(NumericalRobustness, MultiHeadAttentionStaysFiniteWithInputsScaledTo1e4Scores) {
  // Inputs scaled by 100 give scores of ~1e4 after the projections.
  torch::manual_seed(12);
  attn::MultiHeadAttention mha(attn::MultiHeadAttentionOptions(16, 2));
  mha->eval();
  const auto x = (100 * torch::randn({2, 9, 16})).requires_grad_();
  const auto [out, weights] = mha(
      x, x, x, attn::MultiHeadAttentionForwardOptions().need_weights(true));
  const auto ref = attn::testing::reference_multi_head_attention(*mha, x, x, x, {}, {});
  ASSERT_TRUE(all_finite(out));
  ASSERT_TRUE(all_finite(weights));
  // float32 rounds scores of 1e4 to ~1e-3, which moves each weight by up to
  // ~0.1 % of itself; outputs are weighted sums of values of ~1e2.
  const Tolerance of_the_largest_output{0.0, 5e-3};
  EXPECT_CLOSE(weights, ref.weights, Tolerance{5e-3});
  EXPECT_CLOSE(out, ref.output, of_the_largest_output);
  EXPECT_TRUE(all_finite(torch::autograd::grad({out.sum()}, {x})[0]));
}

// Half precision on the CPU runs in float32 inside the function and rounds
// the results once, so each element is within half an ulp of the float32
// result on the same (rounded) inputs: 2^-8 of it for bfloat16 (8 significant
// bits), 2^-11 for float16 (11 bits; plus 2^-25 where it is subnormal).
// Except bfloat16 on the fused kernel's tiled loops and the weights kernel
// where its bfloat16 products outrun float ones (AMX, or AVX512-BF16 on
// AMD's cores): it is computed in bfloat16 there, and
// PropertySweep.Bfloat16IsWithinTwiceLibTorchsBfloat16Error holds it to
// LibTorch's own bfloat16 error; the weights kernel's weights are still
// the float32 ones rounded once. float16 stays in float32 on the tiled
// route here, which runs on the BLAS's products (Route::options), where the
// fused kernel computes float16 in float32 (backend.h,
// half_products_pay); the weights kernel multiplies float16's exact
// values in float where attn's loops run, and at these 40 keys, one block,
// in the float32 kernel's order, so its results are the float32 ones
// rounded once too; PropertySweep.Float16IsWithinFloat32RoundedToFloat16
// holds its float16 loops. The short heads' loops compute both half
// precisions on each head's values widened to float: their output is the
// float32 one rounded once, and so is dV, but dQ and dK read the output as
// stored (delta_i = dO_i·O_i), whose rounding they carry
// (ShortHeads.HalfPrecisionIsTheFloatComputationOfItsValuesRoundedOnce).
TEST(NumericalRobustness, HalfPrecisionFunctionRoundsTheFloat32ResultOnce) {
  torch::manual_seed(13);
  for (const auto dtype : {torch::kBFloat16, torch::kHalf}) {
    const double half_ulp = dtype == torch::kBFloat16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
    for (const auto& route : kRoutes) {
      SCOPED_TRACE(route.describe() + " dtype=" + c10::toString(dtype));
      const auto q = torch::randn({2, 3, 70, 16}).to(dtype).requires_grad_(route.requires_grad);
      const auto k = torch::randn({2, 3, 40, 16}).to(dtype).requires_grad_(route.requires_grad);
      const auto v = torch::randn({2, 3, 40, 16}).to(dtype).requires_grad_(route.requires_grad);
      const auto mask = torch::randn({70, 40}).masked_fill(torch::rand({70, 40}) > 0.7, -kInf);
      const auto options = route.options(70, 40).is_causal(true);
      const bool bf16_products = dtype == torch::kBFloat16 && !route.short_heads &&
          (route.backend == attn::AttentionBackend::fused_cpu ||
           route.backend == attn::AttentionBackend::fused_cpu_weights) &&
          attn::testing::plan_of(q, k, v, options).compute_dtype == torch::kBFloat16;
      if (bf16_products && !route.need_weights) {
        continue; // computed in bfloat16 (above)
      }
      const auto [out, weights] = attn::scaled_dot_product_attention(
          q, k, v, SDPAOptions(options).attn_mask(mask.to(dtype)));
      const auto as_float = [](const torch::Tensor& t) {
        return t.detach().to(torch::kFloat).requires_grad_(t.requires_grad());
      };
      const auto q32 = as_float(q), k32 = as_float(k), v32 = as_float(v);
      const auto [out32, weights32] = attn::scaled_dot_product_attention(
          q32, k32, v32, SDPAOptions(options).attn_mask(mask.to(dtype).to(torch::kFloat)));
      ASSERT_EQ(out.scalar_type(), dtype);
      const auto within_half_ulp = [&](const torch::Tensor& low, const torch::Tensor& float32) {
        const auto error = (low.to(torch::kFloat) - float32).abs();
        return (error <= half_ulp * float32.abs() + std::ldexp(1.0, -25)).all().item<bool>();
      };
      if (!bf16_products) {
        EXPECT_TRUE(within_half_ulp(out.detach(), out32.detach()));
      }
      if (route.need_weights) {
        EXPECT_TRUE(within_half_ulp(weights.detach(), weights32.detach()));
      }
      if (route.requires_grad) {
        const auto upstream = torch::randn(out.sizes()).to(dtype);
        const auto grads = torch::autograd::grad({out}, {q, k, v}, {upstream});
        const auto grads32 = torch::autograd::grad(
            {out32}, {q32, k32, v32}, {upstream.to(torch::kFloat)});
        for (int i = 0; i < 3; ++i) {
          if (route.short_heads && i < 2) {
            continue; // dQ and dK carry the stored output's rounding (above)
          }
          EXPECT_TRUE(within_half_ulp(grads[i], grads32[i])) << "gradient " << i;
        }
      }
    }
  }
}

TEST(NumericalRobustness, BFloat16MultiHeadAttentionStaysNearItsFloat32Result) {
  torch::manual_seed(14);
  attn::MultiHeadAttention mha(attn::MultiHeadAttentionOptions(32, 4));
  auto low = std::dynamic_pointer_cast<attn::MultiHeadAttentionImpl>(mha->clone());
  low->to(torch::kBFloat16);
  mha->to(torch::kBFloat16); // the float32 module holds the same rounded weights
  mha->to(torch::kFloat);
  const auto x = torch::randn({2, 20, 32}).to(torch::kBFloat16);
  const auto padding = torch::rand({2, 20}) > 0.8;
  const auto options = attn::MultiHeadAttentionForwardOptions()
                           .key_padding_mask(padding)
                           .is_causal(true)
                           .need_weights(true);
  const auto [out, weights] = low->forward(x, x, x, options);
  const auto x32 = x.to(torch::kFloat);
  const auto [out32, weights32] = mha(x32, x32, x32, options);
  // The projections round Q, K, V and the merged heads to bfloat16 (2^-9
  // each) before out_proj mixes 32 of them: a few 2^-9 of the largest value.
  const double rounding = 8 * std::ldexp(1.0, -9);
  const Tolerance of_the_largest_output{0.0, rounding};
  EXPECT_CLOSE(out, out32, of_the_largest_output);
  EXPECT_CLOSE(weights, weights32, Tolerance{rounding});
}

// Under LibTorch's autocast, float32 weights and inputs: the projections
// and attention compute in bfloat16 (the output is bfloat16, near the
// float32 module's), and the weights' gradients come back in float32, near
// the float32 ones.
TEST(NumericalRobustness, MultiHeadAttentionUnderBfloat16AutocastTrainsFloat32Weights) {
  torch::manual_seed(16);
  attn::MultiHeadAttention mha(attn::MultiHeadAttentionOptions(32, 4));
  const auto x = torch::randn({2, 150, 32});
  const auto options = attn::MultiHeadAttentionForwardOptions().is_causal(true);
  const auto [out32, unused32] = mha(x, x, x, options);
  const auto grad32 = torch::autograd::grad({out32.sum()}, {mha->q_proj->weight})[0];
  torch::Tensor out, grad;
  {
    const attn::detail::ScopedAutocast autocast(torch::kCPU, torch::kBFloat16);
    out = std::get<0>(mha(x, x, x, options));
  }
  grad = torch::autograd::grad({out.to(torch::kFloat).sum()}, {mha->q_proj->weight})[0];
  EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(grad.scalar_type(), torch::kFloat);
  // Inputs, weights, heads and products rounded to bfloat16 (2^-9 each)
  // before sums of 32 to 150 terms: a few percent of the largest value.
  const Tolerance of_the_largest_output{0.0, 8 * std::ldexp(1.0, -9)};
  const Tolerance of_the_largest_gradient{0.0, 0.05};
  EXPECT_CLOSE(out, out32, of_the_largest_output);
  EXPECT_CLOSE(grad, grad32, of_the_largest_gradient);
}

TEST(NumericalRobustness, Float16MultiHeadAttentionOnTheCpuRunsOrNamesTheMissingKernel) {
  attn::MultiHeadAttention mha(attn::MultiHeadAttentionOptions(8, 2));
  mha->to(torch::kHalf);
  const auto x = torch::randn({1, 4, 8}).to(torch::kHalf);
#if TORCH_VERSION_MAJOR < 2
  // LibTorch 1.13 has no float16 matrix product on the CPU; the projection
  // fails with a c10::Error naming the dtype, never a crash.
  EXPECT_ATTN_ERROR(mha(x, x, x), "'Half'");
#else
  const auto [out, weights] = mha(x, x, x);
  EXPECT_TRUE(all_finite(out));
#endif
}

TEST(FullyMaskedRows, GiveZerosAndFiniteGradientsOnEveryPath) {
  torch::manual_seed(15);
  for (const auto dtype : {torch::kFloat, torch::kDouble, torch::kBFloat16}) {
    for (const bool bool_mask : {true, false}) {
      for (const auto& route : kRoutes) {
        SCOPED_TRACE(
            route.describe() + " dtype=" + c10::toString(dtype) +
            (bool_mask ? " bool mask" : " float mask"));
        const int64_t L = route.queries(140), S = route.keys(520);
        const auto q = torch::randn({2, L, 8}).to(dtype).requires_grad_(route.requires_grad);
        const auto k = torch::randn({2, S, 8}).to(dtype).requires_grad_(route.requires_grad);
        const auto v = torch::randn({2, S, 8}).to(dtype).requires_grad_(route.requires_grad);
        auto allowed = torch::rand({2, L, S}) > 0.5;
        const int64_t late_row = L - 7; // with 140 queries, in the second query tile
        allowed.select(1, 3).fill_(false);
        allowed.select(1, late_row).fill_(false);
        const auto mask = bool_mask ? allowed : additive_bias(allowed).to(dtype);
        const auto [out, weights] = attn::scaled_dot_product_attention(
            q, k, v, route.options(L, S).attn_mask(mask));
        for (const int64_t row : {int64_t{3}, late_row}) {
          EXPECT_EQ(out.select(1, row).abs().max().item<double>(), 0.0) << "row " << row;
          if (route.need_weights) {
            EXPECT_EQ(weights.select(1, row).abs().max().item<double>(), 0.0) << "row " << row;
          }
        }
        ASSERT_TRUE(all_finite(out));
        if (route.requires_grad) {
          const auto grads = torch::autograd::grad({out.sum()}, {q, k, v});
          for (const auto& grad : grads) {
            EXPECT_TRUE(all_finite(grad));
          }
          EXPECT_EQ(grads[0].select(1, 3).abs().max().item<double>(), 0.0);
        }
      }
    }
  }
}

// Empty operands: no queries, no keys, no batch, or values of width 0, on
// every route, dtype and CPU capability this CPU runs (the loops offset
// their operands by their vectors' width: with AVX2's 8 lanes, no keys and
// values 33 wide once offset a null pointer). Each result against the
// float64 formula (reference_attention).
struct EmptySizes {
  int64_t B, L, S, D, Dv;
  std::string describe() const {
    std::ostringstream s;
    s << "B=" << B << " L=" << L << " S=" << S << " D=" << D << " Dv=" << Dv;
    return s.str();
  }
};
const EmptySizes kEmptySizes[] = {
    {2, 0, 5, 8, 3}, {2, 4, 0, 8, 3}, {0, 4, 5, 8, 3},  {2, 0, 0, 8, 3},  {2, 4, 0, 3, 33},
    {2, 4, 5, 8, 0}, {2, 4, 0, 8, 0}, {1, 3, 70, 8, 0}, {1, 0, 70, 8, 3}, {1, 3, 0, 8, 40}};

// Inputs of `dtype` rounded, the tolerance their results are held to.
Tolerance empty_sweep_tolerance(torch::ScalarType dtype) {
  switch (dtype) {
    case torch::kBFloat16: return {5e-2, 5e-2};
    case torch::kHalf: return {1e-2, 1e-2};
    default: return attn::testing::kFloat32Tolerance;
  }
}

void expect_empty_case_matches_formula(
    const EmptySizes& n,
    torch::ScalarType dtype,
    const Route& route,
    attn::CpuCapability capability) {
  constexpr double kScale = 0.5;
  const int64_t L = route.queries(n.L), S = route.keys(n.S);
  const auto input = [&](int64_t T, int64_t width) {
    return torch::randn({n.B, T, width}).to(dtype).requires_grad_(route.requires_grad);
  };
  const auto q = input(L, n.D), k = input(S, n.D), v = input(S, n.Dv);
  const auto allowed = torch::rand({L, S}) > 0.3;
  const auto [out, weights] = attn::scaled_dot_product_attention(
      q, k, v, route.options(L, S, capability).attn_mask(allowed).is_causal(true).scale(kScale));
  const auto bias =
      additive_bias(allowed & attn::testing::band_mask(L, S, 0, true, 0)).expand({n.B, L, S});
  const auto as_double = [](const torch::Tensor& t) { return t.detach().to(torch::kDouble); };
  const auto [expected_out, expected_weights] = attn::testing::reference_attention(
      as_double(q), as_double(k), as_double(v), bias, kScale);
  const auto tolerance = empty_sweep_tolerance(dtype);
  ASSERT_EQ(out.scalar_type(), dtype);
  EXPECT_CLOSE(out.to(torch::kDouble), expected_out, tolerance);
  if (route.need_weights) {
    EXPECT_CLOSE(weights.to(torch::kDouble), expected_weights, tolerance);
  }
  if (route.requires_grad) {
    const auto upstream = torch::randn(out.sizes()).to(dtype);
    const auto grads = torch::autograd::grad(
        {out}, {q, k, v}, {upstream}, c10::nullopt, false, /*allow_unused=*/true);
    const auto expected = attn::testing::reference_attention_gradients(
        as_double(q), as_double(k), as_double(v), bias, kScale, as_double(upstream));
    for (size_t i = 0; i < grads.size(); ++i) {
      const auto grad = grads[i].defined() ? grads[i] : torch::zeros_like(expected[i]);
      EXPECT_CLOSE(grad.to(torch::kDouble), expected[i], tolerance) << "gradient " << i;
    }
  }
}

TEST(EmptyInputs, EmptyOperandsGiveTheFormulasResultOnEveryPathDtypeAndCpuCapability) {
  torch::manual_seed(17);
  for (const auto capability : attn::cpu_capabilities()) {
    for (const auto dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
      for (const auto& sizes : kEmptySizes) {
        for (const auto& route : kRoutes) {
          SCOPED_TRACE(
              route.describe() + " " + sizes.describe() + " " + c10::toString(dtype) + " at " +
              attn::cpu_capability_name(capability));
          expect_empty_case_matches_formula(sizes, dtype, route, capability);
        }
      }
    }
  }
}

TEST(EmptyInputs, ModulesTakeNoQueriesOrNoKeys) {
  attn::MultiHeadAttention mha(attn::MultiHeadAttentionOptions(8, 2));
  const auto x = torch::randn({2, 3, 8});
  const auto [no_queries, w0] = mha(torch::randn({2, 0, 8}), x, x);
  EXPECT_EQ(no_queries.sizes(), torch::IntArrayRef({2, 0, 8}));
  const auto [no_keys, w1] = mha(
      x, torch::randn({2, 0, 8}), torch::randn({2, 0, 8}),
      attn::MultiHeadAttentionForwardOptions().need_weights(true));
  EXPECT_EQ(w1.sizes(), torch::IntArrayRef({2, 2, 3, 0}));
  // No keys: zero attention, so the output is out_proj's bias.
  EXPECT_TRUE(torch::equal(no_keys, mha->out_proj->bias.expand({2, 3, 8})));
}

TEST(NonContiguousInputs, TransposedAndBroadcastMasksGiveTheContiguousResult) {
  torch::manual_seed(16);
  const auto q = torch::randn({2, 3, 130, 8});
  const auto k = torch::randn({2, 3, 40, 8});
  const auto v = torch::randn({2, 3, 40, 8});
  const auto allowed = torch::rand({40, 130}) > 0.4; // stored (S, L)
  const auto bias = torch::randn({3, 40, 130});
  for (const bool need_weights : {true, false}) {
    const auto run = [&](const torch::Tensor& mask) {
      return std::get<0>(attn::scaled_dot_product_attention(
          q, k, v, SDPAOptions().attn_mask(mask).need_weights(need_weights)));
    };
    EXPECT_TRUE(torch::equal(run(allowed.t()), run(allowed.t().contiguous())));
    EXPECT_TRUE(
        torch::equal(run(bias.transpose(-1, -2)), run(bias.transpose(-1, -2).contiguous())));
  }
}

// ---------------------------------------------------------------------------
// Threads and determinism.

using Forward = std::function<std::tuple<torch::Tensor, torch::Tensor>(int)>;

// Runs forward(t) for t < 4 one after another, then each in its own
// std::thread three times over (under NoGradGuard, with `intra_op_threads`
// OpenMP threads each), and returns the largest difference from the serial
// results of any output or weights.
double largest_difference_from_serial_runs(const Forward& forward, int intra_op_threads) {
  constexpr int kThreads = 4, kRepeats = 3;
  const ThreadCount intra_op(intra_op_threads);
  std::vector<std::tuple<torch::Tensor, torch::Tensor>> serial;
  {
    torch::NoGradGuard no_grad;
    for (int t = 0; t < kThreads; ++t) {
      serial.push_back(forward(t));
    }
  }
  std::vector<double> differences(kThreads, 0.0);
  std::vector<std::thread> workers;
  for (int t = 0; t < kThreads; ++t) {
    workers.emplace_back([&, t] {
      // Grad mode and OpenMP's thread count are per thread.
      const torch::NoGradGuard no_grad;
      at::set_num_threads(intra_op_threads);
      for (int r = 0; r < kRepeats; ++r) {
        const auto [out, weights] = forward(t);
        const auto& [serial_out, serial_weights] = serial[t];
        auto difference = (out - serial_out).abs().max().item<double>();
        if (weights.defined() != serial_weights.defined()) {
          difference = kInf;
        } else if (weights.defined()) {
          difference = std::max(difference, (weights - serial_weights).abs().max().item<double>());
        }
        differences[t] = std::max(differences[t], difference);
      }
    });
  }
  for (auto& worker : workers) {
    worker.join();
  }
  return *std::max_element(differences.begin(), differences.end());
}

// Inputs longer than one query tile, a padding mask, causal or not, with
// and without weights (the two fused kernels).
struct SharedModuleInputs {
  std::vector<torch::Tensor> x, padding;
  SharedModuleInputs() {
    torch::manual_seed(17);
    for (int t = 0; t < 4; ++t) {
      x.push_back(torch::randn({2, 150, 32}));
      padding.push_back(torch::rand({2, 150}) > 0.8);
    }
  }
};

Forward shared_multi_head_attention(const SharedModuleInputs& inputs) {
  attn::MultiHeadAttention mha(attn::MultiHeadAttentionOptions(32, 4));
  mha->eval();
  return [mha, &inputs](int t) mutable {
    const auto& x = inputs.x[t];
    return mha(
        x, x, x,
        attn::MultiHeadAttentionForwardOptions()
            .key_padding_mask(inputs.padding[t])
            .is_causal(t % 2 == 0)
            .need_weights(t % 2 == 1));
  };
}

TEST(Concurrency, SharedMultiHeadAttentionMatchesSerialRunsBitwiseWithOneIntraOpThread) {
  const SharedModuleInputs inputs;
  EXPECT_EQ(largest_difference_from_serial_runs(shared_multi_head_attention(inputs), 1), 0.0);
}

TEST(Concurrency, SharedScaledDotProductAttentionMatchesSerialRunsBitwiseWithTwoIntraOpThreads) {
  const SharedModuleInputs inputs;
  attn::ScaledDotProductAttention sdpa;
  sdpa->eval();
  const auto forward = [&](int t) {
    const auto heads = inputs.x[t].view({2, 150, 4, 8}).transpose(1, 2); // (B, H, L, D)
    const auto allowed = inputs.padding[t].logical_not().view({2, 1, 1, 150});
    return sdpa(heads, heads, heads, allowed, t % 2 == 0);
  };
  EXPECT_EQ(largest_difference_from_serial_runs(forward, 2), 0.0);
}

TEST(Concurrency, SharedMultiHeadAttentionWithTwoIntraOpThreadsDiffersOnlyByGemmRounding) {
  // With more than one intra-op thread the kernels lower OpenBLAS's
  // process-wide thread count while they run, and OpenBLAS rounds
  // differently with one thread than with two: a projection GEMM in another
  // thread may then differ in its last bits (float32, O(1) outputs).
  const SharedModuleInputs inputs;
  EXPECT_LE(largest_difference_from_serial_runs(shared_multi_head_attention(inputs), 2), 1e-5);
}

TEST(Concurrency, OverlappingKernelCallsRestoreTheOpenBlasThreadCount) {
#ifdef _WIN32
  GTEST_SKIP() << "OpenBLAS's thread control is looked up with dlsym, which Windows lacks";
#else
  using Get = int (*)();
  const auto get = reinterpret_cast<Get>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  if (get == nullptr) {
    GTEST_SKIP() << "the BLAS in use is not OpenBLAS, whose thread count the kernels lower";
  }
  if (attn::thread_setup().blas != "pthreads") {
    GTEST_SKIP() << "OpenBLAS here is the " << attn::thread_setup().blas
                 << " build, which runs single-threaded inside ATen's OpenMP tasks by itself; "
                    "the kernels lower only the pthreads build's count";
  }
  const ThreadCount intra_op(2); // the guards act only with more than one
  const int before = get();
  if (before < 2) {
    GTEST_SKIP() << "OpenBLAS runs one thread here (" << before
                 << "), so lowering and restoring it cannot be observed";
  }
  // Two kernel calls in different threads: the first to start ends first.
  auto first = std::make_unique<attn::detail::ScopedSingleThreadedBlas>();
  auto second = std::make_unique<attn::detail::ScopedSingleThreadedBlas>();
  EXPECT_EQ(get(), 1);
  first.reset();
  EXPECT_EQ(get(), 1) << "the second call still runs its tasks";
  second.reset();
  EXPECT_EQ(get(), before);
#endif
}

// attn/threads.h's rule, read from what the library found when it loaded:
// ATen's pool gets one thread per CPU unless the environment sets a count
// or OpenBLAS keeps a pthreads pool of its own. ctest runs this test a
// second time with OMP_NUM_THREADS=1 (threads.environment_count_is_kept).
TEST(ThreadPools, AtenPoolGetsOneThreadPerCpuUnlessTheEnvironmentOrTheBlasSaysOtherwise) {
  const auto& setup = attn::thread_setup();
  SCOPED_TRACE(
      "found " + std::to_string(setup.threads_found) + ", chose " +
      std::to_string(setup.threads_chosen) + ", " + std::to_string(setup.cpus) + " CPUs, BLAS " +
      setup.blas + ": " + setup.reason);
  EXPECT_GT(setup.cpus, 0);
  EXPECT_FALSE(setup.reason.empty());
  if (std::getenv("OMP_NUM_THREADS") != nullptr || std::getenv("MKL_NUM_THREADS") != nullptr) {
    EXPECT_EQ(setup.threads_chosen, setup.threads_found);
    EXPECT_NE(setup.reason.find("environment"), std::string::npos);
    const char* count = std::getenv("OMP_NUM_THREADS");
    if (count != nullptr && std::string(count) == "1") {
      EXPECT_EQ(setup.threads_chosen, 1);
    }
  } else if (setup.blas == "pthreads") {
    EXPECT_EQ(setup.threads_chosen, setup.threads_found);
  } else {
    EXPECT_EQ(setup.threads_chosen, std::max(setup.threads_found, setup.cpus));
  }
}

// OpenBLAS names the kernels it chose; another BLAS has no such name.
TEST(ThreadPools, OpenBlasKernelsAreNamedWhereOpenBlasRuns) {
  const auto& setup = attn::thread_setup();
  SCOPED_TRACE("BLAS " + setup.blas + ", kernels '" + setup.blas_core + "'");
  if (setup.blas == "other") {
    EXPECT_TRUE(setup.blas_core.empty());
  } else {
    EXPECT_FALSE(setup.blas_core.empty());
  }
}

TEST(Determinism, SameSeedGivesBitwiseIdenticalResultsOnEveryPath) {
  const ThreadCount intra_op(2);
  const auto run = [] {
    torch::manual_seed(18);
    attn::MultiHeadAttention mha(attn::MultiHeadAttentionOptions(16, 2).dropout(0.2));
    const auto x = torch::randn({2, 140, 16}).requires_grad_();
    const auto padding = torch::rand({2, 140}) > 0.8;
    std::vector<torch::Tensor> results;
    for (const bool training : {true, false}) { // math path with dropout; fused
      mha->train(training);
      for (const bool need_weights : {true, false}) {
        const auto [out, weights] = mha(
            x, x, x,
            attn::MultiHeadAttentionForwardOptions().key_padding_mask(padding).need_weights(
                need_weights));
        results.push_back(out);
        results.push_back(torch::autograd::grad({out.pow(2).sum()}, {x})[0]);
        if (weights.defined()) {
          results.push_back(weights);
        }
      }
    }
    torch::NoGradGuard no_grad;
    results.push_back(std::get<1>(
        mha(x, x, x,
            attn::MultiHeadAttentionForwardOptions().need_weights(true)))); // fused, with weights
    return results;
  };
  const auto first = run();
  const auto second = run();
  ASSERT_EQ(first.size(), second.size());
  for (size_t i = 0; i < first.size(); ++i) {
    EXPECT_TRUE(torch::equal(first[i], second[i])) << "result " << i;
  }
}

} // namespace
