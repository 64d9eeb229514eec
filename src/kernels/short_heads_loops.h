#pragma once

// What the short-heads kernel (short_heads.h) hands its loops, and the
// loops of each instruction set: short_heads_vector.h compiled for
// AVX-512 (short_heads_avx512.cpp) and for AVX2 (short_heads_avx2.cpp).

#include "kernels/heads.h"
#include "kernels/mask_view.h"

#include <cstdint>

// Whether this compiler builds the loops: x86 with the vector builtins
// they use (__builtin_shufflevector: GCC 12 and Clang on). Elsewhere both
// sets below are null and the fused kernel keeps to its tiled loops.
#if (defined(__x86_64__) || defined(__i386__)) && defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector) && __has_builtin(__builtin_bit_cast)
#define ATTN_SHORT_HEADS_COMPILED 1
#endif
#endif

namespace attn::detail {

// The backward's gradients: the one it reads, the three it writes.
struct ShortHeadsGradients {
  Heads<float> grad_out, dq, dk, dv;
};

// What a call's tasks read, and the forward's and backward's results.
struct ShortHeadsCall {
  Heads<float> q, k, v, out; // out: the forward's result, the backward's input
  MaskView<float> mask;
  float scale;
  int64_t H, group, L, S, D, Dv;
  float* lse_out = nullptr;                       // forward
  const float* lse = nullptr;                     // backward
  const ShortHeadsGradients* gradients = nullptr; // backward
};

// The heads [begin, end) of the call's (B, H) grid.
using ShortHeadsFn = void (*)(const ShortHeadsCall& call, int64_t begin, int64_t end);

struct ShortHeadsLoops {
  ShortHeadsFn forward, backward;
};

// Null where this build cannot compile the set.
const ShortHeadsLoops* short_heads_avx512_loops();
const ShortHeadsLoops* short_heads_avx2_loops();

} // namespace attn::detail
