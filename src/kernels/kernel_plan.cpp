#include "kernels/kernel_plan.h"

#include <torch/torch.h>

namespace attn::detail {

void KernelPlan::save_to(torch::autograd::AutogradContext& ctx) const {
  ctx.saved_data["plan_cpu_level"] = static_cast<int64_t>(cpu.level);
  ctx.saved_data["plan_fused_loops"] = static_cast<int64_t>(fused_loops);
  ctx.saved_data["plan_keeps_out_rounding"] = keeps_out_rounding;
}

KernelPlan KernelPlan::restore_from(torch::autograd::AutogradContext& ctx) {
  KernelPlan plan;
  plan.cpu = cpu_loops(static_cast<CpuLevel>(ctx.saved_data.at("plan_cpu_level").toInt()));
  plan.fused_loops = static_cast<FusedLoops>(ctx.saved_data.at("plan_fused_loops").toInt());
  plan.keeps_out_rounding = ctx.saved_data.at("plan_keeps_out_rounding").toBool();
  return plan;
}

void save_call(
    torch::autograd::AutogradContext& ctx,
    const AttentionParams& params,
    const KernelPlan& plan) {
  params.save_settings_to(ctx);
  plan.save_to(ctx);
}

SavedCall restore_call(torch::autograd::AutogradContext& ctx) {
  return {AttentionParams::restore_settings_from(ctx), KernelPlan::restore_from(ctx)};
}

} // namespace attn::detail
