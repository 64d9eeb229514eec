#pragma once

/// \file
/// Attention as plain functions on tensors.

#include <attn/options.h>

#include <torch/types.h>

#include <tuple>

namespace attn {

/// `softmax(Q·Kᵀ·scale + mask)·V`, returning `(output, weights)`; the
/// weights only when `options.need_weights()` asks for them (off by
/// default), else an undefined tensor.
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
/// auto [out, none] = attn::scaled_dot_product_attention(q, k, v);
/// auto [out2, w] = attn::scaled_dot_product_attention(
///     q, k, v, attn::SDPAOptions().need_weights(true));
/// ```
std::tuple<torch::Tensor, torch::Tensor> scaled_dot_product_attention(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const SDPAOptions& options = {});

/// The backend that `attn::scaled_dot_product_attention(query, key, value,
/// options)` runs, under the current grad mode. Throws the `c10::Error` that
/// call would throw for invalid arguments, including a requested
/// `options.backend()` that cannot run the request. The rules, in order:
///
/// 1. `options.backend()` when set.
/// 2. On the CPU, without dropout and without a mask that needs a gradient:
///    without weights, `libtorch` where it applies and was measured faster
///    (requests with no `attn_mask`, no `window` and at most the square
///    causal band)
///    than attn's kernels (float32 and bfloat16, from LibTorch 2.15 on, on
///    CPUs like the one measured; see docs/BENCHMARKS.md, "Choosing the CPU
///    backend"); else, without weights, `fused_cpu` for short heads (at
///    most 128 queries and 64 keys, on x86 CPUs with AVX-512 or AVX2, where
///    the fused kernel runs its short loops; docs/BENCHMARKS.md, "Short
///    heads"); else `batched_cpu` for short sequences (at most 64 queries
///    and 64 keys; 32 on LibTorch 1.13 where the tiled kernel multiplies in
///    attn's own loops, on x86 CPUs with AVX-512 or AVX2; and up to 128
///    without a causal mask at head width 64 or more; docs/BENCHMARKS.md,
///    "Short sequences"); else, when weights are asked
///    for, `fused_cpu_weights` if no gradient is needed and `batched_cpu`
///    (whose weights are differentiable) if one is; else `fused_cpu`.
/// 3. On CUDA: `libtorch` where it applies, masks and windows included.
/// 4. `math` for everything else.
///
/// Example:
/// ```
/// std::cout << attn::select_backend(q, k, v, attn::SDPAOptions().is_causal(true));
/// ```
AttentionBackend select_backend(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const SDPAOptions& options = {});

} // namespace attn
