// Self-attention's Q/K/V projection as one product
// (src/modules/stacked_projection.cpp): the module keeps the three weights
// as row blocks of one tensor through its life (to, load, clone, the
// distributed modules' copies), and the product and its gradients, first
// and second order, equal a plain linear over the concatenated weights,
// whether the weights are stacked or not.

#include "modules/stacked_projection.h"

#include "test_support.h"

#include <attn/interop.h>
#include <attn/modules/multi_head_attention.h>

#include <sstream>

namespace {

using attn::MultiHeadAttention;
using attn::MultiHeadAttentionOptions;
using attn::detail::stacked_linear;
using attn::detail::stacked_rows;
using attn::testing::kFloat32Tolerance;
using attn::testing::kFloat64Tolerance;
using attn::testing::Tolerance;

bool weights_stacked(const attn::MultiHeadAttentionImpl& mha) {
  return stacked_rows({mha.q_proj->weight, mha.k_proj->weight, mha.v_proj->weight}).defined();
}

bool biases_stacked(const attn::MultiHeadAttentionImpl& mha) {
  return stacked_rows({mha.q_proj->bias, mha.k_proj->bias, mha.v_proj->bias}).defined();
}

TEST(StackedProjection, TheModuleKeepsItsWeightsAsRowBlocksOfOneTensor) {
  MultiHeadAttention mha(MultiHeadAttentionOptions(16, 4));
  ASSERT_TRUE(weights_stacked(*mha));
  ASSERT_TRUE(biases_stacked(*mha));
  const auto* q = mha->q_proj->weight.data_ptr<float>();
  EXPECT_EQ(mha->k_proj->weight.data_ptr<float>(), q + 16 * 16);
  EXPECT_EQ(mha->v_proj->weight.data_ptr<float>(), q + 2 * 16 * 16);
  // The stacked view reads the parameters' values.
  const auto stacked = stacked_rows(
      {mha->q_proj->weight, mha->k_proj->weight, mha->v_proj->weight});
  EXPECT_TRUE(torch::equal(
      stacked, torch::cat({mha->q_proj->weight, mha->k_proj->weight, mha->v_proj->weight})));
  // Each weight is still a leaf of its own.
  EXPECT_TRUE(mha->k_proj->weight.is_leaf());
  EXPECT_EQ(mha->named_parameters().size(), 8U);

  MultiHeadAttention grouped(MultiHeadAttentionOptions(16, 4).num_kv_heads(2));
  EXPECT_TRUE(weights_stacked(*grouped)); // (16, 16), (8, 16), (8, 16)
  MultiHeadAttention no_bias(MultiHeadAttentionOptions(16, 4).bias(false));
  EXPECT_TRUE(weights_stacked(*no_bias));
  MultiHeadAttention cross(MultiHeadAttentionOptions(16, 4).kdim(8).vdim(8));
  EXPECT_FALSE(weights_stacked(*cross));
}

TEST(StackedProjection, StaysStackedThroughToCloneAndLoad) {
  torch::manual_seed(0);
  MultiHeadAttention mha(MultiHeadAttentionOptions(16, 4));
  const auto weight = mha->k_proj->weight.detach().clone();

  // Cloned, directly and as a submodule.
  const auto copy = std::dynamic_pointer_cast<attn::MultiHeadAttentionImpl>(mha->clone());
  ASSERT_TRUE(copy);
  EXPECT_TRUE(weights_stacked(*copy) && biases_stacked(*copy));
  EXPECT_TRUE(torch::equal(copy->k_proj->weight, weight));
  EXPECT_NE(copy->k_proj->weight.data_ptr(), mha->k_proj->weight.data_ptr());
  torch::nn::Sequential parent(mha);
  const auto parent_copy = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(parent->clone());
  ASSERT_TRUE(parent_copy);
  EXPECT_TRUE(weights_stacked(*parent_copy->ptr<attn::MultiHeadAttentionImpl>(0)));

  // Converted, through the parent as a user's model would be.
  parent->to(torch::kDouble);
  ASSERT_EQ(mha->k_proj->weight.scalar_type(), torch::kDouble);
  EXPECT_TRUE(weights_stacked(*mha) && biases_stacked(*mha));
  EXPECT_TRUE(torch::equal(mha->k_proj->weight, weight.to(torch::kDouble)));
  mha->to(torch::kFloat);
  EXPECT_TRUE(weights_stacked(*mha));

  // Loaded: torch::load replaces each parameter's storage.
  MultiHeadAttention saved(MultiHeadAttentionOptions(16, 4));
  std::stringstream stream;
  torch::save(saved, stream);
  torch::load(mha, stream);
  EXPECT_TRUE(weights_stacked(*mha) && biases_stacked(*mha));
  EXPECT_TRUE(torch::equal(mha->v_proj->weight, saved->v_proj->weight));
}

TEST(StackedProjection, LeavesWeightsOfDifferentKindsApart) {
  MultiHeadAttention mha(MultiHeadAttentionOptions(16, 4));
  mha->k_proj->to(torch::kDouble); // one projection converted on its own
  EXPECT_NO_THROW(mha->to(torch::Device(torch::kCPU)));
  EXPECT_FALSE(weights_stacked(*mha));
  EXPECT_EQ(mha->k_proj->weight.scalar_type(), torch::kDouble);
  EXPECT_EQ(mha->q_proj->weight.scalar_type(), torch::kFloat);
  EXPECT_FALSE(attn::detail::stack_rows({mha->q_proj->weight, mha->k_proj->weight}));
}

// attn's module against the built-in with the same weights: output, input
// gradient and every parameter's gradient, for the token counts below and
// above E (where an unstacked module would project separately).
void expect_gradients_match_the_builtin(int64_t tokens, bool stacked) {
  MultiHeadAttention ours(MultiHeadAttentionOptions(16, 4));
  torch::nn::MultiheadAttention builtin(torch::nn::MultiheadAttentionOptions(16, 4));
  attn::copy_weights(*ours, *builtin);
  ours->to(torch::kDouble);
  builtin->to(torch::kDouble);
  if (!stacked) { // a user's set_data ends the stacking
    torch::NoGradGuard no_grad;
    ours->k_proj->weight.set_data(ours->k_proj->weight.clone());
  }
  ASSERT_EQ(weights_stacked(*ours), stacked);
  const auto x = torch::randn({tokens, 1, 16}, torch::kDouble);
  const auto x_ours = x.transpose(0, 1).detach().requires_grad_();
  const auto x_builtin = x.detach().requires_grad_();
  const auto out = std::get<0>(ours->forward(
      x_ours, x_ours, x_ours, attn::MultiHeadAttentionForwardOptions().need_weights(false)));
  const auto expected = std::get<0>(builtin->forward(x_builtin, x_builtin, x_builtin));
  EXPECT_CLOSE(out.transpose(0, 1), expected, kFloat64Tolerance);
  const auto grad = torch::randn_like(expected);
  out.backward(grad.transpose(0, 1));
  expected.backward(grad);
  EXPECT_CLOSE(x_ours.grad().transpose(0, 1), x_builtin.grad(), kFloat64Tolerance);
  EXPECT_CLOSE(
      torch::cat(
          {ours->q_proj->weight.grad(), ours->k_proj->weight.grad(), ours->v_proj->weight.grad()}),
      builtin->in_proj_weight.grad(), kFloat64Tolerance);
  EXPECT_CLOSE(
      torch::cat({ours->q_proj->bias.grad(), ours->k_proj->bias.grad(), ours->v_proj->bias.grad()}),
      builtin->in_proj_bias.grad(), kFloat64Tolerance);
  EXPECT_CLOSE(ours->out_proj->weight.grad(), builtin->out_proj->weight.grad(), kFloat64Tolerance);
}

TEST(StackedProjection, GradientsMatchTheBuiltinStackedOrNot) {
  for (const int64_t tokens : {3, 40}) { // B·T below and above E = 16
    for (const bool stacked : {true, false}) {
      SCOPED_TRACE(::testing::Message() << tokens << " tokens, stacked " << stacked);
      torch::manual_seed(tokens);
      expect_gradients_match_the_builtin(tokens, stacked);
    }
  }
}

// The penalty's gradients below reach 2·10⁴ (sums of squared outputs'
// gradients), so the BLAS's summation order moves them by ulps of that
// size: 3.6e-12 with MKL on an AMD CPU.
constexpr Tolerance kPenaltyGradientTolerance{kFloat64Tolerance.atol, 1e-14};

// stacked_linear against F::linear over the concatenated weights, in
// float64: value, first-order gradients of every input, and a second-order
// gradient through the input gradient (a gradient penalty).
void expect_matches_a_concatenated_linear(
    const std::vector<torch::Tensor>& weights,
    const std::vector<torch::Tensor>& biases,
    const torch::Tensor& input) {
  std::vector<torch::Tensor> leaves{input};
  leaves.insert(leaves.end(), weights.begin(), weights.end());
  if (biases[0].defined()) {
    leaves.insert(leaves.end(), biases.begin(), biases.end());
  }
  const auto reference = [&] {
    const auto bias = biases[0].defined() ? torch::cat(biases) : torch::Tensor();
    return torch::nn::functional::linear(input, torch::cat(weights), bias);
  };
  const auto ours = stacked_linear(input, weights, biases);
  const auto expected = reference();
  EXPECT_CLOSE(ours, expected, kFloat64Tolerance);

  // A loss whose gradient involves the input gradient: second order.
  const auto penalty = [&](const torch::Tensor& output) {
    const auto grad_input = torch::autograd::grad(
        {output.pow(2).sum()}, {input}, {}, /*retain_graph=*/true, /*create_graph=*/true)[0];
    return output.sum() + grad_input.pow(2).sum();
  };
  const auto ours_grads = torch::autograd::grad({penalty(ours)}, leaves);
  const auto expected_grads = torch::autograd::grad({penalty(expected)}, leaves);
  for (size_t i = 0; i < leaves.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "gradient of leaf " << i);
    EXPECT_CLOSE(ours_grads[i], expected_grads[i], kPenaltyGradientTolerance);
  }
}

