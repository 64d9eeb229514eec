#pragma once

// Row operations of the attention kernels on raw float/double arrays:
// max, shifted exp with sum, scaling. The float versions run the vector
// loops of the call's `loops` (isa.h, row_ops_vector.h) where they have
// them, and portable C++ otherwise; the double versions portable C++.

#include "kernels/cpu/isa.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace attn::detail {

// Largest of x[0..n); -inf for n == 0.
float row_max(const CpuLoops& loops, const float* x, int64_t n);
double row_max(const CpuLoops& loops, const double* x, int64_t n);

// x[j] = exp(x[j] - shift) in place; returns the sum of the results. An
// entry of -inf becomes 0. Callers never pass shift == -inf.
float exp_shifted_sum(const CpuLoops& loops, float* x, int64_t n, float shift);
double exp_shifted_sum(const CpuLoops& loops, double* x, int64_t n, double shift);

// Logit soft-capping: x[j] = cap·tanh(x[j] / cap) for cap > 0, and, where
// `slopes` is not null, slopes[j] = 1 - tanh²(x[j] / cap), the derivative.
void softcap_row(const CpuLoops& loops, float* x, int64_t n, float cap, float* slopes);
void softcap_row(const CpuLoops& loops, double* x, int64_t n, double cap, double* slopes);

// x[j] *= factor for every j in [0, n).
template <typename T>
void scale_row(T* x, int64_t n, T factor) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    x[j] *= factor;
  }
}

// x[0..n) → its softmax, in place, its denominator joined by exp(sink)
// (a logit that multiplies nothing: a head's attention sink; -inf for
// none). A row of -inf scores without a sink becomes zeros. Returns the
// row's log-sum-exp, sink included (-inf for such a row). The one row
// softmax of every kernel that materialises weights.
template <typename T>
T softmax_row(const CpuLoops& loops, T* x, int64_t n, T sink) {
  constexpr T kNone = -std::numeric_limits<T>::infinity();
  const T largest = std::max(row_max(loops, x, n), sink);
  if (largest == kNone) {
    std::fill(x, x + n, T(0));
    return largest;
  }
  const T sum = exp_shifted_sum(loops, x, n, largest) +
      (sink == kNone ? T(0) : std::exp(sink - largest));
  scale_row(x, n, T(1) / sum);
  return largest + std::log(sum);
}

// The portable float exp behind the dispatch, for tests (the vector ones
// are in isa.h's table).
float exp_shifted_sum_portable(float* x, int64_t n, float shift);

} // namespace attn::detail
