#pragma once

// Attention on the CPU for short sequences: every head's scores in one
// batched GEMM, masked and normalised row by row in one pass, then one
// batched GEMM into V; the backward likewise, from the probabilities kept
// by the forward. Where the tiled kernel (tiled_attention.h) issues a few
// small GEMMs per head, whose call overhead dominates when L·S is small,
// this issues four batched ones per pass at the price of the
// (B, H, L, S) probabilities in memory.
//
// Below the API boundary: `params` (attention_params.h) in float or
// double; or in bfloat16 or float16, computed a chunk of one matrix of
// the batch at a time in float, each result rounded once into the inputs'
// dtype: no float copy of a whole input, the weights or a gradient (only
// of dK and dV per task where fewer matrices than threads share their
// chunks between tasks), and the backward computes the probabilities
// again instead of keeping them.

#include "kernels/attention_params.h"
#include "kernels/cpu/isa.h"
#include "kernels/kernel_plan.h"

#include <torch/types.h>

#include <tuple>

namespace attn::detail {

// Each runs on `loops`, the call's plan's (kernel_plan.h).

// The output, lse and the weights (B, H, L, S), which the backward reads.
ForwardResult batched_forward(const CpuLoops& loops, const AttentionParams& params);

// The gradients of q, k and v (shaped like them) from `forward`'s
// weights (in half precision, from the probabilities computed again),
// for grad_out (B, H, L, Dv) and grad_weights (B, H, L, S), the gradient
// of the weights where they were returned (undefined otherwise).
InputGradients batched_backward(
    const CpuLoops& loops,
    const AttentionParams& params,
    const ForwardResult& forward,
    const torch::Tensor& grad_out,
    const torch::Tensor& grad_weights);

// The output (B, H, L, Dv) and, with `need_weights`, the weights
// (B, H, L, S), both differentiable through batched_backward (else an
// undefined tensor).
std::tuple<torch::Tensor, torch::Tensor> batched_attention(
    const KernelPlan& plan,
    const AttentionParams& params,
    bool need_weights);

} // namespace attn::detail
