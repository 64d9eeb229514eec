#include "kernels/cpu/fused_attention.h"

#include "kernels/cpu/heads.h"
#include "kernels/cpu/short_heads.h"
#include "kernels/cpu/tiled_attention.h"

#include <torch/torch.h>

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

// Uninitialised gradients for q, k and v (B, H, L, D), (B, H, S, ·): one
// key/value gradient per query head.
InputGradients input_gradients(const AttentionParams& params) {
  const int64_t B = params.B(), H = params.H(), S = params.S();
  return {
      torch::empty(params.q.sizes(), params.q.options()),
      torch::empty({B, H, S, params.D()}, params.k.options()),
      torch::empty({B, H, S, params.Dv()}, params.v.options())};
}

// The key/value gradients per key/value head: with grouped queries, the
// sum over each group's query heads.
InputGradients summed_over_groups(const AttentionParams& params, InputGradients grads) {
  if (params.group() == 1) {
    return grads;
  }
  const auto sum_groups = [&](const torch::Tensor& grad) {
    return grad.view({params.B(), params.Hkv(), params.group(), params.S(), grad.size(3)}).sum(2);
  };
  return {grads.dq, sum_groups(grads.dk), sum_groups(grads.dv)};
}

// The loops' forward into `result`.
void run_forward(FusedLoops loops, const AttentionParams& params, const ForwardResult& result) {
  switch (loops) {
    case FusedLoops::tiled: tiled_forward(params, result); return;
    case FusedLoops::short_heads: short_heads_forward(params, result); return;
  }
}

// The loops' backward into `grads`, every element of which they write.
void run_backward(
    FusedLoops loops,
    const AttentionParams& params,
    const ForwardResult& forward,
    const torch::Tensor& grad_out,
    const InputGradients& grads) {
  const auto prepared = with_heads_for_kernels(params);
  const ForwardResult prepared_forward{heads_for_kernels(forward.out, 1), forward.lse.contiguous()};
  const auto prepared_grad_out = heads_for_kernels(grad_out, 1);
  switch (loops) {
    case FusedLoops::tiled:
      tiled_backward(prepared, prepared_forward, prepared_grad_out, grads);
      return;
    case FusedLoops::short_heads:
      short_heads_backward(prepared, prepared_forward, prepared_grad_out, grads);
      return;
  }
}

// The gradient of params.qkv (B, L, 3, H, D), in qkv's layout. Where few
// query tiles accumulate into each key row, the loops write the three
// gradients straight into it: GPT-2-small's layer at T = 128 trained 7 %
// faster than with a concatenation after. At T = 2048 (16 tiles) the
// strided rows made the loops 4 % slower, and the gradients are computed
// apart and stacked.
torch::Tensor projection_gradient(
    FusedLoops loops,
    const AttentionParams& params,
    const ForwardResult& forward,
    const torch::Tensor& grad_out) {
  TORCH_INTERNAL_ASSERT(params.group() == 1, "the heads of one projection are as many for Q, K, V");
  if (query_tiles(params.L()) <= kMaxQueryTilesInPlace) {
    auto grad = torch::empty_like(params.qkv);
    const auto [dq, dk, dv] = heads_of_projection(grad);
    run_backward(loops, params, forward, grad_out, {dq, dk, dv});
    return grad;
  }
  const auto grads = input_gradients(params);
  run_backward(loops, params, forward, grad_out, grads);
  return torch::stack(
      {grads.dq.transpose(1, 2), grads.dk.transpose(1, 2), grads.dv.transpose(1, 2)}, 2);
}

class FusedAttentionFunction : public torch::autograd::Function<FusedAttentionFunction> {
 public:
  // The inputs that autograd sees: params' q, k and v, or, where they are
  // the heads of one projection, params.qkv alone (undefined tensors are
  // no inputs to autograd). Returns the output as (B, L, H, Dv).
  static torch::Tensor forward(
      torch::autograd::AutogradContext* ctx,
      const c10::optional<torch::Tensor>& q,
      const c10::optional<torch::Tensor>& k,
      const c10::optional<torch::Tensor>& v,
      const c10::optional<torch::Tensor>& qkv,
      const AttentionParams& params,
      FusedLoops loops) {
    const int64_t B = params.B(), H = params.H(), L = params.L();
    // The loops write through a (B, H, L, Dv) view; the function returns
    // the underlying (B, L, H, Dv) tensor itself, not a view of it.
    auto out = torch::empty({B, L, H, params.Dv()}, params.q.options());
    const auto lse = torch::empty({B, H, L}, params.q.options());
    run_forward(loops, with_heads_for_kernels(params), {out.permute({0, 2, 1, 3}), lse});
    ctx->save_for_backward({*q, *k, *v, *qkv, out, lse}); // each holds a tensor, maybe undefined
    params.save_settings_to(*ctx);
    ctx->saved_data["loops"] = static_cast<int64_t>(loops);
    return out;
  }

  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    auto params = AttentionParams::restore_settings_from(*ctx);
    params.qkv = saved[3];
    const auto heads = params.qkv.defined() ? heads_of_projection(params.qkv)
                                            : QkvHeads{saved[0], saved[1], saved[2]};
    params.q = heads.q;
    params.k = heads.k;
    params.v = heads.v;
    const auto loops = static_cast<FusedLoops>(ctx->saved_data.at("loops").toInt());
    const ForwardResult forward{saved[4].permute({0, 2, 1, 3}), saved[5]}; // out (B, H, L, Dv)
    const auto grad_out = grad_outputs[0].permute({0, 2, 1, 3});
    const torch::Tensor none;
    if (params.qkv.defined()) {
      return {none, none, none, projection_gradient(loops, params, forward, grad_out), none, none};
    }
    auto [dq, dk, dv] = fused_backward(loops, params, forward, grad_out);
    return {dq, dk, dv, none, none, none}; // nothing for qkv, params, loops
  }
};

} // namespace

ForwardResult fused_forward(FusedLoops loops, const AttentionParams& params) {
  const ForwardResult result{
      empty_heads_interleaved(params.B(), params.H(), params.L(), params.Dv(), params.q.options()),
      torch::empty({params.B(), params.H(), params.L()}, params.q.options())};
  run_forward(loops, with_heads_for_kernels(params), result);
  return result;
}

InputGradients fused_backward(
    FusedLoops loops,
    const AttentionParams& params,
    const ForwardResult& forward,
    const torch::Tensor& grad_out) {
  const auto grads = input_gradients(params);
  run_backward(loops, params, forward, grad_out, grads);
  return summed_over_groups(params, grads);
}

torch::Tensor fused_attention(FusedLoops loops, const AttentionParams& params) {
  using Input = c10::optional<torch::Tensor>; // an undefined one is no input to autograd
  const bool projection = params.qkv.defined();
  const torch::Tensor none;
  const auto out = FusedAttentionFunction::apply(
      Input(projection ? none : params.q), Input(projection ? none : params.k),
      Input(projection ? none : params.v), Input(params.qkv), params, loops);
  return out.permute({0, 2, 1, 3});
}

} // namespace attn::detail
