#pragma once

/// \file
/// The key/value cache of incremental (token-by-token) decoding.

#include <torch/types.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace attn {

/// Keys and values of the tokens decoded so far, per batch element and
/// key/value head, so that each decoding step projects only its new tokens.
/// `attn::MultiHeadAttention` appends to it when one is passed in
/// `MultiHeadAttentionForwardOptions::kv_cache`; it is meant for
/// self-attention, where each call's keys are the new tokens' own. Each
/// sequence's new tokens stand after its cached ones: positions (for causal
/// masking and rotary embeddings) start at its length.
///
/// The first `append` fixes the batch size, heads, feature sizes, dtype and
/// device until `reset()`; later appends must match them. Without a
/// maximum length the storage grows by doubling; with one it is allocated
/// once, for that many tokens, and an append that would exceed it fails.
/// The cache holds inference state: appending tensors that require grad
/// while grad mode is on is an error (decode under `torch::NoGradGuard`).
///
/// Prompts of different lengths are prefilled packed, with no padding:
/// `append_packed` (or `MultiHeadAttention` given the prompts' `cu_seqlens`
/// with the cache) gives each sequence its own length; later appends add
/// the same number of tokens to each, after its own last one, and
/// `MultiHeadAttention` masks each sequence's keys beyond its length.
///
/// A cache is not thread-safe: calls that use one cache (an append, or a
/// `MultiHeadAttention` forward given it) must not overlap. Decode each
/// sequence with its own cache — one `MultiHeadAttention` may serve several
/// threads for inference, each with its own caches — or make the threads
/// take turns. A cache is not checked for overlapping calls.
///
/// Example:
/// ```
/// attn::KVCache cache(/*max_length=*/2048);
/// torch::NoGradGuard no_grad;
/// mha->eval();  // no dropout while decoding
/// auto options = attn::MultiHeadAttentionForwardOptions().kv_cache(&cache).is_causal(true);
/// auto [out, w] = mha(prompt, prompt, prompt, options);  // (B, P, E)
/// for (int step = 0; step < steps; ++step) {
///   auto token = next_token_embedding(out);               // (B, 1, E)
///   std::tie(out, w) = mha(token, token, token, options);
/// }
/// ```
/// Every cached key and value of each sequence, packed one sequence after
/// the other: `(total, H, D)` and `(total, H, Dv)`, sequence n's tokens
/// from `cu_seqlens[n]` to `cu_seqlens[n + 1]` (int64, on the CPU), the
/// form `attn::varlen_attention` takes.
struct PackedKeysValues {
  torch::Tensor keys, values, cu_seqlens;
};

class KVCache {
 public:
  /// A cache that grows on demand.
  KVCache() = default;
  /// A cache for at most `max_length` tokens (positive).
  explicit KVCache(int64_t max_length);

  /// Not copyable: two caches sharing storage would overwrite each other's
  /// tokens. Use `clone()` to branch a sequence (beam search, speculative
  /// decoding).
  KVCache(const KVCache&) = delete;
  KVCache& operator=(const KVCache&) = delete;
  /// Takes over `other`'s tokens and storage; `other` is left empty.
  KVCache(KVCache&& other) noexcept;
  /// Takes over `other`'s tokens and storage; `other` is left empty.
  KVCache& operator=(KVCache&& other) noexcept;

  /// An independent cache holding a copy of this one's tokens, with the same
  /// maximum length.
  KVCache clone() const;

  /// Appends keys `(B, H, T, D)` and values `(B, H, T, Dv)` (sequence b's
  /// T tokens after its own last) and returns every cached key and value,
  /// `(B, H, length(), D)` and `(B, H, length(), Dv)`: views of the cache's
  /// storage, valid until the next append or reset.
  std::pair<torch::Tensor, torch::Tensor> append(
      const torch::Tensor& keys,
      const torch::Tensor& values);

  /// Appends packed keys `(total, H, D)` and values `(total, H, Dv)` of N
  /// sequences, sequence n's from `cu_seqlens[n]` to `cu_seqlens[n + 1]`
  /// (N + 1 integers, 0 first, nondecreasing, `total` last), each after
  /// its own last token; the first append fixes B = N. Returns every
  /// cached key and value of each sequence, packed (a copy).
  PackedKeysValues append_packed(
      const torch::Tensor& keys,
      const torch::Tensor& values,
      const torch::Tensor& cu_seqlens);

  /// Tokens cached so far: the longest sequence's where they differ.
  int64_t length() const { return length_; }
  /// Tokens cached so far in each sequence (B of them; none before the
  /// first append and after `reset()`).
  const std::vector<int64_t>& lengths() const { return lengths_; }
  /// Whether the sequences hold different numbers of tokens.
  bool ragged() const;
  /// The maximum length given at construction; 0 when it grows on demand.
  int64_t max_length() const { return max_length_; }
  /// The cached keys `(B, H, length(), D)`; undefined before the first
  /// append, empty after `reset()`. Beyond a sequence's own length it holds
  /// zeros, which attention must mask.
  torch::Tensor keys() const;
  /// The cached values `(B, H, length(), Dv)`; undefined before the first
  /// append, empty after `reset()`.
  torch::Tensor values() const;

  /// Forgets every token and the shapes the first append fixed; storage
  /// of the same shape is reused by the next sequence.
  void reset();

 private:
  // Storage for `needed` tokens per sequence shaped like `keys` and
  // `values` ((B, H, ·, F) sizes), keeping the cached tokens.
  void reserve(
      torch::IntArrayRef key_sizes,
      torch::IntArrayRef value_sizes,
      const torch::TensorOptions& options,
      int64_t needed);

  // Where sequences differ in length, zeros past each one's tokens up to
  // the longest's: keys() then holds no uninitialised memory (a masked
  // key's weight is 0, and 0 times a NaN would not be).
  void zero_past_each_sequence();

  torch::Tensor keys_, values_; // storage (B, H, capacity, ·)
  std::vector<int64_t> lengths_;
  int64_t length_ = 0; // the longest of lengths_ (and the count of a batch of 0)
  int64_t max_length_ = 0;
};

} // namespace attn
