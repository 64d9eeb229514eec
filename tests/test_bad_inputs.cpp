// Every table of bad_input_catalogue.h, the bad and unusual inputs to each
// public function and module as docs/BAD_INPUTS.md lists them: each call
// either works (and its result is checked) or raises a c10::Error whose
// message names what was expected and what arrived.

#include "bad_input_catalogue.h"
#include "test_support.h"

namespace {

using attn::testing::expect_catalogued_outcomes;

TEST(BadInputs, ScaledDotProductAttentionFunction) {
  expect_catalogued_outcomes(attn::testing::scaled_dot_product_attention_cases());
}

TEST(BadInputs, ScaledDotProductAttentionModule) {
  expect_catalogued_outcomes(attn::testing::scaled_dot_product_attention_module_cases());
}

TEST(BadInputs, BlockMask) {
  expect_catalogued_outcomes(attn::testing::block_mask_cases());
}

TEST(BadInputs, VarlenAttention) {
  expect_catalogued_outcomes(attn::testing::varlen_attention_cases());
}

TEST(BadInputs, PackedMultiHeadAttention) {
  expect_catalogued_outcomes(attn::testing::packed_multi_head_attention_cases());
}

TEST(BadInputs, MultiHeadAttentionConstruction) {
  expect_catalogued_outcomes(attn::testing::multi_head_attention_construction_cases());
}

TEST(BadInputs, MultiHeadAttentionForward) {
  expect_catalogued_outcomes(attn::testing::multi_head_attention_forward_cases());
}

TEST(BadInputs, MultiHeadAttentionFunction) {
  expect_catalogued_outcomes(attn::testing::multi_head_attention_function_cases());
}

TEST(BadInputs, SelectDeviceAndCopyWeights) {
  expect_catalogued_outcomes(attn::testing::unknown_device_cases());
  if (!torch::cuda::is_available()) {
    expect_catalogued_outcomes(attn::testing::unavailable_cuda_cases());
  }
  expect_catalogued_outcomes(attn::testing::copy_weights_cases());
}

} // namespace
