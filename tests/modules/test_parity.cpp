// attn::MultiHeadAttention against torch::nn::MultiheadAttention holding the
// same weights: outputs, weights and every gradient, over a grid of shapes
// and options, in float32 and float64, on the CPU and (when present) CUDA.

#include "test_support.h"

#include <attn/interop.h>
#include <attn/modules/multi_head_attention.h>

#include <limits>
#include <sstream>

namespace {

using attn::testing::max_abs_diff;
using attn::testing::Tolerance;

struct ParityCase {
  int64_t B, L, S, E, H;
  bool bias;
  int64_t kvdim;        // kdim == vdim; the built-in needs key and value alike
  bool self_attention;  // query, key and value are one tensor
  bool key_padding;     // bool key_padding_mask
  bool float_attn_mask; // additive (L, S) attn_mask with some -inf
  bool average;
  bool batch_first;
  bool bias_kv = false;   // add_bias_kv
  bool zero_attn = false; // add_zero_attn
};

std::string name(const ParityCase& c) {
  std::ostringstream s;
  s << "B" << c.B << "_L" << c.L << "_S" << c.S << "_E" << c.E << "_H" << c.H
    << (c.bias ? "_bias" : "_nobias") << "_kv" << c.kvdim << (c.self_attention ? "_self" : "_cross")
    << (c.key_padding ? "_padding" : "") << (c.float_attn_mask ? "_floatmask" : "")
    << (c.average ? "_averaged" : "_perhead") << (c.batch_first ? "_batchfirst" : "_seqfirst")
    << (c.bias_kv ? "_biaskv" : "") << (c.zero_attn ? "_zeroattn" : "");
  return s.str();
}

// gtest prints parameters with this (ctest shows it for every case).
void PrintTo(const ParityCase& c, std::ostream* os) {
  *os << name(c);
}

const ParityCase kCases[] = {
    // B  L  S    E  H  bias  kv  self   pad    mask   avg    bf
    {1, 5, 5, 8, 1, true, 8, true, false, false, false, true},
    {2, 4, 7, 8, 2, true, 8, false, true, false, true, true},
    {3, 6, 3, 64, 8, false, 64, false, false, true, false, false},
    {1, 7, 9, 64, 2, true, 24, false, true, true, true, true},
    {2, 5, 5, 512, 8, true, 512, true, true, false, false, false},
    {2, 3, 6, 512, 1, false, 100, false, false, true, false, true},
    {4, 8, 8, 64, 1, true, 64, true, true, true, true, false},
    {1, 2, 11, 8, 8, false, 8, false, false, false, true, false},
    {3, 9, 4, 512, 2, true, 32, false, true, false, false, false},
    {2, 6, 6, 8, 2, true, 8, true, false, true, false, true},
    // The built-in's extra keys, with masks that must be widened for them.
    {2, 5, 5, 16, 4, true, 16, true, true, true, false, true, true, false},
    {3, 4, 6, 16, 2, true, 16, false, false, true, true, false, false, true},
    {2, 6, 7, 32, 4, true, 24, false, true, false, false, true, true, true},
};

// Outputs and weights as the issue of record requires. Parameter gradients
// sum B·L·S products, so they are compared relative to their largest entry
// (at least 1).
Tolerance parity_tolerance(torch::ScalarType dtype) {
  return Tolerance{dtype == torch::kFloat ? 1e-5 : 1e-10};
}
Tolerance gradient_tolerance(torch::ScalarType dtype) {
  const double error = parity_tolerance(dtype).atol;
  return Tolerance{error, error};
}

// The built-in's Q/K/V weight blocks, read plainly from its layout.
std::vector<torch::Tensor> builtin_qkv(const torch::nn::MultiheadAttentionImpl& m, bool grad) {
  const auto pick = [grad](const torch::Tensor& t) { return grad ? t.grad() : t; };
  const auto E = m.options.embed_dim();
  if (m.options.kdim() == E && m.options.vdim() == E) {
    const auto packed = pick(m.in_proj_weight);
    return {packed.slice(0, 0, E), packed.slice(0, E, 2 * E), packed.slice(0, 2 * E, 3 * E)};
  }
  return {pick(m.q_proj_weight), pick(m.k_proj_weight), pick(m.v_proj_weight)};
}

class Parity
    : public ::testing::TestWithParam<std::tuple<ParityCase, torch::ScalarType, torch::Device>> {};

// Runs both modules on the same inputs and compares the outputs, the
// weights (when requested) and the gradients of every input and parameter.
// With need_weights the CPU runs our materialising path; without, the
// fused kernel and its backward.
void expect_parity(
    const ParityCase& c,
    torch::ScalarType dtype,
    torch::Device device,
    bool need_weights) {
  torch::manual_seed(42);

  torch::nn::MultiheadAttention builtin(torch::nn::MultiheadAttentionOptions(c.E, c.H)
                                            .bias(c.bias)
                                            .kdim(c.kvdim)
                                            .vdim(c.kvdim)
                                            .add_bias_kv(c.bias_kv)
                                            .add_zero_attn(c.zero_attn));
  attn::MultiHeadAttention ours(attn::MultiHeadAttentionOptions(c.E, c.H)
                                    .bias(c.bias)
                                    .kdim(c.kvdim)
                                    .vdim(c.kvdim)
                                    .batch_first(c.batch_first)
                                    .add_bias_kv(c.bias_kv)
                                    .add_zero_attn(c.zero_attn));
  attn::copy_weights(*builtin, *ours);
  builtin->to(device, dtype);
  ours->to(device, dtype);

  // Inputs are made sequence-first (the built-in's layout) and handed to our
  // module in its own layout.
  const auto opts = torch::TensorOptions(dtype).device(device);
  const auto q_seq = torch::randn({c.L, c.B, c.E}, opts);
  const auto k_seq = c.self_attention ? q_seq : torch::randn({c.S, c.B, c.kvdim}, opts);
  const auto v_seq = c.self_attention ? q_seq : torch::randn({c.S, c.B, c.kvdim}, opts);
  // Each module gets leaves of its own, so gradients are compared, not shared.
  const auto to_ours = [&](const torch::Tensor& t) {
    return (c.batch_first ? t.transpose(0, 1) : t).contiguous().detach().requires_grad_();
  };
  const auto theirs_leaf = [&](const torch::Tensor& t) { return t.detach().requires_grad_(); };
  auto q_ours = to_ours(q_seq);
  auto k_ours = c.self_attention ? q_ours : to_ours(k_seq);
  auto v_ours = c.self_attention ? q_ours : to_ours(v_seq);
  auto q_theirs = theirs_leaf(q_seq);
  auto k_theirs = c.self_attention ? q_theirs : theirs_leaf(k_seq);
  auto v_theirs = c.self_attention ? q_theirs : theirs_leaf(v_seq);

  torch::Tensor padding, attn_mask;
  if (c.key_padding) {
    padding = torch::rand({c.B, c.S}, torch::TensorOptions().device(device)) > 0.6;
    padding.select(1, 0).fill_(false); // keep key 0: no query row is fully masked
  }
  if (c.float_attn_mask) {
    attn_mask = torch::randn({c.L, c.S}, opts);
    attn_mask.masked_fill_(
        torch::rand({c.L, c.S}, opts) > 0.7, -std::numeric_limits<double>::infinity());
    attn_mask.select(1, 0).fill_(0.0);
  }

  const auto [out_theirs, w_theirs] = builtin(
      q_theirs, k_theirs, v_theirs, padding, need_weights, attn_mask, c.average);
  const auto [out_ours, w_ours] = ours(
      q_ours, k_ours, v_ours,
      attn::MultiHeadAttentionForwardOptions()
          .key_padding_mask(padding)
          .attn_mask(attn_mask)
          .need_weights(need_weights)
          .average_attn_weights(c.average));

  const auto out_theirs_in_our_layout = c.batch_first ? out_theirs.transpose(0, 1) : out_theirs;
  ASSERT_EQ(out_ours.sizes(), out_theirs_in_our_layout.sizes());
  EXPECT_CLOSE(out_ours, out_theirs_in_our_layout, parity_tolerance(dtype));
  const double output_difference = max_abs_diff(out_ours, out_theirs_in_our_layout);
  // Kept in the test report (--gtest_output=json) to track how close we are.
  ::testing::Test::RecordProperty("max_output_difference", c10::str(output_difference));
  const auto upstream_out = torch::randn(out_theirs.sizes(), opts);
  auto loss_theirs = (out_theirs * upstream_out).sum();
  auto loss_ours = (out_ours * (c.batch_first ? upstream_out.transpose(0, 1) : upstream_out)).sum();
  ASSERT_EQ(w_ours.defined(), need_weights);
  if (need_weights) {
    ASSERT_EQ(w_ours.sizes(), w_theirs.sizes());
    EXPECT_CLOSE(w_ours, w_theirs, parity_tolerance(dtype));
    const double weights_difference = max_abs_diff(w_ours, w_theirs);
    ::testing::Test::RecordProperty("max_weights_difference", c10::str(weights_difference));
    const auto upstream_w = torch::randn(w_theirs.sizes(), opts);
    loss_theirs = loss_theirs + (w_theirs * upstream_w).sum();
    loss_ours = loss_ours + (w_ours * upstream_w).sum();
  }
  loss_theirs.backward();
  loss_ours.backward();

  double largest_relative_gradient_difference = 0.0;
  const auto expect_grad = [&](const torch::Tensor& our_grad, const torch::Tensor& their_grad,
                               const char* what) {
    EXPECT_CLOSE(our_grad, their_grad, gradient_tolerance(dtype)) << what;
    if (our_grad.defined()) {
      largest_relative_gradient_difference = std::max(
          largest_relative_gradient_difference,
          max_abs_diff(our_grad, their_grad) /
              std::max(1.0, their_grad.abs().max().item<double>()));
    }
  };
  const auto in_our_layout = [&](const torch::Tensor& g) {
    return c.batch_first ? g.transpose(0, 1) : g;
  };
  expect_grad(q_ours.grad(), in_our_layout(q_theirs.grad()), "d query");
  if (!c.self_attention) {
    expect_grad(k_ours.grad(), in_our_layout(k_theirs.grad()), "d key");
    expect_grad(v_ours.grad(), in_our_layout(v_theirs.grad()), "d value");
  }
  const auto their_qkv = builtin_qkv(*builtin, /*grad=*/true);
  expect_grad(ours->q_proj->weight.grad(), their_qkv[0], "d q_proj.weight");
  expect_grad(ours->k_proj->weight.grad(), their_qkv[1], "d k_proj.weight");
  expect_grad(ours->v_proj->weight.grad(), their_qkv[2], "d v_proj.weight");
  expect_grad(ours->out_proj->weight.grad(), builtin->out_proj->weight.grad(), "d out_proj.weight");
  if (c.bias) {
    const auto E = c.E;
    const auto their_bias = builtin->in_proj_bias.grad();
    expect_grad(ours->q_proj->bias.grad(), their_bias.slice(0, 0, E), "d q_proj.bias");
    expect_grad(ours->k_proj->bias.grad(), their_bias.slice(0, E, 2 * E), "d k_proj.bias");
    expect_grad(ours->v_proj->bias.grad(), their_bias.slice(0, 2 * E, 3 * E), "d v_proj.bias");
    expect_grad(ours->out_proj->bias.grad(), builtin->out_proj->bias.grad(), "d out_proj.bias");
  }
  if (c.bias_kv) {
    expect_grad(ours->bias_k.grad(), builtin->bias_k.grad(), "d bias_k");
    expect_grad(ours->bias_v.grad(), builtin->bias_v.grad(), "d bias_v");
  }
  ::testing::Test::RecordProperty(
      "max_relative_gradient_difference", c10::str(largest_relative_gradient_difference));
}

TEST_P(Parity, MatchesBuiltinOutputsWeightsAndGradients) {
  const auto& [c, dtype, device] = GetParam();
  ATTN_SKIP_IF_UNAVAILABLE(device);
  expect_parity(c, dtype, device, /*need_weights=*/true);
}

TEST_P(Parity, WithoutWeightsMatchesBuiltinOutputsAndGradients) {
  const auto& [c, dtype, device] = GetParam();
  ATTN_SKIP_IF_UNAVAILABLE(device);
  expect_parity(c, dtype, device, /*need_weights=*/false);
}

std::vector<ParityCase> unmasked_cross_attention_cases() {
  std::vector<ParityCase> cases;
  for (const auto& c : kCases) {
    if (!c.self_attention && !c.key_padding && !c.float_attn_mask) {
      cases.push_back(c);
    }
  }
  return cases;
}

class DropoutParity : public Parity {};

TEST_P(DropoutParity, MatchesBuiltinInTrainingFromTheSameSeed) {
  // Both modules draw one Bernoulli mask over the B·H·L·S weights in the
  // same order, so equal seeds give equal dropout.
  const auto& [c, dtype, device] = GetParam();
  ATTN_SKIP_IF_UNAVAILABLE(device);
  torch::manual_seed(43);
  torch::nn::MultiheadAttention builtin(torch::nn::MultiheadAttentionOptions(c.E, c.H)
                                            .bias(c.bias)
                                            .kdim(c.kvdim)
                                            .vdim(c.kvdim)
                                            .dropout(0.25));
  attn::MultiHeadAttention ours(attn::MultiHeadAttentionOptions(c.E, c.H)
                                    .bias(c.bias)
                                    .kdim(c.kvdim)
                                    .vdim(c.kvdim)
                                    .dropout(0.25)
                                    .batch_first(false));
  attn::copy_weights(*builtin, *ours);
  builtin->to(device, dtype);
  ours->to(device, dtype);
  const auto opts = torch::TensorOptions(dtype).device(device);
  const auto q = torch::randn({c.L, c.B, c.E}, opts);
  const auto kv = torch::randn({c.S, c.B, c.kvdim}, opts);

  torch::manual_seed(7);
  const auto [out_theirs, w_theirs] = builtin(
      q, kv, kv, torch::Tensor(), true, torch::Tensor(), false);
  torch::manual_seed(7);
  const auto [out_ours, w_ours] = ours(
      q, kv, kv, attn::MultiHeadAttentionForwardOptions().need_weights(true));
  EXPECT_GT((w_ours == 0).sum().item<int64_t>(), 0);
  EXPECT_CLOSE(out_ours, out_theirs, parity_tolerance(dtype));
  EXPECT_CLOSE(w_ours, w_theirs, parity_tolerance(dtype));
}

std::string test_name(const ::testing::TestParamInfo<Parity::ParamType>& info) {
  const auto& [c, dtype, device] = info.param;
  return name(c) + (dtype == torch::kFloat ? "_float32" : "_float64") +
      (device.is_cuda() ? "_cuda" : "_cpu");
}

INSTANTIATE_TEST_SUITE_P(
    Grid,
    Parity,
    ::testing::Combine(
        ::testing::ValuesIn(kCases),
        ::testing::Values(torch::kFloat, torch::kDouble),
        ::testing::ValuesIn(attn::testing::test_devices())),
    test_name);

INSTANTIATE_TEST_SUITE_P(
    Grid,
    DropoutParity,
    ::testing::Combine(
        ::testing::ValuesIn(unmasked_cross_attention_cases()),
        ::testing::Values(torch::kFloat, torch::kDouble),
        ::testing::ValuesIn(attn::testing::test_devices())),
    test_name);

} // namespace
