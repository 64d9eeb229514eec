// The score modifiers of SDPAOptions (ALiBi, soft-capping, relative-position
// tables, a floating mask that requires grad, attention sinks) on the fused
// CPU kernel, forward and every gradient, against a float64 oracle written
// here from the published formulas:
// - ALiBi: Press, Smith and Lewis, "Train Short, Test Long" (ICLR 2022):
//   head h adds m_h·(j - i) to the score of query i and key j, with slopes
//   m_h = 2^(-8h/H) (and the paper's code's interleaving for other H);
// - soft-capping: Gemma 2 (Gemma Team 2024), cap·tanh(s / cap) of the
//   scaled score;
// - the relative-position table: T5 (Raffel et al., JMLR 2020), its
//   `_relative_position_bucket` as the reference code defines it;
// - sinks: a per-head logit in each row's softmax denominator that
//   multiplies no value (as gpt-oss's attention has it).
// The oracle's gradients are autograd's over those float64 operations.

#include "test_support.h"

#include "kernels/cpu/fused_attention.h"
#include "kernels/cpu/tile_product.h"
#include "kernels/cpu/tiled_attention.h"
#include "sdpa/backend.h"
#include "sdpa/score_modifiers.h"

#include <attn/attn.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <iostream>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace {

using attn::AttentionBackend;
using attn::PositionBucketing;
using attn::PositionBuckets;
using attn::SDPAOptions;
using attn::testing::band_mask;
using attn::testing::kInf;
using attn::testing::ThreadCount;
using attn::testing::Tolerance;

// T5's bucket of one distance d = j - i, as T5's reference code computes it
// (mesh-tensorflow's and Hugging Face's `_relative_position_bucket`): half
// the buckets per sign when bidirectional, exact distances below half of
// those, then logarithmic up to max_distance in float32, clipped to the
// last bucket.
int64_t t5_bucket(int64_t d, bool bidirectional, int64_t num_buckets, int64_t max_distance) {
  int64_t bucket = 0;
  int64_t n = num_buckets;
  if (bidirectional) {
    n /= 2;
    bucket += d > 0 ? n : 0;
    d = std::abs(d);
  } else {
    d = std::max<int64_t>(-d, 0);
  }
  const int64_t exact = n / 2;
  if (d < exact) {
    return bucket + d;
  }
  const float ratio = std::log(static_cast<float>(d) / static_cast<float>(exact)) /
      static_cast<float>(std::log(static_cast<double>(max_distance) / static_cast<double>(exact)));
  const auto large = exact + static_cast<int64_t>(ratio * static_cast<float>(n - exact));
  return bucket + std::min(large, n - 1);
}

// The bucket of distance d under `buckets`.
int64_t bucket_of(int64_t d, const PositionBuckets& buckets) {
  switch (buckets.bucketing()) {
    case PositionBucketing::t5_bidirectional:
      return t5_bucket(d, true, buckets.num_buckets(), buckets.max_distance());
    case PositionBucketing::t5_causal:
      return t5_bucket(d, false, buckets.num_buckets(), buckets.max_distance());
    case PositionBucketing::clipped:
      return std::clamp(d, -buckets.max_distance(), buckets.max_distance()) +
          buckets.max_distance();
  }
  return 0;
}

// The user's score function of the tests, and its derivative: a nonlinear
// function of the score that depends on the head and the distance.
double user_value(double s, int64_t /*b*/, int64_t h, int64_t i, int64_t j) {
  return s * (1.0 + 0.1 * static_cast<double>(h)) + 0.3 * std::sin(s) -
      0.05 * static_cast<double>(std::abs(i - j));
}
double user_derivative(double s, int64_t /*b*/, int64_t h, int64_t /*i*/, int64_t /*j*/) {
  return 1.0 + 0.1 * static_cast<double>(h) + 0.3 * std::cos(s);
}

// user_value over scores (B, H, L, S), as tensor operations.
torch::Tensor user_value_of(const torch::Tensor& s) {
  const int64_t H = s.size(1), L = s.size(2), S = s.size(3);
  const auto head = torch::arange(H, s.options()).view({1, H, 1, 1});
  const auto distance = (torch::arange(L).view({L, 1}) - torch::arange(S).view({1, S})).abs();
  return s * (1.0 + 0.1 * head) + 0.3 * torch::sin(s) - 0.05 * distance.to(s.scalar_type());
}

