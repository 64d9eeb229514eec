// Dropout inside the fused CPU kernel (src/kernels/cpu/dropout.*,
// philox.h): its random draws against LibTorch's own Philox4x32-10
// (at::philox_engine, an implementation that shares no code with attn's),
// the kernel's output and gradients against a float64 oracle that applies
// the same mask (the formula of Srivastava et al., "Dropout", JMLR 2014:
// kept weights scaled by 1 / (1 - p)), the keep rate, and reproducibility.

#include "test_support.h"

#include "kernels/attention_params.h"
#include "kernels/cpu/dropout.h"
#include "kernels/cpu/fused_attention.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/tile_product.h"

#include <attn/attn.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/PhiloxRNGEngine.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <iostream>
#include <mutex>
#include <vector>

namespace {

using attn::detail::DropoutRow;
using attn::testing::ThreadCount;
using attn::testing::Tolerance;

// Draws [first, first + n) of stream (seed, subsequence), from LibTorch's
// engine (dropout.h): draws 2k and 2k + 1 are the low and high halves of
// word k, word ⌊(k mod 64) / 16⌋ of the block at counter 16·⌊k / 64⌋ +
// k mod 16.
std::vector<uint16_t> engine_draws(uint64_t seed, uint64_t subsequence, uint64_t first, int64_t n) {
  std::vector<uint16_t> draws;
  draws.reserve(static_cast<size_t>(n));
  for (uint64_t d = first; d < first + static_cast<uint64_t>(n); ++d) {
    const uint64_t k = d / 2;
    at::philox_engine engine(seed, subsequence, 16 * (k / 64) + k % 16);
    uint32_t word = 0;
    for (uint64_t m = 0; m <= k % 64 / 16; ++m) {
      word = engine();
    }
    draws.push_back(static_cast<uint16_t>(d % 2 == 0 ? word : word >> 16));
  }
  return draws;
}

// t = ⌊p·2^16⌋: a weight whose draw is below it is dropped.
uint32_t threshold_of(double p) {
  return static_cast<uint32_t>(std::floor(p * 65536.0));
}

// The probability dropout.h drops a weight with: t / 2^16.
double drop_probability(double p) {
  return threshold_of(p) / 65536.0;
}

// The keep mask (B, H, L, S) of a request keyed by `seed`, as dropout.h
// defines it, from LibTorch's engine: (b, h, i, j) is dropped when draw
// i·S + j of stream (seed, b·H + h) is below t.
torch::Tensor engine_keep_mask(
    int64_t B,
    int64_t H,
    int64_t L,
    int64_t S,
    uint64_t seed,
    double p) {
  auto keep = torch::empty({B, H, L, S}, torch::kBool);
  auto a = keep.accessor<bool, 4>();
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const auto draws = engine_draws(seed, static_cast<uint64_t>(bh), 0, L * S);
    for (int64_t i = 0; i < L; ++i) {
      for (int64_t j = 0; j < S; ++j) {
        a[bh / H][bh % H][i][j] = draws[static_cast<size_t>(i * S + j)] >= threshold_of(p);
      }
    }
  }
  return keep;
}

// What the public function keys its dropout with after torch::manual_seed:
// the next 64 bits of the default CPU generator.
uint64_t seed_after_manual_seed(uint64_t manual_seed) {
  torch::manual_seed(manual_seed);
  auto generator = at::detail::getDefaultCPUGenerator();
  const std::lock_guard<std::mutex> lock(generator.mutex());
  return at::check_generator<at::CPUGeneratorImpl>(generator)->random64();
}

// Every float version of a dropout row operation: each instruction set's
// that this CPU runs, and the one the widest CPU level's loops pick.
template <typename Fn>
std::vector<std::pair<std::string, Fn>> float_versions(
    Fn dispatched,
    const std::function<Fn(const attn::detail::DropoutLoops&)>& of) {
  std::vector<std::pair<std::string, Fn>> versions{{"dispatched", dispatched}};
  for (const auto set :
       {attn::detail::InstructionSet::avx2, attn::detail::InstructionSet::avx512}) {
    const auto* loops = attn::detail::isa_loops(set);
    if (loops != nullptr && loops->dropout != nullptr) {
      versions.emplace_back(attn::detail::instruction_set_name(set), of(*loops->dropout));
    }
  }
  return versions;
}

