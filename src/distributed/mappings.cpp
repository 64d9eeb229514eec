#include <attn/distributed/mappings.h>

#include "distributed/collectives.h"

#include <torch/torch.h>

namespace attn::distributed {

namespace {

using detail::save_group;
using detail::saved_group;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

torch::Tensor own_part(const torch::Tensor& input, int64_t dim, const Group& group) {
  TORCH_CHECK(
      input.size(dim) % group.size() == 0, "attn::distributed: scatter_to_parallel: size ",
      input.size(dim), " of dimension ", dim, " must be divisible by the ", group.size(), " ranks");
  return input.chunk(group.size(), dim)[group.rank()].contiguous();
}

torch::Tensor gathered(const torch::Tensor& input, int64_t dim, const Group& group) {
  return torch::cat(detail::all_gather(input, group), dim);
}

struct CopyToParallel : torch::autograd::Function<CopyToParallel> {
  static torch::Tensor forward(
      AutogradContext* ctx,
      const torch::Tensor& input,
      const Group& group) {
    save_group(ctx, group);
    return input.view_as(input);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {detail::all_reduce_sum(grads[0], saved_group(ctx)), torch::Tensor()};
  }
};

struct ReduceFromParallel : torch::autograd::Function<ReduceFromParallel> {
  static torch::Tensor forward(AutogradContext*, const torch::Tensor& input, const Group& group) {
    return detail::all_reduce_sum(input, group);
  }
  static variable_list backward(AutogradContext*, variable_list grads) {
    return {grads[0], torch::Tensor()};
  }
};

// Scatter (forward: the rank's part along `dim`; backward: the parts
// gathered) or its mirror, gather.
struct SplitAlongDim : torch::autograd::Function<SplitAlongDim> {
  static torch::Tensor forward(
      AutogradContext* ctx,
      const torch::Tensor& input,
      int64_t dim,
      bool scatter,
      const Group& group) {
    save_group(ctx, group);
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["scatter"] = scatter;
    return scatter ? own_part(input, dim, group) : gathered(input, dim, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto dim = ctx->saved_data["dim"].toInt();
    const Group group = saved_group(ctx);
    auto grad = ctx->saved_data["scatter"].toBool() ? gathered(grads[0], dim, group)
                                                    : own_part(grads[0], dim, group);
    return {grad, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

} // namespace

torch::Tensor copy_to_parallel(const torch::Tensor& input, const Group& group) {
  return group.size() == 1 ? input : CopyToParallel::apply(input, group);
}

torch::Tensor reduce_from_parallel(const torch::Tensor& input, const Group& group) {
  return group.size() == 1 ? input : ReduceFromParallel::apply(input, group);
}

torch::Tensor scatter_to_parallel(const torch::Tensor& input, int64_t dim, const Group& group) {
  dim = c10::maybe_wrap_dim(dim, input.dim());
  return group.size() == 1 ? input : SplitAlongDim::apply(input, dim, /*scatter=*/true, group);
}

torch::Tensor gather_from_parallel(const torch::Tensor& input, int64_t dim, const Group& group) {
  dim = c10::maybe_wrap_dim(dim, input.dim());
  return group.size() == 1 ? input : SplitAlongDim::apply(input, dim, /*scatter=*/false, group);
}

} // namespace attn::distributed
