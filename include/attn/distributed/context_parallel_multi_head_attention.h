#pragma once

/// \file
/// Multi-head self-attention over a sequence split across the ranks of a
/// group: each rank projects its own tokens and the ranks attend together
/// through `context_parallel_attention`.

#include <attn/distributed/context_parallel.h>
#include <attn/distributed/process_group.h>
#include <attn/modules/multi_head_attention.h>
#include <attn/modules/multi_head_layers.h>
#include <attn/options.h>

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <cstdint>
#include <iosfwd>
#include <tuple>

namespace attn::distributed {

/// Per-call options of `ContextParallelMultiHeadAttention::forward`: how
/// the sequence is split, and the masks that can be split with it, in the
/// whole sequence's positions (as in `ContextParallelOptions`).
///
/// Example:
/// ```
/// auto options = attn::distributed::ContextParallelForwardOptions(
///     attn::distributed::SequenceSharding(T, group.size())).is_causal(true);
/// ```
struct ContextParallelForwardOptions {
  /// Options for a sequence laid out as `sharding` says; no mask.
  explicit ContextParallelForwardOptions(SequenceSharding sharding);
  /// The options of a `MultiHeadAttention` call carried over: `is_causal`,
  /// `window`, `key_padding_mask` (which must then hold this rank's keys,
  /// as below) and `document_ids` (the whole sequence's, as below). `need_weights` and
  /// `average_attn_weights` do not apply (no weights are computed). Throws a c10::Error for what
  /// cannot be split by sequence: an `attn_mask` (arbitrary pairs of the whole sequence), a
  /// `kv_cache` and `cu_seqlens` (give the whole sequence's `document_ids` instead).
  ContextParallelForwardOptions(
      SequenceSharding sharding,
      const MultiHeadAttentionForwardOptions& attention_options);