TEST(Philox, DrawsAreLibTorchsPhiloxEngineAtEveryStartAndLength) {
  for (const uint64_t seed : {uint64_t{0}, uint64_t{67280421310721}, ~uint64_t{0}}) {
    for (const uint64_t subsequence : {uint64_t{0}, uint64_t{5}, uint64_t{1} << 33}) {
      for (const uint64_t first :
           {uint64_t{0}, uint64_t{1}, uint64_t{7}, (uint64_t{1} << 33) - 2}) {
        for (const int64_t n : {1, 3, 127, 128, 129, 300}) {
          std::vector<uint16_t> ours(static_cast<size_t>(n));
          attn::detail::dropout_draws(ours.data(), n, {seed, subsequence, first, 0});
          EXPECT_EQ(ours, engine_draws(seed, subsequence, first, n))
              << "seed " << seed << " subsequence " << subsequence << " first " << first << " n "
              << n;
        }
      }
    }
  }
}

TEST(Dropout, EveryInstructionSetDropsTheDrawsBelowTheThreshold) {
  using DropRow = void (*)(float*, int64_t, const DropoutRow&);
  const auto versions = float_versions<DropRow>(
      [](float* x, int64_t n, const DropoutRow& row) {
        attn::detail::drop_row(attn::testing::widest_loops(), x, n, row);
      },
      [](const attn::detail::DropoutLoops& loops) { return loops.drop_row; });
  const uint64_t seed = 12345, subsequence = 3;
  for (const auto& [name, drop_row] : versions) {
    for (const uint64_t first : {uint64_t{0}, uint64_t{2}, uint64_t{1001}}) {
      for (const int64_t n : {1, 17, 128, 131, 515}) {
        SCOPED_TRACE(::testing::Message() << name << " first " << first << " n " << n);
        const DropoutRow row{seed, subsequence, first, attn::detail::dropout_threshold(0.5)};
        std::vector<float> x(static_cast<size_t>(n), 1.0f);
        drop_row(x.data(), n, row);
        const auto draws = engine_draws(seed, subsequence, first, n);
        for (int64_t j = 0; j < n; ++j) {
          ASSERT_EQ(x[j], draws[j] < row.threshold ? 0.0f : 1.0f) << "element " << j;
        }
      }
    }
  }
}

TEST(Dropout, EveryInstructionSetsSoftmaxBackwardRowIsItsFormula) {
  // ds = p · (m · dPd - delta), p = m · p, with m = 1 / (1 - p_drop) kept,
  // 0 dropped: the gradient of the softmax through the dropped weights.
  using BackwardRow = void (*)(float*, float*, int64_t, float, float, const DropoutRow&);
  const auto versions = float_versions<BackwardRow>(
      [](float* p, float* ds, int64_t n, float delta, float keep, const DropoutRow& row) {
        attn::detail::dropout_softmax_backward_row(
            attn::testing::widest_loops(), p, ds, n, delta, keep, row);
      },
      [](const attn::detail::DropoutLoops& loops) { return loops.softmax_backward_row; });
  torch::manual_seed(3);
  const int64_t n = 131;
  const auto p0 = torch::rand({n}), ds0 = torch::randn({n});
  const float delta = 0.25f, keep_scale = 1.0f / 0.7f;
  const DropoutRow row{99, 1, 77, attn::detail::dropout_threshold(0.3)};
  const auto draws = engine_draws(99, 1, 77, n);
  for (const auto& [name, backward_row] : versions) {
    SCOPED_TRACE(name);
    auto p = p0.clone(), ds = ds0.clone();
    backward_row(p.data_ptr<float>(), ds.data_ptr<float>(), n, delta, keep_scale, row);
    for (int64_t j = 0; j < n; ++j) {
      const double m = draws[j] < row.threshold ? 0.0 : keep_scale;
      const double pj = p0[j].item<double>(), gj = ds0[j].item<double>();
      EXPECT_NEAR(ds[j].item<double>(), pj * (m * gj - delta), 1e-6) << "element " << j;
      EXPECT_NEAR(p[j].item<double>(), m * pj, 1e-6) << "element " << j;
    }
  }
}

// A request for the fused kernel's dropout test: causal or not, a bool
// mask with an empty row or none, grouped key/value heads.
struct DropoutCase {
  int64_t B, H, Hkv, L, S, D;
  bool causal;
  bool masked;
  double p;
  int threads;
};

