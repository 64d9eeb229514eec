#pragma once

// The fused kernel's loops for short heads: at most kMaxShortKeys keys and
// kMaxShortQueries queries. Each task takes whole heads; a row of scores
// (at most four 16-float vectors) stays in registers from the product
// Q·Kᵀ through the mask and the softmax, and the products are loops of
// attn's own over the head's operands, copied into the task's buffers
// (Kᵀ, Vᵀ, rows padded to whole vectors). The tiled loops
// (tiled_attention.cpp) spend on such a head a product call per operand and
// block and a pass over each row of scores in memory, for a few thousand
// multiply-adds. On 2 cores these loops ran 1.3-2.6x as fast as the
// batched kernel forward and 1.0-1.9x with backward, at 16-64 tokens
// (docs/design/cpu-kernels.md, "Short heads").
//
// The same results as the tiled loops up to rounding, with the same
// shape (tiled_attention.h): the forward writes the output and the row
// log-sum-exp, the backward recomputes the probabilities from it and
// writes the gradients, one key/value gradient per query head. Called
// through fused_attention.h, with its conventions: q (B, H, L, D), k
// (B, Hkv, S, D), v (B, Hkv, S, Dv), out and grad_out (B, H, L, Dv), rows
// of unit stride.

#include "kernels/attention_params.h"
#include "kernels/cpu/isa.h"

#include <torch/types.h>

#include <cstdint>

namespace attn::detail {

constexpr int64_t kMaxShortKeys = 64;
constexpr int64_t kMaxShortQueries = 128;

// Whether heads of L queries and S keys in `dtype` take the short loops
// on `loops`: float, bfloat16 or float16, within the bounds above, where
// `loops` have attn's AVX-512 or AVX2 vector loops.
//
// Half precision runs on the float loops: each task widens the head it
// computes into float copies of its own (exactly), and rounds the head's
// results into the request's tensors once (tile_product.h, half_rows);
// the row log-sum-exp stays float. No tensor is copied whole.
bool short_heads_run(const CpuLoops& loops, torch::ScalarType dtype, int64_t L, int64_t S);

// Each runs on `cpu`, the call's plan's loops (kernel_plan.h), which
// short_heads_run admits.

// Writes `result`'s out (B, H, L, Dv) and lse (B, H, L, contiguous).
void short_heads_forward(
    const CpuLoops& cpu,
    const AttentionParams& params,
    const ForwardResult& result);

// Writes `grads`: dq (B, H, L, D), dk (B, H, S, D) and dv (B, H, S, Dv),
// rows of unit stride, for grad_out, given the forward's out and lse.
void short_heads_backward(
    const CpuLoops& cpu,
    const AttentionParams& params,
    const ForwardResult& forward,
    const torch::Tensor& grad_out,
    const InputGradients& grads);

} // namespace attn::detail
