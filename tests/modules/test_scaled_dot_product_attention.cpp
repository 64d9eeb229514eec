// attn::ScaledDotProductAttention (src/modules/scaled_dot_product_attention.cpp):
// the function's module form, with dropout that follows the training mode.

#include "bad_input_catalogue.h"
#include "test_support.h"

#include <attn/functional.h>
#include <attn/modules/scaled_dot_product_attention.h>

#include <sstream>

namespace {

using attn::ScaledDotProductAttention;
using attn::ScaledDotProductAttentionOptions;
using attn::SDPAOptions;

TEST(ScaledDotProductAttentionModule, AppliesDropoutOnlyInTrainingMode) {
  torch::manual_seed(11);
  ScaledDotProductAttention sdpa(ScaledDotProductAttentionOptions().dropout(0.5));
  const auto q = torch::randn({2, 16, 8});
  const auto [without_dropout, w_without_dropout] = attn::scaled_dot_product_attention(
      q, q, q, SDPAOptions().need_weights(true));

  sdpa->eval();
  const auto [out_eval, w_eval] = sdpa(q, q, q, torch::Tensor(), false, /*need_weights=*/true);
  EXPECT_TRUE(torch::equal(out_eval, without_dropout));

  sdpa->train();
  const auto [out_train, w_train] = sdpa(q, q, q, torch::Tensor(), false, /*need_weights=*/true);
  EXPECT_GT((w_train == 0).sum().item<int64_t>(), 0);
  EXPECT_FALSE(torch::equal(out_train, without_dropout));
}

TEST(ScaledDotProductAttentionModule, ForwardsMaskCausalAndScale) {
  torch::manual_seed(12);
  ScaledDotProductAttention sdpa(ScaledDotProductAttentionOptions().scale(0.5));
  const auto q = torch::randn({2, 5, 8});
  const auto allowed = torch::rand({5, 5}) > 0.2;
  const auto [out, w] = sdpa(q, q, q, allowed, /*is_causal=*/true, /*need_weights=*/true);
  const auto [expected_out, expected_w] = attn::scaled_dot_product_attention(
      q, q, q, SDPAOptions().attn_mask(allowed).is_causal(true).scale(0.5).need_weights(true));
  EXPECT_TRUE(torch::equal(out, expected_out));
  EXPECT_TRUE(torch::equal(w, expected_w));
  // Without need_weights, no weights and the function's default output.
  const auto [out_only, none] = sdpa(q, q, q, allowed, /*is_causal=*/true);
  const auto [expected_only, expected_none] = attn::scaled_dot_product_attention(
      q, q, q, SDPAOptions().attn_mask(allowed).is_causal(true).scale(0.5));
  EXPECT_FALSE(none.defined());
  EXPECT_TRUE(torch::equal(out_only, expected_only));
}

TEST(ScaledDotProductAttentionModule, PrettyPrintsItsOptions) {
  std::ostringstream printed;
  printed << *ScaledDotProductAttention(ScaledDotProductAttentionOptions().dropout(0.25));
  EXPECT_EQ(printed.str(), "attn::ScaledDotProductAttention(dropout=0.25, scale=1/sqrt(E))");
}

TEST(ScaledDotProductAttentionModuleErrors, NameWhatWasExpectedAndWhatArrived) {
  const auto cases = attn::testing::scaled_dot_product_attention_module_cases();
  attn::testing::expect_catalogued_outcomes(attn::testing::error_cases(cases));
}

} // namespace