// The weights of attention with the options' modifiers (B, H, L, S), from
// the formulas above, in the inputs' dtype (float64 for the oracle;
// bfloat16 for LibTorch's own bfloat16 computation): q (B, H, L, D), k (B,
// Hkv, S, D); the modifiers' tensors as given (leaves, for autograd).
torch::Tensor oracle_weights(
    const torch::Tensor& q,
    const torch::Tensor& k,
    const SDPAOptions& options) {
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), S = k.size(2);
  const auto keys = k.repeat_interleave(H / k.size(1), 1);
  const double scale = options.scale().value_or(1.0 / std::sqrt(static_cast<double>(q.size(3))));
  auto s = torch::einsum("bhid,bhjd->bhij", {q, keys}) * scale;
  if (options.softcap()) {
    s = *options.softcap() * torch::tanh(s / *options.softcap());
  }
  if (options.score_function()) {
    s = user_value_of(s);
  }
  // The distance j - i' of each pair, i' = i + query_offset.
  std::vector<int64_t> distance(static_cast<size_t>(L * S)), bucket(distance.size());
  for (int64_t i = 0; i < L; ++i) {
    for (int64_t j = 0; j < S; ++j) {
      const auto at = static_cast<size_t>(i * S + j);
      distance[at] = j - (i + options.query_offset());
      bucket[at] = bucket_of(distance[at], options.position_buckets());
    }
  }
  const auto d = torch::tensor(distance, torch::kDouble).view({1, 1, L, S}).to(s.scalar_type());
  if (options.alibi_slopes().defined()) {
    const auto m = options.alibi_slopes().view({1, H, 1, 1});
    s = s + (options.alibi_symmetric() ? -m * d.abs() : m * d);
  }
  if (options.position_bias().defined()) {
    const auto index = torch::tensor(bucket, torch::kLong);
    s = s + options.position_bias().index_select(1, index).view({1, H, L, S});
  }
  if (options.attn_mask().defined()) {
    s = s + options.attn_mask();
  }
  const auto band = band_mask(
      L, S, options.query_offset(), options.is_causal(), options.window().value_or(0));
  s = s.masked_fill(band.logical_not(), -kInf);
  if (options.sinks().defined()) {
    const auto sink = options.sinks().view({1, H, 1, 1}).expand({B, H, L, 1});
    return torch::softmax(torch::cat({s, sink}, -1), -1).narrow(-1, 0, S);
  }
  // Rows that see no key: zero weights.
  const auto empty = (s == -kInf).all(-1, /*keepdim=*/true);
  return torch::softmax(s.masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0);
}

// The oracle's output: its weights times V (B, Hkv, S, Dv).
torch::Tensor oracle(
    const torch::Tensor& q,
    const torch::Tensor& k,
    const torch::Tensor& v,
    const SDPAOptions& options) {
  return torch::matmul(
      oracle_weights(q, k, options), v.repeat_interleave(q.size(1) / k.size(1), 1));
}

// One request: sizes, the band and which modifiers are set.
struct Case {
  std::string name;
  int64_t B = 0, H = 0, Hkv = 0, L = 0, S = 0, D = 0;
  bool causal = false;
  int64_t window = 0, query_offset = 0;
  bool alibi = false, symmetric = false, softcap = false, sinks = false, mask = false;
  bool key_bias = false; // the mask (B, 1, 1, S): a bias per key, over heads and queries
  bool user = false;     // user_value as the score function
  c10::optional<PositionBucketing> table;
};

// A case of these sizes with no modifier set.
Case sized(int64_t B, int64_t H, int64_t Hkv, int64_t L, int64_t S, int64_t D) {
  Case c;
  c.B = B;
  c.H = H;
  c.Hkv = Hkv;
  c.L = L;
  c.S = S;
  c.D = D;
  return c;
}

// The options of `c` for float64 tensors that require grad.
SDPAOptions options_of(const Case& c) {
  auto options = SDPAOptions().is_causal(c.causal).query_offset(c.query_offset).enable_gqa(true);
  if (c.window > 0) {
    options.window(c.window);
  }
  const auto leaf = [](torch::Tensor t) { return t.to(torch::kDouble).requires_grad_(); };
  if (c.alibi) {
    options.alibi_slopes(leaf(attn::alibi_slopes(c.H))).alibi_symmetric(c.symmetric);
  }
  if (c.softcap) {
    options.softcap(1.5); // small enough that the cap bends the scores of randn inputs
  }
  if (c.table) {
    const auto buckets = PositionBuckets().bucketing(*c.table).num_buckets(16).max_distance(40);
    options.position_bias(leaf(torch::randn({c.H, buckets.count()}))).position_buckets(buckets);
  }
  if (c.sinks) {
    options.sinks(leaf(torch::randn({c.H})));
  }
  if (c.user) {
    options.score_function(
        std::make_shared<attn::ScoreFunction>(attn::ScoreFunction{user_value, user_derivative}));
  }
  if (c.mask) {
    options.attn_mask(
        leaf(c.key_bias ? torch::randn({c.B, 1, 1, c.S}) : torch::randn({1, c.H, c.L, c.S})));
  }
  return options;
}

// The float64 tensors of `options` that require grad.
std::vector<torch::Tensor> learned_tensors(const SDPAOptions& options) {
  std::vector<torch::Tensor> learned;
  for (const auto& t :
       {options.alibi_slopes(), options.position_bias(), options.sinks(), options.attn_mask()}) {
    if (t.defined()) {
      learned.push_back(t);
    }
  }
  return learned;
}

// `options` with each tensor in `dtype`, a leaf of its own that requires grad.
SDPAOptions in_dtype(SDPAOptions options, torch::ScalarType dtype) {
  const auto leaf = [&](const torch::Tensor& t) {
    return t.defined() ? t.detach().to(dtype).requires_grad_() : t;
  };
  return options.alibi_slopes(leaf(options.alibi_slopes()))
      .position_bias(leaf(options.position_bias()))
      .sinks(leaf(options.sinks()))
      .attn_mask(leaf(options.attn_mask()));
}

