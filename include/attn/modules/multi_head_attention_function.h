#pragma once

/// \file
/// Multi-head attention as a function of its parameters, as
/// `torch::nn::functional::multi_head_attention_forward` is to
/// `torch::nn::MultiheadAttention`.

#include <attn/modules/rotary_embedding.h>
#include <attn/options.h>

#include <torch/types.h>

#include <tuple>

namespace attn {

/// The tensors multi-head attention computes with, in `torch::nn::Linear`'s
/// layout (weight `(out_features, in_features)`). A bias may be undefined:
/// a projection without one. `MultiHeadAttentionImpl::functional_parameters`
/// gives a module's.
struct MultiHeadAttentionParameters {
  /// H: the query heads.
  int64_t num_heads = 0;
  /// H_kv: the key/value heads, dividing H (H_kv = H unless grouped).
  int64_t num_kv_heads = 0;
  /// D: the width of a head.
  int64_t head_dim = 0;
  /// `(H·D, E)` and `(H·D)`: the query projection.
  torch::Tensor q_weight, q_bias;
  /// `(H_kv·D, kdim)` and `(H_kv·D)`: the key projection.
  torch::Tensor k_weight, k_bias;
  /// `(H_kv·D, vdim)` and `(H_kv·D)`: the value projection.
  torch::Tensor v_weight, v_bias;
  /// `(1, 1, H_kv·D)` each with `add_bias_kv`, else undefined: the extra
  /// key and its value.
  torch::Tensor bias_k, bias_v;
  /// `(E, H·D)` and `(E)`: the projection of the merged heads.
  torch::Tensor out_weight, out_bias;
  /// Rotary positions for queries and keys; null: none.
  RotaryEmbedding rotary = nullptr;
  /// `(H)`: ALiBi's slopes (`SDPAOptions::alibi_slopes`); undefined: none.
  torch::Tensor alibi_slopes;
  /// `(H, buckets)`: the relative-position table, indexed by the options'
  /// `position_buckets`; undefined: none.
  torch::Tensor position_bias;
  /// `(H)`: the sinks' logits; undefined: none.
  torch::Tensor sinks;
};

/// Multi-head attention as a function of its parameters: what
/// `MultiHeadAttention::forward` computes, with `parameters` for its
/// layers (`module->forward(q, k, v, f)` equals
/// `multi_head_attention_forward(q, k, v, module->options,
/// module->functional_parameters(), f, module->is_training())`), as
/// `torch::nn::functional::multi_head_attention_forward` is to
/// `torch::nn::MultiheadAttention`.
///
/// `options` gives the layout and the features: `embed_dim`, `kdim`,
/// `vdim`, `batch_first`, `dropout`, `add_bias_kv`, `add_zero_attn`,
/// `alibi_symmetric`, `softcap` and `position_buckets`; the heads and the
/// modifiers' tensors are `parameters'` (its `num_heads`, `num_kv_heads`,
/// `bias`, `rotary`, `alibi` and `sinks` are not read). Shapes, masks, the KV cache and the
/// returned `(output, weights)` are as `MultiHeadAttentionImpl::forward`
/// documents; dropout applies while `training`. Throws a `c10::Error`
/// naming the parameter when one does not have the shape, dtype or device
/// it must have (the query projection's dtype and device, which the inputs
/// must have too).
std::tuple<torch::Tensor, torch::Tensor> multi_head_attention_forward(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const MultiHeadAttentionOptions& options,
    const MultiHeadAttentionParameters& parameters,
    const MultiHeadAttentionForwardOptions& forward_options = {},
    bool training = true);

} // namespace attn
