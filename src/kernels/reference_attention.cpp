#include "reference_attention.h"

#include <torch/torch.h>

#include <limits>

namespace attn::detail {
namespace {

constexpr double kNegativeInfinity = -std::numeric_limits<double>::infinity();

// Softmax over the last dim in which a row that is -inf everywhere (a query
// with every key masked) gets zero weights instead of NaN. Such rows are
// zeroed before the softmax too, so that its backward stays finite.
torch::Tensor softmax_allowing_masked_rows(const torch::Tensor& scores) {
  if (scores.size(-1) == 0) {
    return scores;
  }
  const auto fully_masked = scores.amax(-1, /*keepdim=*/true) == kNegativeInfinity;
  return torch::softmax(scores.masked_fill(fully_masked, 0.0), -1)
      .masked_fill(fully_masked, 0.0);
}

} // namespace

std::tuple<torch::Tensor, torch::Tensor> reference_attention(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const SDPAOptions& options,
    double scale) {
  const auto L = query.size(-2);
  const auto S = key.size(-2);
  // Scaling the (L, E) query rather than the (L, S) scores is cheaper when
  // S > E and rounds as torch::nn::MultiheadAttention does.
  auto scores = torch::matmul(query * scale, key.transpose(-2, -1)); // (..., L, S)
  const auto& mask = options.attn_mask();
  if (mask.defined()) {
    scores = mask.scalar_type() == torch::kBool
        ? scores.masked_fill(mask.logical_not(), kNegativeInfinity)
        : scores + mask;
  }
  if (options.is_causal()) {
    const auto future = torch::ones(
        {L, S}, torch::TensorOptions(torch::kBool).device(query.device()))
                            .triu(1);
    scores = scores.masked_fill(future, kNegativeInfinity);
  }

  // Causal masking alone always leaves key 0 visible, so only an explicit
  // mask can empty a row.
  auto weights = mask.defined() ? softmax_allowing_masked_rows(scores)
                                : torch::softmax(scores, -1);
  if (options.training() && options.dropout_p() > 0.0) {
    weights = torch::dropout(weights, options.dropout_p(), /*train=*/true);
  }
  auto output = torch::matmul(weights, value); // (..., L, Ev)
  if (!options.need_weights()) {
    weights = torch::Tensor();
  }
  return {output, weights};
}

} // namespace attn::detail
