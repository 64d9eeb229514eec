#pragma once

// The kernels' view of the masks: element access to the (B, H, L, S) mask
// through its (possibly zero, broadcast) strides, and the band of keys that
// `causal` and `window` leave visible.

#include "kernels/attention_params.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace attn::detail {

template <typename scalar_t>
constexpr scalar_t kNegativeInfinity = -std::numeric_limits<scalar_t>::infinity();

template <typename scalar_t>
struct MaskView {
  const bool* allowed = nullptr;  // bool mask: true = may attend
  const scalar_t* bias = nullptr; // additive mask
  int64_t stride_b = 0, stride_h = 0, stride_l = 0, stride_s = 0;
  KeyBand band;

  explicit MaskView(const AttentionParams& params) : band(params.key_band()) {
    const auto& mask = params.mask;
    if (!mask.defined()) {
      return;
    }
    stride_b = mask.stride(0);
    stride_h = mask.stride(1);
    stride_l = mask.stride(2);
    stride_s = mask.stride(3);
    if (mask.scalar_type() == torch::kBool) {
      allowed = mask.data_ptr<bool>();
    } else {
      bias = mask.data_ptr<scalar_t>();
    }
  }

  // The keys [tile_key_begin, tile_key_end) that some query of rows
  // [i0, i0 + rows) sees.
  int64_t tile_key_begin(int64_t i0) const { return band.begin(i0); }
  int64_t tile_key_end(int64_t i0, int64_t rows) const {
    return std::max(tile_key_begin(i0), band.end(i0 + rows - 1));
  }

  // Applies the masks to the scores of query i against keys j0 .. j0+n-1.
  void apply(scalar_t* scores, int64_t n, int64_t b, int64_t h, int64_t i, int64_t j0) const {
    const int64_t base = b * stride_b + h * stride_h + i * stride_l + j0 * stride_s;
    if (allowed != nullptr) {
      for (int64_t j = 0; j < n; ++j) {
        if (!allowed[base + j * stride_s]) {
          scores[j] = kNegativeInfinity<scalar_t>;
        }
      }
    } else if (bias != nullptr) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        scores[j] += bias[base + j * stride_s];
      }
    }
    const int64_t visible_begin = std::clamp<int64_t>(band.begin(i) - j0, 0, n);
    const int64_t visible_end = std::clamp<int64_t>(band.end(i) - j0, visible_begin, n);
    std::fill(scores, scores + visible_begin, kNegativeInfinity<scalar_t>);
    std::fill(scores + visible_end, scores + n, kNegativeInfinity<scalar_t>);
  }
};

} // namespace attn::detail
