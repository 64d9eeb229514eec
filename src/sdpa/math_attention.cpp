#include "sdpa/math_attention.h"

#include "sdpa/masks.h"

#include <torch/torch.h>

#include <limits>

namespace attn::detail {
namespace {

// The score of a pair that may not attend.
constexpr double kForbiddenScore = -std::numeric_limits<double>::infinity();

// Softmax over the last dim in which a row that is -inf everywhere (a query
// with every key masked) gets zero weights instead of NaN. Such rows are
// zeroed before the softmax too, so that its backward stays finite.
torch::Tensor softmax_allowing_masked_rows(const torch::Tensor& scores) {
  if (scores.size(-1) == 0) {
    return scores;
  }
  const auto fully_masked = scores.amax(-1, /*keepdim=*/true) == kForbiddenScore;
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

// The per-distance bias (H, L + S - 1) as the (H, L, S) bias of each
// query and key: entry j - i + L - 1 of each head's row.
torch::Tensor bias_of_each_pair(const torch::Tensor& offset_bias, int64_t L, int64_t S) {
  const auto options = torch::dtype(torch::kLong).device(offset_bias.device());
  const auto index = torch::arange(S, options).unsqueeze(0) -
      torch::arange(L, options).unsqueeze(1) + (L - 1);
  return offset_bias.index_select(1, index.flatten()).view({offset_bias.size(0), L, S});
}

// The user's function of each score (B, H, L, S): its values, with the
// gradient of the scores multiplied by its derivative (first order: the
// derivative's own gradient is not taken).
torch::Tensor user_function_of(const torch::Tensor& scores, const UserScoreFunction& function) {
  const auto x = scores.detach().to(torch::kCPU, torch::kDouble).contiguous();
  auto values = torch::empty_like(x), slopes = torch::empty_like(x);
  const auto s = x.accessor<double, 4>();
  auto value = values.accessor<double, 4>(), slope = slopes.accessor<double, 4>();
  calling_score_function([&] {
    for (int64_t b = 0; b < x.size(0); ++b) {
      for (int64_t h = 0; h < x.size(1); ++h) {
        for (int64_t i = 0; i < x.size(2); ++i) {
          for (int64_t j = 0; j < x.size(3); ++j) {
            value[b][h][i][j] = function.value(s[b][h][i][j], b, h, i, j);
            slope[b][h][i][j] = function.derivative(s[b][h][i][j], b, h, i, j);
          }
        }
      }
    }
  });
  const auto like_scores = [&](const torch::Tensor& t) { return t.to(scores.options()); };
  return like_scores(values) + (scores - scores.detach()) * like_scores(slopes);
}

// The softmax of each row with head h's sink logit as one more score,
// which takes its share of the weight and is left out of the result.
torch::Tensor softmax_with_sinks(const torch::Tensor& scores, const torch::Tensor& sinks) {
  auto sizes = scores.sizes().vec();
  sizes.back() = 1;
  const auto sink_scores = sinks.view({1, -1, 1, 1}).expand(sizes);
  return torch::softmax(torch::cat({scores, sink_scores}, -1), -1).narrow(-1, 0, scores.size(-1));
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
  const auto& modifiers = params.modifiers;
  if (modifiers.softcap > 0.0) {
    scores = torch::tanh(scores / modifiers.softcap) * modifiers.softcap;
  }
  if (modifiers.user != nullptr) {
    scores = user_function_of(scores, *modifiers.user);
  }
  if (modifiers.offset_bias.defined()) {
    scores = scores + bias_of_each_pair(modifiers.offset_bias, params.L(), params.S());
  }
  const auto& mask = params.mask;
  if (mask.defined()) {
    scores = mask.scalar_type() == torch::kBool
        ? scores.masked_fill(mask.logical_not(), kForbiddenScore)
        : scores + mask;
  }
  if (params.causal || params.window > 0) {
    scores = scores.masked_fill(
        visible_band(params.key_band(), params.L(), params.q.device()).logical_not(),
        kForbiddenScore);
  }

  // Causal masking alone with a non-negative offset always leaves key 0
  // visible; other masks can empty a row.
  // (A user's score function may return -inf for a whole row.)
  const bool rows_may_be_empty = mask.defined() || params.window > 0 || params.query_offset < 0 ||
      modifiers.user != nullptr;
  auto weights = modifiers.sinks.defined() ? softmax_with_sinks(scores, modifiers.sinks)
      : rows_may_be_empty                  ? softmax_allowing_masked_rows(scores)
                                           : torch::softmax(scores, -1);
  if (params.dropout.active()) { // LibTorch's draw, as torch::nn::MultiheadAttention's
    weights = torch::dropout(weights, params.dropout.p, /*train=*/true);
  }
  return {torch::matmul(weights, v), weights};
}

} // namespace attn::detail
