#pragma once

// Partial results of one attention request: the output and row
// log-sum-exp of its queries over some of its keys, as every kernel's
// forward returns them (ForwardResult's out and lse). Parts over disjoint
// sets of keys merge into the result over their union, exactly up to
// rounding: what a request split by keys (the context-parallel ring's key
// blocks, a decoding step's key splits) adds up with.

#include <torch/types.h>

namespace attn::detail {

// Folds the part (out_part (…, L, Dv), lse_part (…, L)) into the running
// (out, lse), in place: each weighted by its share exp(lse - lse_merged) of
// the merged row sum. A row that has seen no key (lse -inf) in both stays
// zero with lse -inf.
void merge_partial(
    const torch::Tensor& out,
    const torch::Tensor& lse,
    const torch::Tensor& out_part,
    const torch::Tensor& lse_part);

} // namespace attn::detail
