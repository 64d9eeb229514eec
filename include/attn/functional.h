#pragma once

/// \file
/// Attention as plain functions on tensors.

#include <attn/options.h>

#include <torch/types.h>

#include <tuple>

namespace attn {

/// `softmax(Q·Kᵀ·scale + mask)·V`, returning `(output, weights)`.
///
/// Shapes: query `(..., L, E)`, key `(..., S, E)`, value `(..., S, Ev)` with
/// identical leading dims (with `enable_gqa`, key and value may have fewer
/// heads in dim -3); output `(..., L, Ev)`, weights `(..., L, S)`. Masks,
/// `is_causal`, `window` and `query_offset` combine as `SDPAOptions`
/// describes.
/// A query row whose keys are all masked gets zero weights and a zero output
/// (not NaN), with finite gradients. The returned weights are the ones that
/// multiplied V, so they include dropout when it is active.
///
/// Example:
/// ```
/// auto [out, w] = attn::scaled_dot_product_attention(q, k, v);
/// ```
std::tuple<torch::Tensor, torch::Tensor> scaled_dot_product_attention(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const SDPAOptions& options = {});

} // namespace attn