  /// Which tokens this rank holds: the same on every rank.
  TORCH_ARG(SequenceSharding, sharding);
  /// `(B, N)` bool, this rank's keys (`N = sharding.local_length()`, shard
  /// it as the input): `true` marks a padding key that no query attends to.
  TORCH_ARG(torch::Tensor, key_padding_mask) = {};
  /// Token `i` of the whole sequence attends only to tokens `j <= i`.
  TORCH_ARG(bool, is_causal) = false;
  /// Token `i` attends only to tokens `j` with `|i - j| < window`; with
  /// `is_causal`, to its last `window` tokens. Unset: no window.
  TORCH_ARG(c10::optional<int64_t>, window) = c10::nullopt;
  /// Packed documents: `(T)` or `(B, T)` integer ids of the whole
  /// sequence's tokens, nondecreasing (every rank passes the same). Each
  /// token attends only to its own document's, and rotary positions
  /// restart at 0 at each document (`ContextParallelOptions::document_ids`).
  TORCH_ARG(torch::Tensor, document_ids) = {};
  /// How attention crosses the ranks (see `ContextParallelStrategy`).
  TORCH_ARG(ContextParallelStrategy, strategy) = ContextParallelStrategy::ring;
};

/// `attn::MultiHeadAttention` applied to self-attention over a sequence
/// split across the W ranks of a group: each rank passes its
/// `N = sharding.local_length()` tokens and gets its rows of the output
/// that the whole module gives for the whole sequence. With the ring
/// strategy a rank's memory is O(N): no rank holds the whole sequence, its
/// keys or its scores.
///
/// Every rank holds the whole module (the same parameters, under
/// `MultiHeadAttention`'s names, so that a state_dict loads into either):
/// a rank projects its tokens with all the heads, turns their queries and
/// keys by rotary embeddings at their positions in the whole sequence,
/// attends with `context_parallel_attention` (grouped-query heads are not copied) and
/// projects the merged heads by `out_proj`.
///
/// Gradients: the gradient of a rank's input is that of its rows; the
/// parameters' gradients are summed over the ranks in the backward, so
/// that every rank's `.grad()` is the whole module's gradient for the
/// whole sequence and an optimizer keeps the copies equal.
///
/// Collectives, on the ring strategy: one forward makes the all-gather of
/// the sizes (so that ranks that disagree fail with a message, not a hang)
/// and W-1 steps that each send this rank's keys and values (and key
/// padding) to the next rank and receive the previous rank's; one backward
/// makes W-1 such steps again, W steps passing the keys' and values'
/// gradients, and one all-reduce per parameter (4 weights and, with `bias`,
/// 4 biases).
///
/// Not split by sequence, and refused with a c10::Error: `add_bias_kv`,
/// `add_zero_attn`, `kdim` or `vdim` other than `embed_dim` (at
/// construction), dropout while training (at the forward), an `attn_mask`,
/// a `kv_cache` and `cu_seqlens` (see `ContextParallelForwardOptions`).
///
/// Example:
/// ```
/// auto group = attn::distributed::init_process_group();
/// torch::manual_seed(0);  // the same module on every rank
/// attn::distributed::ContextParallelMultiHeadAttention mha(
///     attn::MultiHeadAttentionOptions(512, 8).rotary(attn::RotaryEmbeddingOptions(64)),
///     group);
/// attn::distributed::SequenceSharding sharding(T, group.size());
/// auto x_local = sharding.shard(x, /*dim=*/1, group.rank());  // (B, N, 512)
/// auto [out_local, none] = mha(x_local,
///     attn::distributed::ContextParallelForwardOptions(sharding).is_causal(true));
/// ```
class ContextParallelMultiHeadAttentionImpl
    : public torch::nn::Cloneable<ContextParallelMultiHeadAttentionImpl>,
      public MultiHeadLayers {
 public:
  /// `MultiHeadAttention(options)`, made with the current random state
  /// (which must be the same on every rank), on every rank. Refuses the
  /// options that cannot be split by sequence.
  ContextParallelMultiHeadAttentionImpl(const MultiHeadAttentionOptions& options, Group group);
  /// A copy of `full`'s parameters (the same on every rank), e.g. of a
  /// module loaded from a PyTorch state_dict. Refuses the options that
  /// cannot be split by sequence.
  ContextParallelMultiHeadAttentionImpl(const MultiHeadAttention& full, Group group);

  /// `x_local`: this rank's rows of the sequence, `(B, N, E)` (`(N, B, E)`
  /// when not `batch_first`), laid out as `options.sharding()` says, with
  /// the module's dtype, on the CPU. Returns, as `MultiHeadAttention`
  /// does, `(output, weights)`: this rank's rows of `MultiHeadAttention(x,
  /// x, x)`'s output for the whole sequence x, shaped like `x_local` (rows
  /// past the end of the sequence, padding, are zeros), and an undefined
  /// tensor, since no weights are computed. A collective: every rank calls
  /// it with the same options.
  std::tuple<torch::Tensor, torch::Tensor> forward(
      const torch::Tensor& x_local,
      const ContextParallelForwardOptions& options);

  /// Registers the layers (their values drawn without touching the default
  /// generator's state), as `clone()` needs; the constructors then copy
  /// the whole module's parameters into them.
  void reset() override;
  /// A copy on the same group (every rank clones its own), its Q/K/V
  /// weights stacked again as the constructors leave them.
  std::shared_ptr<torch::nn::Module> clone(
      const c10::optional<torch::Device>& device = c10::nullopt) const override;

  /// Prints `attn::distributed::ContextParallelMultiHeadAttention(embed_dim=512,
  /// num_heads=8, rank=0, world_size=2)`, with `num_kv_heads` and
  /// `rotary_dim` when set.
  void pretty_print(std::ostream& stream) const override;

  const Group& group() const { return group_; }
  /// The options of the module.
  MultiHeadAttentionOptions options;

 private:
  Group group_;
};

/// Holder of `ContextParallelMultiHeadAttentionImpl`, as `TORCH_MODULE`
/// defines it.
TORCH_MODULE(ContextParallelMultiHeadAttention);

} // namespace attn::distributed
