#pragma once

// What the AVX-512 micro-tiles share (micro_tile_avx512.cpp for float,
// micro_tile_avx512_bf16.cpp for bfloat16 inputs): a tile of kTileVectors
// registers of 16 floats per row, the lane masks of an edge tile, and the
// accumulators zeroed, and their store as c = alpha·acc (+ c). Included only by
// those files, under their x86 guard; every function here is inlined into
// their micro-tiles, whose target attributes include AVX-512F.

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace attn::detail::avx512 {

constexpr int kTileRows = 8;
constexpr int64_t kLanes = 16; // floats per register
constexpr int64_t kTileVectors = 2;
constexpr int64_t kTileCols = kLanes * kTileVectors;

// The lanes of each register that a tile of `width` columns covers; all of
// them where kFull (width == kTileCols).
template <bool kFull>
__attribute__((target("avx512f"), always_inline)) inline void edge_lanes(
    int64_t width,
    __mmask16 (&lanes)[kTileVectors]) {
  for (int64_t v = 0; v < kTileVectors; ++v) {
    const int64_t n = kFull ? kLanes : std::clamp<int64_t>(width - kLanes * v, 0, kLanes);
    lanes[v] = static_cast<__mmask16>((1U << n) - 1U);
  }
}

// Every accumulator of a tile of Rows rows at zero.
template <int Rows>
__attribute__((target("avx512f"), always_inline)) inline void zero_tile(
    __m512 (&acc)[Rows][kTileVectors]) {
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r) {
#pragma GCC unroll 4
    for (int64_t v = 0; v < kTileVectors; ++v) {
      acc[r][v] = _mm512_setzero_ps();
    }
  }
}

// c[r, c0 ..) = alpha·acc[r] (+ c[r, c0 ..) when `accumulate`) for the
// tile's Rows rows of c (row stride ldc) from `c_first_row`, the lanes
// past an edge tile's width untouched.
template <int Rows, bool kFull>
__attribute__((target("avx512f"), always_inline)) inline void store_tile(
    __m512 (&acc)[Rows][kTileVectors],
    const __mmask16 (&lanes)[kTileVectors],
    float alpha,
    float* c_first_row,
    int64_t ldc,
    bool accumulate) {
  const __m512 scale = _mm512_set1_ps(alpha);
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r) {
    float* c_row = c_first_row + r * ldc;
#pragma GCC unroll 4
    for (int64_t v = 0; v < kTileVectors; ++v) {
      __m512 result = _mm512_mul_ps(acc[r][v], scale);
      if constexpr (kFull) {
        if (accumulate) {
          result = _mm512_add_ps(result, _mm512_loadu_ps(c_row + kLanes * v));
        }
        _mm512_storeu_ps(c_row + kLanes * v, result);
      } else {
        if (accumulate) {
          result = _mm512_add_ps(result, _mm512_maskz_loadu_ps(lanes[v], c_row + kLanes * v));
        }
        _mm512_mask_storeu_ps(c_row + kLanes * v, lanes[v], result);
      }
    }
  }
}

} // namespace attn::detail::avx512
