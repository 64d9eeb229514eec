#pragma once

// Philox4x32-10 (dropout.h) in groups of 16 blocks, and the dropout row
// loops over its draws, written once: dropout.cpp instantiates them with
// the portable group below, the vector loop files (through
// dropout_vector.h) with the group drawn in vector registers, inside
// functions compiled for their instruction set.
//
// A stream's words come in groups of 64: word k is word ⌊(k mod 64) / 16⌋
// of block 16·⌊k / 64⌋ + k mod 16, so that a group's words are the four
// output words of 16 consecutive blocks, each word's 16 values side by
// side: one vector register's lanes (two with AVX2), stored as they are.
// Cut in halves, a group is 128 draws.

#include "kernels/cpu/dropout.h"

#include <algorithm>
#include <cstdint>

namespace attn::detail {

#define ATTN_PHILOX_INLINE [[gnu::always_inline]] inline

// Philox4x32's round multipliers and key increments (Salmon et al., the
// constants of Random123 and of at::philox_engine).
constexpr uint32_t kPhiloxMultiplier0 = 0xD2511F53u;
constexpr uint32_t kPhiloxMultiplier1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxKeyStep0 = 0x9E3779B9u;
constexpr uint32_t kPhiloxKeyStep1 = 0xBB67AE85u;
constexpr int kPhiloxRounds = 10;

constexpr int64_t kPhiloxGroupBlocks = 16;
constexpr int64_t kPhiloxGroupWords = 4 * kPhiloxGroupBlocks;
constexpr int64_t kPhiloxGroupDraws = 2 * kPhiloxGroupWords;

// The draws of group `group` of stream (seed, subsequence), in portable
// C++: draws 2k and 2k + 1 are the low and high halves of word k = 16·m + l,
// word m of block 16·group + l.
ATTN_PHILOX_INLINE void philox_group(
    uint16_t* draws,
    uint64_t group,
    uint64_t seed,
    uint64_t subsequence) {
  uint32_t c[4][kPhiloxGroupBlocks];
  for (int64_t l = 0; l < kPhiloxGroupBlocks; ++l) {
    const uint64_t block = kPhiloxGroupBlocks * group + static_cast<uint64_t>(l);
    c[0][l] = static_cast<uint32_t>(block);
    c[1][l] = static_cast<uint32_t>(block >> 32);
    c[2][l] = static_cast<uint32_t>(subsequence);
    c[3][l] = static_cast<uint32_t>(subsequence >> 32);
  }
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < kPhiloxRounds; ++round) {
    for (int64_t l = 0; l < kPhiloxGroupBlocks; ++l) {
      const uint64_t p0 = uint64_t{kPhiloxMultiplier0} * c[0][l];
      const uint64_t p1 = uint64_t{kPhiloxMultiplier1} * c[2][l];
      c[0][l] = static_cast<uint32_t>(p1 >> 32) ^ c[1][l] ^ k0;
      c[1][l] = static_cast<uint32_t>(p1);
      c[2][l] = static_cast<uint32_t>(p0 >> 32) ^ c[3][l] ^ k1;
      c[3][l] = static_cast<uint32_t>(p0);
    }
    k0 += kPhiloxKeyStep0;
    k1 += kPhiloxKeyStep1;
  }
  for (int64_t k = 0; k < kPhiloxGroupWords; ++k) {
    const uint32_t word = c[k / kPhiloxGroupBlocks][k % kPhiloxGroupBlocks];
    draws[2 * k] = static_cast<uint16_t>(word);
    draws[2 * k + 1] = static_cast<uint16_t>(word >> 16);
  }
}

// apply(at, draws, count) for the row's draws [at, at + count), group by
// group, until n draws have been visited; `draw_group` is philox_group or
// a vector version of it.
template <typename DrawGroup, typename Apply>
ATTN_PHILOX_INLINE void for_each_draw_group(
    const DropoutRow& row,
    int64_t n,
    const DrawGroup& draw_group,
    const Apply& apply) {
  uint16_t draws[kPhiloxGroupDraws];
  for (int64_t at = 0; at < n;) {
    const uint64_t draw = row.first_draw + static_cast<uint64_t>(at);
    const auto skip = static_cast<int64_t>(draw % kPhiloxGroupDraws); // the group's before it
    draw_group(draws, draw / kPhiloxGroupDraws, row.seed, row.subsequence);
    const int64_t count = std::min(n - at, kPhiloxGroupDraws - skip);
    apply(at, draws + skip, count);
    at += count;
  }
}

template <typename T, typename DrawGroup>
ATTN_PHILOX_INLINE void drop_row_loop(
    T* x,
    int64_t n,
    const DropoutRow& row,
    const DrawGroup& draw_group) {
  const uint32_t threshold = row.threshold;
  for_each_draw_group(row, n, draw_group, [&](int64_t at, const uint16_t* draws, int64_t count) {
    T* y = x + at;
#pragma omp simd
    for (int64_t j = 0; j < count; ++j) {
      y[j] = draws[j] < threshold ? T(0) : y[j];
    }
  });
}

template <typename T, typename DrawGroup>
ATTN_PHILOX_INLINE void dropout_softmax_backward_loop(
    T* p,
    T* ds,
    int64_t n,
    T delta,
    T keep_scale,
    const DropoutRow& row,
    const DrawGroup& draw_group) {
  const uint32_t threshold = row.threshold;
  for_each_draw_group(row, n, draw_group, [&](int64_t at, const uint16_t* draws, int64_t count) {
    T* p_part = p + at;
    T* ds_part = ds + at;
#pragma omp simd
    for (int64_t j = 0; j < count; ++j) {
      const T m = draws[j] < threshold ? T(0) : keep_scale;
      ds_part[j] = p_part[j] * (m * ds_part[j] - delta);
      p_part[j] *= m;
    }
  });
}

#undef ATTN_PHILOX_INLINE

} // namespace attn::detail