TEST(StackedProjection, EqualsALinearOverTheConcatenatedWeights) {
  torch::manual_seed(1);
  const auto options = torch::TensorOptions(torch::kDouble).requires_grad(true);
  const auto whole = torch::randn({20, 6}, torch::kDouble);
  const std::vector<torch::Tensor> stacked{
      whole.narrow(0, 0, 8).detach().requires_grad_(),
      whole.narrow(0, 8, 6).detach().requires_grad_(),
      whole.narrow(0, 14, 6).detach().requires_grad_()};
  ASSERT_TRUE(stacked_rows(stacked).defined());
  const std::vector<torch::Tensor> apart{
      torch::randn({8, 6}, options), torch::randn({6, 6}, options), torch::randn({6, 6}, options)};
  ASSERT_FALSE(stacked_rows(apart).defined());
  const std::vector<torch::Tensor> biases{
      torch::randn({8}, options), torch::randn({6}, options), torch::randn({6}, options)};
  const std::vector<torch::Tensor> no_biases(3);
  // Contiguous and sequence-first (transposed) inputs.
  const auto input = torch::randn({2, 5, 6}, options);
  const auto transposed = torch::randn({5, 2, 6}, torch::kDouble).transpose(0, 1).requires_grad_();
  for (const auto* weights : {&stacked, &apart}) {
    for (const auto* bias : {&biases, &no_biases}) {
      for (const auto* x : {&input, &transposed}) {
        SCOPED_TRACE(
            ::testing::Message() << (weights == &stacked ? "stacked" : "apart") << ", "
                                 << (bias == &biases ? "biases" : "no biases") << ", "
                                 << (x == &input ? "contiguous" : "transposed") << " input");
        expect_matches_a_concatenated_linear(*weights, *bias, *x);
      }
    }
  }
}

