#pragma once

/// \file
/// Weight exchange with `torch::nn::MultiheadAttention`.
///
/// The built-in packs the Q/K/V weights into `in_proj_weight` (3E, E) when
/// `kdim == vdim == E` and keeps `q/k/v_proj_weight` otherwise; its biases
/// are always packed in `in_proj_bias` (3E). attn keeps one `Linear` per
/// projection. Both directions require equal `embed_dim`, `num_heads`,
/// `kdim`, `vdim` and `bias`, and a built-in without `add_bias_kv` or
/// `add_zero_attn`; values are copied (and cast) into the target's existing
/// parameters, so the target keeps its device and dtype.

#include <attn/modules/multi_head_attention.h>

#include <torch/nn/modules/activation.h>

namespace attn {

/// Copies the built-in's weights into `target`.
///
/// Example:
/// ```
/// torch::nn::MultiheadAttention builtin(512, 8);
/// attn::MultiHeadAttention ours(512, 8);
/// attn::copy_weights(*builtin, *ours);
/// ```
void copy_weights(
    const torch::nn::MultiheadAttentionImpl& source,
    MultiHeadAttentionImpl& target);

/// Copies `source`'s weights into the built-in.
///
/// Example: `attn::copy_weights(*ours, *builtin);`
void copy_weights(
    const MultiHeadAttentionImpl& source,
    torch::nn::MultiheadAttentionImpl& target);

} // namespace attn
