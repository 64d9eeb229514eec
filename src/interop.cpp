#include <attn/interop.h>

#include <torch/torch.h>

#include <utility>
#include <vector>

namespace attn {
namespace {

// The built-in's parameters paired with ours: (built-in view, our tensor).
// Views alias the built-in's packed storage, so copying into them writes it.
std::vector<std::pair<torch::Tensor, torch::Tensor>> paired_parameters(
    const torch::nn::MultiheadAttentionImpl& builtin,
    const MultiHeadAttentionImpl& ours) {
  const auto& theirs = builtin.options;
  const auto& mine = ours.options;
  TORCH_CHECK(
      theirs.embed_dim() == mine.embed_dim() &&
          theirs.num_heads() == mine.num_heads() &&
          theirs.kdim() == mine.kdim() && theirs.vdim() == mine.vdim() &&
          theirs.bias() == mine.bias(),
      "copy_weights: modules differ; torch::nn::MultiheadAttention has ",
      "embed_dim=", theirs.embed_dim(), ", num_heads=", theirs.num_heads(),
      ", kdim=", theirs.kdim(), ", vdim=", theirs.vdim(),
      ", bias=", theirs.bias(), " but attn::MultiHeadAttention has ",
      "embed_dim=", mine.embed_dim(), ", num_heads=", mine.num_heads(),
      ", kdim=", mine.kdim(), ", vdim=", mine.vdim(), ", bias=", mine.bias());
  TORCH_CHECK(
      !theirs.add_bias_kv() && !theirs.add_zero_attn(),
      "copy_weights: torch::nn::MultiheadAttention with add_bias_kv=",
      theirs.add_bias_kv(), " and add_zero_attn=", theirs.add_zero_attn(),
      " has no attn::MultiHeadAttention counterpart; both must be false");

  std::vector<torch::Tensor> projections;
  if (builtin._qkv_same_embed_dim) {
    projections = builtin.in_proj_weight.chunk(3);
  } else {
    projections = {
        builtin.q_proj_weight, builtin.k_proj_weight, builtin.v_proj_weight};
  }
  std::vector<std::pair<torch::Tensor, torch::Tensor>> pairs = {
      {projections[0], ours.q_proj->weight},
      {projections[1], ours.k_proj->weight},
      {projections[2], ours.v_proj->weight},
      {builtin.out_proj->weight, ours.out_proj->weight}};
  if (mine.bias()) {
    const auto biases = builtin.in_proj_bias.chunk(3);
    pairs.insert(
        pairs.end(),
        {{biases[0], ours.q_proj->bias},
         {biases[1], ours.k_proj->bias},
         {biases[2], ours.v_proj->bias},
         {builtin.out_proj->bias, ours.out_proj->bias}});
  }
  return pairs;
}

} // namespace

void copy_weights(
    const torch::nn::MultiheadAttentionImpl& source,
    MultiHeadAttentionImpl& target) {
  torch::NoGradGuard no_grad;
  for (const auto& [builtin, ours] : paired_parameters(source, target)) {
    ours.copy_(builtin);
  }
}

void copy_weights(
    const MultiHeadAttentionImpl& source,
    torch::nn::MultiheadAttentionImpl& target) {
  torch::NoGradGuard no_grad;
  for (const auto& [builtin, ours] : paired_parameters(target, source)) {
    builtin.copy_(ours);
  }
}

} // namespace attn
