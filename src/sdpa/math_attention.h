#pragma once

// The math path of scaled dot-product attention (PyTorch calls its
// composite implementation the same), written as the
// formula reads: scores = (Q·scale)·Kᵀ, masked, softmax, dropout, times V.
// Every step is an ATen op, so it runs on any device and dtype, autograd
// differentiates it with respect to everything (the mask included), and it
// is the specification the fused kernels are tested against. It
// materialises the (..., L, S) scores.

#include "kernels/attention_params.h"

#include <torch/types.h>

#include <tuple>

namespace attn::detail {

// (output (B, H, L, Dv), weights (B, H, L, S)), both differentiable, for
// `params` on any device and in any floating dtype.
std::tuple<torch::Tensor, torch::Tensor> math_attention(const AttentionParams& params);

} // namespace attn::detail