// The cases: each modifier alone over 2 query tiles and 2 key blocks, then
// together with GQA, causal, window and offset bands, and on one head whose
// keys the backward splits between the threads.
std::vector<Case> cases() {
  const Case big = sized(2, 4, 2, 130, 600, 16);
  std::vector<Case> all;
  const auto with = [&](Case c, const char* name) {
    c.name = name;
    all.push_back(c);
  };
  auto c = big;
  c.alibi = true;
  c.causal = true;
  with(c, "alibi_causal");
  c = big;
  c.alibi = c.symmetric = true;
  with(c, "alibi_symmetric");
  c = big;
  c.softcap = true;
  with(c, "softcap");
  c = big;
  c.table = PositionBucketing::t5_bidirectional;
  with(c, "t5_bidirectional");
  c = big;
  c.table = PositionBucketing::t5_causal;
  c.causal = true;
  with(c, "t5_causal");
  c = big;
  c.table = PositionBucketing::clipped;
  c.window = 50;
  with(c, "clipped_window");
  c = big;
  c.sinks = true;
  c.window = 3;
  c.causal = true;
  c.query_offset = -2; // rows that see no key: the sink takes all
  with(c, "sinks_empty_rows");
  c = big;
  c.mask = true;
  with(c, "mask_gradient");
  c = sized(1, 4, 2, 130, 600, 16); // the mask (1, H, L, S) is the scores' size
  c.mask = true;
  c.causal = true;
  with(c, "mask_gradient_unbroadcast");
  c = sized(2, 2, 1, 130, 600, 8);
  c.mask = c.key_bias = true;
  with(c, "key_bias_gradient");
  c = big;
  c.alibi = c.softcap = c.sinks = c.mask = true;
  c.table = PositionBucketing::t5_bidirectional;
  c.causal = true;
  c.query_offset = 470;
  with(c, "everything_offset");
  c = big;
  c.user = c.causal = true;
  with(c, "user_function");
  c = big;
  c.user = c.softcap = c.sinks = true;
  c.table = PositionBucketing::clipped;
  with(c, "user_function_softcap_sinks_table");
  c = sized(1, 1, 1, 40, 1100, 8);
  c.alibi = c.softcap = c.sinks = true;
  c.table = PositionBucketing::clipped;
  with(c, "split_keys");
  return all;
}

// Float64 queries, keys and values of `c`, drawn from `seed`.
attn::testing::QueryKeyValue inputs_of(const Case& c, uint64_t seed) {
  torch::manual_seed(seed);
  return {
      torch::randn({c.B, c.H, c.L, c.D}, torch::kDouble),
      torch::randn({c.B, c.Hkv, c.S, c.D}, torch::kDouble),
      torch::randn({c.B, c.Hkv, c.S, c.D}, torch::kDouble)};
}

// out and every gradient of attn's fused kernel against the oracle, in
// `dtype`, each within `tolerance` of the oracle's magnitude.
void expect_fused_matches_oracle(
    const Case& c,
    torch::ScalarType dtype,
    const Tolerance& tolerance) {
  SCOPED_TRACE(c.name + " in " + std::string(c10::toString(dtype)));
  torch::manual_seed(3);
  const auto q64 = torch::randn({c.B, c.H, c.L, c.D}, torch::kDouble).requires_grad_();
  const auto k64 = torch::randn({c.B, c.Hkv, c.S, c.D}, torch::kDouble).requires_grad_();
  const auto v64 = torch::randn({c.B, c.Hkv, c.S, c.D}, torch::kDouble).requires_grad_();
  const auto options64 = options_of(c);
  const auto upstream = torch::randn({c.B, c.H, c.L, c.D}, torch::kDouble);
  const auto expected = oracle(q64, k64, v64, options64);
  (expected * upstream).sum().backward();

  const auto leaf = [&](const torch::Tensor& t) { return t.detach().to(dtype).requires_grad_(); };
  const auto q = leaf(q64), k = leaf(k64), v = leaf(v64);
  const auto options = in_dtype(options64, dtype);
  ASSERT_EQ(attn::select_backend(q, k, v, options), AttentionBackend::fused_cpu);
  const auto [out, none] = attn::scaled_dot_product_attention(q, k, v, options);
  (out * upstream.to(dtype)).sum().backward();

  EXPECT_CLOSE(out, expected, tolerance);
  EXPECT_CLOSE(q.grad(), q64.grad(), tolerance);
  EXPECT_CLOSE(k.grad(), k64.grad(), tolerance);
  EXPECT_CLOSE(v.grad(), v64.grad(), tolerance);
  const auto ours = learned_tensors(options), theirs = learned_tensors(options64);
  for (size_t t = 0; t < ours.size(); ++t) {
    EXPECT_CLOSE(ours[t].grad(), theirs[t].grad(), tolerance) << "learned tensor " << t;
  }
}

