#include "kernels/cpu/micro_tile.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define ATTN_HAVE_X86_AVX512 1
#include "kernels/cpu/micro_tile_avx512_store.h"
#endif

namespace attn::detail {

#ifdef ATTN_HAVE_X86_AVX512
namespace {

// A micro-tile is up to kTileRows rows of c by up to kTileCols columns
// (kTileVectors 16-float registers per row): kTileRows · kTileVectors
// accumulators, fed per step of the depth loop by kTileVectors loads of b
// and kTileRows broadcasts of a. Measured on the kernels' products (128 ×
// 512 × 64, 128 × 64 × 512, 512 × 64 × 128; AMD EPYC, one thread): 8 × 2,
// 12 × 2, 6 × 4 and 4 × 4 registers within 3 % of each other, 14 × 2 4 %
// slower.
using avx512::kLanes;
using avx512::kTileCols;
using avx512::kTileRows;
using avx512::kTileVectors;

// c[r0 .. r0+Rows) × [c0 .. c0+width) of the product, width ≤ kTileCols;
// kFull: width == kTileCols, whose loads and stores need no lane masks (the
// masks of the edge version, kept in memory, cost a load per step: the full
// version made the tiled backward 1.2x faster on an AVX-512 Xeon).
template <int Rows, bool kFull>
__attribute__((target("avx512f"))) void micro_tile(
    const GemmOperands& g,
    int64_t r0,
    int64_t c0,
    int64_t width) {
  __mmask16 lanes[kTileVectors];
  avx512::edge_lanes<kFull>(width, lanes);
  __m512 acc[Rows][kTileVectors];
  avx512::zero_tile<Rows>(acc);
  const float* a_rows[Rows];
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r) {
    a_rows[r] = g.a + (r0 + r) * g.a_row_stride;
  }
  const float* b_row = g.b + c0;
  const int64_t depth = g.depth, ldb = g.ldb, a_step = g.a_depth_stride;
  for (int64_t i = 0, a_offset = 0; i < depth; ++i, b_row += ldb, a_offset += a_step) {
    __m512 b_values[kTileVectors];
#pragma GCC unroll 4
    for (int64_t v = 0; v < kTileVectors; ++v) {
      if constexpr (kFull) {
        b_values[v] = _mm512_loadu_ps(b_row + kLanes * v);
      } else {
        b_values[v] = _mm512_maskz_loadu_ps(lanes[v], b_row + kLanes * v);
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r) {
      const __m512 a_value = _mm512_set1_ps(a_rows[r][a_offset]);
#pragma GCC unroll 4
      for (int64_t v = 0; v < kTileVectors; ++v) {
        acc[r][v] = _mm512_fmadd_ps(a_value, b_values[v], acc[r][v]);
      }
    }
  }
  avx512::store_tile<Rows, kFull>(acc, lanes, g.alpha, g.c + r0 * g.ldc + c0, g.ldc, g.accumulate);
}

template <bool kFull, int... Rows>
constexpr std::array<MicroTileFn, sizeof...(Rows)> micro_tiles(
    std::integer_sequence<int, Rows...>) {
  return {micro_tile<Rows + 1, kFull>...};
}

// micro_tile for 1 .. kTileRows rows, for full and partial widths.
constexpr auto kFullMicroTiles = micro_tiles<true>(std::make_integer_sequence<int, kTileRows>());
constexpr auto kEdgeMicroTiles = micro_tiles<false>(std::make_integer_sequence<int, kTileRows>());

// The lanes [0, n) of a register, n ≤ kLanes.
__attribute__((target("avx512f"), always_inline)) inline __mmask16 first_lanes(int64_t n) {
  return static_cast<__mmask16>(n >= kLanes ? 0xFFFFU : (1U << static_cast<unsigned>(n)) - 1U);
}

// float16 rows widened and rounded with vcvtph2ps and vcvtps2ph. (GCC
// 12's conversion intrinsics start from a vector initialised from itself,
// which -Wmaybe-uninitialized reports at every call, as its unpack
// intrinsics below.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
// Whole registers loaded and stored as they are; the last part of a row
// through a copy, so that nothing past it is read (a masked load of 16-bit
// lanes needs AVX512-BW).
__attribute__((target("avx512f"))) void widen_half_row(const uint16_t* from, int64_t n, float* to) {
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    _mm512_storeu_ps(
        to + j, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + j))));
  }
  if (j < n) {
    alignas(32) uint16_t halves[kLanes] = {};
    std::memcpy(halves, from + j, static_cast<size_t>(n - j) * sizeof(uint16_t));
    const __m512 values = _mm512_cvtph_ps(
        _mm256_load_si256(reinterpret_cast<const __m256i*>(halves)));
    _mm512_mask_storeu_ps(to + j, first_lanes(n - j), values);
  }
}

