#include "kernels/cpu/tiled_attention.h"

#include "kernels/cpu/operands_bf16.h"
#include "kernels/cpu/operands_float.h"
#include "kernels/cpu/operands_float16.h"
#include "kernels/cpu/tiled_template.h"

#include <torch/torch.h>

namespace attn::detail {
namespace {

static_assert(kQueryTile == MaskBlocks::kRows, "a query tile is a row of mask blocks");

// A policy as a value, for a generic lambda to name its type.
template <typename Operands>
struct Policy {
  using type = Operands;
};

// `run(inputs)` on the tiled loops' inputs for `params` in `direction`,
// with the operand policy of params' dtype (tiled_template.h); an internal
// error where `loops` cannot run that type's products, which the call's
// plan never asks for.
template <typename Run>
void run_tiled(
    const CpuLoops& loops,
    const AttentionParams& params,
    OperandDirection direction,
    const Run& run) {
  const auto on = [&](auto policy) {
    using Operands = typename decltype(policy)::type;
    TORCH_INTERNAL_ASSERT(
        Operands::runs(loops), "no ", params.q.scalar_type(), " products at the CPU level ",
        cpu_level_name(loops.level));
    run(TiledInputs<Operands>(params, direction, loops));
  };
  switch (params.q.scalar_type()) {
    case torch::kFloat: return on(Policy<FloatOperands<float>>{});
    case torch::kDouble: return on(Policy<FloatOperands<double>>{});
    case torch::kBFloat16: return on(Policy<Bf16Operands<>>{});
    case torch::kHalf: return on(Policy<Float16Operands<>>{});
    default: TORCH_INTERNAL_ASSERT(false, "the tiled loops compute no ", params.q.scalar_type());
  }
}

} // namespace

void tiled_forward(
    const CpuLoops& loops,
    const AttentionParams& params,
    const ForwardResult& result) {
  run_tiled(loops, params, OperandDirection::forward, [&](const auto& in) {
    tiled_forward_loops(in, result);
  });
}

void tiled_backward(
    const CpuLoops& loops,
    const AttentionParams& params,
    const ForwardResult& forward,
    const torch::Tensor& grad_out,
    const InputGradients& grads) {
  run_tiled(loops, params, OperandDirection::backward, [&](const auto& in) {
    tiled_backward_loops(in, forward, grad_out, grads);
  });
}

ForwardResult tiled_forward_with_weights(const CpuLoops& loops, const AttentionParams& params) {
  TORCH_INTERNAL_ASSERT(!params.dropout.active(), "the weights kernel drops no weights");
  auto contiguous = params;
  contiguous.q = params.q.contiguous();
  contiguous.k = params.k.contiguous();
  contiguous.v = params.v.contiguous();
  const int64_t B = params.B(), H = params.H(), L = params.L();
  const auto dtype = params.q.scalar_type();
  const ForwardResult result{
      empty_heads_interleaved(B, H, L, params.Dv(), params.q.options()),
      torch::empty(
          {B, H, L}, params.q.options().dtype(is_half_precision(dtype) ? torch::kFloat : dtype)),
      torch::empty({B, H, L, params.S()}, params.q.options())};
  run_tiled(loops, contiguous, OperandDirection::forward, [&](const auto& in) {
    tiled_forward_with_weights_loops(in, result);
  });
  return result;
}

} // namespace attn::detail
