#include <attn/modules/multi_head_attention.h>

#include <attn/functional.h>

#include "../checks.h"

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

// One mask in SDPA's convention, broadcastable to (B, H, L, S), from the
// per-pair attn_mask and the per-key key_padding_mask (either may be
// undefined). Both bool: their intersection stays bool; otherwise additive.
torch::Tensor merge_masks(
    const torch::Tensor& attn_mask,
    const torch::Tensor& key_padding_mask,
    int64_t B,
    int64_t H,
    int64_t L,
    int64_t S,
    torch::ScalarType dtype) {
  torch::Tensor per_pair;
  if (attn_mask.defined()) {
    per_pair = attn_mask.dim() == 3 ? attn_mask.reshape({B, H, L, S})
                                    : attn_mask;
  }
  torch::Tensor per_key;
  if (key_padding_mask.defined()) {
    const auto padding = key_padding_mask.reshape({B, 1, 1, S});
    per_key = padding.scalar_type() == torch::kBool ? padding.logical_not()
                                                     : padding;
  }
  if (!per_pair.defined() || !per_key.defined()) {
    return per_pair.defined() ? per_pair : per_key;
  }
  if (per_pair.scalar_type() == torch::kBool &&
      per_key.scalar_type() == torch::kBool) {
    return per_pair.logical_and(per_key);
  }
  return as_additive(per_pair, dtype) + as_additive(per_key, dtype);
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
  TORCH_CHECK(E > 0, kCaller, ": embed_dim must be positive, got ", E);
  TORCH_CHECK(H > 0, kCaller, ": num_heads must be positive, got ", H);
  TORCH_CHECK(
      E % H == 0, kCaller, ": embed_dim must be divisible by num_heads, got ",
      "embed_dim=", E, " and num_heads=", H, " (remainder ", E % H, ")");
  TORCH_CHECK(
      options.kdim() > 0 && options.vdim() > 0, kCaller,
      ": kdim and vdim must be positive, got kdim=", options.kdim(),
      " and vdim=", options.vdim());
  TORCH_CHECK(
      options.dropout() >= 0.0 && options.dropout() < 1.0, kCaller,
      ": dropout must be in [0, 1), got ", options.dropout());

  using torch::nn::Linear;
  using torch::nn::LinearOptions;
  const bool bias = options.bias();
  q_proj = register_module("q_proj", Linear(LinearOptions(E, E).bias(bias)));
  k_proj = register_module(
      "k_proj", Linear(LinearOptions(options.kdim(), E).bias(bias)));
  v_proj = register_module(
      "v_proj", Linear(LinearOptions(options.vdim(), E).bias(bias)));
  out_proj =
      register_module("out_proj", Linear(LinearOptions(E, E).bias(bias)));
  reset_parameters();
}

void MultiHeadAttentionImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  const auto E = options.embed_dim();
  if (options.kdim() == E && options.vdim() == E) {
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
}

std::tuple<torch::Tensor, torch::Tensor> MultiHeadAttentionImpl::forward(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const MultiHeadAttentionForwardOptions& forward_options) {
  const auto E = options.embed_dim();
  const auto H = options.num_heads();
  const auto D = E / H;
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
  const auto S = k_in.size(1);
  TORCH_CHECK(
      k_in.size(0) == B && v_in.size(0) == B, kCaller,
      ": query, key and value must have the same batch size B, got query ",
      query.sizes(), ", key ", key.sizes(), ", value ", value.sizes());
  TORCH_CHECK(
      v_in.size(1) == S, kCaller,
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

  const auto& padding = forward_options.key_padding_mask();
  if (padding.defined()) {
    detail::check_mask_dtype_and_device(
        kCaller, "key_padding_mask", padding, query);
    TORCH_CHECK(
        padding.dim() == 2 && padding.size(0) == B && padding.size(1) == S,
        kCaller, ": key_padding_mask must be (B, S) = ",
        torch::IntArrayRef({B, S}), ", got ", padding.sizes());
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
        torch::IntArrayRef({B, H, L, S}), " (B and H may be 1), got ", sizes);
  }

  torch::Tensor q, k, v; // (B, H, L or S, D) views of the projections
  if (query.is_same(key) && key.is_same(value) && options.kdim() == E &&
      options.vdim() == E) {
    // Self-attention: one GEMM against the stacked weights.
    const auto weight = torch::cat({q_proj->weight, k_proj->weight, v_proj->weight});
    const auto bias = options.bias()
        ? torch::cat({q_proj->bias, k_proj->bias, v_proj->bias})
        : torch::Tensor();
    const auto qkv = torch::nn::functional::linear(q_in, weight, bias)
                         .view({B, L, 3, H, D}); // (B, L, 3, H, D)
    q = qkv.select(2, 0).transpose(1, 2);
    k = qkv.select(2, 1).transpose(1, 2);
    v = qkv.select(2, 2).transpose(1, 2);
  } else {
    q = q_proj(q_in).view({B, L, H, D}).transpose(1, 2);
    k = k_proj(k_in).view({B, S, H, D}).transpose(1, 2);
    v = v_proj(v_in).view({B, S, H, D}).transpose(1, 2);
  }
  auto [heads, weights] = scaled_dot_product_attention(
      q, k, v,
      SDPAOptions()
          .attn_mask(merge_masks(
              attn_mask, padding, B, H, L, S, query.scalar_type()))
          .is_causal(forward_options.is_causal())
          .dropout_p(options.dropout())
          .training(is_training())
          .need_weights(forward_options.need_weights()));

  // Merge the heads straight into the caller's layout, so the output is
  // contiguous either way: (B, H, L, D) -> (B, L, E) or (L, B, E).
  const auto merged = batch_first
      ? heads.transpose(1, 2).reshape({B, L, E})
      : heads.permute({2, 0, 1, 3}).reshape({L, B, E});
  auto output = out_proj(merged);
  if (weights.defined() && forward_options.average_attn_weights()) {
    weights = weights.mean(1); // (B, L, S)
  }
  return {output, weights};
}

void MultiHeadAttentionImpl::pretty_print(std::ostream& stream) const {
  stream << std::boolalpha
         << "attn::MultiHeadAttention(embed_dim=" << options.embed_dim()
         << ", num_heads=" << options.num_heads()
         << ", dropout=" << options.dropout() << ", bias=" << options.bias()
         << ", kdim=" << options.kdim() << ", vdim=" << options.vdim()
         << ", batch_first=" << options.batch_first() << ")";
}

} // namespace attn
