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

ShortHeadsCall call_of(
    const torch::Tensor& q,
    const torch::Tensor& k,
    const torch::Tensor& v,
    const torch::Tensor& out,
    const CpuAttentionConfig& config) {
  const int64_t H = q.size(1);
  return {
      Heads<float>(q),
      Heads<float>(k),
      Heads<float>(v),
      Heads<float>(out),
      MaskView<float>(config, k.size(2)),
      static_cast<float>(config.scale),
      H,
      k.size(1) > 0 ? H / k.size(1) : 1,
      q.size(2),
      k.size(2),
      q.size(3),
      v.size(3)};
}

} // namespace

bool short_heads_run(torch::ScalarType dtype, int64_t L, int64_t S) {
  return dtype == torch::kFloat && L <= kMaxShortQueries && S <= kMaxShortKeys &&
      active_loops() != nullptr;
}

void short_heads_forward(
    const torch::Tensor& q,
    const torch::Tensor& k,
    const torch::Tensor& v,
    const CpuAttentionConfig& config,
    const torch::Tensor& out,
    const torch::Tensor& lse) {
  if (lse.numel() == 0) { // no query: nothing to write, however many heads
    return;
  }
  auto call = call_of(q, k, v, out, config);
  call.lse_out = lse.data_ptr<float>();
  parallel_heads(
      call, q.size(0), 2.0 * call.L * call.S * (call.D + call.Dv), admitted_loops().forward);
}

void short_heads_backward(
    const torch::Tensor& q,
    const torch::Tensor& k,
    const torch::Tensor& v,
    const torch::Tensor& out,
    const torch::Tensor& grad_out,
    const torch::Tensor& lse,
    const CpuAttentionConfig& config,
    const torch::Tensor& dq,
    const torch::Tensor& dk,
    const torch::Tensor& dv) {
  if (dq.numel() == 0 && dk.numel() == 0 && dv.numel() == 0) {
    return;
  }
  auto call = call_of(q, k, v, out, config);
  call.lse = lse.data_ptr<float>();
  const ShortHeadsGradients gradients{
      Heads<float>(grad_out), Heads<float>(dq), Heads<float>(dk), Heads<float>(dv)};
  call.gradients = &gradients;
  parallel_heads(
      call, q.size(0), 2.0 * call.L * call.S * (3 * call.D + 2 * call.Dv),
      admitted_loops().backward);
}

} // namespace attn::detail
