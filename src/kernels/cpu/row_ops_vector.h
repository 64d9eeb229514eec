#pragma once

// The float row operations of row_ops.h, written once over vectors of
// kLanes floats with lanes.h's helpers, for the files of each instruction
// set (vector_loops_avx512.cpp, vector_loops_avx2.cpp), under the same
// conventions as lanes.h. A row's last, partial vector is read from and
// written back through a vector's worth of stack, padded with -inf (which
// neither wins a max nor adds to a sum: its exp is 0).

namespace attn::detail {
namespace {

// The lanes of x[j, j + count), count < kLanes, the others -inf.
ATTN_INLINE Lanes load_partial(const float* x, int64_t count) {
  float lanes[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) {
    lanes[i] = i < count ? x[i] : -kInfinity;
  }
  return load(lanes);
}

ATTN_INLINE void store_partial(float* x, int64_t count, const Lanes& v) {
  float lanes[kLanes];
  store(lanes, v);
  std::memcpy(x, lanes, static_cast<size_t>(count) * sizeof(float));
}

float row_max_lanes(const float* x, int64_t n) {
  Lanes best = splat(-kInfinity);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    best = lane_max(best, load(x + j));
  }
  if (j < n) {
    best = lane_max(best, load_partial(x + j, n - j));
  }
  return reduce<true>(best);
}

float exp_shifted_sum_lanes(float* x, int64_t n, float shift) {
  const Lanes shifts = splat(shift);
  Lanes sum{};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const Lanes e = exp_lanes(load(x + j) - shifts);
    store(x + j, e);
    sum += e;
  }
  if (j < n) {
    const Lanes e = exp_lanes(load_partial(x + j, n - j) - shifts);
    store_partial(x + j, n - j, e);
    sum += e;
  }
  return reduce<false>(sum);
}

// tanh(a) for 0 <= a < kTanhSeriesEnd by its Taylor series to a^15
// (truncation below 2e-8 relative there): a·Σ c_k·a^2k, highest first.
constexpr float kTanhSeriesEnd = 0.5f;
constexpr std::array<float, 8> kTanhSeries{
    -929569.0f / 638512875.0f, 21844.0f / 6081075.0f, -1382.0f / 155925.0f, 62.0f / 2835.0f,
    -17.0f / 315.0f,           2.0f / 15.0f,          -1.0f / 3.0f,         1.0f};

// tanh(y) per lane: the series near 0, where (1 - e) / (1 + e) with
// e = exp(-2|y|) would cancel, and that quotient beyond; the sign of y.
ATTN_INLINE Lanes tanh_lanes(const Lanes& y) {
  const LaneBits sign = bits_of(y) & static_cast<int32_t>(0x80000000U);
  const Lanes a = floats_of(bits_of(y) & 0x7FFFFFFF);
  const Lanes a2 = a * a;
  Lanes series = splat(kTanhSeries[0]);
#pragma GCC unroll 8
  for (size_t i = 1; i < kTanhSeries.size(); ++i) {
    series = series * a2 + kTanhSeries[i];
  }
  const Lanes e = exp_lanes(-2.0f * a);
  const Lanes t = select(a < kTanhSeriesEnd, series * a, (1.0f - e) / (1.0f + e));
  return floats_of(bits_of(t) | sign);
}

// x[j] = cap·tanh(x[j] / cap), and slopes[j] = 1 - tanh² (its derivative)
// where slopes is not null.
void softcap_row_lanes(float* x, int64_t n, float cap, float* slopes) {
  const float inverse = 1.0f / cap;
  int64_t j = 0;
  for (; j < n; j += kLanes) {
    const int64_t count = std::min<int64_t>(kLanes, n - j);
    const Lanes t = tanh_lanes(
        (count == kLanes ? load(x + j) : load_partial(x + j, count)) * inverse);
    const Lanes slope = (1.0f - t) * (1.0f + t);
    if (count == kLanes) {
      store(x + j, t * cap);
      if (slopes != nullptr) {
        store(slopes + j, slope);
      }
    } else {
      store_partial(x + j, count, t * cap);
      if (slopes != nullptr) {
        store_partial(slopes + j, count, slope);
      }
    }
  }
}

} // namespace
} // namespace attn::detail
