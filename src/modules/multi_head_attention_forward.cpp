#include "modules/multi_head_attention_forward.h"

#include <attn/block_mask.h>
#include <attn/kv_cache.h>
#include <attn/sdpa.h>

#include "modules/sequence_layout.h"
#include "modules/stacked_projection.h"
#include "sdpa/masks.h"
#include "sdpa/projection_attention.h"
#include "sdpa/score_modifiers.h"

#include <torch/torch.h>

#include <cmath>

namespace attn::detail {
namespace {

// The call's inputs seen batch-first: (B, L, E), (B, S, kdim), (B, S, vdim).
struct BatchFirstInputs {
  torch::Tensor query, key, value;
  int64_t B = 0, L = 0;
};

// Checks the inputs' shapes against the options; returns them batch-first.
BatchFirstInputs batch_first_inputs(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const MultiHeadAttentionOptions& options,
    const MultiHeadCaller& caller) {
  const bool batch_first = options.batch_first();
  TORCH_CHECK(
      query.defined() && key.defined() && value.defined(), caller.name,
      ": query, key and value must be defined tensors");
  TORCH_CHECK(
      query.dim() == 3 && query.size(2) == options.embed_dim(), caller.name, ": query must be ",
      batch_first ? "(B, L, E)" : "(L, B, E)", " with E == ", options.embed_dim(), ", got ",
      query.sizes());
  TORCH_CHECK(
      key.dim() == 3 && key.size(2) == options.kdim(), caller.name, ": key must be ",
      batch_first ? "(B, S, kdim)" : "(S, B, kdim)", " with kdim == ", options.kdim(), ", got ",
      key.sizes());
  TORCH_CHECK(
      value.dim() == 3 && value.size(2) == options.vdim(), caller.name, ": value must be ",
      batch_first ? "(B, S, vdim)" : "(S, B, vdim)", " with vdim == ", options.vdim(), ", got ",
      value.sizes());

  BatchFirstInputs inputs{
      batch_first ? query : query.transpose(0, 1), batch_first ? key : key.transpose(0, 1),
      batch_first ? value : value.transpose(0, 1)};
  inputs.B = inputs.query.size(0);
  inputs.L = inputs.query.size(1);
  TORCH_CHECK(
      inputs.key.size(0) == inputs.B && inputs.value.size(0) == inputs.B, caller.name,
      ": query, key and value must have the same batch size B, got query ", query.sizes(), ", key ",
      key.sizes(), ", value ", value.sizes());
  TORCH_CHECK(
      inputs.value.size(1) == inputs.key.size(1), caller.name,
      ": key and value must have the same length S, got key ", key.sizes(), ", value ",
      value.sizes());
  return inputs;
}

// The inputs must have the parameters' device and dtype.
void check_device_and_dtype(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const torch::Tensor& weight,
    const MultiHeadCaller& caller) {
  for (const auto* input : {&query, &key, &value}) {
    TORCH_CHECK(
        input->device() == weight.device(), caller.name, ": inputs must be on ", caller.owner,
        " device ", weight.device(), ", got query on ", query.device(), ", key on ", key.device(),
        ", value on ", value.device(), " (move one with .to())");
    TORCH_CHECK(
        input->scalar_type() == weight.scalar_type(), caller.name, ": inputs must have ",
        caller.owner, " dtype ", weight.scalar_type(), ", got query ", query.scalar_type(),
        ", key ", key.scalar_type(), ", value ", value.scalar_type(), " (convert one with .to())");
  }
}

// Keys appended after the call's: one for each of add_bias_kv and add_zero_attn.
int64_t extra_keys(const MultiHeadAttentionOptions& options) {
  return int64_t{options.add_bias_kv()} + int64_t{options.add_zero_attn()};
}

void check_window_and_cache(
    const MultiHeadAttentionOptions& options,
    const MultiHeadAttentionForwardOptions& forward_options,
    const MultiHeadCaller& caller) {
  const auto& window = forward_options.window();
  TORCH_CHECK(
      !window || *window > 0, caller.name, ": window must be a positive number of keys, got ",
      *window);
  TORCH_CHECK(
      forward_options.kv_cache() == nullptr || extra_keys(options) == 0, caller.name,
      ": a kv_cache cannot be combined with add_bias_kv or add_zero_attn ",
      "(their extra key would be cached at every step)");
}

// The sizes a call's masks must match: S counts the `past` cached keys
// and the call's keys.
struct MaskShape {
  int64_t B = 0, H = 0, L = 0, S = 0, past = 0;
};

void check_masks(
    const MultiHeadAttentionForwardOptions& forward_options,
    const torch::Tensor& query,
    const MaskShape& shape,
    const MultiHeadCaller& caller) {
  const auto [B, H, L, S, past] = shape;
  const auto& padding = forward_options.key_padding_mask();
  if (padding.defined()) {
    check_mask_dtype_and_device(caller.name, "key_padding_mask", padding, query);
    TORCH_CHECK(
        padding.dim() == 2 && padding.size(0) == B && padding.size(1) == S, caller.name,
        ": key_padding_mask must be (B, S) = ", torch::IntArrayRef({B, S}),
        past > 0 ? " (S counting the cached keys)" : "", ", got ", padding.sizes());
  }
  const auto& attn_mask = forward_options.attn_mask();
  if (attn_mask.defined()) {
    check_mask_dtype_and_device(caller.name, "attn_mask", attn_mask, query);
    const auto sizes = attn_mask.sizes();
    const bool valid = (sizes == torch::IntArrayRef({L, S})) ||
        (sizes == torch::IntArrayRef({B * H, L, S})) ||
        (attn_mask.dim() == 4 && (sizes[0] == B || sizes[0] == 1) &&
         (sizes[1] == H || sizes[1] == 1) && sizes[2] == L && sizes[3] == S);
    TORCH_CHECK(
        valid, caller.name, ": attn_mask must be (L, S) = ", torch::IntArrayRef({L, S}),
        ", (B·H, L, S) = ", torch::IntArrayRef({B * H, L, S}),
        " or (B, H, L, S) = ", torch::IntArrayRef({B, H, L, S}), " (B and H may be 1)",
        past > 0 ? ", S counting the cached keys" : "", ", got ", sizes);
  }
}

// The projections (B, ·, H·D) into heads, by strides.
ProjectedHeads split_heads(
    const torch::Tensor& q,
    const torch::Tensor& k,
    const torch::Tensor& v,
    const MultiHeadAttentionParameters& parameters) {
  const int64_t H = parameters.num_heads, H_kv = parameters.num_kv_heads;
  const int64_t B = q.size(0), D = parameters.head_dim;
  return {
      q.view({B, q.size(1), H, D}).transpose(1, 2), k.view({B, k.size(1), H_kv, D}).transpose(1, 2),
      v.view({B, v.size(1), H_kv, D}).transpose(1, 2)};
}

// Rotary positions: the layout's, or after the `past` cached tokens.
ProjectedHeads rotate(
    ProjectedHeads heads,
    const MultiHeadAttentionParameters& parameters,
    const SequenceLayout& layout) {
  if (parameters.rotary) {
    auto rotary = parameters.rotary; // the module caches its tables: not const
    const auto& positions = layout.positions;
    heads.q = positions.defined() ? rotary->rotate(heads.q, positions)
                                  : rotary(heads.q, layout.past);
    heads.k = positions.defined() ? rotary->rotate(heads.k, positions)
                                  : rotary(heads.k, layout.past);
    heads.qkv = torch::Tensor();
  }
  return heads;
}

// Keys and values after the call's own: the cache's before them, the bias
// key and the zero key after them.
ProjectedHeads append_keys(
    ProjectedHeads heads,
    KVCache* cache,
    const MultiHeadAttentionOptions& options,
    const MultiHeadAttentionParameters& parameters) {
  if (cache != nullptr || extra_keys(options) > 0) {
    heads.qkv = torch::Tensor();
  }
  if (cache != nullptr) {
    std::tie(heads.k, heads.v) = cache->append(heads.k, heads.v);
  }
  const int64_t B = heads.k.size(0), H_kv = parameters.num_kv_heads, D = parameters.head_dim;
  if (options.add_bias_kv()) {
    const auto per_head = [&](const torch::Tensor& bias) {
      return bias.view({1, H_kv, 1, D}).expand({B, H_kv, 1, D});
    };
    heads.k = torch::cat({heads.k, per_head(parameters.bias_k)}, 2);
    heads.v = torch::cat({heads.v, per_head(parameters.bias_v)}, 2);
  }
  if (options.add_zero_attn()) {
    heads.k = torch::cat({heads.k, torch::zeros({B, H_kv, 1, D}, heads.k.options())}, 2);
    heads.v = torch::cat({heads.v, torch::zeros({B, H_kv, 1, D}, heads.v.options())}, 2);
  }
  return heads;
}

// `sdpa_options` with the score modifiers of `options` and `parameters`.
SDPAOptions with_score_modifiers(
    SDPAOptions sdpa_options,
    const MultiHeadAttentionOptions& options,
    const MultiHeadAttentionParameters& parameters) {
  return sdpa_options.alibi_slopes(parameters.alibi_slopes)
      .alibi_symmetric(options.alibi_symmetric())
      .softcap(options.softcap())
      .position_bias(parameters.position_bias)
      .position_buckets(options.position_buckets().value_or(PositionBuckets()))
      .sinks(parameters.sinks);
}

// The module's masks as one SDPA mask over (B, H, L, S + extra keys), and
// the options of the attention call. The appended keys are visible to
// every query, whatever the causal and window rules say of their
// positions: with them, those rules become part of the mask; so they do
// with a ragged cache, whose sequences' queries stand at their own
// positions. Packed documents become a block mask.
SDPAOptions attention_options(
    const MultiHeadAttentionOptions& options,
    const MultiHeadAttentionForwardOptions& forward_options,
    const torch::Tensor& query,
    const MaskShape& shape,
    const SequenceLayout& layout,
    bool training) {
  const auto [B, H, L, S, past] = shape;
  const auto& attn_mask = forward_options.attn_mask();
  const auto& padding = forward_options.key_padding_mask();
  const auto per_pair = attn_mask.defined() && attn_mask.dim() == 3
      ? attn_mask.reshape({B, H, L, S})
      : attn_mask;
  // key_padding_mask marks padding with true; SDPA masks mark allowed pairs.
  const auto per_key = !padding.defined()     ? torch::Tensor()
      : padding.scalar_type() == torch::kBool ? padding.logical_not().reshape({B, 1, 1, S})
                                              : padding.reshape({B, 1, 1, S});
  auto sdpa_options = SDPAOptions()
                          .is_causal(forward_options.is_causal())
                          .window(forward_options.window())
                          .query_offset(past)
                          .enable_gqa(true)
                          .dropout_p(options.dropout())
                          .training(training)
                          .need_weights(forward_options.need_weights());
  if (layout.document_ids.defined() && layout.document_ids.size(0) > 0) {
    sdpa_options.block_mask(
        block_mask(document_mask(layout.document_ids), layout.document_ids.size(0), 1, L, S));
  }
  const int64_t extra = extra_keys(options);
  if (extra == 0 && layout.pasts.empty()) {
    return sdpa_options.attn_mask(intersect_masks({per_pair, per_key}, query.scalar_type()));
  }
  const bool causal = forward_options.is_causal();
  const auto& window = forward_options.window();
  const auto band = !layout.pasts.empty()
      ? ragged_cache_band(layout.pasts, L, S, causal, window, query.device())
      : causal || window ? visible_band(L, S, past, causal, window, query.device())
                         : torch::Tensor();
  auto mask = intersect_masks({per_pair, per_key, band}, query.scalar_type());
  return sdpa_options.is_causal(false)
      .window(c10::nullopt)
      .query_offset(0)
      .attn_mask(mask.defined() && extra > 0 ? allow_extra_keys(mask, extra) : mask);
}

// Packed sequences appended to the cache (cu_seqlens with a kv_cache): each
// sequence's queries attend to its cached keys and its own, as
// varlen_attention packs them, computing no padding. (1, H, L, Dv).
torch::Tensor attend_packed_to_cache(
    const ProjectedHeads& heads,
    KVCache& cache,
    const SequenceLayout& layout,
    const SDPAOptions& sdpa_options) {
  const auto packed = [](const torch::Tensor& t) { return t.squeeze(0).transpose(0, 1); };
  const auto cached = cache.append_packed(
      packed(heads.k), packed(heads.v), torch::tensor(layout.starts, torch::kLong));
  const auto out = varlen_attention(
      packed(heads.q), cached.keys, cached.values,
      PackedSequences(torch::tensor(layout.starts, torch::kLong), cached.cu_seqlens), sdpa_options);
  return out.transpose(0, 1).unsqueeze(0);
}

} // namespace

ProjectedHeads project_heads(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const MultiHeadAttentionOptions& options,
    const MultiHeadAttentionParameters& p) {
  namespace F = torch::nn::functional;
  const bool self_attention = query.is_same(key) && key.is_same(value) &&
      options.kdim() == options.embed_dim() && options.vdim() == options.embed_dim();
  // Self-attention: one GEMM against the stacked weights, a view where the
  // module keeps them stacked (stacked_projection.h). Stacking copies pays
  // off only once the inputs are at least as large as the weights: a
  // decoding step then projects separately.
  const std::vector<torch::Tensor> weights{p.q_weight, p.k_weight, p.v_weight};
  if (!self_attention ||
      (!stacked_rows(weights).defined() && query.size(0) * query.size(1) < options.embed_dim())) {
    return split_heads(
        F::linear(query, p.q_weight, p.q_bias), F::linear(key, p.k_weight, p.k_bias),
        F::linear(value, p.v_weight, p.v_bias), p);
  }
  const auto whole = stacked_linear(query, weights, {p.q_bias, p.k_bias, p.v_bias});
  const int64_t H = p.num_heads, H_kv = p.num_kv_heads, D = p.head_dim;
  if (H == H_kv) {
    const auto qkv = whole.view({query.size(0), query.size(1), 3, H, D});
    const auto heads = heads_of_projection(qkv);
    return {heads.q, heads.k, heads.v, qkv};
  }
  const auto parts = whole.split_with_sizes({H * D, H_kv * D, H_kv * D}, -1);
  return split_heads(parts[0], parts[1], parts[2], p);
}

torch::Tensor merge_heads(const torch::Tensor& heads, bool batch_first) {
  const int64_t B = heads.size(0), H = heads.size(1), L = heads.size(2);
  const int64_t features = H * heads.size(3);
  return batch_first ? heads.transpose(1, 2).reshape({B, L, features})
                     : heads.permute({2, 0, 1, 3}).reshape({L, B, features});
}

MultiHeadAttentionParameters parameters_of(
    const MultiHeadLayers& layers,
    int64_t num_heads,
    int64_t num_kv_heads,
    int64_t head_dim) {
  MultiHeadAttentionParameters parameters;
  parameters.num_heads = num_heads;
  parameters.num_kv_heads = num_kv_heads;
  parameters.head_dim = head_dim;
  parameters.q_weight = layers.q_proj->weight;
  parameters.q_bias = layers.q_proj->bias;
  parameters.k_weight = layers.k_proj->weight;
  parameters.k_bias = layers.k_proj->bias;
  parameters.v_weight = layers.v_proj->weight;
  parameters.v_bias = layers.v_proj->bias;
  parameters.bias_k = layers.bias_k;
  parameters.bias_v = layers.bias_v;
  parameters.out_weight = layers.out_proj->weight;
  parameters.out_bias = layers.out_proj->bias;
  parameters.rotary = layers.rotary;
  parameters.position_bias = layers.position_bias;
  parameters.sinks = layers.sinks;
  return parameters;
}

bool has_score_modifiers(const MultiHeadAttentionOptions& options) {
  return options.alibi() || options.softcap() || options.position_buckets() || options.sinks();
}

void check_score_modifier_options(const MultiHeadAttentionOptions& options, const char* caller) {
  TORCH_CHECK(
      !options.softcap() || (std::isfinite(*options.softcap()) && *options.softcap() > 0.0), caller,
      ": softcap must be a positive finite number, got ", options.softcap().value_or(0.0));
  if (options.position_buckets()) {
    check_position_buckets(caller, *options.position_buckets());
  }
  TORCH_CHECK(
      !has_score_modifiers(options) || (!options.add_bias_kv() && !options.add_zero_attn()), caller,
      ": the score modifiers (alibi, softcap, position_buckets, sinks) take no ",
      "add_bias_kv or add_zero_attn, whose extra keys stand at no position");
}

std::tuple<torch::Tensor, torch::Tensor> multi_head_attention_forward(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const MultiHeadAttentionOptions& options,
    const MultiHeadAttentionParameters& parameters,
    const MultiHeadAttentionForwardOptions& forward_options,
    bool training,
    const MultiHeadCaller& caller) {
  const auto inputs = batch_first_inputs(query, key, value, options, caller);
  check_device_and_dtype(query, key, value, parameters.q_weight, caller);
  check_window_and_cache(options, forward_options, caller);
  // Everything is checked before the cache changes. Cached tokens stand
  // before the call's: queries start at position `past` (each sequence's
  // own in a ragged cache), and the masks cover S keys, the cached ones
  // and the call's.
  KVCache* cache = forward_options.kv_cache();
  const auto layout = sequence_layout(
      forward_options, inputs.query, inputs.B, inputs.L, inputs.key.size(1),
      {extra_keys(options),
       parameters.alibi_slopes.defined() || parameters.position_bias.defined()},
      caller.name);
  const MaskShape mask_shape{
      inputs.B, parameters.num_heads, inputs.L, layout.past + inputs.key.size(1), layout.past};
  check_masks(forward_options, query, mask_shape, caller);

  auto heads = rotate(
      project_heads(inputs.query, inputs.key, inputs.value, options, parameters), parameters,
      layout);
  torch::Tensor attended, weights;
  if (layout.packs_cache()) {
    const auto sdpa_options = SDPAOptions()
                                  .is_causal(forward_options.is_causal())
                                  .window(forward_options.window())
                                  .dropout_p(options.dropout())
                                  .training(training);
    attended = attend_packed_to_cache(
        heads, *cache, layout, with_score_modifiers(sdpa_options, options, parameters));
  } else {
    heads = append_keys(std::move(heads), cache, options, parameters);
    const auto sdpa_options = with_score_modifiers(
        attention_options(options, forward_options, query, mask_shape, layout, training), options,
        parameters);
    std::tie(attended, weights) = heads.qkv.defined()
        ? attention_over_projection(heads.qkv, sdpa_options)
        : scaled_dot_product_attention(heads.q, heads.k, heads.v, sdpa_options);
  }

  auto output = torch::nn::functional::linear(
      merge_heads(attended, options.batch_first()), parameters.out_weight, parameters.out_bias);
  if (weights.defined() && forward_options.average_attn_weights()) {
    weights = weights.mean(1); // (B, L, S')
  }
  return {output, weights};
}

} // namespace attn::detail
