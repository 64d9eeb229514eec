#include "sdpa/plan.h"

#include "kernels/cpu/tile_product.h"
#include "sdpa/backend.h"

#include <torch/torch.h>

#include <algorithm>
#include <sstream>

namespace attn::detail {
namespace {

constexpr const char* kPlanCaller = "scaled_dot_product_attention";

// The call's CPU level: the one SDPAOptions::cpu_capability asks for, else
// the widest this CPU runs.
CpuLevel call_level(const SDPAOptions& options) {
  const auto& levels = cpu_levels();
  if (!options.cpu_capability()) {
    return levels.back();
  }
  const auto wanted = cpu_level_of(*options.cpu_capability());
  if (std::find(levels.begin(), levels.end(), wanted) == levels.end()) {
    std::ostringstream runs;
    for (const auto level : levels) {
      runs << (level == levels.front() ? "" : ", ") << cpu_level_name(level);
    }
    TORCH_CHECK(
        false, kPlanCaller, ": cpu_capability ", cpu_level_name(wanted),
        " is beyond this CPU, which runs ", runs.str());
  }
  return wanted;
}

// The backend of the request and the rule that chose it.
std::pair<AttentionBackend, const char*> chosen_backend(const BackendRequest& request) {
  const auto& requested = request.options.backend();
  if (!requested) {
    const auto& rule = deciding_rule(request);
    return {rule.backend, rule.name};
  }
  const auto reason = unsupported_reason(
      *requested, request.query, request.key, request.value, request.options);
  TORCH_CHECK(
      reason.empty(), kPlanCaller, ": backend ", *requested, " was requested, but it ", reason);
  return {*requested, "requested"};
}

// Whether the request is in half precision on the CPU, no size 0.
bool nonempty_half_request_on_cpu(const BackendRequest& r) {
  const bool every_size_positive = r.query.numel() > 0 && r.key.numel() > 0 && r.value.numel() > 0;
  return r.query.device().is_cpu() && is_half_precision(r.query.scalar_type()) &&
      every_size_positive;
}

// Whether `backend` computes a half-precision request in its own dtype
// (products of half-precision operands, accumulated in float), on `loops`:
// - the fused kernel, on the short heads' loops wherever the same request
//   in float32 takes them (each head widened into float copies of its
//   own: short_heads.h), and on the tiled loops where their products pay
//   (half_products_pay);
// - the weights kernel where the products pay, its weights each a float
//   softmax rounded once into that dtype;
// - the batched kernel always (its products and row passes in float, a
//   chunk of one matrix of the batch at a time: batched_attention.h).
// Elsewhere (and where a size is 0) the request is computed in float32,
// converted whole: scores and softmax sums held in 8 or 11 mantissa bits
// would lose most of the weights' precision, and LibTorch 1.13 has no
// float16 GEMM on the CPU.
bool computes_in_half(AttentionBackend backend, const CpuLoops& loops, const BackendRequest& r) {
  if (!nonempty_half_request_on_cpu(r)) {
    return false;
  }
  const auto dtype = r.query.scalar_type();
  switch (backend) {
    case AttentionBackend::fused_cpu:
      return fused_cpu_loops(
                 loops, dtype, r.query.size(-2), r.key.size(-2), !needs_tiled_loops(r.options)) ==
          FusedLoops::short_heads ||
          half_products_pay(loops, dtype);
    case AttentionBackend::fused_cpu_weights: return half_products_pay(loops, dtype);
    case AttentionBackend::batched_cpu: return true;
    case AttentionBackend::libtorch:
    case AttentionBackend::math: break;
  }
  return false;
}

// The dtype a floating mask reaches the kernels in: its own where the
// request is computed in its dtype, unless its gradient sums over the
// mask's broadcast dims (the mask holds fewer elements than the scores),
// which is summed in float32 before one rounding; float32 where a
// half-precision request is converted whole.
torch::ScalarType mask_dtype_of(
    const BackendRequest& r,
    AttentionBackend backend,
    torch::ScalarType compute_dtype) {
  const auto& mask = r.options.attn_mask();
  if (!mask.defined() || !mask.is_floating_point()) {
    return torch::ScalarType::Undefined;
  }
  const bool converted = r.query.device().is_cpu() && backend != AttentionBackend::libtorch &&
      is_half_precision(r.query.scalar_type());
  if (!converted) {
    return mask.scalar_type();
  }
  const int64_t scores = r.query.numel() / r.query.size(-1) * r.key.size(-2); // E > 0
  const bool gradient_sums = mask.requires_grad() && torch::GradMode::is_enabled() &&
      mask.numel() != scores;
  return compute_dtype == torch::kFloat || gradient_sums ? torch::kFloat : mask.scalar_type();
}

// Whether t is defined and requires grad under grad mode.
bool learns(const torch::Tensor& t) {
  return t.defined() && t.requires_grad() && torch::GradMode::is_enabled();
}

// Whether a differentiable forward of the fused kernel's tiled loops in
// half precision keeps what rounding its output lost
// (ForwardResult::out_rounding). Each dS_ij carries the error of
// delta_i = dO_i·O_i: the output's rounding (up to 2^-8 of
// Σ_d |dO_id·O_id| in bfloat16, 2^-11 in float16) and, in bfloat16, that
// of P rounded for P V.
// - float16: kept wherever a learned tensor takes a gradient, at one
//   more tensor the output's size (0-9 % more training time); without
//   it those gradients reached 36x float32's tolerance plus one rounding.
// - bfloat16: the forward must also multiply P's remainder into V
//   (add_weights_remainder_times_values), about 15 % more training time,
//   which changes the output's last bits; kept only for the offset bias,
//   whose gradients (ALiBi's slopes, a position table's entries) sum dS
//   over every pair of a head: the worst, 1.96x LibTorch's error
//   without it, 0.12x with it. The sinks' gradients sum delta_i over
//   the rows, a mask's take each dS_ij alone or summed over queries or
//   heads: within 0.64x of LibTorch's error without it.
// (tests/sdpa/test_score_modifiers.cpp; docs/design/cpu-kernels.md.)
bool keeps_out_rounding(const SDPAOptions& options, torch::ScalarType compute_dtype) {
  const bool offset_bias = learns(options.alibi_slopes()) || learns(options.position_bias());
  const auto& mask = options.attn_mask();
  switch (compute_dtype) {
    case torch::kHalf:
      return offset_bias || (learns(mask) && mask.is_floating_point()) || learns(options.sinks());
    case torch::kBFloat16: return offset_bias;
    default: return false;
  }
}

} // namespace

CallPlan plan_call(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const SDPAOptions& options) {
  CallPlan plan;
  plan.level = call_level(options);
  const BackendRequest request{query, key, value, options, plan.level};
  std::tie(plan.backend, plan.rule) = chosen_backend(request);
  plan.kernel.cpu = cpu_loops(plan.level);
  const bool half_on_cpu = query.device().is_cpu() && is_half_precision(query.scalar_type());
  plan.compute_dtype = half_on_cpu && plan.backend != AttentionBackend::libtorch &&
          !computes_in_half(plan.backend, plan.kernel.cpu, request)
      ? torch::kFloat
      : query.scalar_type();
  plan.mask_dtype = mask_dtype_of(request, plan.backend, plan.compute_dtype);
  if (plan.backend == AttentionBackend::fused_cpu) {
    plan.kernel.fused_loops = fused_cpu_loops(
        plan.kernel.cpu, plan.compute_dtype, query.size(-2), key.size(-2),
        !needs_tiled_loops(options));
  }
  plan.kernel.keeps_out_rounding = plan.backend == AttentionBackend::fused_cpu &&
      plan.kernel.fused_loops == FusedLoops::tiled &&
      keeps_out_rounding(options, plan.compute_dtype);
  return plan;
}

KernelPlan plan_part(const torch::Tensor& query, const torch::Tensor& key) {
  KernelPlan plan;
  plan.cpu = cpu_loops(widest_cpu_level());
  plan.fused_loops = fused_cpu_loops(
      plan.cpu, query.scalar_type(), query.size(-2), key.size(-2), /*plain=*/true);
  return plan;
}

} // namespace attn::detail
