#include <attn/modules/multi_head_attention.h>

#include <attn/functional.h>

#include "checks.h"
#include "kernels/math_attention.h"

#include <torch/torch.h>

#include <limits>
#include <ostream>

namespace attn {

MultiHeadAttentionOptions::MultiHeadAttentionOptions(
    int64_t embed_dim, int64_t num_heads)
    : embed_dim_(embed_dim),
      num_heads_(num_heads),
      kdim_(embed_dim),
      vdim_(embed_dim) {}

namespace {

constexpr const char* kCaller = "MultiHeadAttention";

// A bool mask in SDPA's convention (true = may attend) as an additive one.
torch::Tensor as_additive(const torch::Tensor& mask, torch::ScalarType dtype) {
  if (mask.scalar_type() != torch::kBool) {
    return mask;
  }
  return torch::zeros(
             mask.sizes(), torch::TensorOptions(dtype).device(mask.device()))
      .masked_fill(
          mask.logical_not(), -std::numeric_limits<double>::infinity());
}

// The pairs that every mask allows, each mask in SDPA's convention and
// broadcastable to (B, H, L, S); undefined ones are skipped. All bool: the
// intersection stays bool; otherwise their additive forms are summed.
torch::Tensor intersect_masks(std::initializer_list<torch::Tensor> masks,
                              torch::ScalarType dtype) {
  std::vector<torch::Tensor> defined;
  bool all_bool = true;
  for (const auto& mask : masks) {
    if (mask.defined()) {
      defined.push_back(mask);
      all_bool = all_bool && mask.scalar_type() == torch::kBool;
    }
  }
  if (defined.size() < 2) {
    return defined.empty() ? torch::Tensor() : defined.front();
  }
  auto result = all_bool ? defined.front() : as_additive(defined.front(), dtype);
  for (size_t i = 1; i < defined.size(); ++i) {
    result = all_bool ? result.logical_and(defined[i])
                      : result + as_additive(defined[i], dtype);
  }
  return result;
}

// `mask` (last dim S) with `extra` more keys that every query may see.
torch::Tensor allow_extra_keys(const torch::Tensor& mask, int64_t extra) {
  auto sizes = mask.sizes().vec();
  sizes.back() = extra;
  const auto allowed = mask.scalar_type() == torch::kBool
      ? torch::ones(sizes, mask.options())
      : torch::zeros(sizes, mask.options());
  return torch::cat({mask, allowed}, -1);
}

} // namespace

MultiHeadAttentionImpl::MultiHeadAttentionImpl(
    const MultiHeadAttentionOptions& options_)
    : options(options_) {
  reset();
}

void MultiHeadAttentionImpl::reset() {
  const auto E = options.embed_dim();
  const auto H = options.num_heads();
  const auto H_kv = options.num_kv_heads().value_or(H);
  TORCH_CHECK(E > 0, kCaller, ": embed_dim must be positive, got ", E);
  TORCH_CHECK(H > 0, kCaller, ": num_heads must be positive, got ", H);
  TORCH_CHECK(
      E % H == 0, kCaller, ": embed_dim must be divisible by num_heads, got ",
      "embed_dim=", E, " and num_heads=", H, " (remainder ", E % H, ")");
  TORCH_CHECK(
      H_kv > 0 && H % H_kv == 0, kCaller,
      ": num_kv_heads must be positive and divide num_heads, got num_heads=",
      H, " and num_kv_heads=", H_kv);
  TORCH_CHECK(
      options.kdim() > 0 && options.vdim() > 0, kCaller,
      ": kdim and vdim must be positive, got kdim=", options.kdim(),
      " and vdim=", options.vdim());
  TORCH_CHECK(
      options.dropout() >= 0.0 && options.dropout() < 1.0, kCaller,
      ": dropout must be in [0, 1), got ", options.dropout());
  const auto D = E / H;
  TORCH_CHECK(
      !options.rotary() || options.rotary()->dim() <= D, kCaller,
      ": rotary dim must be at most the head width embed_dim / num_heads = ", D,
      ", got ", options.rotary() ? options.rotary()->dim() : 0);

  using torch::nn::Linear;
  using torch::nn::LinearOptions;
  const bool bias = options.bias();
  const auto E_kv = H_kv * D;
  q_proj = register_module("q_proj", Linear(LinearOptions(E, E).bias(bias)));
  k_proj = register_module(
      "k_proj", Linear(LinearOptions(options.kdim(), E_kv).bias(bias)));
  v_proj = register_module(
      "v_proj", Linear(LinearOptions(options.vdim(), E_kv).bias(bias)));
  out_proj =
      register_module("out_proj", Linear(LinearOptions(E, E).bias(bias)));
  if (options.add_bias_kv()) {
    bias_k = register_parameter("bias_k", torch::empty({1, 1, E_kv}));
    bias_v = register_parameter("bias_v", torch::empty({1, 1, E_kv}));
  }
  if (options.rotary()) {
    rotary = register_module("rotary", RotaryEmbedding(*options.rotary()));
  }
  reset_parameters();
}

void MultiHeadAttentionImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  const auto E = options.embed_dim();
  if (options.kdim() == E && options.vdim() == E &&
      options.num_kv_heads().value_or(options.num_heads()) == options.num_heads()) {
    // The built-in initialises one packed (3E, E) matrix; draw from the same
    // distribution, whose bound depends on the packed shape.
    auto packed = torch::empty({3 * E, E}, q_proj->weight.options());
    torch::nn::init::xavier_uniform_(packed);
    const auto chunks = packed.chunk(3);
    q_proj->weight.copy_(chunks[0]);
    k_proj->weight.copy_(chunks[1]);
    v_proj->weight.copy_(chunks[2]);
  } else {
    for (const auto& projection : {q_proj, k_proj, v_proj}) {
      torch::nn::init::xavier_uniform_(projection->weight);
    }
  }
  for (const auto& projection : {q_proj, k_proj, v_proj, out_proj}) {
    if (projection->bias.defined()) {
      torch::nn::init::zeros_(projection->bias);
    }
  }
  if (options.add_bias_kv()) {
    torch::nn::init::xavier_normal_(bias_k);
    torch::nn::init::xavier_normal_(bias_v);
  }
}

