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

// (L, S) bool, true where query i (at position i + query_offset) may see
// key j under SDPAOptions' `is_causal` and `window` rules.
torch::Tensor visible_band(
    int64_t L,
    int64_t S,
    int64_t query_offset,
    bool causal,
    const c10::optional<int64_t>& window,
    torch::Device device);

// Inputs already checked; `scale` already resolved from the options.
std::tuple<torch::Tensor, torch::Tensor> math_attention(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const SDPAOptions& options,
    double scale);

} // namespace attn::detail
