#pragma once

// The fused kernel's tiled loops, FlashAttention style: queries in tiles
// of kQueryTile rows, keys in blocks of kKeyBlock, one matrix product per
// operand of each (tile, block) pair (tile_product.h), a running max and
// sum per query row (online softmax) and no L×S tensor. The backward
// recomputes each block's probabilities from the row log-sum-exp saved by
// the forward, split over key ranges when there are fewer heads than
// threads. One template (tiled_template.h) computes every dtype, over an
// operand policy per type (operands_float.h for float and double,
// operands_bf16.h, operands_float16.h). Called through fused_attention.h,
// with its conventions.

#include "kernels/attention_params.h"
#include "kernels/cpu/isa.h"

#include <torch/types.h>

#include <cstdint>

namespace attn::detail {

// A query tile's scores (128 × 512 floats = 256 KiB) stay in L2 while they
// are masked, exponentiated and multiplied into V. Measured single-threaded
// at T = 1024 and 4096 (D = 64): 128 × 512 ran at ~70 % of sgemm, ahead of
// 64 × 512, 256 × 512, 128 × 256, 64 × 1024 and 256 × 1024.
constexpr int64_t kQueryTile = 128;
constexpr int64_t kKeyBlock = 512;

// Each runs on `loops`, the call's plan's (kernel_plan.h).

// Writes `result`'s out (B, H, L, Dv) and lse (B, H, L, contiguous).
void tiled_forward(
    const CpuLoops& loops,
    const AttentionParams& params,
    const ForwardResult& result);

// Writes `grads` (B, H, ·, ·), rows of unit stride: one key/value gradient
// per query head, for grad_out (B, H, L, Dv), given the forward's out and
// lse (contiguous).
void tiled_backward(
    const CpuLoops& loops,
    const AttentionParams& params,
    const ForwardResult& forward,
    const torch::Tensor& grad_out,
    const InputGradients& grads);

// Inference with the weights materialised: the output (B, H, L, Dv), a
// view of (B, L, H, Dv) memory, lse and the weights (B, H, L, S), in q's
// dtype (lse in float for bfloat16 and float16, which the half-precision
// loops compute). No backward: callers use it when no gradient is needed.
ForwardResult tiled_forward_with_weights(const CpuLoops& loops, const AttentionParams& params);

} // namespace attn::detail
