#pragma once

// Multi-head attention as a function of its parameters, in the steps it
// takes: check the inputs, project Q/K/V into heads, rotate them, append
// cached, bias and zero keys, combine the masks, attend, merge the heads and
// project them. attn::MultiHeadAttention's forward is a call of it with the
// module's parameters; a module that holds only some of the heads (one
// rank's share under tensor parallelism) calls it with those, and one that
// attends otherwise (over a sequence split across ranks) calls its steps.

#include <attn/modules/multi_head_layers.h>
#include <attn/modules/rotary_embedding.h>
#include <attn/options.h>

#include <torch/types.h>

#include <tuple>

namespace attn::detail {

// The name MultiHeadAttention's messages start with.
inline constexpr const char* kMultiHeadCaller = "MultiHeadAttention";

// The heads one call computes and the tensors it computes them with, in
// torch::nn::Linear's layout (out_features, in_features). A bias may be
// undefined: a projection without one (`out_bias`: or one that the caller
// adds itself, once, after summing partial outputs).
struct MultiHeadParameters {
  int64_t num_heads = 0;              // H: query heads
  int64_t num_kv_heads = 0;           // H_kv: key/value heads, dividing H
  int64_t head_dim = 0;               // D
  torch::Tensor q_weight, q_bias;     // (H·D, E), (H·D)
  torch::Tensor k_weight, k_bias;     // (H_kv·D, kdim), (H_kv·D)
  torch::Tensor v_weight, v_bias;     // (H_kv·D, vdim), (H_kv·D)
  torch::Tensor bias_k, bias_v;       // (1, 1, H_kv·D) with add_bias_kv
  torch::Tensor out_weight, out_bias; // (E, H·D), (E)
  RotaryEmbedding rotary = nullptr;   // null: no rotary positions
};

// The tensors of `layers` for `num_heads` query and `num_kv_heads`
// key/value heads of width `head_dim`.
MultiHeadParameters parameters_of(
    const MultiHeadLayers& layers,
    int64_t num_heads,
    int64_t num_kv_heads,
    int64_t head_dim);

// Queries, keys and values split into heads: (B, H, L, D), (B, H_kv, S, D).
struct ProjectedHeads {
  torch::Tensor q, k, v;
};

// The projections of batch-first `query` (B, L, E), `key` (B, S, kdim) and
// `value` (B, S, vdim) into heads, views of the projections (no copy).
// Self-attention (the same tensor thrice) projects with one GEMM.
ProjectedHeads project_heads(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const MultiHeadAttentionOptions& options,
    const MultiHeadParameters& parameters);

// (B, H, L, D) heads merged straight into the caller's layout, so that the
// output is contiguous either way: (B, L, H·D) when `batch_first`, else
// (L, B, H·D).
torch::Tensor merge_heads(const torch::Tensor& heads, bool batch_first);

// `options` gives the layout and the features (embed_dim, kdim, vdim,
// batch_first, dropout, add_bias_kv, add_zero_attn); `parameters` the
// heads. Returns (output, weights) as MultiHeadAttentionImpl::forward
// documents. Messages name `MultiHeadAttention`.
std::tuple<torch::Tensor, torch::Tensor> multi_head_attention_forward(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const MultiHeadAttentionOptions& options,
    const MultiHeadParameters& parameters,
    const MultiHeadAttentionForwardOptions& forward_options,
    bool training);

} // namespace attn::detail
