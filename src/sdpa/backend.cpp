#include "sdpa/backend.h"

#include "kernels/cpu/isa.h"
#include "kernels/cpu/short_heads.h"
#include "kernels/cpu/tile_product.h"

#include "runtime/compat.h"
#include "sdpa/masks.h"
#include "sdpa/score_modifiers.h"

#include <torch/torch.h>

#include <iterator>
#include <sstream>

namespace attn {

const char* backend_name(AttentionBackend backend) {
  switch (backend) {
    case AttentionBackend::fused_cpu: return "fused_cpu";
    case AttentionBackend::fused_cpu_weights: return "fused_cpu_weights";
    case AttentionBackend::batched_cpu: return "batched_cpu";
    case AttentionBackend::libtorch: return "libtorch";
    case AttentionBackend::math: return "math";
  }
  return "unknown";
}

std::ostream& operator<<(std::ostream& stream, AttentionBackend backend) {
  return stream << backend_name(backend);
}

const char* cpu_capability_name(CpuCapability capability) {
  return detail::cpu_level_name(detail::cpu_level_of(capability));
}

std::ostream& operator<<(std::ostream& stream, CpuCapability capability) {
  return stream << cpu_capability_name(capability);
}

std::vector<CpuCapability> cpu_capabilities() {
  std::vector<CpuCapability> capabilities;
  for (const auto level : detail::cpu_levels()) {
    capabilities.push_back(detail::cpu_capability_of(level));
  }
  return capabilities;
}

namespace detail {

CpuLevel cpu_level_of(CpuCapability capability) {
  switch (capability) {
    case CpuCapability::portable: return CpuLevel::portable;
    case CpuCapability::avx2: return CpuLevel::avx2;
    case CpuCapability::avx512: return CpuLevel::avx512;
    case CpuCapability::avx512_bf16: return CpuLevel::avx512_bf16;
    case CpuCapability::amx: return CpuLevel::amx;
  }
  return CpuLevel::portable;
}

CpuCapability cpu_capability_of(CpuLevel level) {
  switch (level) {
    case CpuLevel::portable: return CpuCapability::portable;
    case CpuLevel::avx2: return CpuCapability::avx2;
    case CpuLevel::avx512: return CpuCapability::avx512;
    case CpuLevel::avx512_bf16: return CpuCapability::avx512_bf16;
    case CpuLevel::amx: return CpuCapability::amx;
  }
  return CpuCapability::portable;
}

namespace {

constexpr const char* kScoreModifierNames =
    "alibi_slopes, softcap, position_bias, sinks, score_function";

bool dropout_active(const SDPAOptions& options) {
  return options.training() && options.dropout_p() > 0.0;
}

bool inputs_need_grad(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value) {
  return torch::GradMode::is_enabled() &&
      (query.requires_grad() || key.requires_grad() || value.requires_grad());
}

// Whether a score modifier's tensor (slopes, table, sinks) needs a gradient.
bool modifiers_need_grad(const SDPAOptions& options) {
  return torch::GradMode::is_enabled() &&
      (options.alibi_slopes().requires_grad() || options.position_bias().requires_grad() ||
       options.sinks().requires_grad());
}

bool mask_needs_grad(const SDPAOptions& options) {
  const auto& mask = options.attn_mask();
  return mask.defined() && mask.requires_grad() && torch::GradMode::is_enabled();
}

// What one of attn's CPU kernels computes beyond plain attention.
struct CpuKernelAbilities {
  bool drops_weights = false;       // dropout while training
  bool modifies_scores = false;     // SDPAOptions' score modifiers
  bool differentiates_mask = false; // a floating attn_mask's gradient
};

// Whether the request needs what `abilities` says the kernel lacks; the
// device: attn's CPU kernels run on the CPU.
std::string cpu_kernel_reason(
    const torch::Tensor& query,
    const SDPAOptions& options,
    const CpuKernelAbilities& abilities) {
  std::ostringstream reason;
  if (!query.device().is_cpu()) {
    reason << "runs on the CPU only, and the inputs are on " << query.device();
  } else if (dropout_active(options) && !abilities.drops_weights) {
    reason << "has no dropout, and dropout_p is " << options.dropout_p() << " while training";
  } else if (has_score_modifiers(options) && !abilities.modifies_scores) {
    reason << "has no score modifiers (" << kScoreModifierNames << ")";
  } else if (mask_needs_grad(options) && !abilities.differentiates_mask) {
    reason << "gives the attn_mask no gradient, and it requires one";
  }
  return reason.str();
}

std::string fused_cpu_reason(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const SDPAOptions& options,
    bool with_weights) {
  std::ostringstream reason;
  // The weights kernel is inference's: no dropout, no gradients.
  const CpuKernelAbilities abilities{!with_weights, true, !with_weights};
  if (const auto common = cpu_kernel_reason(query, options, abilities); !common.empty()) {
    reason << common;
  } else if (with_weights && inputs_need_grad(query, key, value)) {
    reason << "is not differentiable, and the inputs require grad";
  } else if (with_weights && modifiers_need_grad(options)) {
    reason << "is not differentiable, and a score modifier's tensor requires grad";
  } else if (!with_weights && options.need_weights()) {
    reason << "returns no weights: set need_weights(false)";
  }
  return reason.str();
}

std::string libtorch_reason(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const SDPAOptions& options) {
  std::ostringstream reason;
  if (!kHasNativeAttention) {
    reason << "needs LibTorch 2.0 or later, and this is " << TORCH_VERSION;
  } else if (options.scale() && !kNativeAttentionTakesScale) {
    reason << "takes a custom scale from LibTorch 2.1 on, and this is " << TORCH_VERSION;
  } else if (options.scale() && *options.scale() <= 0.0) {
    // Some 2.x versions scale query and key by sqrt(scale) each.
    reason << "takes only a positive scale, got " << *options.scale();
  } else if (options.need_weights()) {
    reason << "returns no weights: set need_weights(false)";
  } else if (has_score_modifiers(options)) {
    reason << "has no score modifiers (" << kScoreModifierNames << ")";
  } else if (options.block_mask().defined()) {
    reason << "takes no block_mask";
  } else if (mask_needs_grad(options)) {
    reason << "gives the attn_mask no gradient here, and it requires one";
  } else if (query.numel() == 0 || key.numel() == 0 || value.numel() == 0) {
    reason << "needs non-empty query, key and value";
  } else if (options.enable_gqa() && query.size(-3) != key.size(-3)) {
    reason << "needs as many key/value heads as query heads, got " << query.size(-3) << " and "
           << key.size(-3);
  } else if (options.training() && options.dropout_p() >= 1.0) {
    // attn's dropout_p = 1 keeps nothing: a zero output.
    reason << "cannot drop every weight (dropout_p = 1)";
  }
  return reason.str();
}

// LibTorch's fused CPU kernel takes query, key and value of one feature
// size with unit stride in it; other requests fall back to its math path,
// which holds the L×S scores.
bool libtorch_fused_cpu_kernel_applies(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value) {
  return value.size(-1) == query.size(-1) && query.stride(-1) == 1 && key.stride(-1) == 1 &&
      value.stride(-1) == 1;
}

// The condition of the rule `cpu-libtorch-faster` (docs/BACKENDS.md, which
// states it and links the measurements behind it): where LibTorch's fused
// CPU kernel outran attn's, for a request both can run.
bool libtorch_faster_on_cpu(const BackendRequest& r) {
  const auto& [query, key, value, options, level] = r;
  // Masks, windows and non-square causal bands were not measured: attn.
  // Dropout: LibTorch's fused CPU kernel has none (its math path would run).
  if (!kLibTorchCpuRuleMeasured || !libtorch_fused_cpu_kernel_applies(query, key, value) ||
      needs_explicit_mask(options, query.size(-2), key.size(-2)) || dropout_active(options)) {
    return false;
  }
  const int64_t S = key.size(-2);
  const int64_t rows = query.size(-2) * query.size(-1);
  const int64_t heads = rows > 0 ? query.numel() / rows : 0; // batch × heads
  // The machine the rule was measured on had AVX-512 (LibTorch's float32
  // kernel) and AMX (its bfloat16 products); elsewhere attn keeps its own
  // kernel.
  switch (query.scalar_type()) {
    case torch::kFloat:
      return level >= CpuLevel::avx512 &&
          ((S <= 64 && !short_heads_run(cpu_loops(level), torch::kFloat, query.size(-2), S)) ||
           (!options.is_causal() && S >= 2048 && heads >= 32));
    // bfloat16: attn's kernel computes it in bfloat16 on AMX, and trains
    // 1.5-3.7x faster than LibTorch's; LibTorch's forward alone stays
    // 1.0-1.6x faster. Without AMX, attn: on Zen 4's AVX512-BF16 its
    // forward ran 1.5-3.6x LibTorch's, its training 1.5-3.7x.
    case torch::kBFloat16: return level == CpuLevel::amx && !inputs_need_grad(query, key, value);
    default: return false;
  }
}

// The dtype whose loops the rules below consult for a request: float32
// for half precision, which takes the loops float32 takes (the plan's
// compute dtype aside: sdpa/plan.cpp).
torch::ScalarType computed_on_cpu(const torch::Tensor& query) {
  return query.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
}

// Whether the fused kernel's tiled loops multiply bfloat16 in bfloat16 at
// `level`, as the CPU's flags say (the plan's half_products_pay reads
// what this build runs, which a rule must not: every compiler's build
// chooses alike; a build without AMX's loops computes the request in
// float32 on the same kernel): on AMX, or AMD's AVX512-BF16.
bool bf16_loops_at(CpuLevel level) {
  return level == CpuLevel::amx ||
      (level >= CpuLevel::avx512_bf16 && cpu_features().vendor == CpuVendor::amd);
}

// The condition of the rule `cpu-short-sequences` (docs/BACKENDS.md; the
// measurements in docs/design/cpu-kernels.md, "Short sequences"): where
// attn's batched kernel outran its tiled one, whose per-head products are
// too small there to pay for a loop each.
bool batched_cpu_faster(const BackendRequest& r) {
  const auto& [query, key, value, options, level] = r;
  const int64_t L = query.size(-2), S = key.size(-2);
  const int64_t longest = kLibTorchCpuRuleMeasured ||
          !tile_products_run(cpu_loops(level), computed_on_cpu(query))
      ? 64
      : 32;
  // The batched kernel computes half precision in float (a matrix of the
  // batch at a time). Where the CPU multiplies bfloat16 in bfloat16 for
  // attn's loops, they ran as fast or faster (Zen 4, head width 64; AMX
  // unmeasured): the tiled loops without weights at T = 128 without a
  // causal mask (1.34-1.57x, forward and forward + backward), the weights
  // kernel with weights for inference at T = 16 ... 128 (0.99-1.6x).
  // Weights with gradients, which only the batched kernel computes, reach
  // it by a later rule. float16, which both compute in float, ran
  // 0.89-0.94x the tiled loops' time on the batched kernel, and 0.88-0.96x
  // the weights kernel's.
  if (query.scalar_type() == torch::kBFloat16 && bf16_loops_at(level)) {
    return false;
  }
  return (L <= longest && S <= longest) ||
      (!options.is_causal() && L <= 128 && S <= 128 && query.size(-1) >= 64);
}

// The condition of the rule `cpu-short-heads` (docs/BACKENDS.md; the
// measurements in docs/design/cpu-kernels.md, "Short heads"): wherever the
// fused kernel's short loops run (kernels/cpu/short_heads.h).
bool short_heads_faster(const BackendRequest& r) {
  return short_heads_run(
      cpu_loops(r.level), computed_on_cpu(r.query), r.query.size(-2), r.key.size(-2));
}

} // namespace

std::string unsupported_reason(
    AttentionBackend backend,
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const SDPAOptions& options) {
  switch (backend) {
    case AttentionBackend::fused_cpu:
      return fused_cpu_reason(query, key, value, options, /*with_weights=*/false);
    case AttentionBackend::fused_cpu_weights:
      return fused_cpu_reason(query, key, value, options, /*with_weights=*/true);
    case AttentionBackend::batched_cpu: return cpu_kernel_reason(query, options, {});
    case AttentionBackend::libtorch: return libtorch_reason(query, key, value, options);
    case AttentionBackend::math: return {};
  }
  return "is not a backend";
}

namespace {

bool on_cpu(const BackendRequest& r) {
  return r.query.device().is_cpu();
}

bool can_run(AttentionBackend backend, const BackendRequest& r) {
  return unsupported_reason(backend, r.query, r.key, r.value, r.options).empty();
}

// The rules of docs/BACKENDS.md, in its order: the first rule whose
// backend can compute the request and whose condition holds chooses.
// Each condition is named by the rule; the measurements behind it are
// cited where it is defined above.
constexpr BackendRule kBackendRules[] = {
    {"cpu-libtorch-faster", AttentionBackend::libtorch,
     [](const BackendRequest& r) {
       return on_cpu(r) && can_run(AttentionBackend::fused_cpu, r) && libtorch_faster_on_cpu(r);
     }},
    {"cpu-short-heads", AttentionBackend::fused_cpu,
     [](const BackendRequest& r) { return on_cpu(r) && short_heads_faster(r); }},
    {"cpu-short-sequences", AttentionBackend::batched_cpu,
     [](const BackendRequest& r) { return on_cpu(r) && batched_cpu_faster(r); }},
    {"cpu-weights-for-inference", AttentionBackend::fused_cpu_weights,
     [](const BackendRequest& r) { return on_cpu(r) && r.options.need_weights(); }},
    {"cpu-weights-with-gradients", AttentionBackend::batched_cpu,
     [](const BackendRequest& r) { return on_cpu(r) && r.options.need_weights(); }},
    {"cpu-fused", AttentionBackend::fused_cpu, on_cpu},
    {"cuda-libtorch", AttentionBackend::libtorch,
     [](const BackendRequest& r) { return r.query.device().is_cuda(); }},
    {"math", AttentionBackend::math, [](const BackendRequest&) { return true; }},
};

} // namespace

c10::ArrayRef<BackendRule> backend_rules() {
  return kBackendRules;
}

const BackendRule& deciding_rule(const BackendRequest& request) {
  for (const auto& rule : kBackendRules) {
    if (can_run(rule.backend, request) && rule.applies(request)) {
      return rule;
    }
  }
  return kBackendRules[std::size(kBackendRules) - 1]; // math runs everything
}

bool needs_tiled_loops(const SDPAOptions& options) {
  return dropout_active(options) || has_score_modifiers(options) || mask_needs_grad(options);
}

FusedLoops fused_cpu_loops(
    const CpuLoops& loops,
    torch::ScalarType dtype,
    int64_t L,
    int64_t S,
    bool plain) {
  const auto computed = is_half_precision(dtype) ? torch::kFloat : dtype;
  return plain && short_heads_run(loops, computed, L, S) ? FusedLoops::short_heads
                                                         : FusedLoops::tiled;
}

bool half_products_pay(const CpuLoops& loops, torch::ScalarType dtype) {
  return dtype == torch::kBFloat16 ? bf16_products_outrun_float(loops)
                                   : dtype == torch::kHalf && half_products_run(loops);
}

} // namespace detail
} // namespace attn
