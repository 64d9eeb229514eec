#pragma once

// Where a multi-head attention call's tokens stand: after their sequence's
// cached tokens (the same number for every sequence, or each its own in a
// ragged cache), or within the documents packed into their row. The
// rotary positions and the masks of the call follow from it.

#include <attn/kv_cache.h>
#include <attn/options.h>

#include <torch/types.h>

#include <cstdint>
#include <vector>

namespace attn::detail {

struct SequenceLayout {
  // Cached tokens before the call's: the longest sequence's count.
  int64_t past = 0;
  // Each sequence's cached tokens where they differ (a ragged cache), or
  // where the call packs the cache's sequences (cu_seqlens with a cache).
  std::vector<int64_t> pasts;
  // (B, L) or (1, L) int64 document of each query and key, where the call
  // packs documents without a cache.
  torch::Tensor document_ids;
  // cu_seqlens, where given.
  std::vector<int64_t> starts;
  // (L) or (B, L) int64 rotary positions on the query's device, where they
  // are not past + i.
  torch::Tensor positions;

  // Packed sequences appended to a cache: attended as varlen_attention.
  bool packs_cache() const { return !starts.empty() && !pasts.empty(); }
};

// What of the module's options the layout depends on.
struct LayoutLimits {
  // Keys appended after the call's (add_bias_kv, add_zero_attn).
  int64_t extra_keys = 0;
  // Whether a score modifier reads positions (ALiBi, a position table).
  bool positional_modifiers = false;
};

// The layout of a call of `L` queries and `S` keys in `B` rows that
// `forward_options` describes, checked before anything changes: packed
// input is self-attention (S == L) with no extra keys, cu_seqlens one row
// of at least one sequence and no masks or weights with a cache, document
// ids of the call's rows and length and no cache; queries that stand at
// different positions per sequence (a ragged cache, packed sequences after
// cached ones) take no positional modifiers. `caller` prefixes the
// messages.
SequenceLayout sequence_layout(
    const MultiHeadAttentionForwardOptions& forward_options,
    const torch::Tensor& query,
    int64_t B,
    int64_t L,
    int64_t S,
    const LayoutLimits& limits,
    const char* caller);

// Each token's index within its document: t minus the index where the run
// of its id began, along the last dim of `ids` ((T) or (B, T), int64).
torch::Tensor positions_in_documents(const torch::Tensor& ids);

// (B, 1, L, S_total) bool: query i of sequence b sees the keys before
// `pasts[b] + L` (its cached ones and the call's) that `causal` and
// `window` leave it, standing at pasts[b] + i.
torch::Tensor ragged_cache_band(
    const std::vector<int64_t>& pasts,
    int64_t L,
    int64_t S_total,
    bool causal,
    const c10::optional<int64_t>& window,
    torch::Device device);

} // namespace attn::detail
