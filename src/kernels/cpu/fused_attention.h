#pragma once

// The fused CPU kernel: attention without an L×S tensor, as a forward that
// returns (out, lse) and a backward that takes them. Two sets of loops
// compute it, with the same results up to rounding and the same shape;
// the call's plan names them (kernel_plan.h, FusedLoops):
// - FusedLoops::tiled (tiled_attention.h): any size, FlashAttention style;
// - FusedLoops::short_heads (short_heads.h): heads of up to 128 queries
//   and 64 keys, scores in registers.
// Below the API boundary: `params` (attention_params.h) in float or double,
// or bfloat16 or float16 where the plan computes them so
// (sdpa/plan.h; short heads: not double).

#include "kernels/attention_params.h"
#include "kernels/kernel_plan.h"

#include <torch/types.h>

namespace attn::detail {

// Which of the tensors that add to the scores get a gradient in a
// differentiable call: the modifiers' tensors and a floating mask that
// require one; none where grad mode is off.
struct ScoreGradientsWanted {
  bool offset_bias = false, mask = false, sinks = false;

  bool any() const { return offset_bias || mask || sinks; }
};
ScoreGradientsWanted score_gradients_wanted(const AttentionParams& params);

// The output (B, H, L, Dv), a view of (B, L, H, Dv) memory so that merging
// the heads is free, and the row log-sum-exp (B, H, L). Not differentiable.
ForwardResult fused_forward(const KernelPlan& plan, const AttentionParams& params);

// The gradients of q, k and v (shaped like them) for `grad_out`, given the
// forward's out (B, H, L, Dv) and lse (B, H, L). The probabilities are
// recomputed as exp(scores - lse), so that out and lse may be those of a
// larger attention that this one is a key block of (ring attention): the
// gradients are then this block's share.
InputGradients fused_backward(
    const KernelPlan& plan,
    const AttentionParams& params,
    const ForwardResult& forward,
    const torch::Tensor& grad_out);

// The output (B, H, L, Dv), a view of (B, L, H, Dv) memory, differentiable
// through fused_backward on the same plan: in q, k and v, or, where
// params.qkv is defined, in qkv alone, whose gradient is one tensor of its
// layout.
torch::Tensor fused_attention(const KernelPlan& plan, const AttentionParams& params);

} // namespace attn::detail
