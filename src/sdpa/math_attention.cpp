#include "sdpa/math_attention.h"

#include "kernels/cpu/mask_view.h"
#include "sdpa/masks.h"

#include <torch/torch.h>

namespace attn::detail {
namespace {

// Softmax over the last dim in which a row that is -inf everywhere (a query
// with every key masked) gets zero weights instead of NaN. Such rows are
// zeroed before the softmax too, so that its backward stays finite.
torch::Tensor softmax_allowing_masked_rows(const torch::Tensor& scores) {
  if (scores.size(-1) == 0) {
    return scores;
  }
  const auto fully_masked = scores.amax(-1, /*keepdim=*/true) == kNegativeInfinity<double>;
  return torch::softmax(scores.masked_fill(fully_masked, 0.0), -1).masked_fill(fully_masked, 0.0);
}

// `t` (..., Hkv, S, F) with each head repeated `group` times in a row:
// (..., Hkv·group, S, F), what repeat_interleave gives, but without its
// index tensor of Hkv·group entries (2^40 heads of empty sequences would
// ask for 8 TB).
torch::Tensor repeat_heads(const torch::Tensor& t, int64_t group) {
  auto sizes = t.sizes().vec();
  sizes.insert(sizes.end() - 2, group); // (..., Hkv, group, S, F)
  return t.unsqueeze(-3).expand(sizes).flatten(-4, -3);
}

} // namespace

std::tuple<torch::Tensor, torch::Tensor> math_attention(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const SDPAOptions& options,
    double scale) {
  const auto L = query.size(-2);
  const auto S = key.size(-2);
  auto k = key, v = value;
  if (options.enable_gqa() && key.size(-3) != query.size(-3)) {
    const auto group = query.size(-3) / key.size(-3);
    k = repeat_heads(key, group);
    v = repeat_heads(value, group);
  }
  // Scaling the (L, E) query rather than the (L, S) scores is cheaper when
  // S > E and rounds as torch::nn::MultiheadAttention does.
  auto scores = torch::matmul(query * scale, k.transpose(-2, -1)); // (..., L, S)
  const auto& mask = options.attn_mask();
  if (mask.defined()) {
    scores = mask.scalar_type() == torch::kBool
        ? scores.masked_fill(mask.logical_not(), kNegativeInfinity<double>)
        : scores + mask;
  }
  const auto& window = options.window();
  if (options.is_causal() || window) {
    scores = scores.masked_fill(
        visible_band(L, S, options.query_offset(), options.is_causal(), window, query.device())
            .logical_not(),
        kNegativeInfinity<double>);
  }

  // Causal masking alone with a non-negative offset always leaves key 0
  // visible; other masks can empty a row.
  const bool rows_may_be_empty = mask.defined() || window || options.query_offset() < 0;
  auto weights = rows_may_be_empty ? softmax_allowing_masked_rows(scores)
                                   : torch::softmax(scores, -1);
  if (options.training() && options.dropout_p() > 0.0) {
    weights = torch::dropout(weights, options.dropout_p(), /*train=*/true);
  }
  auto output = torch::matmul(weights, v); // (..., L, Ev)
  if (!options.need_weights()) {
    weights = torch::Tensor();
  }
  return {output, weights};
}

} // namespace attn::detail
