#include "kernels/cpu/fused_attention.h"

#include "kernels/cpu/heads.h"
#include "kernels/cpu/short_heads.h"
#include "kernels/cpu/tiled_attention.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>

namespace attn::detail {
namespace {

int64_t query_tiles(int64_t L) {
  return (L + kQueryTile - 1) / kQueryTile;
}

// Heads as the loops read them: rows of unit stride, copied into
// contiguous heads where each key and value row is read by more than
// kMaxQueryTilesInPlace query tiles (`queries`: how many read them; 1 for
// the queries themselves). Heads whose rows interleave with other heads'
// (MultiHeadAttention's (B, L, H, D) projections seen as (B, H, L, D))
// slowed every tile's GEMM by a third at T = 4096, where one copy costs far
// less; read in place, GPT-2-small's layer at T = 128 ran 1-3 % faster
// and at T = 512 2-3 % slower than with the copies.
constexpr int64_t kMaxQueryTilesInPlace = 2;

torch::Tensor heads_for_kernels(const torch::Tensor& t, int64_t queries) {
  const bool rows_have_unit_stride = t.size(-1) <= 1 || t.stride(-1) == 1;
  const bool read_by_few_tiles = query_tiles(queries) <= kMaxQueryTilesInPlace;
  return rows_have_unit_stride && read_by_few_tiles ? t : t.contiguous();
}

// `params` with its inputs as heads_for_kernels leaves them.
AttentionParams with_heads_for_kernels(const AttentionParams& params) {
  auto prepared = params;
  const int64_t L = params.L();
  prepared.q = heads_for_kernels(params.q, 1);
  prepared.k = heads_for_kernels(params.k, L);
  prepared.v = heads_for_kernels(params.v, L);
  return prepared;
}

// The options of what the kernels compute in their score dtype (the row
// log-sum-exp, the scores' gradients but a half-precision mask's): float
// for half-precision inputs, whose softmax runs in float; else the
// inputs' own.
torch::TensorOptions score_options(const AttentionParams& params) {
  const auto dtype = params.q.scalar_type();
  return params.q.options().dtype(is_half_precision(dtype) ? torch::kFloat : dtype);
}

// Whether t is defined and requires grad.
bool wants_gradient(const torch::Tensor& t) {
  return t.defined() && t.requires_grad();
}

// Uninitialised gradients for what `wanted` names, the others undefined
// (q, k and v's among them).
InputGradients score_gradients(const AttentionParams& params, const ScoreGradientsWanted& wanted) {
  const int64_t B = params.B(), H = params.H(), L = params.L(), S = params.S();
  const auto empty_if = [&](bool wanted, at::IntArrayRef sizes) {
    return wanted ? torch::empty(sizes, score_options(params)) : torch::Tensor();
  };
  InputGradients grads;
  grads.d_offset_bias = empty_if(wanted.offset_bias, {H, std::max<int64_t>(L + S - 1, 0)});
  // A mask in half precision (bfloat16 or float16, whose gradient sums
  // over no broadcast dims: sdpa/functional.cpp) gets its gradient in its
  // dtype, each element rounded once.
  const bool half_mask = wanted.mask && is_half_precision(params.mask.scalar_type());
  grads.d_mask = half_mask ? torch::empty({B, H, L, S}, params.mask.options())
                           : empty_if(wanted.mask, {B, H, L, S});
  grads.d_sinks = empty_if(wanted.sinks, {H});
  return grads;
}

// Uninitialised gradients for q, k and v (B, H, L, D), (B, H, S, ·): one
// key/value gradient per query head; and for what `wanted` names.
InputGradients input_gradients(
    const AttentionParams& params,
    const ScoreGradientsWanted& wanted = {}) {
  auto grads = score_gradients(params, wanted);
  // Grouped heads' key/value gradients are summed over each group after:
  // in the score dtype (float for half precision), rounded once after the sum.
  const auto key_options = params.group() > 1 ? score_options(params) : params.k.options();
  grads.dq = torch::empty(params.q.sizes(), params.q.options());
  grads.dk = torch::empty({params.B(), params.H(), params.S(), params.D()}, key_options);
  grads.dv = torch::empty({params.B(), params.H(), params.S(), params.Dv()}, key_options);
  return grads;
}

// The key/value gradients per key/value head: with grouped queries, the
// sum over each group's query heads.
InputGradients summed_over_groups(const AttentionParams& params, InputGradients grads) {
  if (params.group() == 1) {
    return grads;
  }
  const auto sum_groups = [&](const torch::Tensor& grad) {
    return grad.view({params.B(), params.Hkv(), params.group(), params.S(), grad.size(3)})
        .sum(2)
        .to(params.k.scalar_type());
  };
  grads.dk = sum_groups(grads.dk);
  grads.dv = sum_groups(grads.dv);
  return grads;
}

// The plan's loops' forward into `result`.
void run_forward(
    const KernelPlan& plan,
    const AttentionParams& params,
    const ForwardResult& result) {
  switch (plan.fused_loops) {
    case FusedLoops::tiled: tiled_forward(plan.cpu, params, result); return;
    case FusedLoops::short_heads: short_heads_forward(plan.cpu, params, result); return;
  }
}

// The gradient of the sinks (H): a sink's weight in row i is
// exp(sink - lse_i) and multiplies no value, so that its logit's gradient
// is -exp(sink - lse_i)·delta_i, delta_i = dO_i·O_i (as for every score of
// the row), summed over the rows of its head.
torch::Tensor sink_gradient(
    const AttentionParams& params,
    const ForwardResult& forward,
    const torch::Tensor& grad_out) {
  const auto as_lse = [&](const torch::Tensor& t) { return t.to(forward.lse.scalar_type()); };
  const auto out = forward.out_rounding.defined()
      ? as_lse(forward.out) + as_lse(forward.out_rounding)
      : as_lse(forward.out);
  const auto delta = (out * as_lse(grad_out)).sum(-1);                                // (B, H, L)
  const auto weights = (params.modifiers.sinks.view({1, -1, 1}) - forward.lse).exp(); // (B, H, L)
  return -(weights * delta).sum(at::IntArrayRef{0, 2});
}

// The loops' backward into `grads`, every element of which they write.
void run_backward(
    const KernelPlan& plan,
    const AttentionParams& params,
    const ForwardResult& forward,
    const torch::Tensor& grad_out,
    const InputGradients& grads) {
  const auto prepared = with_heads_for_kernels(params);
  const auto& rounding = forward.out_rounding;
  const ForwardResult prepared_forward{
      heads_for_kernels(forward.out, 1),
      forward.lse.contiguous(),
      {},
      rounding.defined() ? heads_for_kernels(rounding, 1) : rounding};
  const auto prepared_grad_out = heads_for_kernels(grad_out, 1);
  switch (plan.fused_loops) {
    case FusedLoops::tiled:
      tiled_backward(plan.cpu, prepared, prepared_forward, prepared_grad_out, grads);
      break;
    case FusedLoops::short_heads:
      TORCH_INTERNAL_ASSERT(!grads.d_offset_bias.defined() && !grads.d_mask.defined());
      short_heads_backward(plan.cpu, prepared, prepared_forward, prepared_grad_out, grads);
      break;
  }
  if (grads.d_sinks.defined()) {
    grads.d_sinks.copy_(sink_gradient(params, forward, grad_out));
  }
}

// `grads` writing the gradients of q, k and v into dq, dk and dv.
InputGradients with_input_gradients(
    InputGradients grads,
    const torch::Tensor& dq,
    const torch::Tensor& dk,
    const torch::Tensor& dv) {
  grads.dq = dq;
  grads.dk = dk;
  grads.dv = dv;
  return grads;
}

// The gradient of params.qkv (B, L, 3, H, D), in qkv's layout; the scores'
// gradients that `score_grads` defines are written into it. Where few
// query tiles accumulate into each key row, the loops write the three
// gradients straight into it: GPT-2-small's layer at T = 128 trained 7 %
// faster than with a concatenation after. At T = 2048 (16 tiles) the
// strided rows made the loops 4 % slower, and the gradients are computed
// apart and stacked.
torch::Tensor projection_gradient(
    const KernelPlan& plan,
    const AttentionParams& params,
    const ForwardResult& forward,
    const torch::Tensor& grad_out,
    const InputGradients& score_grads) {
  TORCH_INTERNAL_ASSERT(params.group() == 1, "the heads of one projection are as many for Q, K, V");
  if (query_tiles(params.L()) <= kMaxQueryTilesInPlace) {
    auto grad = torch::empty_like(params.qkv);
    const auto heads = heads_of_projection(grad);
    run_backward(
        plan, params, forward, grad_out,
        with_input_gradients(score_grads, heads.q, heads.k, heads.v));
    return grad;
  }
  const auto fresh = input_gradients(params);
  run_backward(
      plan, params, forward, grad_out,
      with_input_gradients(score_grads, fresh.dq, fresh.dk, fresh.dv));
  return torch::stack(
      {fresh.dq.transpose(1, 2), fresh.dk.transpose(1, 2), fresh.dv.transpose(1, 2)}, 2);
}

// The gradients of a call that is no projection's: those of q, k, v per
// key/value head, and those `wanted`.
InputGradients summed_gradients(
    const KernelPlan& plan,
    const AttentionParams& params,
    const ForwardResult& forward,
    const torch::Tensor& grad_out,
    const ScoreGradientsWanted& wanted) {
  const auto grads = input_gradients(params, wanted);
  run_backward(plan, params, forward, grad_out, grads);
  return summed_over_groups(params, grads);
}

// A (B, L, H, ·) tensor seen as (B, H, L, ·); an undefined one stays so.
torch::Tensor as_heads(const torch::Tensor& t) {
  return t.defined() ? t.permute({0, 2, 1, 3}) : t;
}

class FusedAttentionFunction : public torch::autograd::Function<FusedAttentionFunction> {
 public:
  // The inputs that autograd sees: params' q, k and v, or, where they are
  // the heads of one projection, params.qkv alone; the modifiers' tensors;
  // the mask where it is `wanted` (undefined tensors are no inputs to
  // autograd). Returns the output as (B, L, H, Dv).
  static torch::Tensor forward(
      torch::autograd::AutogradContext* ctx,
      const c10::optional<torch::Tensor>& q,
      const c10::optional<torch::Tensor>& k,
      const c10::optional<torch::Tensor>& v,
      const c10::optional<torch::Tensor>& qkv,
      const c10::optional<torch::Tensor>& /*mask: params.mask, saved with the settings*/,
      const c10::optional<torch::Tensor>& offset_bias,
      const c10::optional<torch::Tensor>& sinks,
      const AttentionParams& params,
      const KernelPlan& plan,
      ScoreGradientsWanted wanted) {
    const int64_t B = params.B(), H = params.H(), L = params.L();
    // The loops write through a (B, H, L, Dv) view; the function returns
    // the underlying (B, L, H, Dv) tensor itself, not a view of it.
    auto out = torch::empty({B, L, H, params.Dv()}, params.q.options());
    const auto lse = torch::empty({B, H, L}, score_options(params));
    const auto out_rounding = plan.keeps_out_rounding ? torch::empty_like(out) : torch::Tensor();
    run_forward(
        plan, with_heads_for_kernels(params), {as_heads(out), lse, {}, as_heads(out_rounding)});
    // Each holds a tensor, maybe undefined.
    ctx->save_for_backward({*q, *k, *v, *qkv, out, lse, *offset_bias, *sinks, out_rounding});
    save_call(*ctx, params, plan);
    ctx->saved_data["offset_bias_grad"] = wanted.offset_bias;
    ctx->saved_data["mask_grad"] = wanted.mask;
    ctx->saved_data["sinks_grad"] = wanted.sinks;
    return out;
  }

  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    auto [params, plan] = restore_call(*ctx);
    params.qkv = saved[3];
    const auto heads = params.qkv.defined() ? heads_of_projection(params.qkv)
                                            : QkvHeads{saved[0], saved[1], saved[2]};
    params.q = heads.q;
    params.k = heads.k;
    params.v = heads.v;
    params.modifiers.offset_bias = saved[6];
    params.modifiers.sinks = saved[7];
    const ScoreGradientsWanted wanted{
        ctx->saved_data.at("offset_bias_grad").toBool(), ctx->saved_data.at("mask_grad").toBool(),
        ctx->saved_data.at("sinks_grad").toBool()};
    const ForwardResult forward{as_heads(saved[4]), saved[5], {}, as_heads(saved[8])};
    const auto grad_out = as_heads(grad_outputs[0]);
    const torch::Tensor none;
    if (params.qkv.defined()) {
      const auto grads = score_gradients(params, wanted);
      const auto dqkv = projection_gradient(plan, params, forward, grad_out, grads);
      return {none,          none,
              none,          dqkv,
              grads.d_mask,  grads.d_offset_bias,
              grads.d_sinks, none /*params*/,
              none /*plan*/, none /*wanted*/};
    }
    const auto grads = summed_gradients(plan, params, forward, grad_out, wanted);
    return {grads.dq,      grads.dk,        grads.dv,      none, grads.d_mask, grads.d_offset_bias,
            grads.d_sinks, none /*params*/, none /*plan*/, none /*wanted*/};
  }
};

} // namespace

