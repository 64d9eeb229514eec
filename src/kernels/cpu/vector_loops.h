#pragma once

// The loops written once over GCC's vector types (lanes.h), or in C++
// that the compiler vectorises (philox.h), and compiled per instruction
// set, each set in a file of its own under its target pragma:
// vector_loops_avx512.cpp (16 lanes) and vector_loops_avx2.cpp (8).
// isa.h's table hands them out where the CPU runs them.

#include "kernels/cpu/isa.h"
#include "kernels/cpu/short_heads_loops.h"

// Whether this compiler builds them: x86 with the vector builtins they use
// (__builtin_shufflevector: GCC 12 and Clang on). Elsewhere both sets below
// are null: the fused kernel keeps to its tiled loops and the row
// operations to portable C++.
#if (defined(__x86_64__) || defined(__i386__)) && defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector) && __has_builtin(__builtin_bit_cast)
#define ATTN_VECTOR_LOOPS_COMPILED 1
#endif
#endif

namespace attn::detail {

struct VectorLoops {
  ShortHeadsLoops short_heads;
  RowMaxFn row_max;
  ExpShiftedSumFn exp_shifted_sum;
  SoftcapFn softcap;
  DropoutLoops dropout;
};

// Null where this build cannot compile the set; whether the CPU runs it is
// isa.h's question.
const VectorLoops* avx512_vector_loops();
const VectorLoops* avx2_vector_loops();

} // namespace attn::detail
