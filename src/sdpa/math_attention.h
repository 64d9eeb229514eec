#pragma once

// The math path of scaled dot-product attention (PyTorch calls its
// composite implementation the same), written as the
// formula reads: scores = (Q·scale)·Kᵀ, masked, softmax, dropout, times V.
// Every step is an ATen op, so it runs on any device and dtype, autograd
// differentiates it with respect to everything (the mask included), and it
// is the specification the fused kernels are tested against. It
// materialises the (..., L, S) scores.

#include <attn/options.h>

#include <torch/types.h>

#include <tuple>

namespace attn::detail {

// Inputs already checked; `scale` already resolved from the options.
std::tuple<torch::Tensor, torch::Tensor> math_attention(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const SDPAOptions& options,
    double scale);

} // namespace attn::detail
