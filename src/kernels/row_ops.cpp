#include "row_ops.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define ATTN_HAVE_X86_TARGETS 1
#include <immintrin.h>
#endif

namespace attn::detail {
namespace {

template <typename T>
T row_max_portable(const T* x, int64_t n) {
  T best = -std::numeric_limits<T>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    best = x[j] > best ? x[j] : best;
  }
  return best;
}

template <typename T>
T exp_shifted_sum_generic(T* x, int64_t n, T shift) {
  T sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    x[j] = std::exp(x[j] - shift);
    sum += x[j];
  }
  return sum;
}

#ifdef ATTN_HAVE_X86_TARGETS

// exp(x) for 8 floats.
__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
  const __m256 lowest = _mm256_set1_ps(kExpLowest);
  const __m256 underflow = _mm256_cmp_ps(x, lowest, _CMP_LT_OQ);
  x = _mm256_max_ps(lowest, x); // NaN stays NaN
  const __m256 k = _mm256_round_ps(
      _mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpTaylor[0]);
#pragma GCC unroll 8
  for (size_t i = 1; i < kExpTaylor.size(); ++i) {
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpTaylor[i]));
  }
  const __m256i two_to_k = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  const __m256 result = _mm256_mul_ps(p, _mm256_castsi256_ps(two_to_k));
  return _mm256_andnot_ps(underflow, result);
}

__attribute__((target("avx2,fma"))) float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

__attribute__((target("avx2,fma"))) float exp_shifted_sum_avx2_impl(
    float* x,
    int64_t n,
    float shift) {
  const __m256 shift8 = _mm256_set1_ps(shift);
  __m256 sum8 = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), shift8));
    _mm256_storeu_ps(x + j, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  if (j < n) {
    float tail[8];
    std::fill(tail, tail + 8, -std::numeric_limits<float>::infinity());
    std::copy(x + j, x + n, tail);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(tail), shift8));
    _mm256_storeu_ps(tail, e);
    std::copy(tail, tail + (n - j), x + j);
    sum8 = _mm256_add_ps(sum8, e);
  }
  return horizontal_sum(sum8);
}

__attribute__((target("avx2,fma"))) float row_max_avx2(const float* x, int64_t n) {
  __m256 best8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    best8 = _mm256_max_ps(best8, _mm256_loadu_ps(x + j));
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, best8);
  return std::max(row_max_portable(lanes, 8), row_max_portable(x + j, n - j));
}

bool cpu_has_avx2_fma() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

// GCC 12's AVX-512 intrinsics start some results from an undefined vector
// (_mm512_undefined_ps), which -Wuninitialized reports inside its headers.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

// exp8 on 16 floats, the same steps and constants, so that both give the
// same values; 2^k is applied by scalef, and the lanes below kExpLowest
// (where -inf makes the reduction NaN) are zeroed by its mask rather than
// clamped first. The tail of a row is a masked load and store. With exp8
// the row passes (max, exp, sum) took 16 % of the tiled forward's time on
// an AVX-512 Xeon (perf, T = 2048, D = 64); with exp16 that forward ran
// 1.1-1.2x faster.
__attribute__((target("avx512f"))) inline __m512 exp16(__m512 x) {
  const __mmask16 kept = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpLowest), _CMP_NLT_UQ);
  const __m512 k = _mm512_roundscale_ps(
      _mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpTaylor[0]);
#pragma GCC unroll 8
  for (size_t i = 1; i < kExpTaylor.size(); ++i) {
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpTaylor[i]));
  }
  return _mm512_maskz_scalef_ps(kept, p, k);
}

// The sum (or, with kMax, the largest) of the 16 lanes, the halves folded
// onto each other down to one lane.
template <bool kMax>
__attribute__((target("avx512f"))) inline __m512 combine16(__m512 a, __m512 b) {
  if constexpr (kMax) {
    return _mm512_max_ps(a, b);
  } else {
    return _mm512_add_ps(a, b);
  }
}

template <bool kMax>
__attribute__((target("avx512f"))) inline float reduce16(__m512 v) {
  v = combine16<kMax>(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 0, 3, 2)));
  v = combine16<kMax>(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1)));
  v = combine16<kMax>(v, _mm512_permute_ps(v, _MM_SHUFFLE(1, 0, 3, 2)));
  v = combine16<kMax>(v, _mm512_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_cvtss_f32(v);
}

// The lanes of a row's last, partial vector.
__attribute__((target("avx512f"))) inline __mmask16 first_lanes(int64_t count) {
  return static_cast<__mmask16>((1u << count) - 1u);
}

__attribute__((target("avx512f"))) float exp_shifted_sum_avx512_impl(
    float* x,
    int64_t n,
    float shift) {
  const __m512 shift16 = _mm512_set1_ps(shift);
  __m512 sum16 = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + j), shift16));
    _mm512_storeu_ps(x + j, e);
    sum16 = _mm512_add_ps(sum16, e);
  }
  if (j < n) {
    const __mmask16 tail = first_lanes(n - j);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, x + j), shift16));
    _mm512_mask_storeu_ps(x + j, tail, e);
    sum16 = _mm512_mask_add_ps(sum16, tail, sum16, e);
  }
  return reduce16<false>(sum16);
}

__attribute__((target("avx512f"))) float row_max_avx512(const float* x, int64_t n) {
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 best16 = lowest;
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    best16 = _mm512_max_ps(best16, _mm512_loadu_ps(x + j));
  }
  if (j < n) {
    best16 = _mm512_max_ps(best16, _mm512_mask_loadu_ps(lowest, first_lanes(n - j), x + j));
  }
  return reduce16<true>(best16);
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
}

#endif

using RowMaxFn = float (*)(const float*, int64_t);

struct FloatKernels {
  RowMaxFn row_max = row_max_portable<float>;
  ExpShiftedSumFn exp_shifted_sum = exp_shifted_sum_portable;
};

const FloatKernels& float_kernels() {
  static const FloatKernels chosen = [] {
    FloatKernels kernels;
#ifdef ATTN_HAVE_X86_TARGETS
    if (cpu_has_avx512()) {
      kernels.row_max = row_max_avx512;
      kernels.exp_shifted_sum = exp_shifted_sum_avx512_impl;
    } else if (cpu_has_avx2_fma()) {
      kernels.row_max = row_max_avx2;
      kernels.exp_shifted_sum = exp_shifted_sum_avx2_impl;
    }
#endif
    return kernels;
  }();
  return chosen;
}

} // namespace

float exp_shifted_sum_portable(float* x, int64_t n, float shift) {
  return exp_shifted_sum_generic(x, n, shift);
}

ExpShiftedSumFn exp_shifted_sum_avx2() {
#ifdef ATTN_HAVE_X86_TARGETS
  if (cpu_has_avx2_fma()) {
    return exp_shifted_sum_avx2_impl;
  }
#endif
  return nullptr;
}

ExpShiftedSumFn exp_shifted_sum_avx512() {
#ifdef ATTN_HAVE_X86_TARGETS
  if (cpu_has_avx512()) {
    return exp_shifted_sum_avx512_impl;
  }
#endif
  return nullptr;
}

float row_max(const float* x, int64_t n) {
  return float_kernels().row_max(x, n);
}

double row_max(const double* x, int64_t n) {
  return row_max_portable(x, n);
}

float exp_shifted_sum(float* x, int64_t n, float shift) {
  return float_kernels().exp_shifted_sum(x, n, shift);
}

double exp_shifted_sum(double* x, int64_t n, double shift) {
  return exp_shifted_sum_generic(x, n, shift);
}

} // namespace attn::detail

#undef ATTN_HAVE_X86_TARGETS
