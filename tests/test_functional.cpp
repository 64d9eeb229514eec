// attn::scaled_dot_product_attention and the ScaledDotProductAttention
// module against the plain float64 reference in test_support.

#include "test_support.h"

#include <attn/functional.h>
#include <attn/modules/scaled_dot_product_attention.h>

#include <cmath>
#include <limits>
#include <sstream>

namespace {

using attn::SDPAOptions;
using attn::testing::band_mask;
using attn::testing::max_abs_diff;
using attn::testing::numerical_gradient;
using attn::testing::reference_attention;

constexpr double kInf = std::numeric_limits<double>::infinity();

// float32 results of O(1) magnitude after a handful of roundings per
// element; float64 results are limited by summation order only.
constexpr double kFloatTolerance = 1e-5;
constexpr double kDoubleTolerance = 1e-12;

struct Shapes {
  std::vector<int64_t> batch;
  int64_t L, S, E, Ev;
};

std::vector<int64_t> with(std::vector<int64_t> batch, int64_t a, int64_t b) {
  batch.push_back(a);
  batch.push_back(b);
  return batch;
}

torch::Tensor flatten_batch(const torch::Tensor& t) {
  return t.reshape({-1, t.size(-2), t.size(-1)});
}

// (..., L, S) additive float64 mask equivalent to `allowed` (true = attend).
torch::Tensor additive(const torch::Tensor& allowed) {
  return torch::zeros(allowed.sizes(), torch::kDouble)
      .masked_fill(allowed.logical_not(), -kInf);
}

class SdpaMatchesReference
    : public ::testing::TestWithParam<std::tuple<Shapes, torch::ScalarType>> {};

TEST_P(SdpaMatchesReference, OutputAndWeightsWithoutMask) {
  const auto& [s, dtype] = GetParam();
  torch::manual_seed(1);
  const auto q = torch::randn(with(s.batch, s.L, s.E), dtype);
  const auto k = torch::randn(with(s.batch, s.S, s.E), dtype);
  const auto v = torch::randn(with(s.batch, s.S, s.Ev), dtype);

  const auto [out, w] = attn::scaled_dot_product_attention(q, k, v);
  const auto [ref_out, ref_w] = reference_attention(
      flatten_batch(q), flatten_batch(k), flatten_batch(v), {},
      1.0 / std::sqrt(s.E));

  const double tol = dtype == torch::kFloat ? kFloatTolerance : kDoubleTolerance;
  EXPECT_EQ(out.sizes(), torch::IntArrayRef(with(s.batch, s.L, s.Ev)));
  EXPECT_EQ(w.sizes(), torch::IntArrayRef(with(s.batch, s.L, s.S)));
  EXPECT_LE(max_abs_diff(flatten_batch(out), ref_out), tol);
  EXPECT_LE(max_abs_diff(flatten_batch(w), ref_w), tol);
}

TEST_P(SdpaMatchesReference, BoolFloatAndCausalMasks) {
  const auto& [s, dtype] = GetParam();
  torch::manual_seed(2);
  const auto q = torch::randn(with(s.batch, s.L, s.E), dtype);
  const auto k = torch::randn(with(s.batch, s.S, s.E), dtype);
  const auto v = torch::randn(with(s.batch, s.S, s.Ev), dtype);
  const auto allowed = torch::rand(with(s.batch, s.L, s.S)) > 0.3;
  const auto bias = torch::randn(with(s.batch, s.L, s.S), torch::kDouble);
  const auto causal_allowed =
      torch::ones({s.L, s.S}, torch::kBool).tril().expand_as(allowed);
  const double tol = dtype == torch::kFloat ? kFloatTolerance : kDoubleTolerance;
  const double scale = 1.0 / std::sqrt(s.E);

  const auto check = [&](const SDPAOptions& options,
                         const torch::Tensor& reference_bias) {
    const auto [out, w] = attn::scaled_dot_product_attention(q, k, v, options);
    const auto [ref_out, ref_w] = reference_attention(
        flatten_batch(q), flatten_batch(k), flatten_batch(v),
        flatten_batch(reference_bias), scale);
    EXPECT_LE(max_abs_diff(flatten_batch(out), ref_out), tol);
    EXPECT_LE(max_abs_diff(flatten_batch(w), ref_w), tol);
  };
  {
    SCOPED_TRACE("bool mask");
    check(SDPAOptions().attn_mask(allowed), additive(allowed));
  }
  {
    SCOPED_TRACE("float mask");
    check(SDPAOptions().attn_mask(bias.to(dtype)), bias);
  }
  {
    SCOPED_TRACE("causal");
    check(SDPAOptions().is_causal(true), additive(causal_allowed));
  }
  {
    SCOPED_TRACE("causal and bool mask");
    check(
        SDPAOptions().is_causal(true).attn_mask(allowed),
        additive(causal_allowed.logical_and(allowed)));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes,
    SdpaMatchesReference,
    ::testing::Combine(
        ::testing::Values(
            Shapes{{}, 5, 5, 4, 4},
            Shapes{{3}, 4, 7, 8, 5},
            Shapes{{2, 3}, 6, 3, 16, 16},
            Shapes{{1}, 1, 1, 2, 3},
            Shapes{{2}, 9, 13, 32, 7}),
        ::testing::Values(torch::kFloat, torch::kDouble)));

TEST(ScaledDotProductAttention, BoolMaskEqualsFloatMaskOfZerosAndNegativeInfinity) {
  torch::manual_seed(3);
  const auto q = torch::randn({2, 4, 6, 8});
  const auto k = torch::randn({2, 4, 5, 8});
  const auto v = torch::randn({2, 4, 5, 8});
  const auto allowed = torch::rand({2, 1, 6, 5}) > 0.4; // broadcast over dim 1
  const auto as_float = torch::zeros({2, 1, 6, 5}).masked_fill(~allowed, -kInf);

  const auto [out_bool, w_bool] =
      attn::scaled_dot_product_attention(q, k, v, SDPAOptions().attn_mask(allowed));
  const auto [out_float, w_float] =
      attn::scaled_dot_product_attention(q, k, v, SDPAOptions().attn_mask(as_float));
  EXPECT_TRUE(torch::equal(out_bool, out_float));
  EXPECT_TRUE(torch::equal(w_bool, w_float));
}

TEST(ScaledDotProductAttention, CausalEqualsLowerTriangularMaskWhenLengthsDiffer) {
  torch::manual_seed(4);
  for (const auto& [L, S] : {std::pair{4, 7}, std::pair{7, 4}}) {
    const auto q = torch::randn({3, L, 8});
    const auto k = torch::randn({3, S, 8});
    const auto v = torch::randn({3, S, 8});
    const auto lower = torch::ones({L, S}, torch::kBool).tril();
    const auto [out_causal, w_causal] =
        attn::scaled_dot_product_attention(q, k, v, SDPAOptions().is_causal(true));
    const auto [out_mask, w_mask] =
        attn::scaled_dot_product_attention(q, k, v, SDPAOptions().attn_mask(lower));
    EXPECT_TRUE(torch::equal(out_causal, out_mask)) << "L=" << L << " S=" << S;
    EXPECT_TRUE(torch::equal(w_causal, w_mask)) << "L=" << L << " S=" << S;
    // Query i never sees key j > i.
    EXPECT_EQ(w_causal.masked_select(~lower).abs().max().item<float>(), 0.0f);
  }
}

TEST(ScaledDotProductAttention, FullyMaskedRowGivesZerosAndFiniteGradients) {
  torch::manual_seed(5);
  const auto q = torch::randn({2, 3, 4}, torch::requires_grad());
  const auto k = torch::randn({2, 5, 4}, torch::requires_grad());
  const auto v = torch::randn({2, 5, 4}, torch::requires_grad());
  auto allowed = torch::ones({2, 3, 5}, torch::kBool);
  allowed[0][1] = false; // query 1 of batch 0 may attend to nothing
  const auto as_float = torch::zeros({2, 3, 5}).masked_fill(~allowed, -kInf);

  for (const auto& mask : {allowed, as_float}) {
    const auto [out, w] =
        attn::scaled_dot_product_attention(q, k, v, SDPAOptions().attn_mask(mask));
    EXPECT_EQ(out[0][1].abs().max().item<float>(), 0.0f);
    EXPECT_EQ(w[0][1].abs().max().item<float>(), 0.0f);
    EXPECT_TRUE(torch::isfinite(out).all().item<bool>());
    EXPECT_NEAR(w[1].sum(-1).min().item<float>(), 1.0f, 1e-6);

    (out.sum() + w.pow(2).sum()).backward();
    for (const auto& input : {q, k, v}) {
      EXPECT_TRUE(torch::isfinite(input.grad()).all().item<bool>());
      input.grad().zero_();
    }
  }
}

TEST(ScaledDotProductAttention, GradientsMatchFiniteDifferences) {
  // float64 throughout: central differences with step 1e-6 are accurate to
  // about 1e-9 here, so 1e-6 separates a wrong gradient from rounding.
  torch::manual_seed(6);
  const auto opts = torch::TensorOptions(torch::kDouble);
  auto q = torch::randn({2, 3, 4}, opts).requires_grad_();
  auto k = torch::randn({2, 5, 4}, opts).requires_grad_();
  auto v = torch::randn({2, 5, 3}, opts).requires_grad_();
  auto allowed = torch::rand({2, 3, 5}) > 0.3;
  allowed[1][2] = false; // a fully masked row too
  const auto options = SDPAOptions().attn_mask(allowed).is_causal(true);
  const auto upstream_out = torch::randn({2, 3, 3}, opts);
  const auto upstream_w = torch::randn({2, 3, 5}, opts);
  const auto loss = [&] {
    const auto [out, w] = attn::scaled_dot_product_attention(q, k, v, options);
    return (out * upstream_out).sum() + (w * upstream_w).sum();
  };
  loss().backward();
  for (auto* input : {&q, &k, &v}) {
    EXPECT_LE(max_abs_diff(input->grad(), numerical_gradient(loss, *input)), 1e-6);
  }
}

TEST(ScaledDotProductAttention, ExplicitScaleReplacesOneOverSqrtE) {
  torch::manual_seed(7);
  const auto q = torch::randn({2, 4, 8}, torch::kDouble);
  const auto k = torch::randn({2, 6, 8}, torch::kDouble);
  const auto v = torch::randn({2, 6, 8}, torch::kDouble);
  const auto [out, w] =
      attn::scaled_dot_product_attention(q, k, v, SDPAOptions().scale(0.9));
  const auto [ref_out, ref_w] = reference_attention(q, k, v, {}, 0.9);
  EXPECT_LE(max_abs_diff(out, ref_out), kDoubleTolerance);
  EXPECT_LE(max_abs_diff(w, ref_w), kDoubleTolerance);
}

TEST(ScaledDotProductAttention, NeedWeightsFalseReturnsUndefinedWeightsAndSameOutput) {
  torch::manual_seed(8);
  const auto q = torch::randn({2, 4, 8});
  const auto [out, w] = attn::scaled_dot_product_attention(q, q, q);
  const auto [out_only, no_w] =
      attn::scaled_dot_product_attention(q, q, q, SDPAOptions().need_weights(false));
  EXPECT_TRUE(w.defined());
  EXPECT_FALSE(no_w.defined());
  // Without weights the fused kernel normalises after multiplying by V,
  // so the two agree to float32 rounding rather than bitwise.
  EXPECT_LE(max_abs_diff(out, out_only), 1e-6);
}

TEST(ScaledDotProductAttention, EmptyKeySequenceGivesZeroOutput) {
  const auto q = torch::randn({2, 3, 4});
  const auto kv = torch::randn({2, 0, 4});
  const auto [out, w] = attn::scaled_dot_product_attention(q, kv, kv);
  EXPECT_EQ(out.sizes(), torch::IntArrayRef({2, 3, 4}));
  EXPECT_EQ(w.sizes(), torch::IntArrayRef({2, 3, 0}));
  EXPECT_EQ(out.abs().max().item<float>(), 0.0f);
}

TEST(ScaledDotProductAttention, DropoutIsInactiveWhenNotTraining) {
  torch::manual_seed(9);
  const auto q = torch::randn({2, 8, 16});
  const auto [out, w] = attn::scaled_dot_product_attention(q, q, q);
  const auto [out_eval, w_eval] = attn::scaled_dot_product_attention(
      q, q, q, SDPAOptions().dropout_p(0.5).training(false));
  EXPECT_TRUE(torch::equal(out, out_eval));
  EXPECT_TRUE(torch::equal(w, w_eval));
}

TEST(ScaledDotProductAttention, DropoutZeroesAboutPOfTheWeightsAndRescalesTheRest) {
  torch::manual_seed(10);
  constexpr double p = 0.3;
  const auto q = torch::randn({4, 64, 8});
  const auto v = torch::randn({4, 64, 8});
  const auto [out, w] = attn::scaled_dot_product_attention(q, q, v);
  const auto [out_drop, w_drop] = attn::scaled_dot_product_attention(
      q, q, v, SDPAOptions().dropout_p(p).training(true));

  const auto dropped = w_drop == 0;
  // 16384 Bernoulli(0.3) draws: standard deviation of the fraction ~0.0036.
  EXPECT_NEAR(dropped.to(torch::kDouble).mean().item<double>(), p, 0.02);
  const auto kept = ~dropped;
  EXPECT_TRUE(torch::allclose(
      w_drop.masked_select(kept), w.masked_select(kept) / (1 - p), 1e-6, 1e-7));
  // The output is computed from the dropped weights.
  EXPECT_LE(max_abs_diff(out_drop, torch::matmul(w_drop, v)), 1e-6);
}

TEST(ScaledDotProductAttention, SlidingWindowAndQueryOffsetEqualAnExplicitBandMask) {
  // Lengths across the fused kernel's 128-query tiles and 512-key blocks.
  torch::manual_seed(13);
  constexpr int64_t L = 150, S = 600, E = 16;
  const auto q = torch::randn({2, L, E}, torch::kDouble);
  const auto k = torch::randn({2, S, E}, torch::kDouble);
  const auto v = torch::randn({2, S, E}, torch::kDouble);
  const double scale = 1.0 / std::sqrt(E);
  struct Case {
    bool causal;
    int64_t window, offset;
  };
  for (const auto& c : {Case{true, 64, 0}, Case{true, 64, S - L}, Case{false, 64, 0},
                        Case{false, 200, 300}, Case{true, 1, 10}, Case{false, 0, S - L},
                        Case{true, 0, S - L}, Case{true, 0, -20}}) {
    SCOPED_TRACE(::testing::Message() << "causal=" << c.causal << " window=" << c.window
                                      << " offset=" << c.offset);
    auto options = SDPAOptions().is_causal(c.causal).query_offset(c.offset);
    if (c.window > 0) {
      options.window(c.window);
    }
    const auto allowed = band_mask(L, S, c.offset, c.causal, c.window);
    const auto [ref_out, ref_w] =
        reference_attention(q, k, v, additive(allowed).expand({2, L, S}), scale);
    // With weights (weights kernel), without (flash kernel), and both
    // against an explicit mask.
    const auto [out, w] = attn::scaled_dot_product_attention(q, k, v, options);
    const auto [out_only, none] =
        attn::scaled_dot_product_attention(q, k, v, SDPAOptions(options).need_weights(false));
    const auto [out_mask, w_mask] =
        attn::scaled_dot_product_attention(q, k, v, SDPAOptions().attn_mask(allowed));
    EXPECT_LE(max_abs_diff(out, ref_out), kDoubleTolerance);
    EXPECT_LE(max_abs_diff(w, ref_w), kDoubleTolerance);
    EXPECT_LE(max_abs_diff(out_only, ref_out), kDoubleTolerance);
    EXPECT_LE(max_abs_diff(out_mask, out), kDoubleTolerance);
    EXPECT_EQ(w.masked_fill(allowed, 0.0).abs().max().item<double>(), 0.0);
  }
}

TEST(ScaledDotProductAttention, AWindowPastEveryDistanceIsNoWindow) {
  // Including int64's largest value, which the position arithmetic must
  // survive, with offsets on both sides.
  torch::manual_seed(17);
  const auto q = torch::randn({2, 70, 8}, torch::kDouble);
  const auto k = torch::randn({2, 90, 8}, torch::kDouble);
  for (const int64_t offset : {int64_t{0}, int64_t{-50}, int64_t{1} << 60}) {
    for (const bool causal : {false, true}) {
      const auto plain = SDPAOptions().is_causal(causal).query_offset(offset);
      const auto [expected, expected_w] = attn::scaled_dot_product_attention(q, k, k, plain);
      // 200 exceeds every distance unless the queries stand 2^60 away.
      const auto windows = offset > 1000 ? std::vector<int64_t>{std::numeric_limits<int64_t>::max()}
                                         : std::vector<int64_t>{200, std::numeric_limits<int64_t>::max()};
      for (const int64_t window : windows) {
        SCOPED_TRACE(::testing::Message() << "offset=" << offset << " causal=" << causal
                                          << " window=" << window);
        const auto [out, w] = attn::scaled_dot_product_attention(q, k, k, SDPAOptions(plain).window(window));
        const auto [out_only, none] = attn::scaled_dot_product_attention(
            q, k, k, SDPAOptions(plain).window(window).need_weights(false));
        EXPECT_LE(max_abs_diff(out, expected), kDoubleTolerance);
        EXPECT_LE(max_abs_diff(out_only, expected), kDoubleTolerance);
        EXPECT_LE(max_abs_diff(w, expected_w), kDoubleTolerance);
      }
    }
  }
  EXPECT_ATTN_ERROR(
      attn::scaled_dot_product_attention(q, k, k, SDPAOptions().query_offset((int64_t{1} << 60) + 1)),
      "query_offset must be within ±2^60, got 1152921504606846977");
}

TEST(ScaledDotProductAttention, SlidingWindowGradientsMatchTheBandMasksOnes) {
  torch::manual_seed(14);
  const auto opts = torch::TensorOptions(torch::kDouble);
  auto q = torch::randn({2, 3, 140, 8}, opts).requires_grad_();
  auto k = torch::randn({2, 3, 530, 8}, opts).requires_grad_();
  auto v = torch::randn({2, 3, 530, 8}, opts).requires_grad_();
  const auto upstream = torch::randn({2, 3, 140, 8}, opts);
  const auto gradients = [&](const SDPAOptions& options) {
    const auto [out, w] = attn::scaled_dot_product_attention(q, k, v, SDPAOptions(options).need_weights(false));
    return torch::autograd::grad({out}, {q, k, v}, {upstream});
  };
  const auto windowed = gradients(SDPAOptions().is_causal(true).window(100).query_offset(390));
  const auto masked = gradients(SDPAOptions().attn_mask(band_mask(140, 530, 390, true, 100)));
  for (int i = 0; i < 3; ++i) {
    EXPECT_LE(max_abs_diff(windowed[i], masked[i]), kDoubleTolerance) << "input " << i;
  }
}

TEST(ScaledDotProductAttention, GroupedQueryEqualsRepeatedKeyValueHeads) {
  torch::manual_seed(15);
  for (const auto dtype : {torch::kFloat, torch::kDouble}) {
    const auto opts = torch::TensorOptions(dtype);
    auto q = torch::randn({2, 6, 70, 16}, opts).requires_grad_();
    auto k = torch::randn({2, 2, 90, 16}, opts).requires_grad_();
    auto v = torch::randn({2, 2, 90, 8}, opts).requires_grad_();
    const auto mask = torch::rand({2, 1, 70, 90}) > 0.2;
    const auto upstream = torch::randn({2, 6, 70, 8}, opts);
    const double tol = dtype == torch::kFloat ? kFloatTolerance : kDoubleTolerance;
    for (const bool need_weights : {false, true}) {
      SCOPED_TRACE(::testing::Message() << dtype << " need_weights=" << need_weights);
      const auto options =
          SDPAOptions().attn_mask(mask).is_causal(true).need_weights(need_weights);
      // Query heads 0-2 share key/value head 0, heads 3-5 head 1.
      const auto repeated_k = k.repeat_interleave(3, 1);
      const auto repeated_v = v.repeat_interleave(3, 1);
      const auto [grouped, w] =
          attn::scaled_dot_product_attention(q, k, v, SDPAOptions(options).enable_gqa(true));
      const auto [expanded, w_expanded] =
          attn::scaled_dot_product_attention(q, repeated_k, repeated_v, options);
      EXPECT_LE(max_abs_diff(grouped, expanded), tol);
      if (need_weights) {
        EXPECT_LE(max_abs_diff(w, w_expanded), tol);
      }
      const auto grads = torch::autograd::grad({grouped}, {q, k, v}, {upstream});
      const auto expected = torch::autograd::grad({expanded}, {q, k, v}, {upstream});
      for (int i = 0; i < 3; ++i) {
        EXPECT_EQ(grads[i].sizes(), expected[i].sizes());
        EXPECT_LE(max_abs_diff(grads[i], expected[i]), 10 * tol) << "input " << i;
      }
    }
  }
}

TEST(ScaledDotProductAttention, MultiQueryAttentionSharesOneKeyValueHeadWithoutCopies) {
  // 3-D inputs (H, L, E): the heads dim is the first one.
  torch::manual_seed(16);
  const auto q = torch::randn({4, 5, 8});
  const auto k = torch::randn({1, 7, 8});
  const auto v = torch::randn({1, 7, 3});
  const auto [out, w] =
      attn::scaled_dot_product_attention(q, k, v, SDPAOptions().enable_gqa(true));
  EXPECT_EQ(out.sizes(), torch::IntArrayRef({4, 5, 3}));
  EXPECT_EQ(w.sizes(), torch::IntArrayRef({4, 5, 7}));
  for (int64_t h = 0; h < 4; ++h) {
    const auto [head_out, head_w] = attn::scaled_dot_product_attention(q[h], k[0], v[0]);
    EXPECT_LE(max_abs_diff(out[h], head_out), kFloatTolerance) << "head " << h;
  }
}

TEST(ScaledDotProductAttentionModule, AppliesDropoutOnlyInTrainingMode) {
  torch::manual_seed(11);
  attn::ScaledDotProductAttention sdpa(
      attn::ScaledDotProductAttentionOptions().dropout(0.5));
  const auto q = torch::randn({2, 16, 8});
  const auto [reference, w_reference] = attn::scaled_dot_product_attention(q, q, q);

  sdpa->eval();
  const auto [out_eval, w_eval] = sdpa(q, q, q);
  EXPECT_TRUE(torch::equal(out_eval, reference));

  sdpa->train();
  const auto [out_train, w_train] = sdpa(q, q, q);
  EXPECT_GT((w_train == 0).sum().item<int64_t>(), 0);
  EXPECT_FALSE(torch::equal(out_train, reference));
}

TEST(ScaledDotProductAttentionModule, ForwardsMaskCausalAndScale) {
  torch::manual_seed(12);
  attn::ScaledDotProductAttention sdpa(
      attn::ScaledDotProductAttentionOptions().scale(0.5));
  const auto q = torch::randn({2, 5, 8});
  const auto allowed = torch::rand({5, 5}) > 0.2;
  const auto [out, w] = sdpa(q, q, q, allowed, /*is_causal=*/true);
  const auto [expected_out, expected_w] = attn::scaled_dot_product_attention(
      q, q, q, SDPAOptions().attn_mask(allowed).is_causal(true).scale(0.5));
  EXPECT_TRUE(torch::equal(out, expected_out));
  EXPECT_TRUE(torch::equal(w, expected_w));
}

TEST(ScaledDotProductAttentionModule, PrettyPrintsItsOptions) {
  std::ostringstream printed;
  printed << *attn::ScaledDotProductAttention(
      attn::ScaledDotProductAttentionOptions().dropout(0.25));
  EXPECT_EQ(printed.str(), "attn::ScaledDotProductAttention(dropout=0.25, scale=1/sqrt(E))");
}

TEST(ScaledDotProductAttentionErrors, NameWhatWasExpectedAndWhatArrived) {
  const auto q = torch::randn({2, 4, 8});
  const auto k = torch::randn({2, 6, 8});
  const auto v = torch::randn({2, 6, 5});
  EXPECT_ATTN_ERROR(
      attn::scaled_dot_product_attention(torch::randn({8}), k, v),
      "query must be (..., L, E) with at least 2 dims, got [8]");
  EXPECT_ATTN_ERROR(
      attn::scaled_dot_product_attention(q, torch::randn({6, 8}), v),
      "query, key and value must have the same number of dims, got query [2, 4, 8], key [6, 8], value [2, 6, 5]");
  EXPECT_ATTN_ERROR(
      attn::scaled_dot_product_attention(q, torch::randn({3, 6, 8}), torch::randn({3, 6, 5})),
      "query, key and value must have the same leading dims");
  EXPECT_ATTN_ERROR(
      attn::scaled_dot_product_attention(q, torch::randn({2, 6, 7}), v),
      "key must be (..., S, E) with E == 8 (the query's feature size), got [2, 6, 7]");
  EXPECT_ATTN_ERROR(
      attn::scaled_dot_product_attention(q, k, torch::randn({2, 5, 5})),
      "value must be (..., S, Ev) with S == 6 (the key's length), got [2, 5, 5]");
  EXPECT_ATTN_ERROR(
      attn::scaled_dot_product_attention(torch::zeros({2, 4, 0}), torch::zeros({2, 6, 0}), v),
      "query must have a feature size E > 0, got [2, 4, 0]");
  EXPECT_ATTN_ERROR(
      attn::scaled_dot_product_attention(q.to(torch::kLong), k.to(torch::kLong), v.to(torch::kLong)),
      "query must have a floating-point dtype, got Long");
  EXPECT_ATTN_ERROR(
      attn::scaled_dot_product_attention(q, k.to(torch::kDouble), v),
      "key and value must have the query's dtype Float, got key Double and value Float");
  EXPECT_ATTN_ERROR(
      attn::scaled_dot_product_attention(q, k, v, SDPAOptions().attn_mask(torch::zeros({4, 5}))),
      "attn_mask must be broadcastable to the scores' shape (..., L, S) = [2, 4, 6], got [4, 5]");
  EXPECT_ATTN_ERROR(
      attn::scaled_dot_product_attention(q, k, v, SDPAOptions().attn_mask(torch::zeros({3, 2, 4, 6}))),
      "attn_mask must be broadcastable to the scores' shape (..., L, S) = [2, 4, 6], got [3, 2, 4, 6]");
  EXPECT_ATTN_ERROR(
      attn::scaled_dot_product_attention(q, k, v, SDPAOptions().attn_mask(torch::zeros({4, 6}, torch::kInt))),
      "attn_mask must be bool or have the query's dtype Float, got Int");
  EXPECT_ATTN_ERROR(
      attn::scaled_dot_product_attention(q, k, v, SDPAOptions().attn_mask(torch::zeros({4, 6}, torch::kDouble))),
      "attn_mask must be bool or have the query's dtype Float, got Double");
  EXPECT_ATTN_ERROR(
      attn::scaled_dot_product_attention(q, k, v, SDPAOptions().dropout_p(1.5)),
      "dropout_p must be in [0, 1], got 1.5");
  EXPECT_ATTN_ERROR(
      attn::scaled_dot_product_attention(q, torch::Tensor(), v),
      "query, key and value must be defined tensors");
  EXPECT_ATTN_ERROR(
      attn::ScaledDotProductAttention(attn::ScaledDotProductAttentionOptions().dropout(-0.1)),
      "ScaledDotProductAttention: dropout must be in [0, 1), got -0.1");
  EXPECT_ATTN_ERROR(
      attn::scaled_dot_product_attention(q, k, v, SDPAOptions().window(0)),
      "window must be a positive number of keys, got 0");
  EXPECT_ATTN_ERROR(
      attn::scaled_dot_product_attention(q, k, v, SDPAOptions().is_causal(true).window(-4)),
      "window must be a positive number of keys, got -4");
  EXPECT_ATTN_ERROR(
      attn::scaled_dot_product_attention(torch::randn({4, 8}), torch::randn({6, 8}), torch::randn({6, 5}),
                                   SDPAOptions().enable_gqa(true)),
      "enable_gqa needs a heads dim: query must be (..., Hq, L, E), got [4, 8]");
  EXPECT_ATTN_ERROR(
      attn::scaled_dot_product_attention(torch::randn({2, 6, 4, 8}), torch::randn({2, 4, 6, 8}),
                                   torch::randn({2, 4, 6, 5}), SDPAOptions().enable_gqa(true)),
      "the key/value heads Hkv must divide the query heads Hq, got Hq=6 and Hkv=4");
  EXPECT_ATTN_ERROR(
      attn::scaled_dot_product_attention(torch::randn({2, 6, 4, 8}), torch::randn({2, 2, 6, 8}),
                                   torch::randn({2, 3, 6, 5}), SDPAOptions().enable_gqa(true)),
      "and key and value their heads, got query [2, 6, 4, 8], key [2, 2, 6, 8], value [2, 3, 6, 5]");
  EXPECT_ATTN_ERROR(
      attn::scaled_dot_product_attention(torch::randn({2, 6, 4, 8}), torch::randn({2, 2, 6, 8}),
                                   torch::randn({2, 2, 6, 5})),
      "(enable_gqa allows fewer key/value heads)");
}

} // namespace
