#pragma once

#include <attn/options.h>

#include <torch/nn/cloneable.h>
#include <torch/nn/modules/common.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <iosfwd>
#include <tuple>

namespace attn {

/// Scaled dot-product attention as a module: no parameters, it holds the
/// dropout probability and scale, and drops weights only while training.
/// See `attn::scaled_dot_product_attention` for shapes and mask semantics.
///
/// Example:
/// ```
/// attn::ScaledDotProductAttention sdpa(
///     attn::ScaledDotProductAttentionOptions().dropout(0.1));
/// auto [out, none] = sdpa(q, k, v, /*attn_mask=*/{}, /*is_causal=*/true);
/// auto [out2, w] = sdpa(q, k, v, torch::Tensor(), false, /*need_weights=*/true);
/// ```
class ScaledDotProductAttentionImpl : public torch::nn::Cloneable<ScaledDotProductAttentionImpl> {
 public:
  /// A module with these options, checked by `reset()`.
  explicit ScaledDotProductAttentionImpl(const ScaledDotProductAttentionOptions& options = {});

  /// Returns `(output (..., L, Ev), weights (..., L, S))`; the weights only
  /// with `need_weights` (else an undefined tensor), as
  /// `SDPAOptions::need_weights` describes.
  std::tuple<torch::Tensor, torch::Tensor> forward(
      const torch::Tensor& query,
      const torch::Tensor& key,
      const torch::Tensor& value,
      const torch::Tensor& attn_mask = {},
      bool is_causal = false,
      bool need_weights = false);

  /// Checks the options (dropout in [0, 1)); the module has no parameters
  /// to register.
  void reset() override;

  /// Prints `attn::ScaledDotProductAttention(dropout=0.1, scale=default)`.
  void pretty_print(std::ostream& stream) const override;

  /// The options the module was constructed with.
  ScaledDotProductAttentionOptions options;

 protected:
  FORWARD_HAS_DEFAULT_ARGS(
      {3, torch::nn::AnyValue(torch::Tensor())},
      {4, torch::nn::AnyValue(false)},
      {5, torch::nn::AnyValue(false)})
};

/// Holder of `ScaledDotProductAttentionImpl`, as `TORCH_MODULE` defines it.
TORCH_MODULE(ScaledDotProductAttention);

} // namespace attn
