#pragma once

// Every LibTorch call that differs between versions, each behind one
// TORCH_VERSION_MAJOR / TORCH_VERSION_MINOR guard; the rest of attn is
// written once against the API that 1.13 and 2.x share.

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
