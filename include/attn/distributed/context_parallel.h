#pragma once

/// \file
/// Context parallelism: attention over a sequence split across the ranks of
/// a group, each rank holding a chunk of every sequence of the batch.

#include <attn/distributed/process_group.h>

#include <torch/arg.h>
#include <torch/types.h>

#include <cstdint>
#include <iosfwd>
#include <vector>

namespace attn::distributed {

/// Which positions of the sequence each rank holds.
enum class SequenceLayout {
  /// Rank r holds chunk r of W equal chunks. Under causal attention the last
  /// rank does W times the first one's work.
  contiguous,
  /// The sequence is cut into 2W equal chunks; rank r holds chunks r and
  /// 2W-1-r, one early and one late, so that every rank does the same
  /// causal work (the "zigzag" of ring-attention load balancing).
  zigzag,
};

/// Prints `contiguous` or `zigzag`.
std::ostream& operator<<(std::ostream& stream, SequenceLayout layout);

/// How attention crosses the ranks.
enum class ContextParallelStrategy {
  /// Keys and values travel around the ring of ranks, W-1 steps, each
  /// overlapped with the attention of the block already received; partial
  /// outputs merge through their row log-sum-exp (Ring Attention, Liu et
  /// al. 2023). Any head count.
  ring,
  /// All-to-alls over heads turn the sequence chunks of Q, K and V into
  /// whole sequences of H/W heads, attended locally, and one more brings
  /// the output rows home (DeepSpeed-Ulysses): four exchanges per forward
  /// whatever W. Needs W to divide the query and key/value head counts.
  all_to_all,
};

/// Prints `ring` or `all_to_all`.
std::ostream& operator<<(std::ostream& stream, ContextParallelStrategy strategy);

/// A sequence of `length` tokens laid out over `world_size` ranks. Every
/// rank holds `local_length()` rows; when the chunks do not divide
/// `length`, the sequence is padded at its end to `padded_length()`, and
/// the padding positions (at and after `length`) are keys that no query
/// sees and queries whose output is zero. A value: every rank makes the
/// same one.
///
/// Example:
/// ```
/// attn::distributed::SequenceSharding sharding(1000, group.size());
/// auto x_local = sharding.shard(x, /*dim=*/1, group.rank());  // (B, 250, E)
/// ```
class SequenceSharding {
 public:
  /// Checks `length >= 1` and `world_size >= 1`.
  SequenceSharding(
      int64_t length,
      int64_t world_size,
      SequenceLayout layout = SequenceLayout::zigzag);

  /// The tokens `[start, start + length)` of the whole sequence, held as
  /// consecutive local rows.
  struct Segment {
    int64_t start = 0;
    int64_t length = 0;
  };

  /// T: the tokens of the sequence, without padding.
  int64_t length() const { return length_; }
  /// W.
  int64_t world_size() const { return world_size_; }
  SequenceLayout layout() const { return layout_; }
  /// The rows every rank holds, padding included.
  int64_t local_length() const;
  /// `local_length() * world_size()`: T rounded up to whole chunks.
  int64_t padded_length() const;
  /// The positions rank `rank`'s rows hold, in local order: one segment
  /// when contiguous, two when zigzag.
  std::vector<Segment> segments(int64_t rank) const;
  /// The rows of `segment` before the end of the sequence; the rest of it
  /// is padding.
  int64_t rows_inside(const Segment& segment) const;

  /// Rank `rank`'s rows of `whole` (its size along `dim` is `length()`),
  /// padded with zeros past the end of the sequence; a view of `whole`
  /// where one stretch of it without padding is all the rank holds (as
  /// `narrow` gives). Differentiable; not a collective (every rank is
  /// expected to hold `whole`).
  torch::Tensor shard(const torch::Tensor& whole, int64_t dim, int64_t rank) const;
  /// Every rank's rows of `whole`, in rank order: `shard` for each rank,
  /// padding `whole` once.
  std::vector<torch::Tensor> shard_all(const torch::Tensor& whole, int64_t dim) const;
  /// The whole sequence from every rank's part (in rank order, as
  /// `shard` made them), padding removed. Differentiable.
  torch::Tensor unshard(const std::vector<torch::Tensor>& parts, int64_t dim) const;

 private:
  // `whole` (length() along `dim`) with the padding appended.
  torch::Tensor padded(const torch::Tensor& whole, int64_t dim) const;
  // Rank `rank`'s rows of `padded`, the padded sequence along `dim`.
  torch::Tensor rows_of(const torch::Tensor& padded, int64_t dim, int64_t rank) const;

