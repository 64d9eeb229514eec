#pragma once

/// \file
/// Option structs for attn's functions and modules, in the style of
/// `torch::nn`: every field is a chainable `TORCH_ARG` with a default.

#include <attn/backend.h>

#include <torch/arg.h>
#include <torch/types.h>

#include <cstdint>

namespace attn {

class KVCache;

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

 public:
  /// Incremental decoding: the call's keys and values are appended to this
  /// cache and the queries attend to every cached token, standing after
  /// them (for `is_causal`, `window` and rotary positions). Not owned; null:
  /// no cache. Masks then cover all cached keys: `(B, S_total)` and
  /// `(L, S_total)`.
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
