#pragma once

// Self-attention over the heads of one projection for Q, K and V, handed
// over as that one tensor, so that the layout is named, never guessed:
// MultiHeadAttention computes its queries, keys and values with one
// product, and the fused CPU kernel then returns their gradient as one
// tensor of that product's layout, which the projection's backward reads
// with no copy.

#include "kernels/attention_params.h"

#include <attn/options.h>

#include <torch/types.h>

#include <tuple>

namespace attn::detail {

// attn::scaled_dot_product_attention(q, k, v, options) for the heads
// (q, k, v) = heads_of_projection(qkv) of `qkv` (B, L, 3, H, D): the same
// checks, backends and results, differentiable in qkv.
std::tuple<torch::Tensor, torch::Tensor> attention_over_projection(
    const torch::Tensor& qkv,
    const SDPAOptions& options);

} // namespace attn::detail