  int64_t length_;
  int64_t world_size_;
  SequenceLayout layout_;
};

/// Every rank's part gathered into the whole sequence along `dim`, on every
/// rank: an all-gather, then `sharding.unshard`. The gradient keeps this
/// rank's rows. A collective: every rank calls it.
///
/// Example:
/// ```
/// auto out = attn::distributed::gather_sequence(out_local, 1, sharding, group);
/// ```
torch::Tensor gather_sequence(
    const torch::Tensor& part,
    int64_t dim,
    const SequenceSharding& sharding,
    const Group& group);

/// Options of `context_parallel_attention`: the sharding of the sequence, and the
/// masks, with `SDPAOptions`' meaning in the whole sequence's positions.
///
/// Example:
/// ```
/// auto options = attn::distributed::ContextParallelOptions(
///     attn::distributed::SequenceSharding(T, group.size())).is_causal(true);
/// ```
struct ContextParallelOptions {
  /// The layout of queries, keys and values alike (self-attention).
  explicit ContextParallelOptions(SequenceSharding sharding);

  /// Which tokens this rank holds.
  TORCH_ARG(SequenceSharding, sharding);
  /// Query `i` attends only to keys `j <= i + query_offset`, in positions
  /// of the whole sequence.
  TORCH_ARG(bool, is_causal) = false;
  /// Query `i` attends only to keys `j` with `|i + query_offset - j| <
  /// window`; with `is_causal`, to the last `window` keys up to its own
  /// position. Unset: no window.
  TORCH_ARG(c10::optional<int64_t>, window) = c10::nullopt;
  /// Query `i` of the whole sequence stands at key position `i +
  /// query_offset`, as in `SDPAOptions`.
  TORCH_ARG(int64_t, query_offset) = 0;
  /// Multiplier of `Q·Kᵀ`; `1/sqrt(D)` when not set.
  TORCH_ARG(c10::optional<double>, scale) = c10::nullopt;
  /// `(B, local_length)` bool, this rank's keys: `true` marks a padding key
  /// that no query attends to (the `torch::nn::MultiheadAttention`
  /// convention). The ring passes it on with the keys; the all-to-all
  /// strategy gathers it whole.
  TORCH_ARG(torch::Tensor, key_padding_mask) = {};
  /// Packed documents: `(T)` or `(B, T)` integer ids of the *whole*
  /// sequence's tokens (every rank passes the same), nondecreasing along
  /// each row. A query attends only to keys of its own document; the ring
  /// skips the pairs of blocks whose documents differ, and scores only the
  /// blocks of 128 queries × 64 keys that a document spans.
  TORCH_ARG(torch::Tensor, document_ids) = {};
  /// How attention crosses the ranks.
  TORCH_ARG(ContextParallelStrategy, strategy) = ContextParallelStrategy::ring;
};

/// Attention over a sequence split across the ranks of `group`: `query`
/// `(B, H, N, D)`, `key` `(B, H_kv, N, D)` and `value` `(B, H_kv, N, Dv)`
/// are this rank's `N = sharding.local_length()` rows of the whole
/// sequence, laid out as `options.sharding()` says; `H_kv` divides `H`
/// (grouped-query heads, never copied). Returns this rank's rows of
/// `softmax(Q·Kᵀ·scale + masks)·V` over the whole sequence, `(B, H, N, Dv)`,
/// differentiable with respect to the three inputs. A query row that sees
/// no key gets zeros, as in `attn::scaled_dot_product_attention`.
///
/// CPU tensors, float32 or float64 (float16 and bfloat16 are computed in
/// float32), on a Gloo group. Partial results merge in the inputs' dtype
/// (float32 at least). Every rank calls it with the same options and sizes,
/// and runs its backward when one rank does; ranks that disagree on sizes,
/// dtype or options fail together with a message listing each rank's, and
/// a rank that refuses its own arguments fails the others at once. A rank
/// that leaves fails the others within the group's timeout; after any
/// failure the group's ranks are out of step, as after a failed c10d
/// collective.
///
/// With the ring strategy each rank's memory is O(N) in the sequence
/// length: it holds its own rows, one block of keys and values in use and
/// one in flight (and, in the backward, their gradients).
/// With the all_to_all strategy each rank holds the whole sequence of its
/// H/W query heads and H_kv/W key/value heads (as many numbers as its rows
/// of every head) and exchanges each of query, key, value and output once,
/// and each of their gradients once in the backward, whatever W.
///
/// Example:
/// ```
/// SequenceSharding sharding(T, group.size());
/// auto q = sharding.shard(q_whole, 2, group.rank());  // and k, v
/// auto out = attn::distributed::context_parallel_attention(
///     q, k, v, group, ContextParallelOptions(sharding).is_causal(true));
/// ```
torch::Tensor context_parallel_attention(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const Group& group,
    const ContextParallelOptions& options);

/// The earlier name of `context_parallel_attention`, which runs the ring or
/// the all-to-all strategy as `options.strategy()` says.
[[deprecated("renamed attn::distributed::context_parallel_attention")]] inline torch::Tensor
ring_attention(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const Group& group,
    const ContextParallelOptions& options) {
  return context_parallel_attention(query, key, value, group, options);
}

} // namespace attn::distributed
