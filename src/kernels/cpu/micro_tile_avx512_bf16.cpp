#include "kernels/cpu/micro_tile.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define ATTN_HAVE_X86_AVX512_BF16 1
#include "kernels/cpu/micro_tile_avx512_store.h"
#endif

namespace attn::detail {

#ifdef ATTN_HAVE_X86_AVX512_BF16
namespace {

// As the float micro-tiles (micro_tile_avx512.cpp): up to kTileRows rows of
// c by kTileVectors registers of 16 floats, here fed per step by pairs of
// the depth: vdpbf16ps multiplies 16 pairs of bfloat16 of b by one pair of
// a, broadcast, and adds both products to 16 float lanes.
using avx512::kLanes; // floats per register, pairs of bfloat16 per load
using avx512::kTileCols;
using avx512::kTileRows;
using avx512::kTileVectors;

// The 32 bits of a's pair at `at`: two bfloat16, the first in the low half.
inline int32_t pair_bits(const uint16_t* at) {
  int32_t bits = 0;
  std::memcpy(&bits, at, sizeof bits);
  return bits;
}

// 16 pairs of b from `at`; lanes past the edge's width zero.
template <bool kFull>
__attribute__((target("avx512f,avx512bf16"))) inline __m512i load_pairs(
    const uint16_t* at,
    __mmask16 lanes) {
  if constexpr (kFull) {
    return _mm512_loadu_si512(at);
  } else {
    return _mm512_maskz_loadu_epi32(lanes, at);
  }
}

// (GCC 12's shift intrinsic starts from a vector initialised from itself,
// which -Wmaybe-uninitialized reports at every call.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
template <int Rows, bool kFull>
__attribute__((target("avx512f,avx512bf16"))) void bf16_micro_tile(
    const Bf16GemmOperands& g,
    int64_t r0,
    int64_t c0,
    int64_t width) {
  __mmask16 lanes[kTileVectors];
  avx512::edge_lanes<kFull>(width, lanes);
  __m512 acc[Rows][kTileVectors];
  avx512::zero_tile<Rows>(acc);
  const uint16_t* a_rows[Rows];
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r) {
    a_rows[r] = g.a + (r0 + r) * g.a_row_stride;
  }
  const int64_t pairs = g.depth / 2, ldb = g.ldb;
  const uint16_t* b_row = g.b + 2 * c0;
  for (int64_t p = 0; p < pairs; ++p, b_row += ldb) {
    __m512i b_values[kTileVectors];
#pragma GCC unroll 4
    for (int64_t v = 0; v < kTileVectors; ++v) {
      b_values[v] = load_pairs<kFull>(b_row + 2 * kLanes * v, lanes[v]);
    }
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r) {
      const __m512i a_pair = _mm512_set1_epi32(pair_bits(a_rows[r] + 2 * p));
#pragma GCC unroll 4
      for (int64_t v = 0; v < kTileVectors; ++v) {
        acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)a_pair, (__m512bh)b_values[v]);
      }
    }
  }
  if (g.depth % 2 != 0) {
    // The last depth alone, in float: b's last pair holds it in its low
    // half (and padding above), a's row ends at it.
    __m512 b_values[kTileVectors];
#pragma GCC unroll 4
    for (int64_t v = 0; v < kTileVectors; ++v) {
      const __m512i last = load_pairs<kFull>(b_row + 2 * kLanes * v, lanes[v]);
      b_values[v] = _mm512_castsi512_ps(_mm512_slli_epi32(last, 16));
    }
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r) {
      const uint32_t a_bits = static_cast<uint32_t>(a_rows[r][2 * pairs]) << 16;
      float a_value = 0;
      std::memcpy(&a_value, &a_bits, sizeof a_value);
#pragma GCC unroll 4
      for (int64_t v = 0; v < kTileVectors; ++v) {
        acc[r][v] = _mm512_fmadd_ps(_mm512_set1_ps(a_value), b_values[v], acc[r][v]);
      }
    }
  }
  avx512::store_tile<Rows, kFull>(acc, lanes, g.alpha, g.c + r0 * g.ldc + c0, g.ldc, g.accumulate);
}
#pragma GCC diagnostic pop

