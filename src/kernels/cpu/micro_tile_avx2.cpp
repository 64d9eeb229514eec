#include "kernels/cpu/micro_tile.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define ATTN_HAVE_X86_AVX2 1
#include <immintrin.h>
#endif

namespace attn::detail {

#ifdef ATTN_HAVE_X86_AVX2
namespace {

// A micro-tile is up to kTileRows rows of c by up to kTileCols columns
// (kTileVectors 8-float registers per row): 12 accumulators, fed per step
// of the depth loop by 2 loads of b and 6 broadcasts of a, 15 of the 16
// registers. Banded products, whose 8-row blocks 6 does not divide, take
// tiles of kBandedTileRows.
constexpr int kTileRows = 6;
constexpr int kBandedTileRows = 4;
constexpr int64_t kLanes = 8; // floats per register
constexpr int64_t kTileVectors = 2;
constexpr int64_t kTileCols = kLanes * kTileVectors;

// Lanes [0, n) of a mask for maskload and maskstore.
__attribute__((target("avx2,fma"))) inline __m256i first_lanes(int64_t n) {
  return _mm256_cmpgt_epi32(
      _mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// c[r0 .. r0+Rows) × [c0 .. c0+width) of the product, width ≤ kTileCols;
// kFull: width == kTileCols, whose loads and stores need no lane masks.
template <int Rows, bool kFull>
__attribute__((target("avx2,fma"))) void micro_tile(
    const GemmOperands& g,
    int64_t r0,
    int64_t c0,
    int64_t width) {
  __m256i lanes[kTileVectors];
  for (int64_t v = 0; v < kTileVectors; ++v) {
    lanes[v] = first_lanes(kFull ? kLanes : std::clamp<int64_t>(width - kLanes * v, 0, kLanes));
  }
  __m256 acc[Rows][kTileVectors];
  const float* a_rows[Rows];
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r) {
#pragma GCC unroll 4
    for (int64_t v = 0; v < kTileVectors; ++v) {
      acc[r][v] = _mm256_setzero_ps();
    }
    a_rows[r] = g.a + (r0 + r) * g.a_row_stride;
  }
  const float* b_row = g.b + c0;
  const int64_t depth = g.depth, ldb = g.ldb, a_step = g.a_depth_stride;
  for (int64_t i = 0, a_offset = 0; i < depth; ++i, b_row += ldb, a_offset += a_step) {
    __m256 b_values[kTileVectors];
#pragma GCC unroll 4
    for (int64_t v = 0; v < kTileVectors; ++v) {
      b_values[v] = kFull ? _mm256_loadu_ps(b_row + kLanes * v)
                          : _mm256_maskload_ps(b_row + kLanes * v, lanes[v]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < Rows; ++r) {
      const __m256 a_value = _mm256_broadcast_ss(a_rows[r] + a_offset);
#pragma GCC unroll 4
      for (int64_t v = 0; v < kTileVectors; ++v) {
        acc[r][v] = _mm256_fmadd_ps(a_value, b_values[v], acc[r][v]);
      }
    }
  }
  const __m256 alpha = _mm256_set1_ps(g.alpha);
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r) {
    float* c_row = g.c + (r0 + r) * g.ldc + c0;
#pragma GCC unroll 4
    for (int64_t v = 0; v < kTileVectors; ++v) {
      float* c_part = c_row + kLanes * v;
      __m256 result = _mm256_mul_ps(acc[r][v], alpha);
      if (g.accumulate) {
        result = _mm256_add_ps(
            result, kFull ? _mm256_loadu_ps(c_part) : _mm256_maskload_ps(c_part, lanes[v]));
      }
      if constexpr (kFull) {
        _mm256_storeu_ps(c_part, result);
      } else {
        _mm256_maskstore_ps(c_part, lanes[v], result);
      }
    }
  }
}

template <bool kFull, int... Rows>
constexpr std::array<MicroTileFn, sizeof...(Rows)> micro_tiles(
    std::integer_sequence<int, Rows...>) {
  return {micro_tile<Rows + 1, kFull>...};
}

// micro_tile for 1 .. kTileRows rows, for full and partial widths.
constexpr auto kFullMicroTiles = micro_tiles<true>(std::make_integer_sequence<int, kTileRows>());
constexpr auto kEdgeMicroTiles = micro_tiles<false>(std::make_integer_sequence<int, kTileRows>());

// float16 rows widened and rounded with F16C's vcvtph2ps and vcvtps2ph
// (which the callers check the CPU has): whole registers loaded and stored
// as they are, the last part of a row through a copy, so that nothing
// past it is read.
__attribute__((target("avx2,fma,f16c"))) void widen_half_row(
    const uint16_t* from,
    int64_t n,
    float* to) {
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    _mm256_storeu_ps(
        to + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(from + j))));
  }
  if (j < n) {
    alignas(16) uint16_t halves[kLanes] = {};
    std::memcpy(halves, from + j, static_cast<size_t>(n - j) * sizeof(uint16_t));
    const __m256 values = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(halves)));
    _mm256_maskstore_ps(to + j, first_lanes(n - j), values);
  }
}

