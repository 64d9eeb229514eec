#pragma once

// What both context-parallel strategies receive once context_parallel_attention has
// checked its arguments: the inputs in the dtype they are computed in, and
// the options resolved to the numbers the kernels take.

#include <attn/distributed/context_parallel.h>

#include <torch/types.h>

namespace attn::distributed::detail {

// The name context_parallel_attention's messages start with, whichever
// strategy runs.
constexpr const char* kContextParallelAttentionCaller =
    "attn::distributed::context_parallel_attention";

struct ContextParallelInputs {
  torch::Tensor query, key, value; // (B, H, N, D), (B, H_kv, N, D), (B, H_kv, N, Dv)
  torch::Tensor allowed_keys;      // (B, N) uint8, 1 = may be attended (bytes travel through
                                   // Gloo, bool does not); undefined: all
  SequenceSharding sharding;
  double scale = 1.0;
  bool causal = false;
  int64_t window = 0; // 0: none; at most detail::kUnboundedWindow
  int64_t query_offset = 0;
  torch::Tensor document_ids; // (1 or B, T) int64 of the whole sequence; undefined: one document
};

// The whole sequence's document ids, `(T)` or `(B, T)` nondecreasing
// integers, checked, as (1 or B, T) int64 on the CPU.
torch::Tensor checked_document_ids(const torch::Tensor& ids, int64_t B, int64_t T);

// The strategies: this rank's output rows (B, H, N, Dv), differentiable.
torch::Tensor ring_attention_of(const ContextParallelInputs& inputs, const Group& group);
torch::Tensor all_to_all_attention_of(const ContextParallelInputs& inputs, const Group& group);

} // namespace attn::distributed::detail