template <bool kFull, int... Rows>
constexpr std::array<Bf16MicroTileFn, sizeof...(Rows)> bf16_micro_tiles(
    std::integer_sequence<int, Rows...>) {
  return {bf16_micro_tile<Rows + 1, kFull>...};
}

constexpr auto kFullTiles = bf16_micro_tiles<true>(std::make_integer_sequence<int, kTileRows>());
constexpr auto kEdgeTiles = bf16_micro_tiles<false>(std::make_integer_sequence<int, kTileRows>());

// vcvtneps2bf16 rounds 16 floats to the nearest bfloat16, ties to even.
__attribute__((target("avx512f,avx512bf16"))) void round_row(
    const float* from,
    int64_t n,
    uint16_t* to) {
  for (int64_t j = 0; j < n; j += kLanes) {
    const auto lanes = static_cast<__mmask16>(
        n - j >= kLanes ? 0xFFFFU : (1U << static_cast<unsigned>(n - j)) - 1U);
    const __m512 values = _mm512_maskz_loadu_ps(lanes, from + j);
    const __m256i rounded = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(values));
    if (n - j >= kLanes) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + j), rounded);
    } else {
      alignas(32) uint16_t last[kLanes];
      _mm256_store_si256(reinterpret_cast<__m256i*>(last), rounded);
      std::memcpy(to + j, last, static_cast<size_t>(n - j) * sizeof(uint16_t));
    }
  }
}

// Up to 16 floats from `from` (zeros past n, or where from is null)
// rounded to bfloat16.
__attribute__((target("avx512f,avx512bf16"))) inline __m256i rounded_lanes(
    const float* from,
    int64_t n) {
  if (from == nullptr) {
    return _mm256_setzero_si256();
  }
  const auto lanes = static_cast<__mmask16>(
      n >= kLanes ? 0xFFFFU : (1U << static_cast<unsigned>(n)) - 1U);
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(lanes, from)));
}

__attribute__((target("avx2,avx512f,avx512bf16"))) void round_row_pairs(
    const float* first,
    const float* second,
    int64_t n,
    uint16_t* to) {
  for (int64_t j = 0; j < n; j += kLanes) {
    const __m256i a = rounded_lanes(first + j, n - j);
    const __m256i b = rounded_lanes(second == nullptr ? nullptr : second + j, n - j);
    // unpack interleaves within 128-bit halves: pairs 0-3 and 8-11, then
    // 4-7 and 12-15; the permutes put them in order.
    const __m256i low = _mm256_unpacklo_epi16(a, b), high = _mm256_unpackhi_epi16(a, b);
    const __m256i in_order[] = {
        _mm256_permute2x128_si256(low, high, 0x20), _mm256_permute2x128_si256(low, high, 0x31)};
    if (n - j >= kLanes) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + 2 * j), in_order[0]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + 2 * j + kLanes), in_order[1]);
    } else {
      alignas(32) uint16_t pairs[2 * kLanes];
      _mm256_store_si256(reinterpret_cast<__m256i*>(pairs), in_order[0]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(pairs + kLanes), in_order[1]);
      std::memcpy(to + 2 * j, pairs, static_cast<size_t>(2 * (n - j)) * sizeof(uint16_t));
    }
  }
}

} // namespace

const Bf16MicroTiles* avx512_bf16_micro_tiles() {
  static const Bf16MicroTiles tiles{kTileRows,         kTileCols, kFullTiles.data(),
                                    kEdgeTiles.data(), round_row, round_row_pairs};
  return &tiles;
}

#else

const Bf16MicroTiles* avx512_bf16_micro_tiles() {
  return nullptr;
}

#endif

} // namespace attn::detail
