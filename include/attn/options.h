#pragma once

/// \file
/// Option structs for attn's functions and modules, in the style of
/// `torch::nn`: every field is a chainable `TORCH_ARG` with a default.

#include <attn/backend.h>
#include <attn/block_mask.h>

#include <torch/arg.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>

namespace attn {

class KVCache;

/// How a relative-position bias table is indexed: which of its `buckets`
/// holds the bias of query position `i'` against key `j`, from the offset
/// `j - i'` alone.
enum class PositionBucketing {
  /// T5's bidirectional buckets (Raffel et al. 2020, `_relative_position_bucket`
  /// with `bidirectional=True`): half of `num_buckets` for each sign, in each
  /// half exact offsets below a quarter of `num_buckets`, logarithmic ones up
  /// to `max_distance`, the last bucket beyond.
  t5_bidirectional,
  /// T5's decoder buckets (`bidirectional=False`): the keys before the query
  /// only (later keys share bucket 0), exact below half of `num_buckets`.
  t5_causal,
  /// One bucket per offset in `[-max_distance, max_distance]`, clipped to
  /// the ends beyond: `2·max_distance + 1` buckets, whatever `num_buckets`.
  clipped,
};

/// A score modifier written in C++, as FlexAttention's `score_mod` is in
/// Python: the new score of query `i` and key `j` (their indices in the
/// call) of head `h` in batch `b` (the leading dims before the heads
/// flattened into one), given its scaled (and soft-capped) score, and the
/// derivative of that in the score, which the backward multiplies in. Both
/// are called once per score and pass, from the kernel's threads at once:
/// they must be thread-safe, and what they throw becomes a `c10::Error`
/// naming `score_function`. Returning -inf hides a pair.
///
/// Example:
/// ```
/// attn::ScoreFunction tanh_cap{
///     [](double s, int64_t, int64_t, int64_t, int64_t) { return 30 * std::tanh(s / 30); },
///     [](double s, int64_t, int64_t, int64_t, int64_t) {
///       const double t = std::tanh(s / 30);
///       return 1 - t * t;
///     }};
/// ```
struct ScoreFunction {
  using Fn = std::function<double(double score, int64_t b, int64_t h, int64_t i, int64_t j)>;
  Fn value;
  Fn derivative;
};

/// The buckets of `SDPAOptions::position_bias`.
///
/// Example:
/// ```
/// attn::PositionBuckets().num_buckets(32).max_distance(128);  // T5-base's
/// ```
struct PositionBuckets {
  TORCH_ARG(PositionBucketing, bucketing) = PositionBucketing::t5_bidirectional;
  TORCH_ARG(int64_t, num_buckets) = 32;
  TORCH_ARG(int64_t, max_distance) = 128;

