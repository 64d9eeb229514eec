#pragma once

/// \file
/// The key/value cache of incremental (token-by-token) decoding.

#include <torch/types.h>

#include <cstdint>
#include <utility>

namespace attn {

/// Keys and values of the tokens decoded so far, per batch element and
/// key/value head, so that each decoding step projects only its new tokens.
/// `attn::MultiHeadAttention` appends to it when one is passed in
/// `MultiHeadAttentionForwardOptions::kv_cache`; it is meant for
/// self-attention, where each call's keys are the new tokens' own. Every
/// sequence of a batch advances together: positions (for causal masking and
/// rotary embeddings) are the cache's length, the same for all of them.
///
/// The first `append` fixes the batch size, heads, feature sizes, dtype and
/// device until `reset()`; later appends must match them. Without a
/// maximum length the storage grows by doubling; with one it is allocated
/// once, for that many tokens, and an append that would exceed it fails.
/// The cache holds inference state: appending tensors that require grad
/// while grad mode is on is an error (decode under `torch::NoGradGuard`).
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

  /// Appends keys `(B, H, T, D)` and values `(B, H, T, Dv)` and returns
  /// every cached key and value, `(B, H, length(), D)` and
  /// `(B, H, length(), Dv)`: views of the cache's storage, valid until the
  /// next append or reset.
  std::pair<torch::Tensor, torch::Tensor> append(
      const torch::Tensor& keys,
      const torch::Tensor& values);

  /// Tokens cached so far.
  int64_t length() const { return length_; }
  /// The maximum length given at construction; 0 when it grows on demand.
  int64_t max_length() const { return max_length_; }
  /// The cached keys `(B, H, length(), D)`; undefined before the first
  /// append, empty after `reset()`.
  torch::Tensor keys() const;
  /// The cached values `(B, H, length(), Dv)`; undefined before the first
  /// append, empty after `reset()`.
  torch::Tensor values() const;

  /// Forgets every token and the shapes the first append fixed; storage
  /// of the same shape is reused by the next sequence.
  void reset();

 private:
  torch::Tensor keys_, values_; // storage (B, H, capacity, ·)
  int64_t length_ = 0;
  int64_t max_length_ = 0;
};

} // namespace attn
