#pragma once

// The fused CPU kernel: attention without an L×S tensor, as a forward that
// returns (out, lse) and a backward that takes them. Two sets of loops
// compute it, with the same results up to rounding and the same shape;
// sdpa/backend.cpp chooses between them (fused_cpu_loops):
// - FusedLoops::tiled (tiled_attention.h): any size, FlashAttention style;
// - FusedLoops::short_heads (short_heads.h): heads of up to 128 queries
//   and 64 keys, scores in registers.
// Below the API boundary: `params` (attention_params.h) in float or double,
// or bfloat16 or float16 where sdpa/backend.h's fused_cpu_computes_half
// says (short heads: not double).

#include "kernels/attention_params.h"

#include <torch/types.h>

namespace attn::detail {

enum class FusedLoops { tiled, short_heads };

// The output (B, H, L, Dv), a view of (B, L, H, Dv) memory so that merging
// the heads is free, and the row log-sum-exp (B, H, L). Not differentiable.
ForwardResult fused_forward(FusedLoops loops, const AttentionParams& params);

// The gradients of q, k and v (shaped like them) for `grad_out`, given the
// forward's out (B, H, L, Dv) and lse (B, H, L). The probabilities are
// recomputed as exp(scores - lse), so that out and lse may be those of a
// larger attention that this one is a key block of (ring attention): the
// gradients are then this block's share.
InputGradients fused_backward(
    FusedLoops loops,
    const AttentionParams& params,
    const ForwardResult& forward,
    const torch::Tensor& grad_out);

// The output (B, H, L, Dv), a view of (B, L, H, Dv) memory, differentiable
// through fused_backward with the same loops: in q, k and v, or, where
// params.qkv is defined, in qkv alone, whose gradient is one tensor of its
// layout.
torch::Tensor fused_attention(FusedLoops loops, const AttentionParams& params);

// How many backward calls in this process gave a half-precision mask its
// gradient in its own dtype (rather than through a float32 copy): for
// tests that check which path a request took.
int64_t half_mask_gradients();

// How many forward calls in this process kept what rounding their output
// lost (ForwardResult::out_rounding) for a learned tensor's gradient: for
// tests that check which requests do.
int64_t out_roundings_kept();

} // namespace attn::detail