 public:
  /// The table's columns: `num_buckets`, or `2·max_distance + 1` when clipped.
  int64_t count() const {
    return bucketing_ == PositionBucketing::clipped ? 2 * max_distance_ + 1 : num_buckets_;
  }
};

/// Per-call options of the function `attn::scaled_dot_product_attention`
/// (SDPA): everything one call can vary, masks included. Not to be confused
/// with `ScaledDotProductAttentionOptions`, the construction options of the
/// module `attn::ScaledDotProductAttention`, which holds only what stays
/// fixed across calls (dropout, scale).
///
/// Example:
/// ```
/// auto [out, w] = attn::scaled_dot_product_attention(
///     q, k, v, attn::SDPAOptions().is_causal(true).need_weights(true));
/// ```
struct SDPAOptions {
  /// Mask broadcastable to the scores' shape `(..., L, S)`. A bool mask marks
  /// the pairs that *may attend* with `true`; a floating mask (same dtype as
  /// the query) is added to the scaled scores, `-inf` forbidding a pair.
  TORCH_ARG(torch::Tensor, attn_mask) = {};
  /// A mask built once from a predicate (`attn::block_mask`), for scores of
  /// its sizes: the fused CPU kernels skip its empty blocks and test no
  /// element of its full ones. Combines with `attn_mask`, `is_causal` and
  /// `window` (a pair must pass all of them); its own causal band, where
  /// it has one, must then be theirs. LibTorch's kernel takes none; the
  /// math path reads it as a dense mask. Undefined: none.
  TORCH_ARG(BlockMask, block_mask);
  /// Query `i` attends only to keys `j <= i + query_offset` (aligned at the
  /// top-left corner when `L != S` and `query_offset` is 0). Combines with
  /// `attn_mask` and `window`: a pair must pass all of them.
  TORCH_ARG(bool, is_causal) = false;
  /// Sliding-window (local) attention: query `i` attends only to keys `j`
  /// with `|i + query_offset - j| < window`; with `is_causal`, to the last
  /// `window` keys up to its own position. Applied without building an
  /// `L×S` mask on the fused CPU kernels. Unset: no window.
  TORCH_ARG(c10::optional<int64_t>, window) = c10::nullopt;
  /// Position of query 0 among the keys, for `is_causal` and `window`: query
  /// `i` stands at key position `i + query_offset`. With a KV cache holding
  /// `S - L` earlier tokens it is `S - L` (bottom-right alignment).
  TORCH_ARG(int64_t, query_offset) = 0;
  /// Grouped-query attention: query `(..., Hq, L, E)` against key and value
  /// `(..., Hkv, S, ·)` with `Hkv` dividing `Hq`; query head `h` uses
  /// key/value head `h / (Hq / Hkv)`, without copying keys or values on the
  /// fused CPU kernels. When false, all leading dims must match.
  TORCH_ARG(bool, enable_gqa) = false;
  /// Multiplier of `Q·Kᵀ`; `1/sqrt(E)` when not set.
  TORCH_ARG(c10::optional<double>, scale) = c10::nullopt;
  /// Probability of zeroing an attention weight; applied only if `training`.
  TORCH_ARG(double, dropout_p) = 0.0;
  /// Whether dropout is active, as in `torch::nn::functional::dropout`.
  TORCH_ARG(bool, training) = true;
  /// Whether to return the attention weights `(..., L, S)`. Off by default:
  /// without weights a call runs on attn's fused kernels, which never hold
  /// the `L×S` scores; the returned weights tensor is then undefined.
  TORCH_ARG(bool, need_weights) = false;
  /// The implementation to run, or unset to let `attn::select_backend`
  /// choose. A backend that cannot run the request is an error naming why.
  TORCH_ARG(c10::optional<AttentionBackend>, backend) = c10::nullopt;
  /// The widest CPU instructions attn's CPU kernels use for this call, one
  /// of `attn::cpu_capabilities()`, or unset: the widest of them. The
  /// backend rules read it as the CPU's. A capability this CPU lacks is an
  /// error naming the ones it has.
  TORCH_ARG(c10::optional<CpuCapability>, cpu_capability) = c10::nullopt;

  /// Score modifiers. Each scaled score `s` of query `i` (at position
  /// `i' = i + query_offset`) and key `j` of head `h` becomes
  /// `softcap·tanh(s / softcap)` when `softcap` is set, then has the ALiBi
  /// term, the relative-position bias and `attn_mask` added; `sinks` then
  /// join every row's softmax. All of them run inside the fused CPU kernel,
  /// forward and backward, and give gradients to the tensors that require
  /// them (`position_bias`, `sinks`, `alibi_slopes`, a floating `attn_mask`).

