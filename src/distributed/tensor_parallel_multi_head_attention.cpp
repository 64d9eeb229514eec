#include <attn/distributed/tensor_parallel_multi_head_attention.h>

#include <attn/distributed/mappings.h>

#include "distributed/collectives.h"
#include "distributed/random_state.h"
#include "modules/multi_head_attention_forward.h"

#include <torch/torch.h>

#include <ostream>

namespace attn::distributed {

namespace {

constexpr const char* kTensorParallelCaller = "TensorParallelMultiHeadAttention";

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// A parameter copied on several ranks (a key/value head that the query
// heads of several ranks read): identity forward; backward, the sum of the
// copies' gradients, so that each copy gets the whole gradient and the
// copies stay equal. Every rank puts its gradient in its head's slot of a
// (H_kv, ...) buffer that is summed over the ranks.
struct SumOverCopies : torch::autograd::Function<SumOverCopies> {
  static torch::Tensor forward(
      AutogradContext* ctx,
      const torch::Tensor& parameter,
      int64_t slot,
      int64_t slots,
      const Group& group) {
    ctx->saved_data["slot"] = slot;
    ctx->saved_data["slots"] = slots;
    detail::save_group(ctx, group);
    return parameter.view_as(parameter);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto group = detail::saved_group(ctx);
    const auto slot = ctx->saved_data["slot"].toInt();
    auto sizes = grads[0].sizes().vec();
    sizes.insert(sizes.begin(), ctx->saved_data["slots"].toInt());
    auto buffer = grads[0].new_zeros(sizes);
    buffer[slot].copy_(grads[0]);
    return {
        detail::all_reduce_sum(buffer, group)[slot], torch::Tensor(), torch::Tensor(),
        torch::Tensor()};
  }
};

// The rank's slice of a per-head attn_mask: (B·H, L, S) and (B, H, L, S)
// hold every head; (L, S) and a size-1 H broadcast, so they pass whole.
torch::Tensor heads_of_mask(
    const torch::Tensor& mask,
    int64_t B,
    int64_t H,
    int64_t first,
    int64_t count) {
  if (!mask.defined()) {
    return mask;
  }
  if (mask.dim() == 3 && mask.size(0) == B * H && H > 1) {
    const auto sizes = mask.sizes();
    return mask.reshape({B, H, sizes[1], sizes[2]})
        .narrow(1, first, count)
        .reshape({B * count, sizes[1], sizes[2]});
  }
  if (mask.dim() == 4 && mask.size(1) == H && H > 1) {
    return mask.narrow(1, first, count);
  }
  return mask;
}

// The rank's heads and parameters, for detail::multi_head_attention_forward.
::attn::MultiHeadAttentionParameters rank_parameters(TensorParallelMultiHeadAttentionImpl& module) {
  const auto& options = module.options;
  const auto& group = module.group();
  const auto H = options.num_heads();
  const auto H_kv = options.num_kv_heads().value_or(H);
  // A key/value head copied on several ranks sums its copies' gradients.
  const auto kv_ranks = module.kv_ranks_per_head();
  const auto kv_slot = group.rank() / kv_ranks;
  const auto kv = [&](const torch::Tensor& parameter) {
    return kv_ranks == 1 || !parameter.defined()
        ? parameter
        : SumOverCopies::apply(parameter, kv_slot, H_kv, group);
  };
  auto parameters = ::attn::detail::parameters_of(
      module, module.local_heads(), module.local_kv_heads(), options.embed_dim() / H);
  for (auto* kv_parameter :
       {&parameters.k_weight, &parameters.k_bias, &parameters.v_weight, &parameters.v_bias,
        &parameters.bias_k, &parameters.bias_v}) {
    *kv_parameter = kv(*kv_parameter);
  }
  parameters.out_bias = torch::Tensor(); // added once, after the sum over ranks
  return parameters;
}

} // namespace

TensorParallelMultiHeadAttentionImpl::TensorParallelMultiHeadAttentionImpl(
    const MultiHeadAttentionOptions& options_,
    Group group)
    : TensorParallelMultiHeadAttentionImpl(MultiHeadAttention(options_), std::move(group)) {}

TensorParallelMultiHeadAttentionImpl::TensorParallelMultiHeadAttentionImpl(
    const MultiHeadAttention& full,
    Group group)
    : options(full->options), group_(std::move(group)) {
  const auto W = group_.size();
  const auto H = options.num_heads();
  const auto H_kv = options.num_kv_heads().value_or(H);
  TORCH_CHECK(
      H % W == 0, kTensorParallelCaller, ": num_heads must be divisible by the number of ranks, ",
      "got num_heads=", H, " and ", W, " ranks");
  TORCH_CHECK(
      H_kv % W == 0 || W % H_kv == 0, kTensorParallelCaller, ": num_kv_heads and the number of ",
      "ranks must divide one another, got num_kv_heads=", H_kv, " and ", W, " ranks");
  TORCH_CHECK(
      !attn::detail::has_score_modifiers(options), kTensorParallelCaller,
      ": the score modifiers are not split by heads, expected no alibi, softcap, ",
      "position_buckets or sinks");

  reset();
  torch::NoGradGuard no_grad;
  const auto whole = full->named_parameters();
  for (auto& parameter : named_parameters()) {
    parameter.value().set_data(shard(parameter.key(), whole[parameter.key()]));
  }
  stack_input_projections();
  train(full->is_training());
}

void TensorParallelMultiHeadAttentionImpl::reset() {
  const auto D = options.embed_dim() / options.num_heads();
  // The layers draw initial values that the whole module's replace.
  detail::keeping_random_state(
      [&] { register_layers(*this, options, local_heads() * D, local_kv_heads() * D); });
}

std::shared_ptr<torch::nn::Module> TensorParallelMultiHeadAttentionImpl::clone(
    const c10::optional<torch::Device>& device) const {
  return with_stacked_input_projections(Cloneable::clone(device));
}

torch::Tensor TensorParallelMultiHeadAttentionImpl::shard(
    const std::string& name,
    const torch::Tensor& whole) const {
  const auto split = split_of(name);
  const auto parts = group_.size() / split.ranks_per_part;
  const auto local = named_parameters()[name];
  TORCH_CHECK(
      whole.dim() == local.dim() && whole.size(split.dim) == local.size(split.dim) * parts,
      kTensorParallelCaller, ": ", name, " of the whole module must be ", parts, " times ",
      local.sizes(), " along dim ", split.dim, ", got ", whole.sizes());
  return whole.chunk(parts, split.dim)[group_.rank() / split.ranks_per_part].clone();
}

torch::Tensor TensorParallelMultiHeadAttentionImpl::gather(
    const std::string& name,
    const torch::Tensor& part) const {
  const auto split = split_of(name);
  // Part p comes from the first rank that holds it.
  const auto all = detail::all_gather(part, group_);
  std::vector<torch::Tensor> parts;
  for (int64_t rank = 0; rank < group_.size(); rank += split.ranks_per_part) {
    parts.push_back(all[rank]);
  }
  return torch::cat(parts, split.dim);
}

torch::Tensor TensorParallelMultiHeadAttentionImpl::squared_gradient_norm() const {
  const auto options = torch::TensorOptions().dtype(torch::kDouble).device(q_proj->weight.device());
  auto split_parts = torch::zeros({}, options);
  auto held_whole = torch::zeros({}, options);
  for (const auto& parameter : named_parameters()) {
    const auto& grad = parameter.value().grad();
    if (!grad.defined()) {
      continue;
    }
    const auto split = split_of(parameter.key());
    const auto squares = grad.to(torch::kDouble).square().sum();
    if (split.ranks_per_part == group_.size()) {
      held_whole += squares; // the same on every rank
    } else {
      split_parts += squares / split.ranks_per_part; // each copy of a part
    }
  }
  return detail::all_reduce_sum(split_parts, group_) + held_whole;
}

int64_t TensorParallelMultiHeadAttentionImpl::local_heads() const {
  return options.num_heads() / group_.size();
}

int64_t TensorParallelMultiHeadAttentionImpl::local_kv_heads() const {
  return std::max<int64_t>(options.num_kv_heads().value_or(options.num_heads()) / group_.size(), 1);
}

int64_t TensorParallelMultiHeadAttentionImpl::kv_ranks_per_head() const {
  const auto H_kv = options.num_kv_heads().value_or(options.num_heads());
  return H_kv >= group_.size() ? 1 : group_.size() / H_kv;
}

TensorParallelMultiHeadAttentionImpl::Split TensorParallelMultiHeadAttentionImpl::split_of(
    const std::string& name) const {
  if (name.rfind("q_proj.", 0) == 0) {
    return {0, 1};
  }
  if (name.rfind("k_proj.", 0) == 0 || name.rfind("v_proj.", 0) == 0) {
    return {0, kv_ranks_per_head()};
  }
  if (name == "bias_k" || name == "bias_v") {
    return {2, kv_ranks_per_head()};
  }
  if (name == "out_proj.weight") {
    return {1, 1};
  }
  TORCH_CHECK(
      name == "out_proj.bias", kTensorParallelCaller, ": no split for the parameter ", name);
  return {0, group_.size()};
}

std::tuple<torch::Tensor, torch::Tensor> TensorParallelMultiHeadAttentionImpl::forward(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const MultiHeadAttentionForwardOptions& forward_options) {
  detail::check_same_sizes(query, "the query", group_);
  // One copy_to_parallel per distinct tensor: self-attention's input gets
  // one all-reduce of its gradient, not three.
  const auto q = copy_to_parallel(query, group_);
  const auto k = key.is_same(query) ? q : copy_to_parallel(key, group_);
  const auto v = value.is_same(key) ? k
      : value.is_same(query)        ? q
                                    : copy_to_parallel(value, group_);

  const auto H = options.num_heads();
  // A query of another rank fails in the forward's checks, which name it.
  const auto B = query.dim() != 3 ? 0 : options.batch_first() ? query.size(0) : query.size(1);
  auto local_options = forward_options;
  local_options.average_attn_weights(false).attn_mask(heads_of_mask(
      forward_options.attn_mask(), B, H, group_.rank() * local_heads(), local_heads()));
  auto [partial, weights] = ::attn::detail::multi_head_attention_forward(
      q, k, v, options, rank_parameters(*this), local_options, is_training());

  auto output = reduce_from_parallel(partial, group_);
  if (out_proj->bias.defined()) {
    output = output + out_proj->bias;
  }
  if (weights.defined()) {
    weights = gather_from_parallel(weights, 1, group_); // (B, H, L, S')
    if (forward_options.average_attn_weights()) {
      weights = weights.mean(1);
    }
  }
  return {output, weights};
}

MultiHeadAttention TensorParallelMultiHeadAttentionImpl::gather() const {
  MultiHeadAttention full(options);
  full->to(q_proj->weight.device(), q_proj->weight.scalar_type());
  torch::NoGradGuard no_grad;
  auto full_parameters = full->named_parameters();
  for (const auto& parameter : named_parameters()) {
    auto& target = full_parameters[parameter.key()];
    target.copy_(gather(parameter.key(), parameter.value()));
    if (parameter.value().grad().defined()) {
      target.mutable_grad() = gather(parameter.key(), parameter.value().grad());
    }
  }
  full->train(is_training());
  return full;
}

void TensorParallelMultiHeadAttentionImpl::pretty_print(std::ostream& stream) const {
  stream << "attn::distributed::TensorParallelMultiHeadAttention(embed_dim=" << options.embed_dim()
         << ", num_heads=" << options.num_heads() << ", rank=" << group_.rank()
         << ", world_size=" << group_.size() << ", local_heads=" << local_heads()
         << ", local_kv_heads=" << local_kv_heads() << ")";
}

} // namespace attn::distributed
