#pragma once

// What the short-heads kernel (short_heads.h) hands its loops, and their
// shape: short_heads_vector.h compiled for each instruction set
// (vector_loops.h; isa.h's table holds them).

#include "kernels/cpu/heads.h"
#include "kernels/cpu/mask_view.h"

#include <cstdint>

namespace attn::detail {

// The backward's gradients: the one it reads, the three it writes.
struct ShortHeadsGradients {
  Heads<float> grad_out, dq, dk, dv;
};

// What turns a half-precision call's heads into the float heads the loops
// read and write (short_heads.cpp): a task's call names float copies of
// one head (Heads::every_head_at), which widen_head fills before the loops
// compute head (b, h) and round_head rounds into the request's tensors
// after.
class ShortHeadsConversion {
 public:
  virtual ~ShortHeadsConversion() = default;
  virtual void widen_head(int64_t b, int64_t h) = 0;
  virtual void round_head(int64_t b, int64_t h) = 0;
};

// What a call's tasks read, and the forward's and backward's results.
struct ShortHeadsCall {
  Heads<float> q, k, v, out; // out: the forward's result, the backward's input
  MaskView<float> mask;
  float scale;
  int64_t H, group, L, S, D, Dv;
  CpuLoops loops;                                 // the call's plan's (kernel_plan.h)
  float* lse_out = nullptr;                       // forward
  const float* lse = nullptr;                     // backward
  const ShortHeadsGradients* gradients = nullptr; // backward
  ShortHeadsConversion* conversion = nullptr;     // half precision: before and after each head
};

// The heads [begin, end) of the call's (B, H) grid.
using ShortHeadsFn = void (*)(const ShortHeadsCall& call, int64_t begin, int64_t end);

struct ShortHeadsLoops {
  ShortHeadsFn forward, backward;
};

} // namespace attn::detail
