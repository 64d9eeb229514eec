#include <attn/sdpa.h>

#include "kernels/attention_params.h"
#include "kernels/cpu/batched_attention.h"
#include "kernels/cpu/fused_attention.h"
#include "kernels/cpu/mask_blocks.h"
#include "kernels/cpu/tiled_attention.h"
#include "runtime/compat.h"
#include "sdpa/backend.h"
#include "sdpa/block_mask.h"
#include "sdpa/masks.h"
#include "sdpa/math_attention.h"
#include "sdpa/plan.h"
#include "sdpa/projection_attention.h"
#include "sdpa/score_modifiers.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <vector>

namespace attn {
namespace {

constexpr const char* kSdpaCaller = "scaled_dot_product_attention";

// The leading dims: equal, or with enable_gqa, fewer key/value heads.
void check_leading_dims(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const SDPAOptions& options) {
  TORCH_CHECK(
      query.defined() && key.defined() && value.defined(), kSdpaCaller,
      ": query, key and value must be defined tensors");
  TORCH_CHECK(
      query.dim() >= 2, kSdpaCaller, ": query must be (..., L, E) with at least 2 dims, got ",
      query.sizes());
  TORCH_CHECK(
      key.dim() == query.dim() && value.dim() == query.dim(), kSdpaCaller,
      ": query, key and value must have the same number of dims, got query ", query.sizes(),
      ", key ", key.sizes(), ", value ", value.sizes());

  const auto batch_dims = query.dim() - 2;
  if (options.enable_gqa()) {
    TORCH_CHECK(
        query.dim() >= 3, kSdpaCaller,
        ": enable_gqa needs a heads dim: query must be (..., Hq, L, E), got ", query.sizes());
    const auto Hq = query.size(-3), Hkv = key.size(-3);
    const auto outer_dims = batch_dims - 1;
    TORCH_CHECK(
        key.sizes().slice(0, outer_dims) == query.sizes().slice(0, outer_dims) &&
            value.sizes().slice(0, outer_dims) == query.sizes().slice(0, outer_dims) &&
            value.size(-3) == Hkv,
        kSdpaCaller, ": with enable_gqa, query (..., Hq, L, E), key (..., Hkv, S, E) ",
        "and value (..., Hkv, S, Ev) must share the dims before the heads, ",
        "and key and value their heads, got query ", query.sizes(), ", key ", key.sizes(),
        ", value ", value.sizes());
    TORCH_CHECK(
        Hkv > 0 && Hq % Hkv == 0, kSdpaCaller,
        ": with enable_gqa, the key/value heads Hkv must divide the query ",
        "heads Hq, got Hq=", Hq, " and Hkv=", Hkv);
  } else {
    TORCH_CHECK(
        key.sizes().slice(0, batch_dims) == query.sizes().slice(0, batch_dims) &&
            value.sizes().slice(0, batch_dims) == query.sizes().slice(0, batch_dims),
        kSdpaCaller, ": query, key and value must have the same leading dims, got ", "query ",
        query.sizes(), ", key ", key.sizes(), ", value ", value.sizes(),
        " (enable_gqa allows fewer key/value heads)");
  }
}

// Feature sizes, lengths, dtypes and devices.
void check_features_dtypes_and_devices(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value) {
  const auto E = query.size(-1);
  TORCH_CHECK(E > 0, kSdpaCaller, ": query must have a feature size E > 0, got ", query.sizes());
  TORCH_CHECK(
      key.size(-1) == E, kSdpaCaller, ": key must be (..., S, E) with E == ", E,
      " (the query's feature size), got ", key.sizes());
  TORCH_CHECK(
      value.size(-2) == key.size(-2), kSdpaCaller,
      ": value must be (..., S, Ev) with S == ", key.size(-2), " (the key's length), got ",
      value.sizes());

  TORCH_CHECK(
      torch::isFloatingType(query.scalar_type()), kSdpaCaller,
      ": query must have a floating-point dtype, got ", query.scalar_type());
  TORCH_CHECK(
      key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type(),
      kSdpaCaller, ": key and value must have the query's dtype ", query.scalar_type(),
      ", got key ", key.scalar_type(), " and value ", value.scalar_type());
  TORCH_CHECK(
      key.device() == query.device() && value.device() == query.device(), kSdpaCaller,
      ": key and value must be on the query's device ", query.device(), ", got key on ",
      key.device(), " and value on ", value.device());
}

void check_attn_mask(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& mask) {
  if (mask.defined()) {
    detail::check_mask_dtype_and_device(kSdpaCaller, "attn_mask", mask, query);
    auto scores_shape = query.sizes().vec();
    scores_shape.back() = key.size(-2); // (..., L, S)
    bool broadcastable = mask.dim() <= static_cast<int64_t>(scores_shape.size());
    for (int64_t i = 1; broadcastable && i <= mask.dim(); ++i) {
      const auto m = mask.size(-i);
      broadcastable = m == 1 || m == scores_shape[scores_shape.size() - i];
    }
    TORCH_CHECK(
        broadcastable, kSdpaCaller,
        ": attn_mask must be broadcastable to the scores' shape (..., L, S) = ",
        torch::IntArrayRef(scores_shape), ", got ", mask.sizes());
  }
}

void check_option_values(const SDPAOptions& options) {
  TORCH_CHECK(
      options.dropout_p() >= 0.0 && options.dropout_p() <= 1.0, kSdpaCaller,
      ": dropout_p must be in [0, 1], got ", options.dropout_p());
  TORCH_CHECK(
      !options.scale() || std::isfinite(*options.scale()), kSdpaCaller,
      ": scale must be a finite number, got ", *options.scale());
  TORCH_CHECK(
      !options.window() || *options.window() > 0, kSdpaCaller,
      ": window must be a positive number of keys, got ", *options.window());
  TORCH_CHECK(
      std::abs(options.query_offset()) <= detail::kMaxQueryOffset, kSdpaCaller,
      ": query_offset must be within ±2^60, got ", options.query_offset());
}

// (..., T, F) as (B, H, T, F), a view whenever there are at most 4 dims.
torch::Tensor as_4d(const torch::Tensor& t) {
  switch (t.dim()) {
    case 2: return t.unsqueeze(0).unsqueeze(0);
    case 3: return t.unsqueeze(0);
    case 4: return t;
    default: return t.flatten(0, t.dim() - 4);
  }
}

// query's shape with its last dim replaced: (..., L, last).
std::vector<int64_t> with_last_dim(const torch::Tensor& query, int64_t last) {
  auto shape = query.sizes().vec();
  shape.back() = last;
  return shape;
}

// `mask` expanded to the scores' shape of query and key, as (B, H, L, S).
torch::Tensor scores_mask(
    const torch::Tensor& mask,
    const torch::Tensor& query,
    const torch::Tensor& key) {
  return as_4d(mask.expand(with_last_dim(query, key.size(-2))));
}

// The request as attn's backends read it (kernels/attention_params.h):
// the inputs as (B, H, ·, ·), views whenever there are at most 4 dims, and
// the mask expanded to the scores' shape; the modifiers' tensors in
// `score_dtype` (the inputs' dtype unless given).
detail::AttentionParams attention_params(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const SDPAOptions& options,
    c10::optional<torch::ScalarType> score_dtype = c10::nullopt) {
  const auto& mask = options.attn_mask();
  detail::AttentionParams params;
  params.q = as_4d(query);
  params.k = as_4d(key);
  params.v = as_4d(value);
  if (mask.defined()) {
    params.mask = scores_mask(mask, query, key);
  }
  params.scale = options.scale().value_or(1.0 / std::sqrt(static_cast<double>(query.size(-1))));
  params.causal = options.is_causal();
  params.query_offset = options.query_offset();
  params.window = std::min(options.window().value_or(0), detail::kUnboundedWindow);
  params.dropout.p = options.training() ? options.dropout_p() : 0.0;
  if (options.block_mask().defined()) {
    const auto& block_mask = *options.block_mask().data();
    if (!block_mask.band_only) {
      params.blocks = block_mask.blocks;
    }
    if (block_mask.band.causal) { // check_block_mask: the options' band, if any, is the same
      params.causal = true;
      params.window = block_mask.band.window;
    }
  }
  params.modifiers = detail::score_modifiers(
      options, params.H(), params.L(), params.S(), score_dtype.value_or(params.q.scalar_type()));
  return params;
}

// params with the blocks of its bool mask where the fused kernel's tiled
// loops run: they skip the blocks the mask hides and test no element of
// those it leaves whole.
detail::AttentionParams with_bool_mask_blocks(
    const detail::KernelPlan& plan,
    detail::AttentionParams params) {
  if (plan.fused_loops == detail::FusedLoops::tiled && params.mask.defined() &&
      params.mask.scalar_type() == torch::kBool && !params.blocks.defined()) {
    params.blocks = detail::blocks_of_bool_mask(params.mask);
  }
  return params;
}

// params for the math path, which reads every mask as one tensor: a block
// mask's pairs (blocks and band) join the mask, expanded to (B, H, L, S).
detail::AttentionParams with_dense_block_mask(
    detail::AttentionParams params,
    const SDPAOptions& options) {
  if (!options.block_mask().defined()) {
    return params;
  }
  const auto dense = options.block_mask().to_dense().to(params.q.device());
  params.mask = detail::intersect_masks({params.mask, dense}, params.q.scalar_type())
                    .expand({params.B(), params.H(), params.L(), params.S()});
  params.blocks = {};
  return params;
}

// attn's backend on `params` as `plan` says: the output (B, H, L, Dv)
// and, with `need_weights`, the weights (B, H, L, S).
std::tuple<torch::Tensor, torch::Tensor> run_attn_backend(
    const detail::CallPlan& plan,
    const detail::AttentionParams& params,
    bool need_weights) {
  const auto& kernel = plan.kernel;
  switch (plan.backend) {
    case AttentionBackend::fused_cpu:
      return {
          detail::fused_attention(kernel, with_bool_mask_blocks(kernel, params)), torch::Tensor()};
    case AttentionBackend::fused_cpu_weights: {
      const auto result = detail::tiled_forward_with_weights(kernel.cpu, params);
      return {result.out, need_weights ? result.weights : torch::Tensor()};
    }
    case AttentionBackend::batched_cpu:
      return detail::batched_attention(kernel, params, need_weights);
    case AttentionBackend::math:
    case AttentionBackend::libtorch: break;
  }
  const auto [output, weights] = detail::math_attention(params);
  return {output, need_weights ? weights : torch::Tensor()};
}

// LibTorch's kernel on the request. Masks, windows and causal bands it
// cannot express with its causal flag reach it as one explicit mask, with
// rows that see no key let through and zeroed after, so that they are zero
// (with zero gradients) as attn defines them on every version and device.
torch::Tensor run_libtorch(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const SDPAOptions& options) {
  const double dropout_p = options.training() ? options.dropout_p() : 0.0;
  const auto output_shape = with_last_dim(query, value.size(-1));
  const auto L = query.size(-2), S = key.size(-2);
  if (!detail::needs_explicit_mask(options, L, S)) {
    return detail::native_attention(
               as_4d(query), as_4d(key), as_4d(value), dropout_p, options.is_causal(),
               options.scale())
        .reshape(output_shape);
  }
  const auto [mask, empty_rows] = detail::without_empty_rows(
      detail::explicit_mask(options, L, S, query.scalar_type(), query.device()));
  // The mask broadcasts against the 4-d view as against the query, unless
  // that view merged leading dims.
  const auto mask_4d = query.dim() > 4 ? as_4d(mask.expand(with_last_dim(query, S))) : mask;
  const auto output = detail::native_attention(
      as_4d(query), as_4d(key), as_4d(value), dropout_p, /*is_causal=*/false, options.scale(),
      mask_4d);
  return output.reshape(output_shape).masked_fill(empty_rows, 0.0);
}

// The request as attn's backends read it in the plan's dtypes: the
// inputs in its compute dtype (half-precision inputs converted whole into
// float32 where it says so, their results rounded once after), a floating
// mask in its mask dtype; the modifiers' tensors float for half-precision
// inputs, which the kernels read in float.
detail::AttentionParams params_of_plan(
    const detail::CallPlan& plan,
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const SDPAOptions& options) {
  const bool half_on_cpu = query.device().is_cpu() &&
      detail::is_half_precision(query.scalar_type());
  auto params = half_on_cpu ? attention_params(query, key, value, options, torch::kFloat)
                            : attention_params(query, key, value, options);
  const auto& mask = options.attn_mask();
  if (mask.defined() && mask.is_floating_point() && mask.scalar_type() != plan.mask_dtype) {
    params.mask = scores_mask(mask.to(plan.mask_dtype), query, key);
  }
  if (params.q.scalar_type() != plan.compute_dtype) {
    params.q = params.q.to(plan.compute_dtype);
    params.k = params.k.to(plan.compute_dtype);
    params.v = params.v.to(plan.compute_dtype);
  }
  return params;
}

// The fused kernel's dropout stream is keyed by the next 64 bits of
// LibTorch's default CPU generator, so that torch::manual_seed reproduces
// it. (The math path draws through torch::dropout; no seed is taken for it,
// so that its draw stays LibTorch's own.)
uint64_t next_dropout_seed() {
  auto generator = at::detail::getDefaultCPUGenerator();
  const std::lock_guard<std::mutex> lock(generator.mutex());
  return at::check_generator<at::CPUGeneratorImpl>(generator)->random64();
}

// Runs the checked request as `plan` says; `qkv` is undefined, or the
// tensor whose heads_of_projection are query, key and value.
std::tuple<torch::Tensor, torch::Tensor> run_plan(
    const detail::CallPlan& plan,
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const SDPAOptions& options,
    const torch::Tensor& qkv = {}) {
  if (plan.backend == AttentionBackend::libtorch) {
    return {run_libtorch(query, key, value, options), torch::Tensor()};
  }
  auto params = params_of_plan(plan, query, key, value, options);
  if (params.q.scalar_type() == query.scalar_type()) {
    params.qkv = qkv;
  }
  if (plan.backend == AttentionBackend::fused_cpu && params.dropout.active()) {
    params.dropout.seed = next_dropout_seed();
  }
  if (plan.backend == AttentionBackend::math) {
    params = with_dense_block_mask(std::move(params), options);
  }
  const auto [output, weights] = run_attn_backend(plan, params, options.need_weights());
  const auto dtype = query.scalar_type();
  return {
      output.reshape(with_last_dim(query, value.size(-1))).to(dtype),
      weights.defined() ? weights.reshape(with_last_dim(query, key.size(-2))).to(dtype) : weights};
}

// Every check of the arguments, once, at the API boundary; then the plan.
detail::CallPlan checked_plan(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const SDPAOptions& options) {
  check_leading_dims(query, key, value, options);
  check_features_dtypes_and_devices(query, key, value);
  check_attn_mask(query, key, options.attn_mask());
  check_option_values(options);
  detail::check_score_modifiers(kSdpaCaller, query, options);
  detail::check_block_mask(kSdpaCaller, query, key, options);
  return detail::plan_call(query, key, value, options);
}

} // namespace

AttentionBackend select_backend(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const SDPAOptions& options) {
  return checked_plan(query, key, value, options).backend;
}

std::tuple<torch::Tensor, torch::Tensor> scaled_dot_product_attention(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const SDPAOptions& options) {
  return run_plan(checked_plan(query, key, value, options), query, key, value, options);
}

torch::Tensor alibi_slopes(int64_t num_heads) {
  TORCH_CHECK(num_heads > 0, "alibi_slopes: num_heads must be positive, got ", num_heads);
  // The paper's sequence for n heads, n a power of 2: 2^(-8k/n), k = 1..n.
  const auto geometric = [](int64_t n) {
    return torch::pow(
        2.0, torch::arange(1, n + 1, torch::kDouble) * (-8.0 / static_cast<double>(n)));
  };
  int64_t power = 1;
  while (power * 2 <= num_heads) {
    power *= 2;
  }
  if (power == num_heads) {
    return geometric(num_heads).to(torch::kFloat);
  }
  // Otherwise, as the paper's code does: the sequence of the power of 2
  // below, then every other slope of twice that, for the remaining heads.
  const auto rest = geometric(2 * power).slice(0, 0, 2 * (num_heads - power), 2);
  return torch::cat({geometric(power), rest}).to(torch::kFloat);
}

namespace detail {

std::tuple<torch::Tensor, torch::Tensor> attention_over_projection(
    const torch::Tensor& qkv,
    const SDPAOptions& options) {
  TORCH_INTERNAL_ASSERT(
      qkv.dim() == 5 && qkv.size(2) == 3, "the heads of one projection are (B, L, 3, H, D), got ",
      qkv.sizes());
  const auto heads = heads_of_projection(qkv);
  const auto plan = checked_plan(heads.q, heads.k, heads.v, options);
  return run_plan(plan, heads.q, heads.k, heads.v, options, qkv);
}

} // namespace detail

} // namespace attn