__attribute__((target("avx2,fma,f16c"))) void round_half_row(
    const float* from,
    int64_t n,
    uint16_t* to) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    _mm_storeu_si128(
        reinterpret_cast<__m128i*>(to + j), _mm256_cvtps_ph(_mm256_loadu_ps(from + j), kNearest));
  }
  if (j < n) {
    alignas(16) uint16_t halves[kLanes];
    _mm_store_si128(
        reinterpret_cast<__m128i*>(halves),
        _mm256_cvtps_ph(_mm256_maskload_ps(from + j, first_lanes(n - j)), kNearest));
    std::memcpy(to + j, halves, static_cast<size_t>(n - j) * sizeof(uint16_t));
  }
}

// bfloat16 rows widened: each element's bits shifted into a float's
// upper half (AVX2 alone; no F16C needed).
__attribute__((target("avx2,fma"))) inline __m256 widen_bf16(__m128i halves) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
}

__attribute__((target("avx2,fma"))) void widen_bf16_row(
    const uint16_t* from,
    int64_t n,
    float* to) {
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    _mm256_storeu_ps(
        to + j, widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(from + j))));
  }
  if (j < n) {
    alignas(16) uint16_t halves[kLanes] = {};
    std::memcpy(halves, from + j, static_cast<size_t>(n - j) * sizeof(uint16_t));
    _mm256_maskstore_ps(
        to + j, first_lanes(n - j),
        widen_bf16(_mm_load_si128(reinterpret_cast<const __m128i*>(halves))));
  }
}

// An 8 × 8 block of `from` (rows of unit stride) transposed into `to`, in
// registers: pairs of rows interleaved at 32, then 64 bits, within 128-bit
// lanes, then the lanes exchanged. (GCC 12's unpack intrinsics warn as in
// micro_tile_avx512.cpp.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
__attribute__((target("avx2,fma"))) void transpose_block8(
    const float* from,
    int64_t from_row_stride,
    float* to,
    int64_t ld_to) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm256_loadu_ps(from + i * from_row_stride);
  }
  for (int i = 0; i < 8; i += 2) { // rows i, i+1 at columns {0, 1 | 4, 5} (lo), {2, 3 | 6, 7} (hi)
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) { // r[i + c]: rows i .. i+3 at column c | c + 4
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int c = 0; c < 4; ++c) { // columns c and c + 4, all 8 rows
    _mm256_storeu_ps(to + c * ld_to, _mm256_permute2f128_ps(r[c], r[c + 4], 0x20));
    _mm256_storeu_ps(to + (c + 4) * ld_to, _mm256_permute2f128_ps(r[c], r[c + 4], 0x31));
  }
}
#pragma GCC diagnostic pop

} // namespace

const MicroTiles* avx2_micro_tiles() {
  static const MicroTiles tiles{
      kTileRows, kTileCols,        kBandedTileRows, kFullMicroTiles.data(), kEdgeMicroTiles.data(),
      kLanes,    transpose_block8, widen_half_row,  round_half_row,         widen_bf16_row};
  return &tiles;
}

#else

const MicroTiles* avx2_micro_tiles() {
  return nullptr;
}

#endif

} // namespace attn::detail