TEST(ScoreModifiers, FusedKernelMatchesTheFloat64OracleInEveryGradient) {
  const ThreadCount two_threads(2);
  for (const auto& c : cases()) {
    expect_fused_matches_oracle(c, torch::kDouble, Tolerance{1e-10, 1e-10});
    expect_fused_matches_oracle(c, torch::kFloat, Tolerance{0.0, 2e-5});
  }
}

// A tensor's values as a leaf of `dtype` that requires grad.
torch::Tensor leaf_in(const torch::Tensor& t, torch::ScalarType dtype) {
  return t.detach().to(dtype).requires_grad_();
}

// A request of `c` in half precision: inputs, upstream gradient and the
// modifiers' tensors drawn and rounded to `dtype` (leaves that require
// grad), and the same values in float64 for the oracle.
struct HalfPrecisionRequest {
  torch::Tensor q, k, v, upstream;
  SDPAOptions options;
  torch::Tensor q64, k64, v64;
  SDPAOptions options64;
};

HalfPrecisionRequest half_precision_request(const Case& c, torch::ScalarType dtype) {
  torch::manual_seed(3);
  HalfPrecisionRequest r;
  r.q = leaf_in(torch::randn({c.B, c.H, c.L, c.D}), dtype);
  r.k = leaf_in(torch::randn({c.B, c.Hkv, c.S, c.D}), dtype);
  r.v = leaf_in(torch::randn({c.B, c.Hkv, c.S, c.D}), dtype);
  r.upstream = torch::randn({c.B, c.H, c.L, c.D}).to(dtype);
  r.options = in_dtype(options_of(c), dtype);
  r.q64 = leaf_in(r.q, torch::kDouble);
  r.k64 = leaf_in(r.k, torch::kDouble);
  r.v64 = leaf_in(r.v, torch::kDouble);
  r.options64 = in_dtype(r.options, torch::kDouble);
  return r;
}

// Where the half-precision loops run (`loops_run`), the call's plan
// computes it in `dtype`, and a learned mask of the scores' size (the
// cases' (1, H, L, S) at B = 1) reaches the kernels in its dtype, which
// gives it its gradient in that dtype; one that broadcasts, as a float32
// copy.
void expect_half_precision_plan(
    const Case& c,
    const attn::detail::CallPlan& plan,
    torch::ScalarType dtype,
    bool loops_run) {
  EXPECT_EQ(plan.compute_dtype, loops_run ? dtype : torch::kFloat);
  const bool in_its_dtype = c.mask && !c.key_bias && c.B == 1 && loops_run;
  EXPECT_EQ(plan.mask_dtype == dtype, in_its_dtype);
}

// In bfloat16, by FlashAttention's rule (test_support.h): inputs and
// modifiers' tensors rounded to bfloat16; the reference is the oracle on
// them in float64, LibTorch's error that of the oracle's operations in
// bfloat16.
void expect_bfloat16_within_twice_libtorchs_error(const Case& c) {
  SCOPED_TRACE(c.name + " in BFloat16");
  const auto bf16 = torch::kBFloat16;
  const auto r = half_precision_request(c, bf16);
  const auto &q = r.q, &k = r.k, &v = r.v, &upstream = r.upstream;
  const auto &q64 = r.q64, &k64 = r.k64, &v64 = r.v64;
  const auto& options = r.options;
  const auto& options64 = r.options64;
  const auto options16 = in_dtype(options, bf16);
  const auto q16 = leaf_in(q, bf16), k16 = leaf_in(k, bf16), v16 = leaf_in(v, bf16);
  (oracle(q64, k64, v64, options64) * upstream.to(torch::kDouble)).sum().backward();
  const auto reference = oracle(q64, k64, v64, options64).detach();
  const auto libtorch = oracle(q16, k16, v16, options16);
  (libtorch * upstream).sum().backward();

  const auto plan = attn::testing::plan_of(q, k, v, options);
  ASSERT_EQ(plan.backend, AttentionBackend::fused_cpu);
  expect_half_precision_plan(
      c, plan, bf16, attn::detail::bf16_products_outrun_float(attn::testing::widest_loops()));
  const auto [out, none] = attn::scaled_dot_product_attention(q, k, v, options);
  (out * upstream).sum().backward();
  EXPECT_EQ(out.scalar_type(), bf16);
  EXPECT_WITHIN_TWICE_LIBTORCHS_ERROR(out, libtorch, reference);
  EXPECT_WITHIN_TWICE_LIBTORCHS_ERROR(q.grad(), q16.grad(), q64.grad());
  EXPECT_WITHIN_TWICE_LIBTORCHS_ERROR(k.grad(), k16.grad(), k64.grad());
  EXPECT_WITHIN_TWICE_LIBTORCHS_ERROR(v.grad(), v16.grad(), v64.grad());
  const auto ours = learned_tensors(options), theirs = learned_tensors(options16);
  const auto reference_tensors = learned_tensors(options64);
  // The learned tensors' gradients sum the error of the softmax
  // backward's delta_i = dO_i·O_i. With delta_i from the output rounded
  // to bfloat16 and computed from P rounded for P V (as FlashAttention
  // computes it), the offset bias's gradients, sums of dS over every pair
  // of a head, measured up to 2.1 times LibTorch 1.13's error and 1.96
  // times 2.15's (split_keys' table). Where the offset bias takes a
  // gradient, the forward keeps what the output's rounding lost and
  // multiplies the remainder of P's rounding too (keeps_out_rounding in
  // sdpa/plan.cpp): every learned tensor measured up to 0.87 times
  // LibTorch's error on 2.15; sinks and masks without an offset bias keep
  // nothing and measured up to 0.32 and 0.44 times. Held to 1.5 times,
  // which a forward that never keeps it does not meet.
  for (size_t t = 0; t < ours.size(); ++t) {
    EXPECT_TRUE(attn::testing::WithinLibTorchsError(
        ours[t].grad(), theirs[t].grad(), reference_tensors[t].grad(), 1.5))
        << "learned tensor " << t;
  }
}

