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

std::tuple<torch::Tensor, torch::Tensor> math_attention(const AttentionParams& params) {
  auto k = params.k, v = params.v;
  // With no query heads the group is 0, and so are the repeated heads.
  if (params.Hkv() != params.H()) {
    k = repeat_heads(params.k, params.group());
    v = repeat_heads(params.v, params.group());
  }
  // Scaling the (L, E) query rather than the (L, S) scores is cheaper when
  // S > E and rounds as torch::nn::MultiheadAttention does.
  auto scores = torch::matmul(params.q * params.scale, k.transpose(-2, -1)); // (B, H, L, S)
  const auto& mask = params.mask;
  if (mask.defined()) {
    scores = mask.scalar_type() == torch::kBool
        ? scores.masked_fill(mask.logical_not(), kNegativeInfinity<double>)
        : scores + mask;
  }
  if (params.causal || params.window > 0) {
    scores = scores.masked_fill(
        visible_band(params.key_band(), params.L(), params.q.device()).logical_not(),
        kNegativeInfinity<double>);
  }

  // Causal masking alone with a non-negative offset always leaves key 0
  // visible; other masks can empty a row.
  const bool rows_may_be_empty = mask.defined() || params.window > 0 || params.query_offset < 0;
  auto weights = rows_may_be_empty ? softmax_allowing_masked_rows(scores)
                                   : torch::softmax(scores, -1);
  if (params.dropout.active()) { // LibTorch's draw, as torch::nn::MultiheadAttention's
    weights = torch::dropout(weights, params.dropout.p, /*train=*/true);
  }
  return {torch::matmul(weights, v), weights};
}

} // namespace attn::detail