  /// ALiBi (Press et al. 2022, "Train Short, Test Long"): head `h` adds
  /// `slope[h]·(j - i')` (the causal form, as BLOOM and MPT add it; the same
  /// as `-slope[h]·(i' - j)` on the keys up to the query) or, with
  /// `alibi_symmetric`, `-slope[h]·|j - i'|`. `(H)`, one slope per query
  /// head; `attn::alibi_slopes(H)` gives the paper's geometric sequence.
  /// Undefined: none.
  TORCH_ARG(torch::Tensor, alibi_slopes) = {};
  /// ALiBi's bidirectional form `-slope·|j - i'|`, for encoders.
  TORCH_ARG(bool, alibi_symmetric) = false;
  /// Logit soft-capping (Gemma 2: 50, Grok-1: 30): `cap·tanh(s / cap)` of
  /// each scaled score, before any bias or mask. Must be positive. Unset:
  /// none.
  TORCH_ARG(c10::optional<double>, softcap) = c10::nullopt;
  /// A learned relative-position bias (T5, Shaw et al. 2018): a table
  /// `(H, position_buckets.count())` whose entry `(h, bucket(j - i'))` is
  /// added to the score; its gradient accumulates into the table without an
  /// `L×S` tensor. Undefined: none.
  TORCH_ARG(torch::Tensor, position_bias) = {};
  /// How `position_bias` is indexed.
  TORCH_ARG(PositionBuckets, position_buckets) = {};
  /// Attention sinks (as gpt-oss has them): a learned logit per query head
  /// `(H)` that joins every row's softmax denominator and multiplies no
  /// value, so that a row may give less than all of its weight to the keys.
  /// Undefined: none.
  TORCH_ARG(torch::Tensor, sinks) = {};
  /// A score modifier written in C++ (`ScoreFunction`), applied after the
  /// soft cap and before the biases and the mask, on the fused CPU kernel
  /// forward and backward. Null: none.
  TORCH_ARG(std::shared_ptr<const ScoreFunction>, score_function) = nullptr;
};

/// Where the sequences of a packed batch start (`attn::varlen_attention`):
/// sequence n holds queries `[cu_seqlens_q[n], cu_seqlens_q[n + 1])` and
/// keys `[cu_seqlens_k[n], cu_seqlens_k[n + 1])`. Each is `(N + 1)` of
/// integers, 0 first, nondecreasing, the total length last.
///
/// Example: `attn::PackedSequences(torch::tensor({0, 3, 5, 6}))`.
struct PackedSequences {
  /// Self-attention: the queries and keys of each sequence start together.
  explicit PackedSequences(torch::Tensor cu_seqlens);
  /// Queries and keys of each sequence apart (cross-attention, or keys
  /// that a cache holds before the queries).
  PackedSequences(torch::Tensor cu_seqlens_q, torch::Tensor cu_seqlens_k);

  /// The queries' sequence starts `(N + 1)`.
  TORCH_ARG(torch::Tensor, cu_seqlens_q);
  /// The keys' sequence starts `(N + 1)`.
  TORCH_ARG(torch::Tensor, cu_seqlens_k);
  /// The longest sequence of queries and of keys allowed: a longer one is
  /// an error. Unset: any.
  TORCH_ARG(c10::optional<int64_t>, max_seqlen_q) = c10::nullopt;
  TORCH_ARG(c10::optional<int64_t>, max_seqlen_k) = c10::nullopt;
};

/// Construction options of the module `attn::ScaledDotProductAttention`:
/// what stays fixed across its calls. Each call's masks and causality are
/// arguments of its `forward`; the function
/// `attn::scaled_dot_product_attention` takes all of it per call, in
/// `SDPAOptions`.
///
/// Example:
/// ```
/// attn::ScaledDotProductAttention sdpa(
///     attn::ScaledDotProductAttentionOptions().dropout(0.1));
/// ```
struct ScaledDotProductAttentionOptions {
  /// Probability of zeroing an attention weight while training.
  TORCH_ARG(double, dropout) = 0.0;
  /// Multiplier of `Q·Kᵀ`; `1/sqrt(E)` when not set.
  TORCH_ARG(c10::optional<double>, scale) = c10::nullopt;
};

/// Options for the `attn::RotaryEmbedding` module (RoPE, Su et al. 2021).
///
/// Example:
/// ```
/// attn::RotaryEmbedding rope(attn::RotaryEmbeddingOptions(64).base(500000));
/// ```
struct RotaryEmbeddingOptions {
  /// Rotates the first `dim` features of each head.
  explicit RotaryEmbeddingOptions(int64_t dim);