// The oracle's weights before dropout: scores = scale·Q·Kᵀ, masked and
// banded (-inf), softmax with a row that sees no key all zeros.
torch::Tensor oracle_weights(
    const torch::Tensor& q,
    const torch::Tensor& k,
    const torch::Tensor& allowed,
    double scale) {
  const int64_t group = q.size(1) / k.size(1);
  const auto scores = torch::matmul(q, k.repeat_interleave(group, 1).transpose(-2, -1)) * scale;
  const auto masked = scores.masked_fill(
      allowed.logical_not(), -std::numeric_limits<double>::infinity());
  const auto empty = allowed.logical_not().all(-1, /*keepdim=*/true);
  return torch::softmax(masked.masked_fill(empty, 0), -1).masked_fill(empty, 0);
}

// The oracle: its weights multiplied by keep / (1 - p) for the probability
// p that a weight is dropped, times V, in the inputs' dtype (float64;
// bfloat16 as LibTorch's own computation) with autograd for the gradients.
torch::Tensor dropout_oracle(
    const torch::Tensor& q,
    const torch::Tensor& k,
    const torch::Tensor& v,
    const torch::Tensor& allowed,
    const torch::Tensor& keep,
    double scale,
    double p) {
  const auto probs = oracle_weights(q, k, allowed, scale);
  const auto dropped = probs * keep.to(probs.scalar_type()) / (1 - p);
  return torch::matmul(dropped, v.repeat_interleave(q.size(1) / k.size(1), 1));
}

// The kernel's float16 results against the float64 oracle's, on `exact`
// (q, k, v in float64): WithinFloat32RoundedToFloat16 with this test's
// float32 tolerance, dQ and dK with what the output's rounding carries
// into them (Float16DeltaError, from the oracle's weights before dropout).
void expect_float16_within_float32_rounded(
    const std::vector<torch::Tensor>& exact,
    const torch::Tensor& out,
    const std::vector<torch::Tensor>& grads,
    const torch::Tensor& expected,
    const std::vector<torch::Tensor>& expected_grads,
    const torch::Tensor& weights,
    const torch::Tensor& upstream,
    double scale) {
  const Tolerance float32{2e-5, 2e-5};
  EXPECT_TRUE(attn::testing::WithinFloat32RoundedToFloat16(out, expected, float32));
  const auto& k = exact[1];
  const int64_t group = exact[0].size(1) / k.size(1);
  const auto carried = attn::testing::float16_delta_error(
      exact[0], k.repeat_interleave(group, 1), expected, weights, upstream, scale);
  const auto summed_over_groups = [&](const torch::Tensor& t) {
    return t.view({k.size(0), k.size(1), group, k.size(2), k.size(3)}).sum(2);
  };
  const torch::Tensor carried_into[] = {carried.dq, summed_over_groups(carried.dk), {}};
  const char* names[] = {"dq", "dk", "dv"};
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_TRUE(attn::testing::WithinFloat32RoundedToFloat16(
        grads[i], expected_grads[i], float32, carried_into[i]))
        << names[i];
  }
}

