// attn::multi_head_attention_forward: the checks of a caller's parameters,
// then the module's forward (multi_head_attention_forward.h).

#include <attn/modules/multi_head_attention_function.h>

#include "modules/multi_head_attention_forward.h"

#include <torch/torch.h>

#include <sstream>
#include <string>
#include <vector>

namespace attn {
namespace {

constexpr const char* kCaller = detail::kMultiHeadFunction.name;

std::string describe(const torch::Tensor& tensor) {
  if (!tensor.defined()) {
    return "an undefined tensor";
  }
  std::ostringstream text;
  text << tensor.sizes();
  return text.str();
}

void check_heads(const MultiHeadAttentionParameters& p) {
  TORCH_CHECK(
      p.num_heads > 0 && p.num_kv_heads > 0 && p.num_heads % p.num_kv_heads == 0 && p.head_dim > 0,
      kCaller,
      ": parameters must have num_heads H > 0, num_kv_heads H_kv > 0 dividing H and "
      "head_dim D > 0, got H=",
      p.num_heads, ", H_kv=", p.num_kv_heads, ", D=", p.head_dim);
}

// A weight of `layout` = `sizes`, and its bias: undefined or (sizes[0]).
void check_projection(
    const torch::Tensor& weight,
    const torch::Tensor& bias,
    const char* name,
    const char* layout,
    const std::vector<int64_t>& sizes) {
  TORCH_CHECK(
      weight.defined() && weight.sizes() == torch::IntArrayRef(sizes), kCaller, ": parameters.",
      name, "_weight must be ", layout, " = ", torch::IntArrayRef(sizes), ", got ",
      describe(weight));
  TORCH_CHECK(
      !bias.defined() || bias.sizes() == torch::IntArrayRef({sizes[0]}), kCaller, ": parameters.",
      name, "_bias must be undefined or (", sizes[0], "), got ", describe(bias));
}

void check_projections(
    const MultiHeadAttentionOptions& options,
    const MultiHeadAttentionParameters& p) {
  const int64_t query_width = p.num_heads * p.head_dim, kv_width = p.num_kv_heads * p.head_dim;
  check_projection(
      p.q_weight, p.q_bias, "q", "(H·D, embed_dim)", {query_width, options.embed_dim()});
  check_projection(p.k_weight, p.k_bias, "k", "(H_kv·D, kdim)", {kv_width, options.kdim()});
  check_projection(p.v_weight, p.v_bias, "v", "(H_kv·D, vdim)", {kv_width, options.vdim()});
  check_projection(
      p.out_weight, p.out_bias, "out", "(embed_dim, H·D)", {options.embed_dim(), query_width});
}

// bias_k and bias_v: (1, 1, H_kv·D) with add_bias_kv, undefined without.
void check_extra_key(
    const MultiHeadAttentionOptions& options,
    const MultiHeadAttentionParameters& p) {
  const std::vector<int64_t> sizes{1, 1, p.num_kv_heads * p.head_dim};
  for (const auto& [bias, name] :
       {std::pair{&p.bias_k, "bias_k"}, std::pair{&p.bias_v, "bias_v"}}) {
    if (options.add_bias_kv()) {
      TORCH_CHECK(
          bias->defined() && bias->sizes() == torch::IntArrayRef(sizes), kCaller, ": parameters.",
          name, " must be (1, 1, H_kv·D) = ", torch::IntArrayRef(sizes), " with add_bias_kv, got ",
          describe(*bias));
    } else {
      TORCH_CHECK(
          !bias->defined(), kCaller, ": parameters.", name,
          " is read only with add_bias_kv: set it in the options, or leave ", name,
          " undefined (got ", describe(*bias), ")");
    }
  }
}

// Every parameter in q_weight's floating dtype, on its device.
void check_dtypes_and_devices(const MultiHeadAttentionParameters& p) {
  const auto& reference = p.q_weight;
  TORCH_CHECK(
      torch::isFloatingType(reference.scalar_type()), kCaller,
      ": parameters.q_weight must have a floating-point dtype, got ", reference.scalar_type());
  const std::pair<const torch::Tensor*, const char*> tensors[] = {
      {&p.q_bias, "q_bias"},     {&p.k_weight, "k_weight"},     {&p.k_bias, "k_bias"},
      {&p.v_weight, "v_weight"}, {&p.v_bias, "v_bias"},         {&p.bias_k, "bias_k"},
      {&p.bias_v, "bias_v"},     {&p.out_weight, "out_weight"}, {&p.out_bias, "out_bias"}};
  for (const auto& [tensor, name] : tensors) {
    TORCH_CHECK(
        !tensor->defined() ||
            (tensor->scalar_type() == reference.scalar_type() &&
             tensor->device() == reference.device()),
        kCaller, ": parameters.", name, " must have q_weight's dtype ", reference.scalar_type(),
        " and device ", reference.device(), ", got ", tensor->scalar_type(), " on ",
        tensor->device());
  }
}

} // namespace

std::tuple<torch::Tensor, torch::Tensor> multi_head_attention_forward(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const MultiHeadAttentionOptions& options,
    const MultiHeadAttentionParameters& parameters,
    const MultiHeadAttentionForwardOptions& forward_options,
    bool training) {
  TORCH_CHECK(
      options.dropout() >= 0.0 && options.dropout() < 1.0, kCaller,
      ": options.dropout must be in [0, 1), got ", options.dropout());
  check_heads(parameters);
  check_projections(options, parameters);
  check_extra_key(options, parameters);
  check_dtypes_and_devices(parameters);
  detail::check_score_modifier_options(options, kCaller);
  TORCH_CHECK(
      !(parameters.alibi_slopes.defined() || parameters.position_bias.defined() ||
        parameters.sinks.defined()) ||
          (!options.add_bias_kv() && !options.add_zero_attn()),
      kCaller, ": the score modifiers (alibi_slopes, position_bias, sinks) take no add_bias_kv ",
      "or add_zero_attn, whose extra keys stand at no position");
  return detail::multi_head_attention_forward(
      query, key, value, options, parameters, forward_options, training,
      detail::kMultiHeadFunction);
}

} // namespace attn
