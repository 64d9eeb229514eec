#pragma once

/// \file
/// Scaled dot-product attention as functions on tensors: dense, over packed
/// sequences, the backend a call runs, and ALiBi's slopes.

#include <attn/backend.h>
#include <attn/options.h>

#include <torch/types.h>

#include <tuple>

namespace attn {

/// `softmax(Q·Kᵀ·scale + mask)·V`, returning `(output, weights)`; the
/// weights only when `options.need_weights()` asks for them (off by
/// default), else an undefined tensor.
///
/// Shapes: query `(..., L, E)`, key `(..., S, E)`, value `(..., S, Ev)` with
/// identical leading dims (with `enable_gqa`, key and value may have fewer
/// heads in dim -3); output `(..., L, Ev)`, weights `(..., L, S)`. Masks,
/// `is_causal`, `window` and `query_offset` combine as `SDPAOptions`
/// describes.
/// A query row whose keys are all masked gets zero weights and a zero output
/// (not NaN), with finite gradients. The returned weights are the ones that
/// multiplied V, so they include dropout when it is active.
///
/// Example:
/// ```
/// auto [out, none] = attn::scaled_dot_product_attention(q, k, v);
/// auto [out2, w] = attn::scaled_dot_product_attention(
///     q, k, v, attn::SDPAOptions().need_weights(true));
/// ```
std::tuple<torch::Tensor, torch::Tensor> scaled_dot_product_attention(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const SDPAOptions& options = {});

/// Attention over packed sequences (FlashAttention-2's variable-length
/// form): query `(total_q, H, E)`, key `(total_k, Hkv, E)` and value
/// `(total_k, Hkv, Ev)` hold the sequences one after the other, as
/// `sequences` delimits them; sequence n's queries attend to its own keys
/// only, and no padding is computed. `Hkv` must divide `H` (grouped-query
/// heads, no copy). Returns `(total_q, H, Ev)`, differentiable in query,
/// key, value and the score modifiers' tensors.
///
/// From `options`: `is_causal` and `window` apply within each sequence,
/// aligned at its bottom-right corner where its query and key lengths
/// differ (query i of a sequence of L queries and S keys stands at key
/// position i + S - L); scale, dropout, soft cap, sinks, a score function
/// (whose i and j are packed indices) and a backend (attn's; `libtorch`
/// takes no block mask). ALiBi and a
/// relative-position table need each sequence's queries and keys to start
/// together (equal `cu_seqlens_q` and `cu_seqlens_k`). attn_mask,
/// block_mask, query_offset and need_weights are refused.
///
/// Example: three documents of 3, 2 and 1 tokens, causal within each.
/// ```
/// const auto starts = torch::tensor({0, 3, 5, 6}, torch::kLong);
/// auto out = attn::varlen_attention(
///     q, k, v, attn::PackedSequences(starts), attn::SDPAOptions().is_causal(true));
/// ```
torch::Tensor varlen_attention(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const PackedSequences& sequences,
    const SDPAOptions& options = {});

/// The backend that `attn::scaled_dot_product_attention(query, key, value,
/// options)` runs, under the current grad mode. Throws the `c10::Error` that
/// call would throw for invalid arguments, including a requested
/// `options.backend()` that cannot run the request. Unless one is
/// requested, the first of these rules (docs/BACKENDS.md, the one table of
/// their conditions and measurements) whose backend can compute the
/// request chooses: `cpu-libtorch-faster` (`libtorch` on the CPU where it
/// was measured faster), `cpu-short-heads` (`fused_cpu`),
/// `cpu-short-sequences` (`batched_cpu`), `cpu-weights-for-inference`
/// (`fused_cpu_weights`), `cpu-weights-with-gradients` (`batched_cpu`),
/// `cpu-fused` (`fused_cpu`), `cuda-libtorch` (`libtorch`), `math`.
///
/// Example:
/// ```
/// std::cout << attn::select_backend(q, k, v, attn::SDPAOptions().is_causal(true));
/// ```
AttentionBackend select_backend(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const SDPAOptions& options = {});

/// ALiBi's slopes for `num_heads` heads (Press et al. 2022): for n a power
/// of 2, `2^(-8k/n)` for head k = 1..n; otherwise those of the power of 2
/// below, then every other slope of twice that power, as the paper's code
/// gives them. Float32, `(num_heads)`, for `SDPAOptions::alibi_slopes`.
torch::Tensor alibi_slopes(int64_t num_heads);

} // namespace attn
