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

namespace detail {
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

// Where LibTorch's fused CPU kernel outruns attn's, for a request both can
// run. Measured with LibTorch 2.15 on 2 cores of a Xeon with AVX-512 and
// AMX (docs/BENCHMARKS.md, "Choosing the CPU backend"): in float32
// LibTorch's kernel is faster up to 64 keys than attn's batched kernel
// (its forward up to 1.5x; with backward, GPT-2-small's layer and
// train_transformer's trained 1.0-1.1x faster through it), which it
// replaces where the fused kernel's short loops do not run, and from 2048
// keys without a causal mask where batch x heads is 32 or more (forward
// 1.04-1.18x, backward level); in between, and causal from 128 keys at every length,
// attn's tiled kernel is faster (1.05-1.25x at 1024 keys without a mask,
// 1.05-1.6x causal), forward and backward.
// In bfloat16 LibTorch multiplies on the AMX units and is 2-5x faster,
// except that training on 128 keys runs 1.5-1.7x faster through attn's
// float32 kernels. Other versions, CPUs and dtypes: attn.
bool libtorch_faster_on_cpu(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const SDPAOptions& options) {
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
  const auto& cpu = cpu_features();
  switch (query.scalar_type()) {
    case torch::kFloat:
      return cpu.avx512f &&
          ((S <= 64 && !short_heads_run(torch::kFloat, query.size(-2), S)) ||
           (!options.is_causal() && S >= 2048 && heads >= 32));
    case torch::kBFloat16: return cpu.amx_bf16 && (!inputs_need_grad(query, key, value) || S > 256);
    default: return false;
  }
}

// The dtype attn's CPU kernels compute a request in: half precision in
// float32.
torch::ScalarType computed_on_cpu(const torch::Tensor& query) {
  return query.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
}

// Where attn's batched kernel outruns its tiled one: short sequences, whose
// per-head products are too small to pay for a loop each. Measured on 2
// cores (docs/BENCHMARKS.md, "Short sequences"), forward and backward,
// D = 16 and 64, 32 to 256 heads. With LibTorch 2.15 and MKL the batched
// kernel is level to 1.3x as fast up to 64 queries and keys. With LibTorch
// 1.13, where the tiled kernel multiplies in attn's loops (float,
// AVX-512), it is up to 1.2x as fast forward up to 32, and the tiled
// kernel 1.15-1.25x as fast with backward from 48 (with AVX2's loops, on a
// Zen 2: the batched one 1.0-1.3x as fast up to 32, level at 64, slower
// from 96); where BLAS multiplies for the tiled kernel, the batched one is
// as fast up to 64. From 96 to 128 queries and keys without a causal mask
// at D = 64 it is the faster again (a Xeon with AVX-512,
// attn_training_bench --kernels: on 2.15 forward 1.28x and with backward
// 1.23x at 8 heads, 1.02x and 1.08x at 96; on 1.13 1.08x and 1.04x at 8
// heads, 0.93x at 96), but not at D = 16 (0.88-0.93x at 96 heads) nor with
// a causal mask. Other versions: as 1.13.
bool batched_cpu_faster(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const SDPAOptions& options) {
  const int64_t L = query.size(-2), S = key.size(-2);
  const int64_t longest = kLibTorchCpuRuleMeasured || !tile_products_run(computed_on_cpu(query))
      ? 64
      : 32;
  return (L <= longest && S <= longest) ||
      (!options.is_causal() && L <= 128 && S <= 128 && query.size(-1) >= 64);
}

// Where the fused kernel's short loops run (kernels/cpu/short_heads.h), they
// are the fastest of the CPU kernels without weights in nearly every case
// measured (L = S = 16 to 64). Measured on 2 cores
// of an AMD EPYC (Zen 4), LibTorch 2.15 and 1.13 (docs/BENCHMARKS.md, "Short
// heads"): at 16-64 tokens, D = 16 and 64, forward 1.3-2.6x the batched
// kernel and 1.05-2.2x LibTorch's; with backward 1.0-1.9x and 1.2-2.3x
// (on 1.13 the batched kernel was up to 1.27x faster at 32 tokens, D = 64,
// 96 heads; with AVX2 forced on that CPU, up to 1.2x at 64 keys, D = 64).
// In the module, train_transformer's layer ran forward + backward 1.2-1.4x
// as fast as the built-in, against 0.9-1.0x through LibTorch's kernel, and
// no short shape lost.
bool short_heads_faster(const torch::Tensor& query, const torch::Tensor& key) {
  return short_heads_run(computed_on_cpu(query), query.size(-2), key.size(-2));
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
       return on_cpu(r) && can_run(AttentionBackend::fused_cpu, r) &&
           libtorch_faster_on_cpu(r.query, r.key, r.value, r.options);
     }},
    {"cpu-short-heads", AttentionBackend::fused_cpu,
     [](const BackendRequest& r) { return on_cpu(r) && short_heads_faster(r.query, r.key); }},
    {"cpu-short-sequences", AttentionBackend::batched_cpu,
     [](const BackendRequest& r) {
       return on_cpu(r) && batched_cpu_faster(r.query, r.key, r.options);
     }},
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

AttentionBackend choose_backend(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const SDPAOptions& options) {
  return deciding_rule({query, key, value, options}).backend;
}

FusedLoops fused_cpu_loops(const AttentionParams& params) {
  // Only the tiled loops drop weights, modify scores and differentiate the
  // mask.
  const bool mask_needs_grad = params.mask.defined() && params.mask.requires_grad() &&
      torch::GradMode::is_enabled();
  const bool plain = !params.dropout.active() && !params.modifiers.active() && !mask_needs_grad;
  return plain && short_heads_run(params.q.scalar_type(), params.L(), params.S())
      ? FusedLoops::short_heads
      : FusedLoops::tiled;
}

ForwardResult fused_cpu_forward(const AttentionParams& params) {
  return fused_forward(fused_cpu_loops(params), params);
}

InputGradients fused_cpu_backward(
    const AttentionParams& params,
    const ForwardResult& forward,
    const torch::Tensor& grad_out) {
  return fused_backward(fused_cpu_loops(params), params, forward, grad_out);
}

} // namespace detail
} // namespace attn