std::tuple<torch::Tensor, torch::Tensor> MultiHeadAttentionImpl::forward(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const MultiHeadAttentionForwardOptions& forward_options) {
  const auto E = options.embed_dim();
  const auto H = options.num_heads();
  const auto H_kv = options.num_kv_heads().value_or(H);
  const auto D = E / H;
  const auto E_kv = H_kv * D;
  const bool batch_first = options.batch_first();
  const char* layout_q = batch_first ? "(B, L, E)" : "(L, B, E)";
  const char* layout_k = batch_first ? "(B, S, kdim)" : "(S, B, kdim)";
  const char* layout_v = batch_first ? "(B, S, vdim)" : "(S, B, vdim)";

  TORCH_CHECK(
      query.defined() && key.defined() && value.defined(), kCaller,
      ": query, key and value must be defined tensors");
  TORCH_CHECK(
      query.dim() == 3 && query.size(2) == E, kCaller, ": query must be ",
      layout_q, " with E == ", E, ", got ", query.sizes());
  TORCH_CHECK(
      key.dim() == 3 && key.size(2) == options.kdim(), kCaller,
      ": key must be ", layout_k, " with kdim == ", options.kdim(), ", got ",
      key.sizes());
  TORCH_CHECK(
      value.dim() == 3 && value.size(2) == options.vdim(), kCaller,
      ": value must be ", layout_v, " with vdim == ", options.vdim(),
      ", got ", value.sizes());

  // Batch-first views of the inputs: (B, L, E), (B, S, kdim), (B, S, vdim).
  const auto q_in = batch_first ? query : query.transpose(0, 1);
  const auto k_in = batch_first ? key : key.transpose(0, 1);
  const auto v_in = batch_first ? value : value.transpose(0, 1);
  const auto B = q_in.size(0);
  const auto L = q_in.size(1);
  TORCH_CHECK(
      k_in.size(0) == B && v_in.size(0) == B, kCaller,
      ": query, key and value must have the same batch size B, got query ",
      query.sizes(), ", key ", key.sizes(), ", value ", value.sizes());
  TORCH_CHECK(
      v_in.size(1) == k_in.size(1), kCaller,
      ": key and value must have the same length S, got key ", key.sizes(),
      ", value ", value.sizes());

  const auto& weight = q_proj->weight;
  for (const auto* input : {&query, &key, &value}) {
    TORCH_CHECK(
        input->device() == weight.device(), kCaller,
        ": inputs must be on the module's device ", weight.device(),
        ", got query on ", query.device(), ", key on ", key.device(),
        ", value on ", value.device(), " (move one with .to())");
    TORCH_CHECK(
        input->scalar_type() == weight.scalar_type(), kCaller,
        ": inputs must have the module's dtype ", weight.scalar_type(),
        ", got query ", query.scalar_type(), ", key ", key.scalar_type(),
        ", value ", value.scalar_type(), " (convert one with .to())");
  }

  const auto& window = forward_options.window();
  TORCH_CHECK(
      !window || *window > 0, kCaller,
      ": window must be a positive number of keys, got ", *window);
  KVCache* cache = forward_options.kv_cache();
  const int64_t extra_keys =
      int64_t{options.add_bias_kv()} + int64_t{options.add_zero_attn()};
  TORCH_CHECK(
      cache == nullptr || extra_keys == 0, kCaller,
      ": a kv_cache cannot be combined with add_bias_kv or add_zero_attn ",
      "(their extra key would be cached at every step)");
  // Everything is checked before the cache changes. Cached tokens stand
  // before the call's: queries start at position `past`.
  const int64_t past = cache != nullptr ? cache->length() : 0;
  // Keys that the masks cover: the cached ones and the call's.
  const int64_t S = past + k_in.size(1);

  const auto& padding = forward_options.key_padding_mask();
  if (padding.defined()) {
    detail::check_mask_dtype_and_device(
        kCaller, "key_padding_mask", padding, query);
    TORCH_CHECK(
        padding.dim() == 2 && padding.size(0) == B && padding.size(1) == S,
        kCaller, ": key_padding_mask must be (B, S) = ",
        torch::IntArrayRef({B, S}), past > 0 ? " (S counting the cached keys)" : "",
        ", got ", padding.sizes());
  }
  const auto& attn_mask = forward_options.attn_mask();
  if (attn_mask.defined()) {
    detail::check_mask_dtype_and_device(kCaller, "attn_mask", attn_mask, query);
    const auto sizes = attn_mask.sizes();
    const bool valid = (sizes == torch::IntArrayRef({L, S})) ||
        (sizes == torch::IntArrayRef({B * H, L, S})) ||
        (attn_mask.dim() == 4 && (sizes[0] == B || sizes[0] == 1) &&
         (sizes[1] == H || sizes[1] == 1) && sizes[2] == L && sizes[3] == S);
    TORCH_CHECK(
        valid, kCaller, ": attn_mask must be (L, S) = ",
        torch::IntArrayRef({L, S}), ", (B·H, L, S) = ",
        torch::IntArrayRef({B * H, L, S}), " or (B, H, L, S) = ",
        torch::IntArrayRef({B, H, L, S}), " (B and H may be 1)",
        past > 0 ? ", S counting the cached keys" : "", ", got ", sizes);
  }

  torch::Tensor q, k, v; // (B, L, E), (B, S, E_kv), (B, S, E_kv)
  if (query.is_same(key) && key.is_same(value) && options.kdim() == E &&
      options.vdim() == E && B * L >= E) {
    // Self-attention: one GEMM against the stacked weights. Stacking copies
    // (E + 2·E_kv)·E values per call, which only pays off once the inputs
    // are at least as large: a decoding step projects separately.
    const auto weight = torch::cat({q_proj->weight, k_proj->weight, v_proj->weight});
    const auto bias = options.bias()
        ? torch::cat({q_proj->bias, k_proj->bias, v_proj->bias})
        : torch::Tensor();
    const auto qkv = torch::nn::functional::linear(q_in, weight, bias);
    q = qkv.narrow(2, 0, E);
    k = qkv.narrow(2, E, E_kv);
    v = qkv.narrow(2, E + E_kv, E_kv);
  } else {
    q = q_proj(q_in);
    k = k_proj(k_in);
    v = v_proj(v_in);
  }
  // Heads by strides: (B, H, L, D) and (B, H_kv, ·, D).
  q = q.view({B, L, H, D}).transpose(1, 2);
  k = k.view({B, k.size(1), H_kv, D}).transpose(1, 2);
  v = v.view({B, v.size(1), H_kv, D}).transpose(1, 2);
  if (rotary) {
    q = rotary(q, past);
    k = rotary(k, past);
  }
  if (cache != nullptr) {
    std::tie(k, v) = cache->append(k, v);
  }
  if (options.add_bias_kv()) {
    const auto per_head = [&](const torch::Tensor& bias) {
      return bias.view({1, H_kv, 1, D}).expand({B, H_kv, 1, D});
    };
    k = torch::cat({k, per_head(bias_k)}, 2);
    v = torch::cat({v, per_head(bias_v)}, 2);
  }
  if (options.add_zero_attn()) {
    k = torch::cat({k, torch::zeros({B, H_kv, 1, D}, k.options())}, 2);
    v = torch::cat({v, torch::zeros({B, H_kv, 1, D}, v.options())}, 2);
  }

  const torch::Tensor per_pair =
      attn_mask.defined() && attn_mask.dim() == 3 ? attn_mask.reshape({B, H, L, S})
                                                  : attn_mask;
  const torch::Tensor per_key = !padding.defined() ? torch::Tensor()
      : padding.scalar_type() == torch::kBool      ? padding.logical_not().reshape({B, 1, 1, S})
                                                   : padding.reshape({B, 1, 1, S});
  auto sdpa_options = SDPAOptions()
                          .is_causal(forward_options.is_causal())
                          .window(window)
                          .query_offset(past)
                          .enable_gqa(true)
                          .dropout_p(options.dropout())
                          .training(is_training())
                          .need_weights(forward_options.need_weights());
  torch::Tensor mask;
  if (extra_keys == 0) {
    mask = intersect_masks({per_pair, per_key}, query.scalar_type());
  } else {
    // The appended keys are visible to every query, whatever the causal
    // and window rules say of their positions: those rules become a mask.
    const bool banded = forward_options.is_causal() || window;
    mask = intersect_masks(
        {per_pair, per_key,
         banded ? detail::visible_band(L, S, past, forward_options.is_causal(),
                                       window, query.device())
                : torch::Tensor()},
        query.scalar_type());
    if (mask.defined()) {
      mask = allow_extra_keys(mask, extra_keys);
    }
    sdpa_options.is_causal(false).window(c10::nullopt);
  }
  auto [heads, weights] =
      scaled_dot_product_attention(q, k, v, sdpa_options.attn_mask(mask));

  // Merge the heads straight into the caller's layout, so the output is
  // contiguous either way: (B, H, L, D) -> (B, L, E) or (L, B, E).
  const auto merged = batch_first
      ? heads.transpose(1, 2).reshape({B, L, E})
      : heads.permute({2, 0, 1, 3}).reshape({L, B, E});
  auto output = out_proj(merged);
  if (weights.defined() && forward_options.average_attn_weights()) {
    weights = weights.mean(1); // (B, L, S')
  }
  return {output, weights};
}

void MultiHeadAttentionImpl::pretty_print(std::ostream& stream) const {
  stream << std::boolalpha
         << "attn::MultiHeadAttention(embed_dim=" << options.embed_dim()
         << ", num_heads=" << options.num_heads();
  if (options.num_kv_heads()) {
    stream << ", num_kv_heads=" << *options.num_kv_heads();
  }
  stream << ", dropout=" << options.dropout() << ", bias=" << options.bias()
         << ", kdim=" << options.kdim() << ", vdim=" << options.vdim()
         << ", batch_first=" << options.batch_first();
  if (options.rotary()) {
    stream << ", rotary_dim=" << options.rotary()->dim();
  }
  if (options.add_bias_kv()) {
    stream << ", add_bias_kv=true";
  }
  if (options.add_zero_attn()) {
    stream << ", add_zero_attn=true";
  }
  stream << ")";
}

} // namespace attn
