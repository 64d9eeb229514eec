#pragma once

/// \file
/// Block masks: which pairs of queries and keys may attend, described by a
/// predicate over `(b, h, i, j)` (as FlexAttention's `mask_mod`) and turned
/// once into a map of the scores' blocks of 128 queries × 64 keys: empty
/// (no pair may attend: the kernels skip it), full (every pair may: no
/// element is tested) or partial (its elements are kept, computed once).
/// Built once, a `BlockMask` serves every call of its sizes
/// (`SDPAOptions::block_mask`), forward and backward.
///
/// Example: documents packed into rows of 4096 tokens, causal within each.
/// ```
/// const auto documents = torch::tensor({0, 0, 0, 1, 1, 2}, torch::kLong); // (T)
/// const auto mask = attn::block_mask(
///     attn::causal_mask() & attn::document_mask(documents), 1, 1, 6, 6);
/// const auto [out, weights] = attn::scaled_dot_product_attention(
///     q, k, v, attn::SDPAOptions().block_mask(mask));
/// ```

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>

namespace attn {

namespace detail {
struct MaskPredicateNode;
struct BlockMaskData;
} // namespace detail

/// Whether query `i` of head `h` in batch row `b` may attend key `j` (their
/// indices in the call; `b` the leading dims before the heads flattened
/// into one). Built from the functions below and combined with `&` (both
/// allow) and `|` (either allows).
class MaskPredicate {
 public:
  using Function = std::function<bool(int64_t b, int64_t h, int64_t i, int64_t j)>;

  /// A predicate written in C++, called once per pair of every block that
  /// the built-in predicates it is combined with leave undecided, from
  /// several threads at once: it must be thread-safe. What it throws
  /// becomes a `c10::Error` naming the predicate (a `c10::Error` passes
  /// unchanged).
  explicit MaskPredicate(Function function);
  /// A predicate of attn's own (the built-ins below); not null.
  explicit MaskPredicate(std::shared_ptr<const detail::MaskPredicateNode> node);

  /// The pairs both predicates allow.
  MaskPredicate operator&(const MaskPredicate& other) const;
  /// The pairs either predicate allows.
  MaskPredicate operator|(const MaskPredicate& other) const;

  /// The predicate as attn evaluates it.
  const std::shared_ptr<const detail::MaskPredicateNode>& node() const { return node_; }

 private:
  std::shared_ptr<const detail::MaskPredicateNode> node_;
};

/// `j <= i`: each query sees the keys up to its own index (aligned at the
/// top-left corner, as `SDPAOptions::is_causal` with no `query_offset`).
MaskPredicate causal_mask();

/// `i - window < j <= i`: each query sees its own key and the
/// `window - 1` before it. `window` must be positive.
MaskPredicate sliding_window_mask(int64_t window);

/// Packed sequences: a query sees the keys of its own document.
/// `document_ids` is `(T)` or `(B, T)` of integers, nondecreasing along
/// each row (each document's tokens together), for the queries and the
/// keys alike (self-attention, `L == S == T`).
MaskPredicate document_mask(const torch::Tensor& document_ids);

/// As above with the queries' `(L)` or `(B, L)` and the keys' `(S)` or
/// `(B, S)` document ids apart.
MaskPredicate document_mask(
    const torch::Tensor& query_document_ids,
    const torch::Tensor& key_document_ids);

/// Prefix-LM (as T5 and UL2 train decoders): every query sees the first
/// `prefix_lengths[b]` keys, and the keys up to its own index after them.
/// `prefix_lengths` is `(B)` or `(1)` of integers, each at least 0.
MaskPredicate prefix_lm_mask(const torch::Tensor& prefix_lengths);

/// A predicate turned into its map of blocks, for calls whose scores are
/// `(batch, heads, query_length, key_length)`; a `batch` or `heads` of 1
/// serves every batch row or head of a call. Cheap to copy (shared).
class BlockMask {
 public:
  /// No mask (`defined()` is false).
  BlockMask() = default;
  /// The blocks `attn::block_mask` computed.
  explicit BlockMask(std::shared_ptr<const detail::BlockMaskData> data);

  /// Whether this holds a mask (a default-constructed one holds none).
  bool defined() const { return data_ != nullptr; }
  /// The sizes it was built for (0 when not defined).
  int64_t batch() const;
  /// \copydoc batch
  int64_t heads() const;
  /// \copydoc batch
  int64_t query_length() const;
  /// \copydoc batch
  int64_t key_length() const;
  /// The fraction of blocks that no pair may attend: the work the kernels skip.
  double sparsity() const;
  /// The mask as bool `(batch, heads, query_length, key_length)`, true
  /// where a pair may attend.
  torch::Tensor to_dense() const;

  /// The blocks as attn's kernels read them.
  const std::shared_ptr<const detail::BlockMaskData>& data() const { return data_; }

 private:
  std::shared_ptr<const detail::BlockMaskData> data_;
};

/// Evaluates `predicate` into the blocks of `(batch, heads, query_length,
/// key_length)` scores: the built-in predicates classify a block without
/// looking at its pairs, a user's predicate is called on each pair of the
/// blocks they leave undecided. A causal or sliding-window predicate joined
/// to the rest by `&` becomes the kernels' band of keys, the same one
/// `SDPAOptions::is_causal` and `window` give.
BlockMask block_mask(
    const MaskPredicate& predicate,
    int64_t batch,
    int64_t heads,
    int64_t query_length,
    int64_t key_length);

} // namespace attn
