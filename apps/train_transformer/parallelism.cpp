#include "parallelism.h"

#include <attn/modules/multi_head_attention.h>

#if ATTN_TRAIN_TENSOR_PARALLEL
#include <attn/distributed/process_group.h>
#include <attn/distributed/tensor_parallel_multi_head_attention.h>
#endif

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace train {

#if ATTN_TRAIN_TENSOR_PARALLEL
using SplitLayer = attn::distributed::TensorParallelMultiHeadAttentionImpl;

struct Parallelism::Ranks {
  attn::distributed::Group group;
};

Parallelism::Parallelism(bool tensor_parallel) {
  if (tensor_parallel) {
    ranks_ = std::make_unique<Ranks>(Ranks{attn::distributed::init_process_group()});
  }
}

int64_t Parallelism::rank() const {
  return ranks_ ? ranks_->group.rank() : 0;
}

int64_t Parallelism::world_size() const {
  return ranks_ ? ranks_->group.size() : 1;
}
#else
// Built without attn::distributed: no layer is ever split, and this type
// only lets the code below compile.
struct SplitLayer : torch::nn::Module {
  torch::Tensor gather(const std::string&, const torch::Tensor& part) const { return part; }
  torch::Tensor shard(const std::string&, const torch::Tensor& whole) const { return whole; }
  torch::Tensor squared_gradient_norm() const { return {}; }
};

struct Parallelism::Ranks {};

Parallelism::Parallelism(bool tensor_parallel) {
  TORCH_CHECK(
      !tensor_parallel,
      "--tensor-parallel needs attn::distributed, which this build of attn does not have "
      "(its LibTorch has no c10d, or ATTN_DISTRIBUTED is OFF)");
}

int64_t Parallelism::rank() const {
  return 0;
}

int64_t Parallelism::world_size() const {
  return 1;
}
#endif

Parallelism::~Parallelism() = default;
Parallelism::Parallelism(Parallelism&&) noexcept = default;
Parallelism& Parallelism::operator=(Parallelism&&) noexcept = default;

namespace {

// A parameter of the model and, where a tensor-parallel layer holds a
// share of it, that layer and the parameter's name there.
struct Located {
  std::string name;
  torch::Tensor tensor;
  const SplitLayer* layer = nullptr;
  std::string name_in_layer;
};

std::vector<Located> locate_parameters(const torch::nn::Module& model) {
  std::vector<std::pair<std::string, const SplitLayer*>> layers;
  for (const auto& module : model.named_modules()) {
    if (const auto* layer = module.value()->as<SplitLayer>()) {
      layers.emplace_back(module.key() + ".", layer);
    }
  }
  std::vector<Located> located;
  for (const auto& parameter : model.named_parameters()) {
    Located entry;
    entry.name = parameter.key();
    entry.tensor = parameter.value();
    for (const auto& [prefix, layer] : layers) {
      if (parameter.key().rfind(prefix, 0) == 0) {
        entry.layer = layer;
        entry.name_in_layer = parameter.key().substr(prefix.size());
      }
    }
    located.push_back(std::move(entry));
  }
  return located;
}

// Optimizers key their state by the parameter's TensorImpl: in LibTorch
// 1.x by its address printed to a string, in 2.x by the pointer.
template <typename StateMap>
typename StateMap::key_type state_key(const StateMap& /*state*/, const torch::Tensor& parameter) {
  if constexpr (std::is_same_v<typename StateMap::key_type, std::string>) {
    std::ostringstream address;
    address << parameter.unsafeGetTensorImpl();
    return address.str();
  } else {
    return parameter.unsafeGetTensorImpl();
  }
}

// Copies AdamW's state of `from` (in `source`) to `to` (in `target`), each
// moment passed through `convert`. The trainer gathers and shards after its
// first step, when every parameter has its moments.
template <typename Convert>
void copy_adamw_state(
    const torch::optim::AdamW& source,
    const Located& from,
    torch::optim::AdamW& target,
    const torch::Tensor& to,
    const Convert& convert) {
  const auto& states = source.state();
  const auto found = states.find(state_key(states, from.tensor));
  TORCH_CHECK(
      found != states.end(), "train_transformer: no optimizer state for ", from.name,
      " (expected moments for every parameter after the first step)");
  const auto& state = static_cast<const torch::optim::AdamWParamState&>(*found->second);
  auto copy = std::make_unique<torch::optim::AdamWParamState>();
  copy->step(state.step());
  copy->exp_avg(convert(state.exp_avg()));
  copy->exp_avg_sq(convert(state.exp_avg_sq()));
  if (state.max_exp_avg_sq().defined()) {
    copy->max_exp_avg_sq(convert(state.max_exp_avg_sq()));
  }
  auto& target_states = target.state();
  target_states[state_key(target_states, to)] = std::move(copy);
}

} // namespace

torch::nn::AnyModule Parallelism::attention(const attn::MultiHeadAttentionOptions& options) const {
  attn::MultiHeadAttention whole(options);
#if ATTN_TRAIN_TENSOR_PARALLEL
  if (ranks_) {
    return torch::nn::AnyModule(
        attn::distributed::TensorParallelMultiHeadAttention(whole, ranks_->group));
  }
#endif
  return torch::nn::AnyModule(whole);
}

double Parallelism::clip_gradients(torch::nn::Module& model, double max_norm) const {
  torch::NoGradGuard no_grad;
  const auto parameters = locate_parameters(model);
  if (parameters.empty()) {
    return 0.0;
  }
  // Summed where the gradients are: one transfer to the host, not one per
  // parameter.
  auto squared_norm = torch::zeros(
      {}, torch::TensorOptions().dtype(torch::kDouble).device(parameters.front().tensor.device()));
  std::vector<const SplitLayer*> counted;
  for (const auto& parameter : parameters) {
    if (parameter.layer) {
      if (std::find(counted.begin(), counted.end(), parameter.layer) == counted.end()) {
        squared_norm += parameter.layer->squared_gradient_norm();
        counted.push_back(parameter.layer);
      }
    } else if (parameter.tensor.grad().defined()) {
      squared_norm += parameter.tensor.grad().to(torch::kDouble).square().sum();
    }
  }
  const double norm = std::sqrt(squared_norm.item<double>());
  // torch::nn::utils::clip_grad_norm_'s rule.
  const double scale = max_norm / (norm + 1e-6);
  if (scale < 1.0) {
    for (auto& parameter : model.parameters()) {
      if (parameter.grad().defined()) {
        parameter.grad().mul_(scale);
      }
    }
  }
  return norm;
}

void Parallelism::gather(
    const torch::nn::Module& model,
    const torch::optim::AdamW& optimizer,
    torch::nn::Module& whole_model,
    torch::optim::AdamW& whole_optimizer) const {
  torch::NoGradGuard no_grad;
  auto whole_parameters = whole_model.named_parameters();
  for (const auto& parameter : locate_parameters(model)) {
    const auto whole_of = [&](const torch::Tensor& part) {
      return parameter.layer ? parameter.layer->gather(parameter.name_in_layer, part)
                             : part.clone();
    };
    auto& whole = whole_parameters[parameter.name];
    whole.copy_(whole_of(parameter.tensor));
    copy_adamw_state(optimizer, parameter, whole_optimizer, whole, whole_of);
  }
}

void Parallelism::shard(
    const torch::nn::Module& whole_model,
    const torch::optim::AdamW& whole_optimizer,
    torch::nn::Module& model,
    torch::optim::AdamW& optimizer) const {
  torch::NoGradGuard no_grad;
  const auto whole_parameters = whole_model.named_parameters();
  for (const auto& parameter : locate_parameters(model)) {
    const auto part_of = [&](const torch::Tensor& whole) {
      return parameter.layer ? parameter.layer->shard(parameter.name_in_layer, whole)
                             : whole.clone();
    };
    Located whole;
    whole.name = parameter.name;
    whole.tensor = whole_parameters[parameter.name];
    parameter.tensor.copy_(part_of(whole.tensor));
    copy_adamw_state(whole_optimizer, whole, optimizer, parameter.tensor, part_of);
  }
}

} // namespace train
