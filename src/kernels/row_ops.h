#pragma once

// Row operations of the attention kernels on raw float/double arrays:
// max, shifted exp with sum, scaling. The float versions run AVX-512 or
// AVX2+FMA code when the CPU has it (chosen once at run time) and portable
// C++ otherwise.

#include <array>
#include <cstdint>

namespace attn::detail {

// The vectorised float exp's constants, shared by every vector version
// (row_ops.cpp's 8- and 16-lane ones, short_heads.cpp's): x = k·ln2 + r
// with |r| <= ln2/2 (ln2 split in two for an exact k·ln2_hi), exp(r) by its
// Taylor polynomial to degree 7 (truncation below 1e-8 relative), highest
// coefficient first, times 2^k built in the exponent bits. Inputs below
// kExpLowest (including -inf) give 0; the attention kernels never pass
// values above 0.
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kExpLowest = -87.3f;
constexpr std::array<float, 8> kExpTaylor{
    1.0f / 5040.0f, 1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f};

// Largest of x[0..n); -inf for n == 0.
float row_max(const float* x, int64_t n);
double row_max(const double* x, int64_t n);

// x[j] = exp(x[j] - shift) in place; returns the sum of the results. An
// entry of -inf becomes 0. Callers never pass shift == -inf.
float exp_shifted_sum(float* x, int64_t n, float shift);
double exp_shifted_sum(double* x, int64_t n, double shift);

// x[j] *= factor for every j in [0, n).
template <typename T>
void scale_row(T* x, int64_t n, T factor) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    x[j] *= factor;
  }
}

// The float implementations behind the dispatch, for tests.
float exp_shifted_sum_portable(float* x, int64_t n, float shift);
// Null when this build or CPU has no AVX2+FMA.
using ExpShiftedSumFn = float (*)(float*, int64_t, float);
ExpShiftedSumFn exp_shifted_sum_avx2();
// Null when this build or CPU has no AVX-512.
ExpShiftedSumFn exp_shifted_sum_avx512();

} // namespace attn::detail