TEST(StackedProjection, BackwardReadsTheOutputGradientInAnyLayout) {
  // The output gradient contiguous, in (L, B) memory (as the fused kernel
  // writes it for a sequence-first module), and with strided columns.
  torch::manual_seed(2);
  const auto options = torch::TensorOptions(torch::kDouble).requires_grad(true);
  const std::vector<torch::Tensor> weights{
      torch::randn({4, 6}, options), torch::randn({4, 6}, options), torch::randn({4, 6}, options)};
  const std::vector<torch::Tensor> biases{
      torch::randn({4}, options), torch::randn({4}, options), torch::randn({4}, options)};
  const auto input = torch::randn({2, 5, 6}, options);
  std::vector<torch::Tensor> leaves{input};
  leaves.insert(leaves.end(), weights.begin(), weights.end());
  leaves.insert(leaves.end(), biases.begin(), biases.end());

  const std::vector<torch::Tensor> layouts{
      torch::randn({2, 5, 12}, torch::kDouble),
      torch::randn({5, 2, 12}, torch::kDouble).transpose(0, 1),
      torch::randn({2, 5, 24}, torch::kDouble).slice(2, 0, 24, 2)};
  for (size_t layout = 0; layout < layouts.size(); ++layout) {
    SCOPED_TRACE("layout " + std::to_string(layout));
    const auto& grad = layouts[layout];
    const auto ours = torch::autograd::grad(
        {stacked_linear(input, weights, biases)}, leaves, {grad});
    const auto reference = torch::nn::functional::linear(
        input, torch::cat(weights), torch::cat(biases));
    const auto expected = torch::autograd::grad({reference}, leaves, {grad});
    for (size_t i = 0; i < leaves.size(); ++i) {
      EXPECT_CLOSE(ours[i], expected[i], kFloat64Tolerance) << "leaf " << i;
    }
  }
}

TEST(StackedProjection, StackedRowsRefusesWhatIsNotOneRunOfRows) {
  const auto whole = torch::randn({12, 4});
  EXPECT_TRUE(stacked_rows({whole.narrow(0, 0, 4), whole.narrow(0, 4, 8)}).defined());
  // Out of order, with a gap, of another width, or undefined.
  EXPECT_FALSE(stacked_rows({whole.narrow(0, 4, 4), whole.narrow(0, 0, 4)}).defined());
  EXPECT_FALSE(stacked_rows({whole.narrow(0, 0, 4), whole.narrow(0, 5, 4)}).defined());
  EXPECT_FALSE(stacked_rows({whole.narrow(0, 0, 4), torch::randn({4, 4})}).defined());
  EXPECT_FALSE(
      stacked_rows({whole.narrow(0, 0, 4), whole.view({4, 12}).narrow(0, 1, 1)}).defined());
  EXPECT_FALSE(stacked_rows({whole.narrow(0, 0, 4), torch::Tensor()}).defined());
  // Columns of one tensor are not rows.
  EXPECT_FALSE(stacked_rows({whole.narrow(1, 0, 2), whole.narrow(1, 2, 2)}).defined());
}

} // namespace