// Where its bfloat16 products outrun float ones (AMX, AVX512-BF16 on AMD's
// cores) the fused kernel computes these in bfloat16, elsewhere in
// float32: the rule holds either way.
TEST(ScoreModifiers, FusedKernelInBfloat16IsWithinTwiceLibTorchsBfloat16Error) {
  const ThreadCount two_threads(2);
  for (const auto& c : cases()) {
    expect_bfloat16_within_twice_libtorchs_error(c);
  }
}

// In float16 (test_support.h, WithinFloat32RoundedToFloat16): inputs and
// the modifiers' tensors rounded to float16, the reference the oracle on
// them in float64; out and the gradients of q, k and v within the float32
// check's tolerance plus half a float16 ulp, dQ and dK plus what the
// output's rounding carries into them (Float16DeltaError, from the
// oracle's weights, times the largest slope of a score function, which
// multiplies dS: user_value_of's is below 1.3 + 0.1·h, soft-capping's at
// most 1). The learned tensors' gradients, sums of dS over their pairs,
// are held to the same rule with nothing carried: their forward keeps what
// the output's rounding lost (keeps_out_rounding in sdpa/plan.cpp).
void expect_float16_within_float32_rounded(const Case& c) {
  SCOPED_TRACE(c.name + " in Float16");
  const auto f16 = torch::kHalf;
  const auto r = half_precision_request(c, f16);
  const auto &q = r.q, &k = r.k, &v = r.v, &upstream = r.upstream;
  const auto &q64 = r.q64, &k64 = r.k64, &v64 = r.v64;
  const auto& options = r.options;
  const auto& options64 = r.options64;
  const auto reference = oracle(q64, k64, v64, options64);
  (reference * upstream.to(torch::kDouble)).sum().backward();

  const auto plan = attn::testing::plan_of(q, k, v, options);
  ASSERT_EQ(plan.backend, AttentionBackend::fused_cpu);
  expect_half_precision_plan(
      c, plan, f16, attn::detail::half_products_run(attn::testing::widest_loops()));
  const auto [out, none] = attn::scaled_dot_product_attention(q, k, v, options);
  (out * upstream).sum().backward();
  EXPECT_EQ(out.scalar_type(), f16);
  const Tolerance float32{0.0, 2e-5};
  EXPECT_TRUE(attn::testing::WithinFloat32RoundedToFloat16(out, reference, float32));
  const int64_t group = c.H / c.Hkv;
  const auto carried = attn::testing::float16_delta_error(
      q64, k64.repeat_interleave(group, 1), reference, oracle_weights(q64, k64, options64),
      upstream, options.scale().value_or(1.0 / std::sqrt(static_cast<double>(c.D))));
  const double slope = c.user ? 1.3 + 0.1 * static_cast<double>(c.H - 1) : 1.0;
  const auto dq_carried = slope * carried.dq;
  const auto dk_carried = slope * carried.dk.view({c.B, c.Hkv, group, c.S, c.D}).sum(2);
  EXPECT_TRUE(
      attn::testing::WithinFloat32RoundedToFloat16(q.grad(), q64.grad(), float32, dq_carried));
  EXPECT_TRUE(
      attn::testing::WithinFloat32RoundedToFloat16(k.grad(), k64.grad(), float32, dk_carried));
  EXPECT_TRUE(attn::testing::WithinFloat32RoundedToFloat16(v.grad(), v64.grad(), float32));
  const auto ours = learned_tensors(options), theirs = learned_tensors(options64);
  for (size_t t = 0; t < ours.size(); ++t) {
    EXPECT_TRUE(
        attn::testing::WithinFloat32RoundedToFloat16(ours[t].grad(), theirs[t].grad(), float32))
        << "learned tensor " << t;
  }
}

// Wherever attn's float loops widen float16 the fused kernel computes
// these in float16, elsewhere in float32: the rule holds either way.
TEST(ScoreModifiers, FusedKernelInFloat16IsWithinFloat32RoundedToFloat16) {
  const ThreadCount two_threads(2);
  for (const auto& c : cases()) {
    expect_float16_within_float32_rounded(c);
  }
}

