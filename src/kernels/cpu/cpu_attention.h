#pragma once

// Fused attention on the CPU, FlashAttention style: queries in tiles of
// kQueryTile rows, keys in blocks of kKeyBlock, one matrix product per
// operand of each (tile, block) pair (tile_product.h), a running max and
// sum per query row (online softmax) and no L×S tensor. The backward
// recomputes each block's probabilities from the row log-sum-exp saved by
// the forward, split over key ranges when there are fewer heads than
// threads.
//
// Below the API boundary: inputs are already checked. q (B, H, L, D),
// k (B, Hkv, S, D), v (B, Hkv, S, Dv) with Hkv dividing H (query head h
// reads key/value head h / (H / Hkv)), float or double, any strides;
// `mask` is undefined or expanded to (B, H, L, S), bool (true = may attend)
// or of the inputs' dtype (added).

#include "kernels/key_band.h"

#include <torch/types.h>

#include <tuple>

namespace torch::autograd {
struct AutogradContext;
} // namespace torch::autograd

namespace attn::detail {

// What the kernels need beyond the tensors. Query i stands at key position
// i + query_offset; `causal` and a positive `window` limit the keys it sees
// as SDPAOptions describes (KeyBand in kernels/key_band.h, applied per tile).
struct CpuAttentionConfig {
  torch::Tensor mask;
  double scale = 1.0;
  bool causal = false;
  int64_t query_offset = 0;
  int64_t window = 0; // 0: none; at most kUnboundedWindow

  KeyBand key_band(int64_t S) const { return {causal, query_offset, window, S}; }

  // Keeps the config in an autograd context between forward and backward,
  // and reads it back.
  void save_to(torch::autograd::AutogradContext& ctx) const;
  static CpuAttentionConfig restore_from(torch::autograd::AutogradContext& ctx);
};

// Output (B, H, L, Dv) — a view of (B, L, H, Dv) memory, so that merging
// the heads is free — and differentiable through the fused backward.
torch::Tensor cpu_flash_attention(
    const torch::Tensor& q,
    const torch::Tensor& k,
    const torch::Tensor& v,
    const CpuAttentionConfig& config);

// The forward kernel alone, not differentiable: the output (B, H, L, Dv),
// a view of (B, L, H, Dv) memory, and the row log-sum-exp (B, H, L) of the
// scaled, masked scores (-inf for a row that sees no key).
std::tuple<torch::Tensor, torch::Tensor> cpu_flash_forward(
    const torch::Tensor& q,
    const torch::Tensor& k,
    const torch::Tensor& v,
    const CpuAttentionConfig& config);

// The backward kernel alone: the gradients of q, k and v (shaped like
// them) for `grad_out`, given `out` (B, H, L, Dv) and `lse` (B, H, L). The
// probabilities are recomputed as exp(scores - lse), so that `out` and
// `lse` may be those of a larger attention that this one is a key block of
// (ring attention): the gradients are then this block's share.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> cpu_flash_backward(
    const torch::Tensor& q,
    const torch::Tensor& k,
    const torch::Tensor& v,
    const torch::Tensor& out,
    const torch::Tensor& lse,
    const torch::Tensor& grad_out,
    const CpuAttentionConfig& config);

// Inference with the weights materialised: (output, weights (B, H, L, S)).
// Not differentiable; callers use it when no gradient is needed.
std::tuple<torch::Tensor, torch::Tensor> cpu_attention_with_weights(
    const torch::Tensor& q,
    const torch::Tensor& k,
    const torch::Tensor& v,
    const CpuAttentionConfig& config);

} // namespace attn::detail
