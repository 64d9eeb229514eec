#include "modules/stacked_projection.h"

#include "runtime/compat.h"

#include <torch/torch.h>

namespace attn::detail {
namespace {

bool same_kind(const torch::Tensor& a, const torch::Tensor& b) {
  return a.defined() && b.defined() && a.scalar_type() == b.scalar_type() &&
      a.device() == b.device() && a.dim() == b.dim() && a.dim() > 0 &&
      a.sizes().slice(1) == b.sizes().slice(1);
}

int64_t total_rows(const std::vector<torch::Tensor>& parts) {
  int64_t rows = 0;
  for (const auto& part : parts) {
    rows += part.size(0);
  }
  return rows;
}

// The stacked view where there is one; copies otherwise, and always when
// grad mode is on (a backward that builds a graph), whose cat records how
// the stacked matrix depends on each part.
torch::Tensor stacked(const std::vector<torch::Tensor>& parts) {
  auto view = torch::GradMode::is_enabled() ? torch::Tensor() : stacked_rows(parts);
  return view.defined() ? view : torch::cat(parts);
}

// Inputs: input, the three weights, the three biases (none without: an
// optional, which autograd counts as no input at all). Output: the three
// projections as one product.
class StackedLinearFunction : public torch::autograd::Function<StackedLinearFunction> {
 public:
  static torch::Tensor forward(
      torch::autograd::AutogradContext* ctx,
      const torch::Tensor& input,
      const torch::Tensor& w0,
      const torch::Tensor& w1,
      const torch::Tensor& w2,
      const c10::optional<torch::Tensor>& b0,
      const c10::optional<torch::Tensor>& b1,
      const c10::optional<torch::Tensor>& b2) {
    ctx->save_for_backward({input, w0, w1, w2});
    ctx->saved_data["bias"] = b0.has_value();
    const auto bias = b0 ? stacked({*b0, *b1, *b2}) : torch::Tensor();
    return torch::nn::functional::linear(input, stacked({w0, w1, w2}), bias);
  }

  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      const torch::autograd::variable_list& grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto& input = saved[0];
    const std::vector<torch::Tensor> weights(saved.begin() + 1, saved.end());
    const auto& grad = grad_outputs[0];                       // (..., Σ out_i)
    const auto grad_rows = grad.reshape({-1, grad.size(-1)}); // (N, Σ out_i)
    const std::vector<int64_t> rows{weights[0].size(0), weights[1].size(0), weights[2].size(0)};
    const auto needs = [&](size_t first) {
      return ctx->needs_input_grad(first) || ctx->needs_input_grad(first + 1) ||
          ctx->needs_input_grad(first + 2);
    };

    torch::autograd::variable_list grads(7);
    if (ctx->needs_input_grad(0)) {
      grads[0] = grad.matmul(stacked(weights));
    }
    if (needs(1)) {
      const auto grad_weight = grad_rows.t().mm(input.reshape({-1, input.size(-1)}));
      const auto parts = grad_weight.split_with_sizes(rows);
      std::copy(parts.begin(), parts.end(), grads.begin() + 1);
    }
    if (ctx->saved_data["bias"].toBool() && needs(4)) {
      const auto parts = grad_rows.sum(0).split_with_sizes(rows);
      std::copy(parts.begin(), parts.end(), grads.begin() + 4);
    }
    return grads;
  }
};

} // namespace

bool stack_rows(const std::vector<torch::Tensor>& parts) {
  if (stacked_rows(parts).defined()) {
    return true;
  }
  for (const auto& part : parts) {
    if (!same_kind(part, parts.at(0))) {
      return false;
    }
  }
  const torch::NoGradGuard no_grad;
  auto sizes = parts[0].sizes().vec();
  sizes[0] = total_rows(parts);
  const auto whole = torch::empty(sizes, parts[0].options());
  int64_t row = 0;
  for (const auto& part : parts) { // set_data changes the tensor this handle shares
    auto block = whole.narrow(0, row, part.size(0));
    block.copy_(part);
    part.set_data(block);
    row += block.size(0);
  }
  return true;
}

torch::Tensor stacked_rows(const std::vector<torch::Tensor>& parts) {
  const auto& first = parts.at(0);
  int64_t row_numel = 0;
  int64_t rows = 0;
  for (const auto& part : parts) {
    if (!same_kind(part, first) || !part.is_contiguous() || !part.has_storage() ||
        !part.storage().is_alias_of(first.storage())) {
      return {};
    }
    row_numel = part.numel() / std::max<int64_t>(part.size(0), 1);
    if (part.storage_offset() != first.storage_offset() + rows * row_numel) {
      return {};
    }
    rows += part.size(0);
  }
  auto sizes = first.sizes().vec();
  sizes[0] = rows;
  // Contiguous strides of the whole (a part of one row may have any
  // stride(0)).
  std::vector<int64_t> strides(sizes.size(), 1);
  for (size_t i = sizes.size() - 1; i > 0; --i) {
    strides[i - 1] = strides[i] * sizes[i];
  }
  return torch::empty({0}, first.options())
      .set_(first.storage(), first.storage_offset(), sizes, strides);
}

torch::Tensor stacked_linear(
    const torch::Tensor& input,
    const std::vector<torch::Tensor>& weights,
    const std::vector<torch::Tensor>& biases) {
  TORCH_INTERNAL_ASSERT(weights.size() == 3 && biases.size() == 3);
  TORCH_INTERNAL_ASSERT(
      biases[0].defined() == biases[1].defined() && biases[1].defined() == biases[2].defined(),
      "stacked_linear: biases for all three weights or for none");
  // Under LibTorch's autocast, in its dtype, as torch::nn::functional::linear
  // computes there: the casts are autograd's, so that float32 weights get
  // float32 gradients.
  const auto dtype = autocast_dtype(input);
  const auto cast = [&](const torch::Tensor& t) { return dtype ? t.to(*dtype) : t; };
  const auto bias = [&](size_t i) {
    return biases[i].defined() ? c10::optional<torch::Tensor>(cast(biases[i])) : c10::nullopt;
  };
  return StackedLinearFunction::apply(
      cast(input), cast(weights[0]), cast(weights[1]), cast(weights[2]), bias(0), bias(1), bias(2));
}

} // namespace attn::detail
