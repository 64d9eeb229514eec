#pragma once

// How one call is computed below the choice of its backend: the loops it
// runs on and the policies its kernels follow, decided once per call from
// the request and the CPU's capabilities (sdpa/plan.h builds it) and
// carried down unchanged. The kernels read their loops and policies here,
// never from process-wide state, and derive none of them again.

#include "kernels/attention_params.h"
#include "kernels/cpu/isa.h"

#include <torch/types.h>

namespace torch::autograd {
struct AutogradContext;
} // namespace torch::autograd

namespace attn::detail {

// The fused kernel's loops (fused_attention.h): the tiled ones
// (tiled_attention.h) or the short heads' (short_heads.h).
enum class FusedLoops { tiled, short_heads };

struct KernelPlan {
  // The loops of the call's CPU level: products, row operations, the short
  // heads' and dropout's loops.
  CpuLoops cpu;
  // The loops that compute the fused kernel.
  FusedLoops fused_loops = FusedLoops::tiled;
  // Whether a differentiable forward of the fused kernel keeps what
  // rounding its half-precision output lost (ForwardResult::out_rounding)
  // for the gradients of learned tensors.
  bool keeps_out_rounding = false;

  // Keeps the plan in an autograd context between forward and backward,
  // and reads it back: the backward runs on the forward's loops.
  void save_to(torch::autograd::AutogradContext& ctx) const;
  static KernelPlan restore_from(torch::autograd::AutogradContext& ctx);
};

// A differentiable call of a kernel as its autograd function keeps it
// between forward and backward: the request (AttentionParams' settings,
// its tensors q, k, v and the modifiers' those that autograd saves as
// variables, which restore_call leaves to the caller) and its plan.
struct SavedCall {
  AttentionParams params;
  KernelPlan plan;
};
void save_call(
    torch::autograd::AutogradContext& ctx,
    const AttentionParams& params,
    const KernelPlan& plan);
SavedCall restore_call(torch::autograd::AutogradContext& ctx);

} // namespace attn::detail
