#pragma once

// Self-attention's three input projections as one product. The built-in
// keeps Q/K/V's weights in one (3E, E) parameter; attn keeps three, under
// the built-in's state_dict names, and makes them consecutive row blocks of
// one buffer (`stack_rows`), so that the stacked (3E, E) matrix is a view of
// memory that already exists (`stacked_rows`): one GEMM, no copy of the
// weights, at every size. Whatever replaces a weight's storage (a user's
// set_data, torch::load, to(), clone()) ends the sharing, and the product
// then stacks copies: the same result, one copy of the weights slower.

#include <torch/types.h>

#include <vector>

namespace attn::detail {

// Makes `parts` consecutive row blocks of one new tensor, keeping their
// values, their autograd identity and their gradients; true when they are
// such blocks (already, or now). Returns false, changing nothing, unless
// they are defined, of one dtype and device, with equal sizes after the
// first dimension.
bool stack_rows(const std::vector<torch::Tensor>& parts);

// The tensor whose consecutive row blocks `parts` are, a view of their
// memory, or an undefined tensor when they are not such blocks (or when any
// part is undefined).
torch::Tensor stacked_rows(const std::vector<torch::Tensor>& parts);

// `input` (..., in) projected by the three weights (out_i, in) stacked by
// rows, with the three biases (all defined or all undefined): one product
// (..., Σ out_i), whose column blocks are the three projections,
// differentiable in the input, the weights and the biases. Stacks copies
// of the weights when `stacked_rows` finds no view.
torch::Tensor stacked_linear(
    const torch::Tensor& input,
    const std::vector<torch::Tensor>& weights,
    const std::vector<torch::Tensor>& biases);

} // namespace attn::detail
