// attn::varlen_attention: packed sequences as one call of
// scaled_dot_product_attention over all of them, whose block mask keeps
// each sequence's queries to its own keys, so that the kernels skip the
// blocks between sequences.

#include <attn/sdpa.h>

#include "sdpa/block_mask.h"
#include "sdpa/sequence_starts.h"

#include <torch/torch.h>

#include <algorithm>
#include <vector>

namespace attn {

PackedSequences::PackedSequences(torch::Tensor cu_seqlens)
    : cu_seqlens_q_(cu_seqlens), cu_seqlens_k_(std::move(cu_seqlens)) {}

PackedSequences::PackedSequences(torch::Tensor cu_seqlens_q, torch::Tensor cu_seqlens_k)
    : cu_seqlens_q_(std::move(cu_seqlens_q)), cu_seqlens_k_(std::move(cu_seqlens_k)) {}

namespace {

constexpr const char* kVarlenCaller = "varlen_attention";

// Sequence by sequence: query i of sequence n sees its keys, causal and
// windowed as KeyBand says with the query at key position
// i - q_start + (S_n - L_n) + k_start (bottom-right alignment).
class SequencesNode final : public detail::MaskPredicateNode {
 public:
  SequencesNode(
      std::vector<int64_t> q_starts,
      std::vector<int64_t> k_starts,
      bool causal,
      int64_t window)
      : q_starts_(std::move(q_starts)),
        k_starts_(std::move(k_starts)),
        causal_(causal),
        window_(window) {}

  uint8_t classify(const detail::PairBlock& block) const override {
    const int64_t first = sequence_of(block.i0), last = sequence_of(block.i1 - 1);
    if (block.j1 <= k_starts_[first] || block.j0 >= k_starts_[last + 1]) {
      return detail::kEmptyBlock;
    }
    const int64_t k_begin = k_starts_[first], k_end = k_starts_[first + 1];
    if (first != last || block.j0 < k_begin || block.j1 > k_end) {
      return detail::kPartialBlock;
    }
    return detail::band_block_kind(band_of(first), block);
  }

  // Query i sees keys of its own sequence only, within its band.
  bool key_bounds(int64_t /*b*/, int64_t L, int64_t /*S*/, int64_t* out) const override {
    for (int64_t i = 0; i < L; ++i) {
      const int64_t n = sequence_of(i);
      const auto band = band_of(n);
      out[2 * i] = std::max(k_starts_[n], band.begin(i));
      out[2 * i + 1] = std::min(k_starts_[n + 1], band.end(i));
    }
    return true;
  }

  void allows_row(int64_t /*b*/, int64_t /*h*/, int64_t i, int64_t j0, int64_t j1, uint8_t* out)
      const override {
    const int64_t n = sequence_of(i);
    const auto band = band_of(n);
    const int64_t begin = std::max(k_starts_[n], band.begin(i));
    const int64_t end = std::min(k_starts_[n + 1], band.end(i));
    for (int64_t j = j0; j < j1; ++j) {
      out[j - j0] = begin <= j && j < end ? 1 : 0;
    }
  }

 private:
  // The sequence that holds query i (empty sequences hold none).
  int64_t sequence_of(int64_t i) const {
    return std::upper_bound(q_starts_.begin(), q_starts_.end(), i) - q_starts_.begin() - 1;
  }

  detail::KeyBand band_of(int64_t n) const {
    const int64_t L = q_starts_[n + 1] - q_starts_[n], S = k_starts_[n + 1] - k_starts_[n];
    return {causal_, k_starts_[n] - q_starts_[n] + S - L, window_, k_starts_[n + 1]};
  }

  std::vector<int64_t> q_starts_, k_starts_;
  bool causal_;
  int64_t window_;
};

void check_packed_shapes(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value) {
  TORCH_CHECK(
      query.defined() && key.defined() && value.defined(), kVarlenCaller,
      ": query, key and value must be defined tensors");
  TORCH_CHECK(
      query.dim() == 3 && key.dim() == 3 && value.dim() == 3, kVarlenCaller,
      ": query (total_q, H, E), key (total_k, Hkv, E) and value (total_k, Hkv, Ev) must have 3 ",
      "dims, got query ", query.sizes(), ", key ", key.sizes(), ", value ", value.sizes());
  const int64_t H = query.size(1), Hkv = key.size(1);
  TORCH_CHECK(
      value.size(1) == Hkv && Hkv > 0 && H % Hkv == 0, kVarlenCaller,
      ": key and value must have the same heads Hkv, dividing the query's H, got query ",
      query.sizes(), ", key ", key.sizes(), ", value ", value.sizes());
}

void check_packed_options(const SDPAOptions& options, bool starts_together) {
  TORCH_CHECK(
      !options.attn_mask().defined() && !options.block_mask().defined(), kVarlenCaller,
      ": takes no attn_mask or block_mask: the sequences are the mask");
  TORCH_CHECK(
      options.query_offset() == 0, kVarlenCaller,
      ": takes no query_offset (each sequence is aligned at its bottom-right corner), got ",
      options.query_offset());
  TORCH_CHECK(
      !options.need_weights(), kVarlenCaller, ": returns no weights: set need_weights(false)");
  TORCH_CHECK(
      starts_together || (!options.alibi_slopes().defined() && !options.position_bias().defined()),
      kVarlenCaller, ": alibi_slopes and position_bias need each sequence's queries and keys to ",
      "start together (cu_seqlens_q equal to cu_seqlens_k)");
}

} // namespace

torch::Tensor varlen_attention(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const PackedSequences& sequences,
    const SDPAOptions& options) {
  check_packed_shapes(query, key, value);
  const int64_t total_q = query.size(0), total_k = key.size(0);
  auto q_starts = detail::sequence_starts(
      kVarlenCaller, "cu_seqlens_q", sequences.cu_seqlens_q(), total_q, sequences.max_seqlen_q());
  auto k_starts = detail::sequence_starts(
      kVarlenCaller, "cu_seqlens_k", sequences.cu_seqlens_k(), total_k, sequences.max_seqlen_k());
  TORCH_CHECK(
      q_starts.size() == k_starts.size(), kVarlenCaller,
      ": cu_seqlens_q and cu_seqlens_k must count as many sequences, got ", q_starts.size() - 1,
      " and ", k_starts.size() - 1);
  const bool starts_together = q_starts == k_starts;
  check_packed_options(options, starts_together);

  auto call = options;
  call.enable_gqa(query.size(1) != key.size(1));
  if (starts_together) {
    // Each sequence's band is the call's own: causal and window as given.
    call.block_mask(
        block_mask(document_mask(detail::document_ids_of(q_starts)), 1, 1, total_q, total_k));
  } else {
    const int64_t window = std::min(options.window().value_or(0), detail::kUnboundedWindow);
    call.block_mask(block_mask(
        MaskPredicate(std::make_shared<SequencesNode>(
            std::move(q_starts), std::move(k_starts), options.is_causal(), window)),
        1, 1, total_q, total_k));
    call.is_causal(false).window(c10::nullopt);
  }
  const auto [out, none] = scaled_dot_product_attention(
      query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), call);
  return out.transpose(0, 1);
}

} // namespace attn
