#include <attn/modules/multi_head_attention.h>

#include <attn/sdpa.h>

#include "modules/multi_head_attention_forward.h"
#include "modules/stacked_projection.h"

#include <torch/torch.h>

#include <ostream>

namespace attn {

MultiHeadAttentionOptions::MultiHeadAttentionOptions(int64_t embed_dim, int64_t num_heads)
    : embed_dim_(embed_dim), num_heads_(num_heads), kdim_(embed_dim), vdim_(embed_dim) {}

void MultiHeadLayers::register_layers(
    torch::nn::Module& owner,
    const MultiHeadAttentionOptions& options,
    int64_t query_width,
    int64_t kv_width) {
  using torch::nn::Linear;
  using torch::nn::LinearOptions;
  const bool bias = options.bias();
  const auto E = options.embed_dim();
  q_proj = owner.register_module("q_proj", Linear(LinearOptions(E, query_width).bias(bias)));
  k_proj = owner.register_module(
      "k_proj", Linear(LinearOptions(options.kdim(), kv_width).bias(bias)));
  v_proj = owner.register_module(
      "v_proj", Linear(LinearOptions(options.vdim(), kv_width).bias(bias)));
  out_proj = owner.register_module("out_proj", Linear(LinearOptions(query_width, E).bias(bias)));
  if (options.add_bias_kv()) {
    bias_k = owner.register_parameter("bias_k", torch::empty({1, 1, kv_width}));
    bias_v = owner.register_parameter("bias_v", torch::empty({1, 1, kv_width}));
  }
  if (options.rotary()) {
    rotary = owner.register_module("rotary", RotaryEmbedding(*options.rotary()));
  }
  const int64_t heads = query_width / (E / options.num_heads());
  if (options.position_buckets()) {
    position_bias = owner.register_parameter(
        "position_bias", torch::empty({heads, options.position_buckets()->count()}));
  }
  if (options.sinks()) {
    sinks = owner.register_parameter("sinks", torch::empty({heads}));
  }
  stack_input_projections();
}

void MultiHeadLayers::stack_input_projections() {
  // stack_rows refuses weights of different widths (kdim or vdim other than
  // E); the biases are stacked only along with the weights.
  if (detail::stack_rows({q_proj->weight, k_proj->weight, v_proj->weight}) &&
      q_proj->bias.defined()) {
    detail::stack_rows({q_proj->bias, k_proj->bias, v_proj->bias});
  }
}

std::shared_ptr<torch::nn::Module> MultiHeadLayers::with_stacked_input_projections(
    std::shared_ptr<torch::nn::Module> copy) {
  std::dynamic_pointer_cast<MultiHeadLayers>(copy)->stack_input_projections();
  return copy;
}

MultiHeadAttentionImpl::MultiHeadAttentionImpl(const MultiHeadAttentionOptions& options_)
    : options(options_) {
  reset();
}

void MultiHeadAttentionImpl::reset() {
  const auto E = options.embed_dim();
  const auto H = options.num_heads();
  const auto H_kv = options.num_kv_heads().value_or(H);
  TORCH_CHECK(E > 0, detail::kMultiHeadCaller, ": embed_dim must be positive, got ", E);
  TORCH_CHECK(H > 0, detail::kMultiHeadCaller, ": num_heads must be positive, got ", H);
  TORCH_CHECK(
      E % H == 0, detail::kMultiHeadCaller, ": embed_dim must be divisible by num_heads, got ",
      "embed_dim=", E, " and num_heads=", H, " (remainder ", E % H, ")");
  TORCH_CHECK(
      H_kv > 0 && H % H_kv == 0, detail::kMultiHeadCaller,
      ": num_kv_heads must be positive and divide num_heads, got num_heads=", H,
      " and num_kv_heads=", H_kv);
  TORCH_CHECK(
      options.kdim() > 0 && options.vdim() > 0, detail::kMultiHeadCaller,
      ": kdim and vdim must be positive, got kdim=", options.kdim(), " and vdim=", options.vdim());
  TORCH_CHECK(
      options.dropout() >= 0.0 && options.dropout() < 1.0, detail::kMultiHeadCaller,
      ": dropout must be in [0, 1), got ", options.dropout());
  const auto D = E / H;
  TORCH_CHECK(
      !options.rotary() || options.rotary()->dim() <= D, detail::kMultiHeadCaller,
      ": rotary dim must be at most the head width embed_dim / num_heads = ", D, ", got ",
      options.rotary() ? options.rotary()->dim() : 0);
  detail::check_score_modifier_options(options, detail::kMultiHeadCaller);

  register_layers(*this, options, E, H_kv * D);
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
  // Both start as no change to the scores (T5 and gpt-oss learn them from
  // their own initialisations; zero is the neutral one).
  if (position_bias.defined()) {
    torch::nn::init::zeros_(position_bias);
  }
  if (sinks.defined()) {
    torch::nn::init::zeros_(sinks);
  }
}

std::tuple<torch::Tensor, torch::Tensor> MultiHeadAttentionImpl::forward(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const MultiHeadAttentionForwardOptions& forward_options) {
  return detail::multi_head_attention_forward(
      query, key, value, options, functional_parameters(), forward_options, is_training());
}

MultiHeadAttentionParameters MultiHeadAttentionImpl::functional_parameters() const {
  const auto H = options.num_heads();
  auto parameters = detail::parameters_of(
      *this, H, options.num_kv_heads().value_or(H), options.embed_dim() / H);
  if (options.alibi()) {
    parameters.alibi_slopes = alibi_slopes(H).to(q_proj->weight.options());
  }
  return parameters;
}

void MultiHeadAttentionImpl::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  Cloneable::to(device, dtype, non_blocking);
  stack_input_projections();
}

void MultiHeadAttentionImpl::to(torch::Dtype dtype, bool non_blocking) {
  Cloneable::to(dtype, non_blocking);
  stack_input_projections();
}

void MultiHeadAttentionImpl::to(torch::Device device, bool non_blocking) {
  Cloneable::to(device, non_blocking);
  stack_input_projections();
}

void MultiHeadAttentionImpl::load(torch::serialize::InputArchive& archive) {
  Cloneable::load(archive);
  stack_input_projections();
}

std::shared_ptr<torch::nn::Module> MultiHeadAttentionImpl::clone(
    const c10::optional<torch::Device>& device) const {
  return with_stacked_input_projections(Cloneable::clone(device));
}

void MultiHeadAttentionImpl::pretty_print(std::ostream& stream) const {
  stream << std::boolalpha << "attn::MultiHeadAttention(embed_dim=" << options.embed_dim()
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
  if (options.alibi()) {
    stream << ", alibi=" << (options.alibi_symmetric() ? "symmetric" : "causal");
  }
  if (options.softcap()) {
    stream << ", softcap=" << *options.softcap();
  }
  if (options.position_buckets()) {
    stream << ", position_buckets=" << options.position_buckets()->count();
  }
  if (options.sinks()) {
    stream << ", sinks=true";
  }
  stream << ")";
}

} // namespace attn