  /// Features rotated per head: even, and at most the head width; the
  /// features after them pass through unchanged (partial rotary).
  TORCH_ARG(int64_t, dim);
  /// θ: feature pair `i` turns by `position · base^(-2i/dim)` radians.
  TORCH_ARG(double, base) = 10000.0;
  /// `false`: feature `i` pairs with `i + dim/2` (GPT-NeoX, Hugging Face
  /// Llama). `true`: feature `2i` pairs with `2i + 1` (the paper, Meta's
  /// original Llama, GPT-J).
  TORCH_ARG(bool, interleaved) = false;
};

/// Options for the `attn::MultiHeadAttention` module.
///
/// Example:
/// ```
/// attn::MultiHeadAttention mha(
///     attn::MultiHeadAttentionOptions(512, 8).dropout(0.1).bias(false));
/// ```
struct MultiHeadAttentionOptions {
  /// `kdim` and `vdim` default to `embed_dim`.
  MultiHeadAttentionOptions(int64_t embed_dim, int64_t num_heads);

  /// Model width E: the query's feature size and the output's.
  TORCH_ARG(int64_t, embed_dim);
  /// Number of heads H; must divide `embed_dim` (head width D = E / H).
  TORCH_ARG(int64_t, num_heads);
  /// Probability of zeroing an attention weight while training.
  TORCH_ARG(double, dropout) = 0.0;
  /// Whether the four projections have a bias.
  TORCH_ARG(bool, bias) = true;
  /// Feature size of the key input.
  TORCH_ARG(int64_t, kdim);
  /// Feature size of the value input.
  TORCH_ARG(int64_t, vdim);
  /// `true`: inputs and output are `(B, T, E)`; `false`: `(T, B, E)`.
  TORCH_ARG(bool, batch_first) = true;
  /// Key/value heads for grouped-query attention: must divide `num_heads`;
  /// 1 gives multi-query attention. `k_proj` and `v_proj` then produce
  /// `num_kv_heads · D` features, each shared by `num_heads / num_kv_heads`
  /// query heads without being copied. Unset: `num_heads`.
  TORCH_ARG(c10::optional<int64_t>, num_kv_heads) = c10::nullopt;
  /// Rotary position embeddings applied to queries and keys after the
  /// projections (token `t` at position `t`, or after the cached tokens
  /// with a KV cache). Unset: none.
  TORCH_ARG(c10::optional<RotaryEmbeddingOptions>, rotary) = c10::nullopt;
  /// Learned biases `bias_k`, `bias_v` appended to the keys and values as
  /// one extra key, as in `torch::nn::MultiheadAttention`.
  TORCH_ARG(bool, add_bias_kv) = false;
  /// A zero key and value appended after the others, as in
  /// `torch::nn::MultiheadAttention`.
  TORCH_ARG(bool, add_zero_attn) = false;

  /// Score modifiers (`SDPAOptions` describes each), for every forward. None
  /// combines with `add_bias_kv` or `add_zero_attn`, whose extra keys stand
  /// at no position.