ForwardResult fused_forward(const KernelPlan& plan, const AttentionParams& params) {
  const ForwardResult result{
      empty_heads_interleaved(params.B(), params.H(), params.L(), params.Dv(), params.q.options()),
      torch::empty({params.B(), params.H(), params.L()}, score_options(params))};
  run_forward(plan, with_heads_for_kernels(params), result);
  return result;
}

InputGradients fused_backward(
    const KernelPlan& plan,
    const AttentionParams& params,
    const ForwardResult& forward,
    const torch::Tensor& grad_out) {
  return summed_gradients(plan, params, forward, grad_out, {});
}

torch::Tensor fused_attention(const KernelPlan& plan, const AttentionParams& params) {
  using Input = c10::optional<torch::Tensor>; // an undefined one is no input to autograd
  const bool projection = params.qkv.defined();
  const auto wanted = score_gradients_wanted(params);
  const torch::Tensor none;
  const auto out = FusedAttentionFunction::apply(
      Input(projection ? none : params.q), Input(projection ? none : params.k),
      Input(projection ? none : params.v), Input(params.qkv),
      Input(wanted.mask ? params.mask : none), Input(params.modifiers.offset_bias),
      Input(params.modifiers.sinks), params, plan, wanted);
  return as_heads(out);
}

// Read before the autograd function's forward, which runs without grad
// mode.
ScoreGradientsWanted score_gradients_wanted(const AttentionParams& params) {
  if (!torch::GradMode::is_enabled()) {
    return {};
  }
  return {
      wants_gradient(params.modifiers.offset_bias),
      wants_gradient(params.mask) && params.mask.is_floating_point(),
      wants_gradient(params.modifiers.sinks)};
}

} // namespace attn::detail
