#include "modules/sequence_layout.h"

#include "sdpa/block_mask.h"
#include "sdpa/masks.h"
#include "sdpa/sequence_starts.h"

#include <torch/torch.h>

#include <algorithm>

namespace attn::detail {
namespace {

void check_packed_call(
    const MultiHeadAttentionForwardOptions& forward_options,
    int64_t L,
    int64_t S,
    int64_t extra_keys,
    const char* caller) {
  const bool documents = forward_options.document_ids().defined();
  const bool sequences = forward_options.cu_seqlens().defined();
  TORCH_CHECK(
      !(documents && sequences), caller,
      ": give the packing as document_ids or as cu_seqlens, not both");
  const char* name = documents ? "document_ids" : "cu_seqlens";
  TORCH_CHECK(
      S == L, caller, ": ", name, " pack self-attention: key and value must be as long as the ",
      "query (", L, " tokens), got ", S);
  TORCH_CHECK(
      extra_keys == 0, caller, ": ", name, " take no add_bias_kv or add_zero_attn (their extra ",
      "keys belong to no document)");
  TORCH_CHECK(
      !documents || forward_options.kv_cache() == nullptr, caller,
      ": document_ids take no kv_cache (a cache holds sequences: give their cu_seqlens)");
}

SequenceLayout document_layout(const torch::Tensor& ids, int64_t B, int64_t L, const char* caller) {
  TORCH_CHECK(
      (ids.dim() == 1 && ids.size(0) == L) ||
          (ids.dim() == 2 && ids.size(0) == B && ids.size(1) == L),
      caller, ": document_ids must be (T) = (", L, ") or (B, T) = (", B, ", ", L, "), got ",
      ids.sizes());
  check_integers(caller, "document_ids", ids);
  SequenceLayout layout;
  layout.document_ids = (ids.dim() == 1 ? ids.unsqueeze(0) : ids).to(torch::kLong);
  layout.positions = positions_in_documents(ids.to(torch::kLong));
  return layout;
}

// cu_seqlens with a cache: sequence n's positions continue after its
// `pasts[n]` cached tokens.
torch::Tensor positions_after(
    const std::vector<int64_t>& pasts,
    const std::vector<int64_t>& starts) {
  auto positions = torch::empty({starts.back()}, torch::kLong);
  auto* data = positions.data_ptr<int64_t>();
  for (size_t n = 0; n + 1 < starts.size(); ++n) {
    for (int64_t t = starts[n]; t < starts[n + 1]; ++t) {
      data[t] = pasts[n] + t - starts[n];
    }
  }
  return positions;
}

SequenceLayout sequence_starts_layout(
    const MultiHeadAttentionForwardOptions& forward_options,
    int64_t B,
    int64_t L,
    const char* caller) {
  TORCH_CHECK(
      B == 1, caller, ": cu_seqlens pack sequences into one row: the query must be (1, total, E) ",
      "((total, 1, E) sequence-first), got ", B, " rows");
  SequenceLayout layout;
  layout.starts = sequence_starts(caller, "cu_seqlens", forward_options.cu_seqlens(), L);
  const KVCache* cache = forward_options.kv_cache();
  if (cache == nullptr) {
    layout.document_ids = document_ids_of(layout.starts).unsqueeze(0);
    layout.positions = positions_in_documents(layout.document_ids);
    return layout;
  }
  const auto N = static_cast<int64_t>(layout.starts.size()) - 1;
  TORCH_CHECK(
      N > 0, caller, ": cu_seqlens with a kv_cache must hold at least one sequence, got [0]");
  TORCH_CHECK(
      cache->lengths().empty() || static_cast<int64_t>(cache->lengths().size()) == N, caller,
      ": cu_seqlens must count the kv_cache's ", cache->lengths().size(), " sequences, got ", N);
  TORCH_CHECK(
      !forward_options.attn_mask().defined() && !forward_options.key_padding_mask().defined() &&
          !forward_options.need_weights(),
      caller, ": cu_seqlens with a kv_cache take no attn_mask, key_padding_mask or need_weights ",
      "(the sequences are the mask, and no padding is computed)");
  layout.past = cache->length();
  layout.pasts = cache->lengths().empty() ? std::vector<int64_t>(N, 0) : cache->lengths();
  layout.positions = positions_after(layout.pasts, layout.starts);
  return layout;
}

// A ragged cache: query i of sequence b stands at pasts[b] + i.
SequenceLayout ragged_cache_layout(const KVCache& cache, int64_t B, int64_t L, const char* caller) {
  TORCH_CHECK(
      static_cast<int64_t>(cache.lengths().size()) == B, caller, ": the kv_cache holds ",
      cache.lengths().size(), " sequences, got a batch of ", B);
  SequenceLayout layout;
  layout.past = cache.length();
  layout.pasts = cache.lengths();
  const auto pasts = torch::tensor(layout.pasts, torch::kLong).unsqueeze(1);
  layout.positions = pasts + torch::arange(L, torch::kLong);
  return layout;
}

} // namespace

torch::Tensor positions_in_documents(const torch::Tensor& ids) {
  const int64_t T = ids.size(-1);
  const auto index = torch::arange(T, ids.options().dtype(torch::kLong)).expand_as(ids);
  if (T == 0) {
    return index.clone();
  }
  auto begins = torch::ones_like(ids, torch::kBool);
  begins.narrow(-1, 1, T - 1).copy_(ids.narrow(-1, 1, T - 1) != ids.narrow(-1, 0, T - 1));
  const auto run_start = std::get<0>(torch::where(begins, index, 0).cummax(-1));
  return index - run_start;
}

SequenceLayout sequence_layout(
    const MultiHeadAttentionForwardOptions& forward_options,
    const torch::Tensor& query,
    int64_t B,
    int64_t L,
    int64_t S,
    const LayoutLimits& limits,
    const char* caller) {
  const KVCache* cache = forward_options.kv_cache();
  SequenceLayout layout;
  if (forward_options.document_ids().defined() || forward_options.cu_seqlens().defined()) {
    check_packed_call(forward_options, L, S, limits.extra_keys, caller);
    layout = forward_options.document_ids().defined()
        ? document_layout(forward_options.document_ids(), B, L, caller)
        : sequence_starts_layout(forward_options, B, L, caller);
  } else if (cache != nullptr && cache->ragged()) {
    layout = ragged_cache_layout(*cache, B, L, caller);
  } else if (cache != nullptr) {
    layout.past = cache->length();
  }
  const bool positions_differ = std::any_of(
                                    layout.pasts.begin(), layout.pasts.end(),
                                    [&](int64_t past) { return past != layout.pasts.front(); }) ||
      (layout.packs_cache() && layout.past > 0);
  TORCH_CHECK(
      !(positions_differ && limits.positional_modifiers), caller,
      ": alibi and a position table need every sequence's queries to stand where its keys ",
      "start, but a kv_cache of sequences of different lengths, or packed sequences after ",
      "cached tokens, places them apart (decode such sequences with caches of their own)");
  if (layout.positions.defined()) {
    layout.positions = layout.positions.to(query.device());
  }
  return layout;
}

torch::Tensor ragged_cache_band(
    const std::vector<int64_t>& pasts,
    int64_t L,
    int64_t S_total,
    bool causal,
    const c10::optional<int64_t>& window,
    torch::Device device) {
  std::vector<torch::Tensor> rows;
  rows.reserve(pasts.size());
  for (const int64_t past : pasts) {
    const auto band = visible_band(L, past + L, past, causal, window, device);
    auto row = torch::zeros({L, S_total}, torch::TensorOptions(torch::kBool).device(device));
    row.narrow(1, 0, past + L).copy_(band);
    rows.push_back(row);
  }
  return torch::stack(rows).unsqueeze(1);
}

} // namespace attn::detail
