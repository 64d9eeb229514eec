#pragma once

// Attention over a part of a request's keys, for callers that split a
// request by keys and merge the parts (the context-parallel ring): each
// part runs attn's fused CPU kernel and returns its output and row
// log-sum-exp, which merge_part folds into the result over the keys of
// every part before it (kernels/partial_results.h); a part's backward
// takes that merged result. Callers hand over tensors and numbers and
// never fill the kernels' parameters themselves.

#include <torch/types.h>

#include <cstdint>

namespace attn::detail {

// The queries of a request and a part of its keys.
struct AttentionPart {
  // q (B, H, L, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv) with Hkv dividing
  // H, any strides; float32 or float64.
  torch::Tensor q, k, v;
  double scale = 1.0;
  // The band of keys each query sees: query row i stands at key position i
  // + query_offset; `causal` hides the keys after it, a positive `window`
  // (at most kUnboundedWindow) those at a distance of `window` or more.
  bool causal = false;
  int64_t window = 0;
  int64_t query_offset = 0;
  // (B, S) bool, true where the key may be attended; undefined: every key.
  torch::Tensor allowed_keys;
  // (1 or B, L) and (1 or B, S) int64, nondecreasing along each row: the
  // documents of the queries and of the keys, a query attending within its
  // own only; undefined (both): one document.
  torch::Tensor query_documents, key_documents;
};

// Whether the band (AttentionPart's causal, window and query_offset)
// leaves some of `queries` queries a key among `keys` keys.
bool band_leaves_pairs(
    bool causal,
    int64_t window,
    int64_t query_offset,
    int64_t queries,
    int64_t keys);

// A part's output (B, H, L, Dv) and row log-sum-exp (B, H, L) in q's
// dtype (-inf where a query sees none of the part's keys), or the merged
// result of several parts.
struct PartResult {
  torch::Tensor out, lse;
};

PartResult attend_part(const AttentionPart& part);

// Folds `part` into `merged`, in place (kernels/partial_results.h).
void merge_part(const PartResult& merged, const PartResult& part);

// The gradients of the part's q, k and v, shaped like them, for the
// output gradient grad_out (B, H, L, Dv) of the result `merged` over every
// part of the queries' keys.
struct PartGradients {
  torch::Tensor dq, dk, dv;
};

PartGradients attend_part_backward(
    const AttentionPart& part,
    const PartResult& merged,
    const torch::Tensor& grad_out);

} // namespace attn::detail
