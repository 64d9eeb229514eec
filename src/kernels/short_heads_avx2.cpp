// The short-heads loops (short_heads_vector.h) compiled for AVX2 with FMA.

#include "kernels/short_heads_loops.h"

#ifdef ATTN_SHORT_HEADS_COMPILED
// Every other header before the target: what follows is compiled for it.
#include "kernels/heads.h"
#include "kernels/mask_view.h"
#include "kernels/micro_tile.h"
#include "kernels/short_heads.h"
#include "kernels/tile_product.h"
#include "row_ops.h"

#include <algorithm>
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
typedef float Lanes __attribute__((vector_size(32)));      // NOLINT(modernize-use-using)
typedef int32_t LaneBits __attribute__((vector_size(32))); // NOLINT(modernize-use-using)

} // namespace
} // namespace attn::detail

#include "kernels/short_heads_vector.h"

namespace attn::detail {
namespace {

// 16 registers of 8 floats: 12 accumulators, the rest for the right
// operand's row and the broadcasts.
constexpr int kAccumulators = 12;

const ShortHeadsLoops kLoops{forward_heads<kAccumulators>, backward_heads<kAccumulators>};

} // namespace
} // namespace attn::detail

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif

namespace attn::detail {

const ShortHeadsLoops* short_heads_avx2_loops() {
#ifdef ATTN_SHORT_HEADS_COMPILED
  return &kLoops;
#else
  return nullptr;
#endif
}

} // namespace attn::detail