// Which requests' plans keep what their output's rounding lost
// (keeps_out_rounding): in float16 any that gives a learned tensor a
// gradient, in bfloat16 those that give the offset bias one (ALiBi's
// slopes here), in float32 none; none under no grad mode, whatever
// requires_grad says. (The sinks are float32 here, which reach the kernel
// as they are, still requiring grad under no grad mode; ALiBi's slopes
// reach it as a bias computed from them.) Where a dtype's loops do not
// run, the request is computed in float32 and keeps nothing.
TEST(ScoreModifiers, HalfPrecisionKeepsTheOutputsRoundingWhereALearnedGradientNeedsIt) {
  torch::manual_seed(5);
  const int64_t H = 4;
  const auto kept_by = [&](torch::ScalarType dtype, const SDPAOptions& modifiers) {
    const auto q = torch::randn({1, H, 200, 32}).to(dtype).requires_grad_();
    const auto k = torch::randn({1, H, 700, 32}).to(dtype);
    const auto v = torch::randn({1, H, 700, 32}).to(dtype);
    const auto options = SDPAOptions(modifiers).backend(AttentionBackend::fused_cpu);
    return attn::testing::plan_of(q, k, v, options).kernel.keeps_out_rounding ? 1 : 0;
  };
  const auto learned = [](const torch::Tensor& t) { return t.clone().requires_grad_(); };
  const auto slopes = SDPAOptions().alibi_slopes(learned(attn::alibi_slopes(H)));
  const auto sinks = SDPAOptions().sinks(learned(torch::zeros({H})));
  const auto fixed = SDPAOptions().alibi_slopes(attn::alibi_slopes(H));
  const auto mask_of = [&](torch::ScalarType dtype) {
    return SDPAOptions().attn_mask(learned(torch::randn({1, H, 200, 700}).to(dtype)));
  };
  const bool float16_loops = attn::detail::half_products_run(attn::testing::widest_loops());
  EXPECT_EQ(kept_by(torch::kHalf, slopes), float16_loops ? 1 : 0);
  EXPECT_EQ(kept_by(torch::kHalf, sinks), float16_loops ? 1 : 0);
  EXPECT_EQ(kept_by(torch::kHalf, mask_of(torch::kHalf)), float16_loops ? 1 : 0);
  EXPECT_EQ(kept_by(torch::kHalf, fixed), 0);
  const bool bfloat16_loops = attn::detail::bf16_products_outrun_float(
      attn::testing::widest_loops());
  EXPECT_EQ(kept_by(torch::kBFloat16, slopes), bfloat16_loops ? 1 : 0);
  EXPECT_EQ(kept_by(torch::kBFloat16, sinks), 0);
  EXPECT_EQ(kept_by(torch::kBFloat16, mask_of(torch::kBFloat16)), 0);
  EXPECT_EQ(kept_by(torch::kFloat, slopes), 0);
  const torch::NoGradGuard no_grad;
  EXPECT_EQ(kept_by(torch::kHalf, sinks), 0);
  if (!float16_loops) {
    std::cout << "[  NOTE    ] attn's float loops do not run on this CPU: no float16 request "
                 "keeps the rounding\n";
  }
  if (!bfloat16_loops) {
    std::cout << "[  NOTE    ] the fused kernel computes bfloat16 in float32 on this CPU: no "
                 "bfloat16 request keeps the rounding\n";
  }
}

TEST(ScoreModifiers, WeightsKernelReturnsTheOraclesOutput) {
  const torch::NoGradGuard no_grad;
  for (const auto& c : cases()) {
    SCOPED_TRACE(c.name);
    const auto [q, k, v] = inputs_of(c, 5);
    const auto options = options_of(c).need_weights(true);
    ASSERT_EQ(attn::select_backend(q, k, v, options), AttentionBackend::fused_cpu_weights);
    const auto [out, weights] = attn::scaled_dot_product_attention(q, k, v, options);
    EXPECT_CLOSE(out, oracle(q, k, v, options), (Tolerance{1e-10, 1e-10}));
    // The weights multiply V into the output.
    EXPECT_CLOSE(
        torch::matmul(weights, v.repeat_interleave(c.H / c.Hkv, 1)), out,
        (Tolerance{1e-12, 1e-12}));
  }
}