__attribute__((target("avx512f"))) void round_half_row(const float* from, int64_t n, uint16_t* to) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    _mm256_storeu_si256(
        reinterpret_cast<__m256i*>(to + j), _mm512_cvtps_ph(_mm512_loadu_ps(from + j), kNearest));
  }
  if (j < n) {
    alignas(32) uint16_t halves[kLanes];
    _mm256_store_si256(
        reinterpret_cast<__m256i*>(halves),
        _mm512_cvtps_ph(_mm512_maskz_loadu_ps(first_lanes(n - j), from + j), kNearest));
    std::memcpy(to + j, halves, static_cast<size_t>(n - j) * sizeof(uint16_t));
  }
}

// bfloat16 rows widened: each element's bits shifted into a float's
// upper half.
__attribute__((target("avx512f"))) inline __m512 widen_bf16(__m256i halves) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}

__attribute__((target("avx512f"))) void widen_bf16_row(const uint16_t* from, int64_t n, float* to) {
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    _mm512_storeu_ps(
        to + j, widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + j))));
  }
  if (j < n) {
    alignas(32) uint16_t halves[kLanes] = {};
    std::memcpy(halves, from + j, static_cast<size_t>(n - j) * sizeof(uint16_t));
    _mm512_mask_storeu_ps(
        to + j, first_lanes(n - j),
        widen_bf16(_mm256_load_si256(reinterpret_cast<const __m256i*>(halves))));
  }
}

#pragma GCC diagnostic pop

// A 16 × 16 block of `from` (rows of unit stride) transposed into `to`,
// in registers: pairs of rows interleaved at 32, then 64 bits, within
// 128-bit lanes, then the lanes exchanged twice. (GCC 12's unpack
// intrinsics start from a vector initialised from itself, which
// -Wuninitialized, and with sanitizers -Wmaybe-uninitialized, report at
// every call.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
__attribute__((target("avx512f"))) void transpose_block16(
    const float* from,
    int64_t from_row_stride,
    float* to,
    int64_t ld_to) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) {
    r[i] = _mm512_loadu_ps(from + i * from_row_stride);
  }
  for (int i = 0; i < 16;
       i += 2) { // lane k of t[i]: rows i, i+1 at columns 4k, 4k+1 (lo) or 4k+2, 4k+3 (hi)
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) { // lane k of r[i + c]: rows i .. i+3 at column 4k + c
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 1] = _mm512_castpd_ps(
        _mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(
        _mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(
        _mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  for (int c = 0; c < 4;
       ++c) { // lanes of rows 0-3, 4-7 (and 8-11, 12-15) at columns c + {0, 8} or c + {4, 12}
    t[c] = _mm512_shuffle_f32x4(r[c], r[c + 4], 0x88);
    t[c + 4] = _mm512_shuffle_f32x4(r[c], r[c + 4], 0xdd);
    t[c + 8] = _mm512_shuffle_f32x4(r[c + 8], r[c + 12], 0x88);
    t[c + 12] = _mm512_shuffle_f32x4(r[c + 8], r[c + 12], 0xdd);
  }
  for (int c = 0; c < 8; ++c) { // column c and c + 8, all 16 rows
    _mm512_storeu_ps(to + c * ld_to, _mm512_shuffle_f32x4(t[c], t[c + 8], 0x88));
    _mm512_storeu_ps(to + (c + 8) * ld_to, _mm512_shuffle_f32x4(t[c], t[c + 8], 0xdd));
  }
}
#pragma GCC diagnostic pop

} // namespace

const MicroTiles* avx512_micro_tiles() {
  static const MicroTiles tiles{
      kTileRows, kTileCols,         kTileRows,      kFullMicroTiles.data(), kEdgeMicroTiles.data(),
      kLanes,    transpose_block16, widen_half_row, round_half_row,         widen_bf16_row};
  return &tiles;
}

#else

const MicroTiles* avx512_micro_tiles() {
  return nullptr;
}

#endif

} // namespace attn::detail