// One case in `dtype` on the fused kernel's tiled loops of `loops`,
// against the oracle with the engine's mask.
void expect_dropout_case_matches_the_oracle(
    const DropoutCase& c,
    torch::ScalarType dtype,
    const attn::detail::CpuLoops& loops) {
  SCOPED_TRACE(
      ::testing::Message() << "B " << c.B << " H " << c.H << " Hkv " << c.Hkv << " L " << c.L
                           << " S " << c.S << " D " << c.D << " causal " << c.causal << " masked "
                           << c.masked << " p " << c.p << " " << dtype);
  ThreadCount threads(c.threads);
  torch::manual_seed(c.L + c.S);
  const auto opts = torch::TensorOptions(dtype);
  const auto q = torch::randn({c.B, c.H, c.L, c.D}, opts).requires_grad_();
  const auto k = torch::randn({c.B, c.Hkv, c.S, c.D}, opts).requires_grad_();
  const auto v = torch::randn({c.B, c.Hkv, c.S, c.D}, opts).requires_grad_();
  auto allowed = c.masked ? (torch::rand({c.B, 1, c.L, c.S}) > 0.2)
                          : torch::ones({1, 1, c.L, c.S}, torch::kBool);
  if (c.masked) {
    allowed.select(2, c.L / 2).fill_(false); // a row that sees no key
  }
  attn::detail::AttentionParams params;
  params.q = q;
  params.k = k;
  params.v = v;
  params.scale = 1.0 / std::sqrt(c.D);
  params.causal = c.causal;
  if (c.masked) {
    params.mask = allowed.expand({c.B, c.H, c.L, c.S});
  }
  params.dropout = {c.p, 0x0123456789abcdefULL + static_cast<uint64_t>(c.S)};
  const auto out = attn::detail::fused_attention({loops, attn::detail::FusedLoops::tiled}, params);
  const auto upstream = torch::randn(out.sizes(), opts);
  const auto grads = torch::autograd::grad({out}, {q, k, v}, {upstream});

  const auto band = attn::testing::band_mask(c.L, c.S, 0, c.causal, 0);
  const auto keep = engine_keep_mask(c.B, c.H, c.L, c.S, params.dropout.seed, c.p);
  std::vector<torch::Tensor> exact{
      q.detach().to(torch::kDouble).requires_grad_(),
      k.detach().to(torch::kDouble).requires_grad_(),
      v.detach().to(torch::kDouble).requires_grad_()};
  const auto expected = dropout_oracle(
      exact[0], exact[1], exact[2], allowed.logical_and(band), keep, params.scale,
      drop_probability(c.p));
  const auto expected_grads = torch::autograd::grad(
      {expected}, exact, {upstream.to(torch::kDouble)});
  if (dtype == torch::kHalf) {
    expect_float16_within_float32_rounded(
        exact, out, grads, expected, expected_grads,
        oracle_weights(exact[0], exact[1], allowed.logical_and(band), params.scale), upstream,
        params.scale);
    return;
  }
  const char* names[] = {"dq", "dk", "dv"};
  if (dtype == torch::kBFloat16) { // FlashAttention's rule (test_support.h)
    std::vector<torch::Tensor> low{
        q.detach().requires_grad_(), k.detach().requires_grad_(), v.detach().requires_grad_()};
    const auto libtorch = dropout_oracle(
        low[0], low[1], low[2], allowed.logical_and(band), keep, params.scale,
        drop_probability(c.p));
    const auto libtorch_grads = torch::autograd::grad({libtorch}, low, {upstream});
    EXPECT_WITHIN_TWICE_LIBTORCHS_ERROR(out, libtorch, expected);
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_WITHIN_TWICE_LIBTORCHS_ERROR(grads[i], libtorch_grads[i], expected_grads[i])
          << names[i];
    }
    return;
  }
  // float64: summation order only. float32: O(1) values, relative to
  // the largest (the 1 / (1 - p) scale makes them larger).
  const Tolerance tolerance = dtype == torch::kDouble ? Tolerance{1e-10} : Tolerance{2e-5, 2e-5};
  EXPECT_CLOSE(out, expected, tolerance);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_CLOSE(grads[i], expected_grads[i], tolerance) << names[i];
  }
}

TEST(FusedKernelDropout, OutputAndEveryGradientAreTheOraclesWithTheEngineMask) {
  const DropoutCase cases[] = {
      // Two query tiles, two key blocks (128 × 512): every tile edge.
      {2, 4, 2, 150, 600, 16, false, true, 0.3, 2},
      {1, 2, 2, 150, 600, 16, true, false, 0.1, 2},
      // One head on two threads: the backward splits the keys.
      {1, 1, 1, 40, 1100, 8, false, false, 0.5, 2},
      {2, 3, 3, 33, 70, 64, true, true, 0.9, 1},
  };
  // bfloat16 on each level with bfloat16 products (AVX512-BF16's
  // micro-tiles, AMX's tiles), whichever the plan would choose.
  std::vector<attn::detail::CpuLoops> bf16_levels;
  for (const auto level : attn::detail::cpu_levels()) {
    if (level >= attn::detail::CpuLevel::avx512_bf16) {
      bf16_levels.push_back(attn::detail::cpu_loops(level));
    }
  }
  if (bf16_levels.empty()) {
    std::cout << "[  NOTE    ] no bfloat16 products on this CPU (AVX512-BF16, AMX): the "
                 "fused kernel computes bfloat16 in float32, through the public function\n";
  }
  const auto widest = attn::testing::widest_loops();
  if (!attn::detail::half_products_run(widest)) {
    std::cout << "[  NOTE    ] attn's loops do not widen float16 here: the fused kernel "
                 "computes float16 in float32, through the public function\n";
  }
  for (const auto& c : cases) {
    for (const auto dtype : {torch::kDouble, torch::kFloat}) {
      expect_dropout_case_matches_the_oracle(c, dtype, widest);
    }
    for (const auto& loops : bf16_levels) {
      SCOPED_TRACE(std::string("level ") + attn::detail::cpu_level_name(loops.level));
      expect_dropout_case_matches_the_oracle(c, torch::kBFloat16, loops);
    }
    if (attn::detail::half_products_run(widest)) {
      expect_dropout_case_matches_the_oracle(c, torch::kHalf, widest);
    }
  }
}

