#pragma once

// Every LibTorch call that differs between versions, each behind one
// TORCH_VERSION_MAJOR / TORCH_VERSION_MINOR guard; the rest of attn is
// written once against the API that 1.13 and 2.x share.

#include <ATen/autocast_mode.h>
#include <torch/types.h>
#include <torch/version.h>

// c10::Allocator::allocate lost its const in LibTorch 2.3, when copy_data
// arrived; an allocator written for both versions declares
// `c10::DataPtr allocate(size_t) ATTN_ALLOCATE_CONST override`.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
#define ATTN_ALLOCATE_CONST
#else
#define ATTN_ALLOCATE_CONST const
#endif

namespace attn::detail {

// at::scaled_dot_product_attention arrived in LibTorch 2.0, its `scale`
// argument in 2.1.
constexpr bool kHasNativeAttention = TORCH_VERSION_MAJOR >= 2;
constexpr bool kNativeAttentionTakesScale = TORCH_VERSION_MAJOR > 2 ||
    (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1);

// The LibTorch version whose CPU attention attn's backend rule was measured
// against (docs/BACKENDS.md, cpu-libtorch-faster); the rule applies from there on.
constexpr bool kLibTorchCpuRuleMeasured = TORCH_VERSION_MAJOR > 2 ||
    (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 15);

// The dtype LibTorch's autocast computes matrix products in on `t`'s
// device, where it is on for that device and would cast `t` (floating,
// not float64); else none. LibTorch 2.4 named autocast's switches by
// device type.
inline c10::optional<torch::ScalarType> autocast_dtype(const torch::Tensor& t) {
  if (!t.is_floating_point() || t.scalar_type() == torch::kDouble) {
    return c10::nullopt;
  }
  const auto type = t.device().type();
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  const bool on = (type == torch::kCPU || type == torch::kCUDA) &&
      at::autocast::is_autocast_enabled(type);
  return on ? c10::optional<torch::ScalarType>(at::autocast::get_autocast_dtype(type))
            : c10::nullopt;
#else
  if (type == torch::kCPU && at::autocast::is_cpu_enabled()) {
    return at::autocast::get_autocast_cpu_dtype();
  }
  if (type == torch::kCUDA && at::autocast::is_enabled()) {
    return at::autocast::get_autocast_gpu_dtype();
  }
  return c10::nullopt;
#endif
}

// While alive, LibTorch's autocast is on in `dtype` for `type` (kCPU or
// kCUDA); then as it was. For tests: apps set it as users do.
class ScopedAutocast {
 public:
  ScopedAutocast(torch::DeviceType type, torch::ScalarType dtype)
      : type_(type), was_on_(enabled(type)), previous_dtype_(dtype_of(type)) {
    set(type, true, dtype);
  }
  ~ScopedAutocast() {
    set(type_, was_on_, previous_dtype_);
    at::autocast::clear_cache();
  }
  ScopedAutocast(const ScopedAutocast&) = delete;
  ScopedAutocast& operator=(const ScopedAutocast&) = delete;

 private:
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  static bool enabled(torch::DeviceType type) {
    return at::autocast::is_autocast_enabled(type);
  }
  static torch::ScalarType dtype_of(torch::DeviceType type) {
    return at::autocast::get_autocast_dtype(type);
  }
  static void set(torch::DeviceType type, bool on, torch::ScalarType dtype) {
    at::autocast::set_autocast_enabled(type, on);
    at::autocast::set_autocast_dtype(type, dtype);
  }
#else
  static bool enabled(torch::DeviceType type) {
    return type == torch::kCPU ? at::autocast::is_cpu_enabled() : at::autocast::is_enabled();
  }
  static torch::ScalarType dtype_of(torch::DeviceType type) {
    return type == torch::kCPU ? at::autocast::get_autocast_cpu_dtype()
                               : at::autocast::get_autocast_gpu_dtype();
  }
  static void set(torch::DeviceType type, bool on, torch::ScalarType dtype) {
    if (type == torch::kCPU) {
      at::autocast::set_cpu_enabled(on);
      at::autocast::set_autocast_cpu_dtype(dtype);
    } else {
      at::autocast::set_enabled(on);
      at::autocast::set_autocast_gpu_dtype(dtype);
    }
  }
#endif

  torch::DeviceType type_;
  bool was_on_;
  torch::ScalarType previous_dtype_;
};

// at::scaled_dot_product_attention on (B, H, L, E) inputs, returning the
// (B, H, L, Ev) output; `attn_mask` as LibTorch takes it (bool: true may
// attend; floating: added), undefined for none. Callers check
// kHasNativeAttention (and kNativeAttentionTakesScale for a set `scale`)
// first. `dropout_p` applies unconditionally: the caller passes 0 outside
// training.
inline torch::Tensor native_attention(
    [[maybe_unused]] const torch::Tensor& query,
    [[maybe_unused]] const torch::Tensor& key,
    [[maybe_unused]] const torch::Tensor& value,
    [[maybe_unused]] double dropout_p,
    [[maybe_unused]] bool is_causal,
    [[maybe_unused]] c10::optional<double> scale,
    [[maybe_unused]] const torch::Tensor& attn_mask = {}) {
#if TORCH_VERSION_MAJOR >= 2
  // An undefined tensor is not "no mask" to LibTorch: an empty optional is.
  const auto mask = attn_mask.defined() ? c10::optional<torch::Tensor>(attn_mask) : c10::nullopt;
#endif
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
  return at::scaled_dot_product_attention(query, key, value, mask, dropout_p, is_causal, scale);
#elif TORCH_VERSION_MAJOR == 2
  TORCH_CHECK(!scale, "at::scaled_dot_product_attention takes a scale from LibTorch 2.1 on");
  return at::scaled_dot_product_attention(query, key, value, mask, dropout_p, is_causal);
#else
  TORCH_CHECK(false, "at::scaled_dot_product_attention needs LibTorch 2.0 or later");
  return {};
#endif
}

} // namespace attn::detail