  /// ALiBi with the paper's slopes for `num_heads` heads
  /// (`attn::alibi_slopes`), which are no parameters.
  TORCH_ARG(bool, alibi) = false;
  /// ALiBi's bidirectional form `-slope·|j - i|`, for encoders.
  TORCH_ARG(bool, alibi_symmetric) = false;
  /// Logit soft-capping `cap·tanh(s / cap)`. Unset: none.
  TORCH_ARG(c10::optional<double>, softcap) = c10::nullopt;
  /// A learned relative-position bias: the parameter `position_bias`
  /// `(num_heads, buckets)`, indexed as these buckets say (T5:
  /// `PositionBuckets().num_buckets(32).max_distance(128)`). Unset: none.
  TORCH_ARG(c10::optional<PositionBuckets>, position_buckets) = c10::nullopt;
  /// Attention sinks: the parameter `sinks` `(num_heads)`, one learned logit
  /// per head in every row's softmax.
  TORCH_ARG(bool, sinks) = false;
};

/// Per-call options of `attn::MultiHeadAttention::forward`.
///
/// Example:
/// ```
/// auto [out, w] = mha(x, x, x,
///     attn::MultiHeadAttentionForwardOptions().key_padding_mask(pad).need_weights(true));
/// ```
struct MultiHeadAttentionForwardOptions {
  /// `(B, S)`. Bool: `true` marks a padding key that no query attends to
  /// (the `torch::nn::MultiheadAttention` convention). Floating: added.
  TORCH_ARG(torch::Tensor, key_padding_mask) = {};
  /// `(L, S)`, `(B·H, L, S)` or `(B, H, L, S)` (size-1 B or H broadcast).
  /// Bool: `true` means *may attend*, as in `SDPAOptions::attn_mask`.
  /// Floating: added to the scores.
  TORCH_ARG(torch::Tensor, attn_mask) = {};
  /// Query `i` attends only to keys `j <= i` (with a KV cache: to the
  /// cached keys and the call's keys up to its own position).
  TORCH_ARG(bool, is_causal) = false;
  /// Sliding window: query `i` attends only to keys within `window`
  /// positions of its own; with `is_causal`, to its last `window` keys. See
  /// `SDPAOptions::window`. Unset: no window.
  TORCH_ARG(c10::optional<int64_t>, window) = c10::nullopt;
  /// Packed documents in each row of a self-attention call (key and value
  /// as long as the query): `(T)` or `(B, T)` integer ids of each token's
  /// document, nondecreasing along each row. A query attends only to keys
  /// of its own document (`is_causal` and `window` apply within it),
  /// rotary positions restart at 0 at each document, and the masks apply
  /// besides. Blocks between documents are skipped, not masked
  /// (`attn::document_mask`). Takes no `kv_cache` (see `cu_seqlens`).
  TORCH_ARG(torch::Tensor, document_ids) = {};
  /// Packed sequences in one row (the query `(1, total, E)`, or `(total,
  /// 1, E)` sequence-first):
  /// `(N + 1)` integer starts of N sequences, 0 first, nondecreasing,
  /// `total` last (FlashAttention's `cu_seqlens`). Without a `kv_cache`, as
  /// `document_ids` of one row. With one, the prompts of a ragged batch:
  /// sequence n is the cache's sequence n, its tokens appended after its
  /// own cached ones and attending to them (`is_causal` aligned at each
  /// sequence's end), positions starting at its length; the call computes
  /// no padding (`attn::varlen_attention`) and takes no masks or weights.
  /// Where sequences then stand at different positions (cached lengths that
  /// differ), ALiBi and a position table are refused.
  TORCH_ARG(torch::Tensor, cu_seqlens) = {};

 public:
  /// Incremental decoding: the call's keys and values are appended to this
  /// cache and the queries attend to every cached token, standing after
  /// them (for `is_causal`, `window` and rotary positions), each sequence
  /// after its own where their lengths differ (`KVCache::lengths()`; keys
  /// beyond a sequence's length are masked). Not owned; null: no cache.
  /// Masks then cover all cached keys: `(B, S_total)` and `(L, S_total)`,
  /// S_total the longest sequence's length after the call.
  MultiHeadAttentionForwardOptions& kv_cache(KVCache* cache) {
    kv_cache_ = cache;
    return *this;
  }
  /// The cache set with `kv_cache(KVCache*)`, or null.
  KVCache* kv_cache() const { return kv_cache_; }
  /// Whether to return the attention weights. Off by default (unlike
  /// `torch::nn::MultiheadAttention`, whose `need_weights` defaults to true):
  /// without weights the call runs on attn's fused kernels; the returned
  /// weights tensor is then undefined.
  TORCH_ARG(bool, need_weights) = false;
  /// `false`: per-head weights `(B, H, L, S)`; `true`: their mean `(B, L, S)`.
  TORCH_ARG(bool, average_attn_weights) = false;

 private:
  KVCache* kv_cache_ = nullptr;
};

} // namespace attn
