#include "kernels/cpu/short_heads.h"

#include "kernels/cpu/isa.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/short_heads_loops.h"
#include "kernels/cpu/tile_product.h"

#include <torch/torch.h>

namespace attn::detail {
namespace {

// The loops of the instruction set that computes the float products now
// (tile_product.h); null while the BLAS does.
const ShortHeadsLoops* active_loops() {
  const auto loops_of = [](InstructionSet set) {
    const auto* isa = isa_loops(set);
    return isa == nullptr ? nullptr : isa->short_heads;
  };
  switch (active_product_loops()) {
    case ProductLoops::avx512: return loops_of(InstructionSet::avx512);
    case ProductLoops::avx2: return loops_of(InstructionSet::avx2);
    case ProductLoops::blas: return nullptr;
  }
  return nullptr;
}

// The active loops of a call that short_heads_run admitted; an error, not
// a null call, if a ScopedProductLoops on another thread took them since.
const ShortHeadsLoops& admitted_loops() {
  const auto* loops = active_loops();
  TORCH_CHECK(
      loops != nullptr,
      "attn: the short-heads loops were switched off during the call (expected AVX-512 or AVX2 "
      "product loops, got the BLAS's)");
  return *loops;
}

// `run` over every (b, h) head, in parallel where the work pays for it.
void parallel_heads(
    const ShortHeadsCall& call,
    int64_t B,
    double flops_per_head,
    ShortHeadsFn run) {
  const int64_t grain = parallel_grain(flops_per_head, kMinShortHeadsTaskFlops);
  parallel_for(0, B * call.H, grain, [&](int64_t begin, int64_t end) { run(call, begin, end); });
}

ShortHeadsCall call_of(const AttentionParams& params, const torch::Tensor& out) {
  TORCH_INTERNAL_ASSERT(!params.dropout.active(), "the short-head loops drop no weights");
  return {
      Heads<float>(params.q),
      Heads<float>(params.k),
      Heads<float>(params.v),
      Heads<float>(out),
      MaskView<float>(params),
      static_cast<float>(params.scale),
      params.H(),
      params.group(),
      params.L(),
      params.S(),
      params.D(),
      params.Dv()};
}

} // namespace

bool short_heads_run(torch::ScalarType dtype, int64_t L, int64_t S) {
  return dtype == torch::kFloat && L <= kMaxShortQueries && S <= kMaxShortKeys &&
      active_loops() != nullptr;
}

void short_heads_forward(const AttentionParams& params, const ForwardResult& result) {
  if (result.lse.numel() == 0) { // no query: nothing to write, however many heads
    return;
  }
  auto call = call_of(params, result.out);
  call.lse_out = result.lse.data_ptr<float>();
  parallel_heads(
      call, params.B(), 2.0 * call.L * call.S * (call.D + call.Dv), admitted_loops().forward);
}

void short_heads_backward(
    const AttentionParams& params,
    const ForwardResult& forward,
    const torch::Tensor& grad_out,
    const InputGradients& grads) {
  if (grads.dq.numel() == 0 && grads.dk.numel() == 0 && grads.dv.numel() == 0) {
    return;
  }
  auto call = call_of(params, forward.out);
  call.lse = forward.lse.data_ptr<float>();
  const ShortHeadsGradients gradients{
      Heads<float>(grad_out), Heads<float>(grads.dq), Heads<float>(grads.dk),
      Heads<float>(grads.dv)};
  call.gradients = &gradients;
  parallel_heads(
      call, params.B(), 2.0 * call.L * call.S * (3 * call.D + 2 * call.Dv),
      admitted_loops().backward);
}

} // namespace attn::detail
