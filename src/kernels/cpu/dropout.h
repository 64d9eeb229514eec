#pragma once

// Dropout inside the fused kernels, drawn by counter and never stored:
// weight (b, h, i, j) of a request is dropped when draw i·S + j of the
// stream (key: the request's seed; subsequence: b·H + h) is below
// t = ⌊p·2^16⌋, which happens with probability t / 2^16 (within 2^-16 of
// p), and every kept weight is scaled by 2^16 / (2^16 - t), so that the
// expected output is the undropped one. A draw depends on its position
// alone, so the backward draws the forward's mask again, and no thread
// count or tiling changes it.
//
// The draws are Philox4x32-10's words cut in 16-bit halves: draws 2k and
// 2k + 1 are the low and high halves of word k. Philox4x32-10: Salmon,
// Moraes, Dror and Shaw, "Parallel random numbers: as easy as 1, 2, 3"
// (SC 2011), the generator of PyTorch's CUDA kernels and of
// FlashAttention's dropout (which draws 8 bits a weight). Block n of stream
// (seed, subsequence) is the 4 words Philox draws for counter (n as two
// 32-bit words, subsequence as two) under key `seed`, as
// at::philox_engine(seed, subsequence, n) numbers them; word k of the
// stream is word ⌊(k mod 64) / 16⌋ of block 16·⌊k / 64⌋ + k mod 16
// (philox.h says why).

#include "kernels/attention_params.h"
#include "kernels/cpu/isa.h"

#include <cstdint>

namespace attn::detail {

// One row of a request's dropout stream.
struct DropoutRow {
  uint64_t seed = 0;
  uint64_t subsequence = 0; // b·H + h
  uint64_t first_draw = 0;  // the draw of the row's first element: i·S + j
  uint32_t threshold = 0;   // dropped where the draw is below it
};

// t = ⌊p·2^16⌋, from 0 to 2^16 (p = 1: every draw is below it).
uint32_t dropout_threshold(double p);

// 2^16 / (2^16 - t), the inverse of the keep probability; 0 where nothing
// is kept.
double dropout_keep_scale(double p);

// A request's stream: its seed and threshold, taken once per call (the
// row and first draw 0).
DropoutRow dropout_stream(const DropoutDraw& draw);

// The row of `stream` for query i of head bh = b·H + h of a request with S
// keys, from key j on.
DropoutRow dropout_row(const DropoutRow& stream, int64_t bh, int64_t i, int64_t S, int64_t j);

// The draws [row.first_draw, row.first_draw + n) of the row's stream, in
// portable C++ (the vector loops in isa.h's table draw the same).
void dropout_draws(uint16_t* draws, int64_t n, const DropoutRow& row);

// x[j] = 0 where the row's draw j drops it (the kept ones unscaled: the
// forward folds the keep scale into its normalisation).
// On the vector loops of `loops` where they have them (isa.h).
void drop_row(const CpuLoops& loops, float* x, int64_t n, const DropoutRow& row);
void drop_row(const CpuLoops& loops, double* x, int64_t n, const DropoutRow& row);

// The softmax backward of a row whose probabilities `p` were dropped:
// given dPd = dO·Vᵀ in `ds` and delta = Σ_j dO_j·O_j, writes
// ds[j] = p[j] · (m_j · ds[j] - delta) and p[j] = m_j · p[j], where m_j is
// keep_scale for a kept weight and 0 for a dropped one; on the vector
// loops of `loops` where they have them.
void dropout_softmax_backward_row(
    const CpuLoops& loops,
    float* p,
    float* ds,
    int64_t n,
    float delta,
    float keep_scale,
    const DropoutRow& row);
void dropout_softmax_backward_row(
    const CpuLoops& loops,
    double* p,
    double* ds,
    int64_t n,
    double delta,
    double keep_scale,
    const DropoutRow& row);

} // namespace attn::detail
