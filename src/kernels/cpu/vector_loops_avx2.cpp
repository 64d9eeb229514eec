// The vector loops (vector_loops.h) compiled for AVX2 with FMA: the short-head
// loops (short_heads_vector.h) and the float row operations
// (row_ops_vector.h), both over lanes.h, and dropout's row operations
// (dropout_vector.h).

#include "kernels/cpu/vector_loops.h"

#ifdef ATTN_VECTOR_LOOPS_COMPILED
// Every other header before the target: what follows is compiled for it.
#include "kernels/cpu/heads.h"
#include "kernels/cpu/mask_view.h"
#include "kernels/cpu/micro_tile.h"
#include "kernels/cpu/philox.h"
#include "kernels/cpu/short_heads.h"
#include "kernels/cpu/tile_product.h"

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif
namespace attn::detail {
namespace {

// Vectors of the registers' width (32 bytes): wider ones would live in
// memory.
constexpr int64_t kLanes = 8;
typedef float Lanes __attribute__((vector_size(32)));            // NOLINT(modernize-use-using)
typedef int32_t LaneBits __attribute__((vector_size(32)));       // NOLINT(modernize-use-using)
typedef uint32_t LaneWords __attribute__((vector_size(32)));     // NOLINT(modernize-use-using)
typedef uint64_t LaneWordPairs __attribute__((vector_size(32))); // NOLINT(modernize-use-using)

} // namespace
} // namespace attn::detail

#include "kernels/cpu/lanes.h"

namespace attn::detail {
namespace {

// lanes.h's last exp step with 2^k built in the exponent bits, from k
// clamped at -127 (its lanes zeroed or NaN after: -inf's k is -inf, which
// has no integer).
ATTN_INLINE Lanes times_two_to_or_zero(const Lanes& p, const Lanes& k, const Lanes& x) {
  const Lanes k_clamped = lane_max(k, splat(-127.0f));
  const LaneBits two_to_k = (__builtin_convertvector(k_clamped, LaneBits) + 127) << 23;
  return select(x < splat(kExpLowest), Lanes{}, p * floats_of(two_to_k));
}

// The 64-bit products of the low 32 bits of each pair of lanes: one
// vpmuludq.
ATTN_INLINE LaneWordPairs multiply_low_words(const LaneWordPairs& a, const LaneWordPairs& b) {
  return __builtin_bit_cast(
      LaneWordPairs,
      _mm256_mul_epu32(__builtin_bit_cast(__m256i, a), __builtin_bit_cast(__m256i, b)));
}

} // namespace
} // namespace attn::detail

#include "kernels/cpu/dropout_vector.h"
#include "kernels/cpu/row_ops_vector.h"
#include "kernels/cpu/short_heads_vector.h"

namespace attn::detail {
namespace {

// 16 registers of 8 floats: 12 accumulators, the rest for the right
// operand's row and the broadcasts.
constexpr int kAccumulators = 12;

const VectorLoops kLoops{
    {forward_heads<kAccumulators>, backward_heads<kAccumulators>},
    row_max_lanes,
    exp_shifted_sum_lanes,
    softcap_row_lanes,
    {drop_row_vector, dropout_softmax_backward_row_vector}};

} // namespace
} // namespace attn::detail

#undef ATTN_INLINE
#undef ATTN_OWN_CODE
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif

namespace attn::detail {

const VectorLoops* avx2_vector_loops() {
#ifdef ATTN_VECTOR_LOOPS_COMPILED
  return &kLoops;
#else
  return nullptr;
#endif
}

} // namespace attn::detail
