#include <attn/modules/scaled_dot_product_attention.h>

#include <attn/sdpa.h>

#include <torch/torch.h>

#include <ostream>

namespace attn {

ScaledDotProductAttentionImpl::ScaledDotProductAttentionImpl(
    const ScaledDotProductAttentionOptions& options_)
    : options(options_) {
  reset();
}

void ScaledDotProductAttentionImpl::reset() {
  TORCH_CHECK(
      options.dropout() >= 0.0 && options.dropout() < 1.0,
      "ScaledDotProductAttention: dropout must be in [0, 1), got ", options.dropout());
}

std::tuple<torch::Tensor, torch::Tensor> ScaledDotProductAttentionImpl::forward(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const torch::Tensor& attn_mask,
    bool is_causal,
    bool need_weights) {
  return scaled_dot_product_attention(
      query, key, value,
      SDPAOptions()
          .attn_mask(attn_mask)
          .is_causal(is_causal)
          .need_weights(need_weights)
          .scale(options.scale())
          .dropout_p(options.dropout())
          .training(is_training()));
}

void ScaledDotProductAttentionImpl::pretty_print(std::ostream& stream) const {
  stream << "attn::ScaledDotProductAttention(dropout=" << options.dropout() << ", scale=";
  if (options.scale()) {
    stream << *options.scale();
  } else {
    stream << "1/sqrt(E)";
  }
  stream << ")";
}

} // namespace attn