// The public function at the fused kernel, training with dropout: q = k =
// 0 makes every weight 1/S, and v = I reads the weights back out of the
// output: out = keep / ((1 - p)·S).
torch::Tensor dropped_uniform_weights(int64_t B, int64_t H, int64_t T, double p) {
  const auto q = torch::zeros({B, H, T, 8});
  const auto v = torch::eye(T).expand({B, H, T, T});
  return std::get<0>(attn::scaled_dot_product_attention(
      q, q, v,
      attn::SDPAOptions().dropout_p(p).training(true).backend(attn::AttentionBackend::fused_cpu)));
}

TEST(Dropout, KeepsOneMinusPScaledByItsInverseAsTheEngineDraws) {
  const int64_t B = 2, H = 4, T = 256;
  for (const double p : {0.1, 0.5, 0.9}) {
    SCOPED_TRACE(::testing::Message() << "p " << p);
    const auto seed = seed_after_manual_seed(21);
    torch::manual_seed(21);
    const auto out = dropped_uniform_weights(B, H, T, p);
    const auto kept = out != 0;
    // The draw is the engine's mask for the seed the generator gave.
    EXPECT_TRUE(torch::equal(kept, engine_keep_mask(B, H, T, T, seed, p)));
    // Every kept weight is 1/S scaled by the inverse of the keep
    // probability, 1 - t / 2^16 (float32 rounding): the expectation of
    // each weight is 1/S.
    const double dropped = drop_probability(p);
    EXPECT_NEAR(dropped, p, 1.0 / 65536);
    const auto kept_weights = out.masked_select(kept);
    const auto scaled = torch::full_like(kept_weights, 1.0 / ((1.0 - dropped) * T), torch::kDouble);
    const Tolerance float32_rounding{0, 1e-6};
    EXPECT_CLOSE(kept_weights, scaled, float32_rounding);
    // The keep rate: N = 524288 draws, within 5 standard deviations of 1 - p.
    const double n = static_cast<double>(kept.numel());
    const double rate = kept.sum().item<double>() / n;
    EXPECT_NEAR(rate, 1.0 - p, 5 * std::sqrt(p * (1 - p) / n));
  }
}

TEST(Dropout, OneSeedGivesBitwiseEqualResultsAndTheDrawDoesNotDependOnTheThreads) {
  torch::manual_seed(1);
  const auto q = torch::randn({1, 2, 300, 16}).requires_grad_();
  const auto k = torch::randn({1, 2, 300, 16}).requires_grad_();
  const auto v = torch::randn({1, 2, 300, 16}).requires_grad_();
  const auto options = attn::SDPAOptions().dropout_p(0.2).training(true).is_causal(true);
  ASSERT_EQ(attn::select_backend(q, k, v, options), attn::AttentionBackend::fused_cpu);
  const auto run = [&](uint64_t seed, int threads) {
    ThreadCount count(threads);
    torch::manual_seed(seed);
    const auto out = std::get<0>(attn::scaled_dot_product_attention(q, k, v, options));
    auto grads = torch::autograd::grad({out.sum()}, {q, k, v});
    grads.insert(grads.begin(), out);
    return grads;
  };
  const auto first = run(4, 2), again = run(4, 2), one_thread = run(4, 1), other = run(5, 2);
  // The backward's split of keys between threads sums dq in another order.
  const Tolerance summation_order{1e-5, 1e-5};
  for (size_t i = 0; i < first.size(); ++i) {
    EXPECT_TRUE(torch::equal(first[i], again[i])) << "result " << i;
    EXPECT_CLOSE(one_thread[i], first[i], summation_order) << "result " << i;
    EXPECT_FALSE(torch::equal(first[i], other[i])) << "result " << i;
  }
  // The forward is per query tile: where attn's loops multiply (not a
  // BLAS, whose summation may follow its threads), bitwise the same on
  // any thread count.
  if (attn::detail::tile_products_run(attn::testing::widest_loops(), torch::kFloat)) {
    EXPECT_TRUE(torch::equal(one_thread[0], first[0]));
  }
}

} // namespace
