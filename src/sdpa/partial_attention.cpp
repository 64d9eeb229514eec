#include "sdpa/partial_attention.h"

#include "kernels/attention_params.h"
#include "kernels/cpu/fused_attention.h"
#include "kernels/partial_results.h"
#include "sdpa/block_mask.h"
#include "sdpa/plan.h"

#include <attn/block_mask.h>

#include <torch/torch.h>

namespace attn::detail {
namespace {

// The fused kernel's request for `part`.
AttentionParams part_params(const AttentionPart& part) {
  AttentionParams params;
  params.q = part.q;
  params.k = part.k;
  params.v = part.v;
  params.scale = part.scale;
  params.causal = part.causal;
  params.window = part.window;
  params.query_offset = part.query_offset;
  const int64_t B = params.B(), H = params.H(), L = params.L(), S = params.S();
  if (part.allowed_keys.defined()) {
    params.mask = part.allowed_keys.to(torch::kBool).view({B, 1, 1, S}).expand({B, H, L, S});
  }
  if (part.query_documents.defined()) {
    const auto documents = document_mask(part.query_documents, part.key_documents);
    params.blocks = block_mask(documents, part.query_documents.size(0), 1, L, S).data()->blocks;
  }
  return params;
}

} // namespace

bool band_leaves_pairs(
    bool causal,
    int64_t window,
    int64_t query_offset,
    int64_t queries,
    int64_t keys) {
  const KeyBand band{causal, query_offset, window, keys};
  // Both bounds grow with the row: no row sees a key when the last row's
  // end is at or before the first row's beginning.
  return queries > 0 && keys > 0 && band.end(queries - 1) > band.begin(0);
}

PartResult attend_part(const AttentionPart& part) {
  const auto params = part_params(part);
  const auto result = fused_forward(plan_part(params.q, params.k), params);
  return {result.out, result.lse};
}

void merge_part(const PartResult& merged, const PartResult& part) {
  merge_partial(merged.out, merged.lse, part.out, part.lse);
}

PartGradients attend_part_backward(
    const AttentionPart& part,
    const PartResult& merged,
    const torch::Tensor& grad_out) {
  const auto params = part_params(part);
  const auto grads = fused_backward(
      plan_part(params.q, params.k), params, {merged.out, merged.lse}, grad_out);
  return {grads.dq, grads.dk, grads.dv};
}

} // namespace attn::detail
