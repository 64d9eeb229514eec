#pragma once

// Everything attn knows about masks, in one place: the band of keys that
// `is_causal` and `window` leave visible (as index bounds for the kernels
// and as a bool tensor for the math path and the module), the bounds that
// keep position arithmetic in int64, the checks every mask argument passes,
// and the combination of several masks into one.
//
// Conventions: a bool mask is true where a query *may attend*; a floating
// mask is added to the scaled scores, -inf forbidding a pair.

#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>

namespace attn::detail {

// Query offsets are bounded by 2^60 (no tensor is that long), so every
// query-key distance is below 2^61 and a window of 2^62 reaches every key:
// with both bounds, positions and distances stay in int64.
constexpr int64_t kMaxQueryOffset = int64_t{1} << 60;
constexpr int64_t kUnboundedWindow = int64_t{1} << 62;

// The keys [begin(i), end(i)) that query i sees under SDPAOptions' rules:
// query i stands at key position i + query_offset; `causal` hides the keys
// after it, a positive `window` the keys at a distance of `window` or more.
// Both bounds are nondecreasing in i, so a tile of queries sees
// [begin(first row), end(last row)).
struct KeyBand {
  bool causal = false;
  int64_t query_offset = 0;
  int64_t window = 0; // 0: none; at most kUnboundedWindow
  int64_t S = 0;

  int64_t begin(int64_t i) const {
    return window > 0 ? std::clamp<int64_t>(i + query_offset - window + 1, 0, S) : 0;
  }

  int64_t end(int64_t i) const {
    if (causal) {
      return std::clamp<int64_t>(i + query_offset + 1, 0, S);
    }
    return window > 0 ? std::clamp<int64_t>(i + query_offset + window, 0, S) : S;
  }
};

// The same band as an (L, S) bool tensor: true where query i may see key j.
torch::Tensor visible_band(
    int64_t L,
    int64_t S,
    int64_t query_offset,
    bool causal,
    const c10::optional<int64_t>& window,
    torch::Device device);

// `mask` (named `name` in messages) must be bool or of `query`'s floating
// dtype, and live on `query`'s device. `caller` prefixes the message.
void check_mask_dtype_and_device(
    const char* caller,
    const char* name,
    const torch::Tensor& mask,
    const torch::Tensor& query);

// A bool mask as an additive one of `dtype` (0 allowed, -inf forbidden);
// a floating mask unchanged.
torch::Tensor as_additive_mask(const torch::Tensor& mask, torch::ScalarType dtype);

// The pairs that every mask allows; the masks broadcast against each other
// and undefined ones are skipped (none defined: undefined). All bool: the
// result is bool; otherwise the sum of their additive forms.
torch::Tensor intersect_masks(std::initializer_list<torch::Tensor> masks, torch::ScalarType dtype);

// `mask` (..., S) with `extra` more keys at the end that every query sees.
torch::Tensor allow_extra_keys(const torch::Tensor& mask, int64_t extra);

} // namespace attn::detail
