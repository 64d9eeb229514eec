#include <attn/functional.h>

#include "checks.h"

#include <torch/torch.h>

#include <cmath>
#include <limits>

namespace attn {
namespace detail {

void check_mask_dtype_and_device(
    const char* caller,
    const char* name,
    const torch::Tensor& mask,
    const torch::Tensor& query) {
  TORCH_CHECK(
      mask.scalar_type() == torch::kBool ||
          mask.scalar_type() == query.scalar_type(),
      caller, ": ", name, " must be bool or have the query's dtype ",
      query.scalar_type(), ", got ", mask.scalar_type());
  TORCH_CHECK(
      mask.device() == query.device(), caller, ": ", name,
      " must be on the query's device ", query.device(), ", got ",
      mask.device());
}

} // namespace detail

namespace {

constexpr const char* kCaller = "scaled_dot_product_attention";
constexpr double kNegativeInfinity = -std::numeric_limits<double>::infinity();

void check_inputs(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const SDPAOptions& options) {
  TORCH_CHECK(
      query.defined() && key.defined() && value.defined(), kCaller,
      ": query, key and value must be defined tensors");
  TORCH_CHECK(
      query.dim() >= 2, kCaller,
      ": query must be (..., L, E) with at least 2 dims, got ", query.sizes());
  TORCH_CHECK(
      key.dim() == query.dim() && value.dim() == query.dim(), kCaller,
      ": query, key and value must have the same number of dims, got query ",
      query.sizes(), ", key ", key.sizes(), ", value ", value.sizes());

  const auto batch_dims = query.dim() - 2;
  TORCH_CHECK(
      key.sizes().slice(0, batch_dims) == query.sizes().slice(0, batch_dims) &&
          value.sizes().slice(0, batch_dims) ==
              query.sizes().slice(0, batch_dims),
      kCaller, ": query, key and value must have the same leading dims, got ",
      "query ", query.sizes(), ", key ", key.sizes(), ", value ",
      value.sizes());
  const auto E = query.size(-1);
  TORCH_CHECK(
      E > 0, kCaller, ": query must have a feature size E > 0, got ",
      query.sizes());
  TORCH_CHECK(
      key.size(-1) == E, kCaller, ": key must be (..., S, E) with E == ", E,
      " (the query's feature size), got ", key.sizes());
  TORCH_CHECK(
      value.size(-2) == key.size(-2), kCaller,
      ": value must be (..., S, Ev) with S == ", key.size(-2),
      " (the key's length), got ", value.sizes());

  TORCH_CHECK(
      torch::isFloatingType(query.scalar_type()), kCaller,
      ": query must have a floating-point dtype, got ", query.scalar_type());
  TORCH_CHECK(
      key.scalar_type() == query.scalar_type() &&
          value.scalar_type() == query.scalar_type(),
      kCaller, ": key and value must have the query's dtype ",
      query.scalar_type(), ", got key ", key.scalar_type(), " and value ",
      value.scalar_type());
  TORCH_CHECK(
      key.device() == query.device() && value.device() == query.device(),
      kCaller, ": key and value must be on the query's device ",
      query.device(), ", got key on ", key.device(), " and value on ",
      value.device());

  const auto& mask = options.attn_mask();
  if (mask.defined()) {
    detail::check_mask_dtype_and_device(kCaller, "attn_mask", mask, query);
    auto scores_shape = query.sizes().vec();
    scores_shape.back() = key.size(-2); // (..., L, S)
    bool broadcastable = mask.dim() <= static_cast<int64_t>(scores_shape.size());
    for (int64_t i = 1; broadcastable && i <= mask.dim(); ++i) {
      const auto m = mask.size(-i);
      broadcastable = m == 1 || m == scores_shape[scores_shape.size() - i];
    }
    TORCH_CHECK(
        broadcastable, kCaller,
        ": attn_mask must be broadcastable to the scores' shape (..., L, S) = ",
        torch::IntArrayRef(scores_shape), ", got ", mask.sizes());
  }
  TORCH_CHECK(
      options.dropout_p() >= 0.0 && options.dropout_p() <= 1.0, kCaller,
      ": dropout_p must be in [0, 1], got ", options.dropout_p());
}

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

std::tuple<torch::Tensor, torch::Tensor> scaled_dot_product_attention(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const SDPAOptions& options) {
  check_inputs(query, key, value, options);
  const auto L = query.size(-2);
  const auto S = key.size(-2);
  const auto E = query.size(-1);
  const double scale =
      options.scale().value_or(1.0 / std::sqrt(static_cast<double>(E)));

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

} // namespace attn
