// attn::scaled_dot_product_attention (src/sdpa/functional.cpp) against the
// plain float64 reference in test_support.

#include "bad_input_catalogue.h"
#include "sdpa/projection_attention.h"
#include "test_support.h"

#include <attn/functional.h>

#include <cmath>
#include <limits>

namespace {

using attn::SDPAOptions;
using attn::testing::additive_bias;
using attn::testing::band_mask;
using attn::testing::kFloat32Tolerance;
using attn::testing::kFloat64Tolerance;
using attn::testing::numerical_gradient;
using attn::testing::reference_attention;
using attn::testing::Tolerance;
using attn::testing::tolerance_for;

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

using Inputs = attn::testing::QueryKeyValue;

// Most of these tests read the weights, which a call returns when asked.
SDPAOptions sdpa_with_weights() {
  return SDPAOptions().need_weights(true);
}

// Random query (..., L, E), key (..., S, E) and value (..., S, Ev).
Inputs random_inputs(const Shapes& s, torch::ScalarType dtype) {
  return {
      torch::randn(with(s.batch, s.L, s.E), dtype), torch::randn(with(s.batch, s.S, s.E), dtype),
      torch::randn(with(s.batch, s.S, s.Ev), dtype)};
}

class SdpaMatchesReference
    : public ::testing::TestWithParam<std::tuple<Shapes, torch::ScalarType>> {};

TEST_P(SdpaMatchesReference, OutputAndWeightsWithoutMask) {
  const auto& [s, dtype] = GetParam();
  torch::manual_seed(1);
  const auto [q, k, v] = random_inputs(s, dtype);

  const auto [out, w] = attn::scaled_dot_product_attention(q, k, v, sdpa_with_weights());
  const auto [ref_out, ref_w] = reference_attention(
      flatten_batch(q), flatten_batch(k), flatten_batch(v), {}, 1.0 / std::sqrt(s.E));

  EXPECT_EQ(out.sizes(), torch::IntArrayRef(with(s.batch, s.L, s.Ev)));
  EXPECT_EQ(w.sizes(), torch::IntArrayRef(with(s.batch, s.L, s.S)));
  EXPECT_CLOSE(flatten_batch(out), ref_out, tolerance_for(dtype));
  EXPECT_CLOSE(flatten_batch(w), ref_w, tolerance_for(dtype));
}

TEST_P(SdpaMatchesReference, BoolFloatAndCausalMasks) {
  const auto& [s, dtype] = GetParam();
  torch::manual_seed(2);
  const auto inputs = random_inputs(s, dtype);
  const auto &q = inputs.q, &k = inputs.k, &v = inputs.v; // captured by `check`
  const auto allowed = torch::rand(with(s.batch, s.L, s.S)) > 0.3;
  const auto bias = torch::randn(with(s.batch, s.L, s.S), torch::kDouble);
  const auto causal_allowed = torch::ones({s.L, s.S}, torch::kBool).tril().expand_as(allowed);
  const double scale = 1.0 / std::sqrt(s.E);

  const auto check = [&](const SDPAOptions& options, const torch::Tensor& reference_bias) {
    const auto [out, w] = attn::scaled_dot_product_attention(q, k, v, options);
    const auto [ref_out, ref_w] = reference_attention(
        flatten_batch(q), flatten_batch(k), flatten_batch(v), flatten_batch(reference_bias), scale);
    EXPECT_CLOSE(flatten_batch(out), ref_out, tolerance_for(dtype));
    EXPECT_CLOSE(flatten_batch(w), ref_w, tolerance_for(dtype));
  };
  {
    SCOPED_TRACE("bool mask");
    check(sdpa_with_weights().attn_mask(allowed), additive_bias(allowed));
  }
  {
    SCOPED_TRACE("float mask");
    check(sdpa_with_weights().attn_mask(bias.to(dtype)), bias);
  }
  {
    SCOPED_TRACE("causal");
    check(sdpa_with_weights().is_causal(true), additive_bias(causal_allowed));
  }
  {
    SCOPED_TRACE("causal and bool mask");
    check(
        sdpa_with_weights().is_causal(true).attn_mask(allowed),
        additive_bias(causal_allowed.logical_and(allowed)));
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
  const auto as_float = additive_bias(allowed).to(torch::kFloat);

  const auto [out_bool, w_bool] = attn::scaled_dot_product_attention(
      q, k, v, sdpa_with_weights().attn_mask(allowed));
  const auto [out_float, w_float] = attn::scaled_dot_product_attention(
      q, k, v, sdpa_with_weights().attn_mask(as_float));
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
    const auto [out_causal, w_causal] = attn::scaled_dot_product_attention(
        q, k, v, sdpa_with_weights().is_causal(true));
    const auto [out_mask, w_mask] = attn::scaled_dot_product_attention(
        q, k, v, sdpa_with_weights().attn_mask(lower));
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
  const auto as_float = additive_bias(allowed).to(torch::kFloat);

  for (const auto& mask : {allowed, as_float}) {
    const auto [out, w] = attn::scaled_dot_product_attention(
        q, k, v, sdpa_with_weights().attn_mask(mask));
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
  constexpr Tolerance kFiniteDifferences{1e-6};
  torch::manual_seed(6);
  const auto opts = torch::TensorOptions(torch::kDouble);
  auto q = torch::randn({2, 3, 4}, opts).requires_grad_();
  auto k = torch::randn({2, 5, 4}, opts).requires_grad_();
  auto v = torch::randn({2, 5, 3}, opts).requires_grad_();
  auto allowed = torch::rand({2, 3, 5}) > 0.3;
  allowed[1][2] = false; // a fully masked row too
  const auto options = sdpa_with_weights().attn_mask(allowed).is_causal(true);
  const auto upstream_out = torch::randn({2, 3, 3}, opts);
  const auto upstream_w = torch::randn({2, 3, 5}, opts);
  const auto loss = [&] {
    const auto [out, w] = attn::scaled_dot_product_attention(q, k, v, options);
    return (out * upstream_out).sum() + (w * upstream_w).sum();
  };
  loss().backward();
  for (auto* input : {&q, &k, &v}) {
    EXPECT_CLOSE(input->grad(), numerical_gradient(loss, *input), kFiniteDifferences);
  }
}

TEST(ScaledDotProductAttention, ExplicitScaleReplacesOneOverSqrtE) {
  torch::manual_seed(7);
  const auto q = torch::randn({2, 4, 8}, torch::kDouble);
  const auto k = torch::randn({2, 6, 8}, torch::kDouble);
  const auto v = torch::randn({2, 6, 8}, torch::kDouble);
  const auto [out, w] = attn::scaled_dot_product_attention(q, k, v, sdpa_with_weights().scale(0.9));
  const auto [ref_out, ref_w] = reference_attention(q, k, v, {}, 0.9);
  EXPECT_CLOSE(out, ref_out, kFloat64Tolerance);
  EXPECT_CLOSE(w, ref_w, kFloat64Tolerance);
}

TEST(ScaledDotProductAttention, WeightsOnlyWhenAskedForAndTheSameOutputEitherWay) {
  torch::manual_seed(8);
  const auto q = torch::randn({2, 4, 8});
  const auto [out, w] = attn::scaled_dot_product_attention(q, q, q, sdpa_with_weights());
  const auto [out_default, none] = attn::scaled_dot_product_attention(q, q, q);
  const auto [out_only, no_w] = attn::scaled_dot_product_attention(
      q, q, q, SDPAOptions().need_weights(false));
  EXPECT_TRUE(w.defined());
  EXPECT_FALSE(none.defined());
  EXPECT_FALSE(no_w.defined());
  // Without weights the fused kernel normalises after multiplying by V,
  // so the two agree to float32 rounding rather than bitwise.
  EXPECT_CLOSE(out, out_default, Tolerance{1e-6});
  EXPECT_TRUE(torch::equal(out_default, out_only));
}

// The internal entry MultiHeadAttention calls with its one product for Q,
// K and V (sdpa/projection_attention.h) is the function over that
// product's heads: outputs, weights and the projection's gradient, in
// float32 (attn's kernels, qkv's gradient written in place) and bfloat16
// (on the short heads' loops in bfloat16), with and without weights,
// and with dropout while training (the same seed: the same draw).
TEST(ScaledDotProductAttention, OverTheHeadsOfOneProjectionIsTheFunctionOverThoseHeads) {
  torch::manual_seed(9);
  for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
    for (const bool need_weights : {false, true}) {
      for (const double dropout : {0.0, 0.3}) {
        SCOPED_TRACE(
            ::testing::Message() << dtype << (need_weights ? ", weights" : "") << ", dropout "
                                 << dropout);
        const auto options = SDPAOptions()
                                 .is_causal(true)
                                 .need_weights(need_weights)
                                 .dropout_p(dropout)
                                 .training(true);
        const auto qkv = torch::randn({2, 24, 3, 3, 8}, dtype).requires_grad_();
        torch::manual_seed(10);
        const auto [out, w] = attn::detail::attention_over_projection(qkv, options);
        const auto apart = qkv.detach().clone().requires_grad_();
        const auto heads = attn::detail::heads_of_projection(apart);
        torch::manual_seed(10);
        const auto [expected, expected_w] = attn::scaled_dot_product_attention(
            heads.q, heads.k, heads.v, options);
        EXPECT_TRUE(torch::equal(out, expected));
        EXPECT_EQ(w.defined(), need_weights);
        if (need_weights) {
          EXPECT_TRUE(torch::equal(w, expected_w));
        }
        const auto grad_out = torch::randn(out.sizes(), dtype);
        const auto grad = torch::autograd::grad({out}, {qkv}, {grad_out})[0];
        const auto expected_grad = torch::autograd::grad({expected}, {apart}, {grad_out})[0];
        EXPECT_CLOSE(grad.to(torch::kFloat), expected_grad.to(torch::kFloat), tolerance_for(dtype));
      }
    }
  }
}

TEST(ScaledDotProductAttention, EmptyKeySequenceGivesZeroOutput) {
  const auto q = torch::randn({2, 3, 4});
  const auto kv = torch::randn({2, 0, 4});
  const auto [out, w] = attn::scaled_dot_product_attention(q, kv, kv, sdpa_with_weights());
  EXPECT_EQ(out.sizes(), torch::IntArrayRef({2, 3, 4}));
  EXPECT_EQ(w.sizes(), torch::IntArrayRef({2, 3, 0}));
  EXPECT_EQ(out.abs().max().item<float>(), 0.0f);
}

TEST(ScaledDotProductAttention, DropoutIsInactiveWhenNotTraining) {
  torch::manual_seed(9);
  const auto q = torch::randn({2, 8, 16});
  const auto [out, w] = attn::scaled_dot_product_attention(q, q, q, sdpa_with_weights());
  const auto [out_eval, w_eval] = attn::scaled_dot_product_attention(
      q, q, q, sdpa_with_weights().dropout_p(0.5).training(false));
  EXPECT_TRUE(torch::equal(out, out_eval));
  EXPECT_TRUE(torch::equal(w, w_eval));
}

TEST(ScaledDotProductAttention, DropoutZeroesAboutPOfTheWeightsAndRescalesTheRest) {
  torch::manual_seed(10);
  constexpr double p = 0.3;
  const auto q = torch::randn({4, 64, 8});
  const auto v = torch::randn({4, 64, 8});
  const auto [out, w] = attn::scaled_dot_product_attention(q, q, v, sdpa_with_weights());
  const auto [out_drop, w_drop] = attn::scaled_dot_product_attention(
      q, q, v, sdpa_with_weights().dropout_p(p).training(true));

  const auto dropped = w_drop == 0;
  // 16384 Bernoulli(0.3) draws: standard deviation of the fraction ~0.0036.
  EXPECT_NEAR(dropped.to(torch::kDouble).mean().item<double>(), p, 0.02);
  const auto kept = ~dropped;
  EXPECT_CLOSE(w_drop.masked_select(kept), w.masked_select(kept) / (1 - p), Tolerance{1e-6});
  // The output is computed from the dropped weights.
  EXPECT_CLOSE(out_drop, torch::matmul(w_drop, v), Tolerance{1e-6});
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
  for (const auto& c :
       {Case{true, 64, 0}, Case{true, 64, S - L}, Case{false, 64, 0}, Case{false, 200, 300},
        Case{true, 1, 10}, Case{false, 0, S - L}, Case{true, 0, S - L}, Case{true, 0, -20}}) {
    SCOPED_TRACE(
        ::testing::Message() << "causal=" << c.causal << " window=" << c.window
                             << " offset=" << c.offset);
    auto options = sdpa_with_weights().is_causal(c.causal).query_offset(c.offset);
    if (c.window > 0) {
      options.window(c.window);
    }
    const auto allowed = band_mask(L, S, c.offset, c.causal, c.window);
    const auto [ref_out, ref_w] = reference_attention(
        q, k, v, additive_bias(allowed).expand({2, L, S}), scale);
    // With weights (weights kernel), without (flash kernel), and both
    // against an explicit mask.
    const auto [out, w] = attn::scaled_dot_product_attention(q, k, v, options);
    const auto [out_only, none] = attn::scaled_dot_product_attention(
        q, k, v, SDPAOptions(options).need_weights(false));
    const auto [out_mask, w_mask] = attn::scaled_dot_product_attention(
        q, k, v, sdpa_with_weights().attn_mask(allowed));
    EXPECT_CLOSE(out, ref_out, kFloat64Tolerance);
    EXPECT_CLOSE(w, ref_w, kFloat64Tolerance);
    EXPECT_CLOSE(out_only, ref_out, kFloat64Tolerance);
    EXPECT_CLOSE(out_mask, out, kFloat64Tolerance);
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
      const auto plain = sdpa_with_weights().is_causal(causal).query_offset(offset);
      const auto [expected, expected_w] = attn::scaled_dot_product_attention(q, k, k, plain);
      // 200 exceeds every distance unless the queries stand 2^60 away.
      const auto windows = offset > 1000
          ? std::vector<int64_t>{std::numeric_limits<int64_t>::max()}
          : std::vector<int64_t>{200, std::numeric_limits<int64_t>::max()};
      for (const int64_t window : windows) {
        SCOPED_TRACE(
            ::testing::Message() << "offset=" << offset << " causal=" << causal
                                 << " window=" << window);
        const auto [out, w] = attn::scaled_dot_product_attention(
            q, k, k, SDPAOptions(plain).window(window));
        const auto [out_only, none] = attn::scaled_dot_product_attention(
            q, k, k, SDPAOptions(plain).window(window).need_weights(false));
        EXPECT_CLOSE(out, expected, kFloat64Tolerance);
        EXPECT_CLOSE(out_only, expected, kFloat64Tolerance);
        EXPECT_CLOSE(w, expected_w, kFloat64Tolerance);
      }
    }
  }
}

TEST(ScaledDotProductAttention, SlidingWindowGradientsMatchTheBandMasksOnes) {
  torch::manual_seed(14);
  const auto opts = torch::TensorOptions(torch::kDouble);
  auto q = torch::randn({2, 3, 140, 8}, opts).requires_grad_();
  auto k = torch::randn({2, 3, 530, 8}, opts).requires_grad_();
  auto v = torch::randn({2, 3, 530, 8}, opts).requires_grad_();
  const auto upstream = torch::randn({2, 3, 140, 8}, opts);
  const auto gradients = [&](const SDPAOptions& options) {
    const auto [out, w] = attn::scaled_dot_product_attention(
        q, k, v, SDPAOptions(options).need_weights(false));
    return torch::autograd::grad({out}, {q, k, v}, {upstream});
  };
  const auto windowed = gradients(
      sdpa_with_weights().is_causal(true).window(100).query_offset(390));
  const auto masked = gradients(sdpa_with_weights().attn_mask(band_mask(140, 530, 390, true, 100)));
  for (int i = 0; i < 3; ++i) {
    EXPECT_CLOSE(windowed[i], masked[i], kFloat64Tolerance) << "input " << i;
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
    const auto tolerance = tolerance_for(dtype);
    // Gradients sum over the query heads that share a key/value head.
    const Tolerance gradient_tolerance{10 * tolerance.atol};
    for (const bool need_weights : {false, true}) {
      SCOPED_TRACE(::testing::Message() << dtype << " need_weights=" << need_weights);
      const auto options = SDPAOptions().attn_mask(mask).is_causal(true).need_weights(need_weights);
      // Query heads 0-2 share key/value head 0, heads 3-5 head 1.
      const auto repeated_k = k.repeat_interleave(3, 1);
      const auto repeated_v = v.repeat_interleave(3, 1);
      const auto [grouped, w] = attn::scaled_dot_product_attention(
          q, k, v, SDPAOptions(options).enable_gqa(true));
      const auto [expanded, w_expanded] = attn::scaled_dot_product_attention(
          q, repeated_k, repeated_v, options);
      EXPECT_CLOSE(grouped, expanded, tolerance);
      if (need_weights) {
        EXPECT_CLOSE(w, w_expanded, tolerance);
      }
      const auto grads = torch::autograd::grad({grouped}, {q, k, v}, {upstream});
      const auto expected = torch::autograd::grad({expanded}, {q, k, v}, {upstream});
      for (int i = 0; i < 3; ++i) {
        EXPECT_CLOSE(grads[i], expected[i], gradient_tolerance) << "input " << i;
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
  const auto [out, w] = attn::scaled_dot_product_attention(
      q, k, v, sdpa_with_weights().enable_gqa(true));
  EXPECT_EQ(out.sizes(), torch::IntArrayRef({4, 5, 3}));
  EXPECT_EQ(w.sizes(), torch::IntArrayRef({4, 5, 7}));
  for (int64_t h = 0; h < 4; ++h) {
    const auto [head_out, head_w] = attn::scaled_dot_product_attention(
        q[h], k[0], v[0], sdpa_with_weights());
    EXPECT_CLOSE(out[h], head_out, kFloat32Tolerance) << "head " << h;
  }
}

TEST(ScaledDotProductAttentionErrors, NameWhatWasExpectedAndWhatArrived) {
  const auto cases = attn::testing::scaled_dot_product_attention_cases();
  attn::testing::expect_catalogued_outcomes(attn::testing::error_cases(cases));
}

} // namespace