// The weights kernel in half precision (inference), inputs and the
// modifiers' tensors rounded as above: where the tiled loops' products
// compute that dtype (backend.h, half_products_pay) it
// computes there, elsewhere in float32. Either way its weights are the
// float32 softmax rounded once (WithinFloat32RoundedOnce, against the
// oracle's weights), and its output meets each dtype's rule above.
TEST(ScoreModifiers, WeightsKernelInHalfPrecisionRoundsItsWeightsOnce) {
  const torch::NoGradGuard no_grad;
  const ThreadCount two_threads(2);
  const Tolerance float32{0.0, 2e-5};
  for (const auto dtype : {torch::kBFloat16, torch::kHalf}) {
    const bool bfloat16 = dtype == torch::kBFloat16;
    const bool loops_run = attn::detail::half_products_pay(attn::testing::widest_loops(), dtype);
    for (const auto& c : cases()) {
      SCOPED_TRACE(c.name + " in " + c10::toString(dtype));
      const auto r = half_precision_request(c, dtype);
      const auto options = SDPAOptions(r.options).need_weights(true);
      const auto plan = attn::testing::plan_of(r.q, r.k, r.v, options);
      ASSERT_EQ(plan.backend, AttentionBackend::fused_cpu_weights);
      EXPECT_EQ(plan.compute_dtype, loops_run ? dtype : torch::kFloat);
      const auto [out, weights] = attn::scaled_dot_product_attention(r.q, r.k, r.v, options);
      ASSERT_EQ(weights.scalar_type(), dtype);
      EXPECT_TRUE(attn::testing::WithinFloat32RoundedOnce(
          weights, oracle_weights(r.q64, r.k64, r.options64)));
      const auto reference = oracle(r.q64, r.k64, r.v64, r.options64);
      if (bfloat16) {
        EXPECT_WITHIN_TWICE_LIBTORCHS_ERROR(
            out, oracle(r.q, r.k, r.v, in_dtype(r.options, dtype)), reference);
      } else {
        EXPECT_TRUE(attn::testing::WithinFloat32RoundedToFloat16(out, reference, float32));
      }
    }
  }
}

TEST(ScoreModifiers, MathPathMatchesTheOracle) {
  for (const auto& c : cases()) {
    SCOPED_TRACE(c.name);
    const auto [q, k, v] = inputs_of(c, 7);
    const auto options = options_of(c);
    const auto [out, none] = attn::scaled_dot_product_attention(
        q, k, v, SDPAOptions(options).backend(AttentionBackend::math));
    EXPECT_CLOSE(out, oracle(q, k, v, options), (Tolerance{1e-10, 1e-10}));
  }
}

TEST(ScoreModifiers, T5BucketsAreTheReferenceCodes) {
  // Buckets of T5-base (32 buckets, max distance 128), by hand from the
  // reference code: bidirectional 16 per sign, exact below 8.
  const auto bidirectional = PositionBuckets().num_buckets(32).max_distance(128);
  const auto causal = PositionBuckets(bidirectional).bucketing(PositionBucketing::t5_causal);
  const auto distances = torch::tensor({-1, 1, 0, -7, 7, 10, -200, 200, 20, -20}, torch::kLong);
  EXPECT_TRUE(attn::detail::position_buckets(distances, bidirectional)
                  .equal(torch::tensor({1, 17, 0, 7, 23, 24, 15, 31, 26, 10}, torch::kLong)));
  // Causal: later keys all in bucket 0; exact below 16, then log buckets.
  const auto causal_distances = torch::tensor({5, 0, -1, -15, -16, -100, -1000}, torch::kLong);
  EXPECT_TRUE(attn::detail::position_buckets(causal_distances, causal)
                  .equal(torch::tensor({0, 0, 1, 15, 16, 30, 31}, torch::kLong)));
  // Every distance within ±600, against the scalar reference above.
  const auto all = torch::arange(-600, 601, torch::kLong);
  for (const auto& buckets :
       {bidirectional, causal,
        PositionBuckets().bucketing(PositionBucketing::clipped).max_distance(9)}) {
    const auto ours = attn::detail::position_buckets(all, buckets);
    for (int64_t d = -600; d <= 600; ++d) {
      ASSERT_EQ(ours[d + 600].item<int64_t>(), bucket_of(d, buckets)) << "distance " << d;
    }
  }
}

TEST(ScoreModifiers, AlibiSlopesAreThePapers) {
  // 8 heads: 2^-1 .. 2^-8; 12 heads: those of 8, then every other slope of
  // 16 heads, 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5.
  std::vector<double> eight, twelve;
  for (int k = 1; k <= 8; ++k) {
    eight.push_back(std::pow(2.0, -k));
  }
  twelve = eight;
  for (double e : {-0.5, -1.5, -2.5, -3.5}) {
    twelve.push_back(std::pow(2.0, e));
  }
  EXPECT_CLOSE(attn::alibi_slopes(8), torch::tensor(eight, torch::kDouble), (Tolerance{1e-7}));
  EXPECT_CLOSE(attn::alibi_slopes(12), torch::tensor(twelve, torch::kDouble), (Tolerance{1e-7}));
}

} // namespace

