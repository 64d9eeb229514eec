#pragma once

// Multi-head attention as a function of its parameters, in the steps it
// takes: check the inputs, project Q/K/V into heads, rotate them, append
// cached, bias and zero keys, combine the masks, attend, merge the heads and
// project them. attn::MultiHeadAttention's forward is a call of it with the
// module's parameters; a module that holds only some of the heads (one
// rank's share under tensor parallelism) calls it with those, and one that
// attends otherwise (over a sequence split across ranks) calls its steps.

#include <attn/modules/multi_head_attention_function.h>
#include <attn/modules/multi_head_layers.h>
#include <attn/options.h>

#include <torch/types.h>

#include <tuple>

namespace attn::detail {

// The name MultiHeadAttention's messages start with.
inline constexpr const char* kMultiHeadCaller = "MultiHeadAttention";

// Whom a call's messages name: the module, or the public function
// (attn::multi_head_attention_forward), and whose dtype and device the
// inputs must have.
struct MultiHeadCaller {
  const char* name;
  const char* owner;
};
inline constexpr MultiHeadCaller kMultiHeadModule{kMultiHeadCaller, "the module's"};
inline constexpr MultiHeadCaller kMultiHeadFunction{
    "multi_head_attention_forward", "the parameters'"};

// The tensors of `layers` for `num_heads` query and `num_kv_heads`
// key/value heads of width `head_dim`.
MultiHeadAttentionParameters parameters_of(
    const MultiHeadLayers& layers,
    int64_t num_heads,
    int64_t num_kv_heads,
    int64_t head_dim);

// Queries, keys and values split into heads: (B, H, L, D), (B, H_kv, S, D).
// `qkv` is defined while they are the heads of one projection
// (B, L, 3, H, D): heads_of_projection(qkv) (sdpa/projection_attention.h).
struct ProjectedHeads {
  torch::Tensor q, k, v;
  torch::Tensor qkv = {};
};

// The projections of batch-first `query` (B, L, E), `key` (B, S, kdim) and
// `value` (B, S, vdim) into heads, views of the projections (no copy).
// Self-attention (the same tensor thrice) projects with one GEMM, whose
// product is `qkv` where there are as many key/value heads as query heads.
ProjectedHeads project_heads(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const MultiHeadAttentionOptions& options,
    const MultiHeadAttentionParameters& parameters);

// (B, H, L, D) heads merged straight into the caller's layout, so that the
// output is contiguous either way: (B, L, H·D) when `batch_first`, else
// (L, B, H·D).
torch::Tensor merge_heads(const torch::Tensor& heads, bool batch_first);

// The options' score modifiers: a positive finite softcap, position
// buckets that can index a table, and none with add_bias_kv or
// add_zero_attn. `caller` prefixes the messages.
void check_score_modifier_options(const MultiHeadAttentionOptions& options, const char* caller);

// Whether the options ask for any score modifier.
bool has_score_modifiers(const MultiHeadAttentionOptions& options);

// attn::multi_head_attention_forward with `parameters` already checked
// (a module's own, or the public function's after its checks); messages
// name `caller`.
std::tuple<torch::Tensor, torch::Tensor> multi_head_attention_forward(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const MultiHeadAttentionOptions& options,
    const MultiHeadAttentionParameters& parameters,
    const MultiHeadAttentionForwardOptions& forward_options,
    bool training,
    const MultiHeadCaller& caller = kMultiHeadModule);

} // namespace attn::detail
