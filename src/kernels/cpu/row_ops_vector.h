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

} // namespace
} // namespace attn::detail