namespace {

// One attention of a published model at T tokens: its options, and its
// query, key and value heads.
struct Published {
  const char* model;
  SDPAOptions options;
  int64_t B, H, Hkv, T, D;
};

// The configurations of the coverage table in docs/BENCHMARKS.md ("Score
// modifiers"), as each model publishes its attention.
std::vector<Published> published_attentions() {
  const auto t5 = PositionBuckets().num_buckets(32).max_distance(128);
  const auto t5_causal = PositionBuckets(t5).bucketing(PositionBucketing::t5_causal);
  const auto dropout = SDPAOptions().dropout_p(0.1);
  const auto padding = torch::arange(1024).view({1, 1, 1, 1024}) < 900;
  const auto learned = [](torch::IntArrayRef sizes) {
    return torch::zeros(sizes).requires_grad_();
  };
  return {
      {"BERT-base", SDPAOptions(dropout).attn_mask(padding), 2, 12, 12, 1024, 64},
      {"GPT-2 small", SDPAOptions(dropout).is_causal(true), 2, 12, 12, 1024, 64},
      {"T5 encoder",
       SDPAOptions(dropout).scale(1.0).position_bias(learned({12, 32})).position_buckets(t5), 2, 12,
       12, 1024, 64},
      {"T5 decoder",
       SDPAOptions(dropout)
           .scale(1.0)
           .is_causal(true)
           .position_bias(learned({12, 32}))
           .position_buckets(t5_causal),
       2, 12, 12, 1024, 64},
      {"BLOOM", SDPAOptions().is_causal(true).alibi_slopes(attn::alibi_slopes(16)), 1, 16, 16, 1024,
       64},
      {"Gemma 2 (sliding)",
       SDPAOptions().is_causal(true).enable_gqa(true).softcap(50.0).window(4096), 1, 8, 4, 8192,
       256},
      {"Gemma 2 (global)", SDPAOptions().is_causal(true).enable_gqa(true).softcap(50.0), 1, 8, 4,
       1024, 256},
      {"gpt-oss (sliding)",
       SDPAOptions().is_causal(true).enable_gqa(true).window(128).sinks(learned({64})), 1, 64, 8,
       1024, 64},
      {"gpt-oss (global)", SDPAOptions().is_causal(true).enable_gqa(true).sinks(learned({64})), 1,
       64, 8, 1024, 64},
      {"Swin block", SDPAOptions().attn_mask(learned({1, 3, 49, 49})), 64, 3, 3, 49, 32},
  };
}

} // namespace

TEST(ScoreModifiers, EveryPublishedConfigurationRunsOnAFusedKernel) {
  for (const auto& m : published_attentions()) {
    SCOPED_TRACE(m.model);
    const auto heads = [&](int64_t H) { return torch::empty({m.B, H, m.T, m.D}).requires_grad_(); };
    const auto q = heads(m.H), k = heads(m.Hkv), v = heads(m.Hkv);
    EXPECT_EQ(attn::select_backend(q, k, v, m.options), AttentionBackend::fused_cpu) << "training";
    const torch::NoGradGuard no_grad;
    const auto inference = SDPAOptions(m.options).training(false);
    EXPECT_EQ(attn::select_backend(q, k, v, inference), AttentionBackend::fused_cpu) << "inference";
    // With weights: attn's weights kernel, or at 49 tokens its batched one.
    EXPECT_NE(
        attn::select_backend(q, k, v, SDPAOptions(inference).need_weights(true)),
        AttentionBackend::math)
        << "inference with weights";
  }
}

TEST(ScoreModifiers, WeightsWithALearnedModifierGetItsGradient) {
  // The weights kernel differentiates nothing: a learned sink with weights
  // asked for takes the math path, and gets its gradient.
  const auto c = sized(1, 2, 2, 5, 7, 4);
  const auto [q, k, v] = inputs_of(c, 9);
  const auto sinks64 = torch::randn({2}, torch::kDouble).requires_grad_();
  const auto sinks = sinks64.detach().clone().requires_grad_();
  const auto options = SDPAOptions().sinks(sinks).need_weights(true);
  EXPECT_EQ(attn::select_backend(q, k, v, options), AttentionBackend::math);
  std::get<0>(attn::scaled_dot_product_attention(q, k, v, options)).sum().backward();
  oracle(q, k, v, SDPAOptions().sinks(sinks64)).sum().backward();
  EXPECT_CLOSE(sinks.grad(), sinks64.grad(), (Tolerance{1e-12, 1e-12}));
}

TEST(ScoreModifiers, AUserFunctionMayHideAWholeRow) {
  // Returning -inf hides a pair; a row with every pair hidden gets zeros,
  // on the fused kernel and on the math path alike.
  const auto hide_row_zero = std::make_shared<attn::ScoreFunction>(attn::ScoreFunction{
      [](double s, int64_t, int64_t, int64_t i, int64_t) {
        return i == 0 ? -std::numeric_limits<double>::infinity() : s;
      },
      [](double, int64_t, int64_t, int64_t, int64_t) { return 1.0; }});
  const auto c = sized(1, 2, 2, 5, 7, 4);
  const auto [q, k, v] = inputs_of(c, 11);
  for (const auto backend : {AttentionBackend::fused_cpu, AttentionBackend::math}) {
    const auto leaf = q.clone().requires_grad_();
    const auto out = std::get<0>(attn::scaled_dot_product_attention(
        leaf, k, v, SDPAOptions().score_function(hide_row_zero).backend(backend)));
    out.sum().backward();
    EXPECT_TRUE(torch::equal(out.select(2, 0), torch::zeros({1, 2, 4}, torch::kDouble))) << backend;
    EXPECT_CLOSE(
        out.narrow(2, 1, 4), oracle(q, k, v, SDPAOptions()).narrow(2, 1, 4),
        (Tolerance{1e-12, 1e-12}))
        << backend;
    EXPECT_TRUE(torch::isfinite(leaf.grad()).all().item<bool>()) << backend;
  }
}
