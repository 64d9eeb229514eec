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

// Whether q, k and v (B, H, L, D) are the query, key and value parts of
// one projection: (B, L, 3, H, D) or (L, B, 3, H, D) memory, as
// MultiHeadAttention's one product for Q, K and V leaves them.
bool parts_of_one_projection(
    const torch::Tensor& q,
    const torch::Tensor& k,
    const torch::Tensor& v) {
  const int64_t width = q.size(1) * q.size(3); // H·D
  const auto tokens_major = [&](int64_t outer, int64_t inner) {
    return q.stride(inner) == 3 * width && q.stride(outer) == 3 * width * q.size(inner);
  };
  return q.sizes() == k.sizes() && q.sizes() == v.sizes() && q.strides() == k.strides() &&
      q.strides() == v.strides() && q.has_storage() && k.has_storage() && v.has_storage() &&
      k.storage().is_alias_of(q.storage()) && v.storage().is_alias_of(q.storage()) &&
      k.storage_offset() == q.storage_offset() + width &&
      v.storage_offset() == q.storage_offset() + 2 * width && q.stride(3) == 1 &&
      q.stride(1) == q.size(3) && (tokens_major(0, 2) || tokens_major(2, 0));
}

// Uninitialised gradients for q, k and v (B, H, L, D), (B, H, S, ·): one
// key/value gradient per query head. Where q, k and v are the parts of one
// projection, and few query tiles accumulate into each row, their
// gradients are the same parts of one buffer, which that projection's
// backward reads as one matrix, with no concatenation: GPT-2-small's layer
// at T = 128 trained 7 % faster. At T = 2048 (16 tiles) the strided rows
// made it 4 % slower, and the gradients stay apart.
InputGradients input_gradients(const AttentionParams& params) {
  const auto &q = params.q, &k = params.k, &v = params.v;
  if (parts_of_one_projection(q, k, v) && query_tiles(params.L()) <= kMaxQueryTilesInPlace) {
    const auto buffer = torch::empty({3 * q.numel()}, q.options());
    const auto part = [&](int64_t i) {
      return buffer.as_strided(q.sizes(), q.strides(), i * params.H() * params.D());
    };
    return {part(0), part(1), part(2)};
  }
  const int64_t B = params.B(), H = params.H(), S = params.S();
  return {
      torch::empty(q.sizes(), q.options()), torch::empty({B, H, S, params.D()}, k.options()),
      torch::empty({B, H, S, params.Dv()}, v.options())};
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

class FusedAttentionFunction : public torch::autograd::Function<FusedAttentionFunction> {
 public:
  // q, k and v are params' own, passed apart so that autograd sees them.
  // Returns the output as (B, L, H, Dv).
  static torch::Tensor forward(
      torch::autograd::AutogradContext* ctx,
      const torch::Tensor& q,
      const torch::Tensor& k,
      const torch::Tensor& v,
      const AttentionParams& params,
      FusedLoops loops) {
    const int64_t B = params.B(), H = params.H(), L = params.L();
    // The loops write through a (B, H, L, Dv) view; the function returns
    // the underlying (B, L, H, Dv) tensor itself, not a view of it.
    auto out = torch::empty({B, L, H, params.Dv()}, q.options());
    const auto lse = torch::empty({B, H, L}, q.options());
    run_forward(loops, with_heads_for_kernels(params), {out.permute({0, 2, 1, 3}), lse});
    ctx->save_for_backward({q, k, v, out, lse});
    params.save_settings_to(*ctx);
    ctx->saved_data["loops"] = static_cast<int64_t>(loops);
    return out;
  }

  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    auto params = AttentionParams::restore_settings_from(*ctx);
    params.q = saved[0];
    params.k = saved[1];
    params.v = saved[2];
    const auto loops = static_cast<FusedLoops>(ctx->saved_data.at("loops").toInt());
    const auto out = saved[3].permute({0, 2, 1, 3}); // (B, H, L, Dv)
    const auto grad_out = grad_outputs[0].permute({0, 2, 1, 3});
    auto [dq, dk, dv] = fused_backward(loops, params, {out, saved[4]}, grad_out);
    return {dq, dk, dv, torch::Tensor(), torch::Tensor()}; // nothing for params, loops
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
  // Every element of the gradients is written by the loops.
  const auto grads = input_gradients(params);
  const auto prepared = with_heads_for_kernels(params);
  const ForwardResult prepared_forward{heads_for_kernels(forward.out, 1), forward.lse.contiguous()};
  const auto prepared_grad_out = heads_for_kernels(grad_out, 1);
  switch (loops) {
    case FusedLoops::tiled:
      tiled_backward(prepared, prepared_forward, prepared_grad_out, grads);
      break;
    case FusedLoops::short_heads:
      short_heads_backward(prepared, prepared_forward, prepared_grad_out, grads);
      break;
  }
  return summed_over_groups(params, grads);
}

torch::Tensor fused_attention(FusedLoops loops, const AttentionParams& params) {
  return FusedAttentionFunction::apply(params.q, params.k, params.v, params, loops)
      .permute({0, 2, 1, 3});
}

} // namespace attn::detail
