#pragma once

// Dropout's float row operations (dropout.h) for the files of each
// instruction set (vector_loops_avx512.cpp, vector_loops_avx2.cpp), under
// their target pragma and lanes.h's conventions: philox.h's loops over
// groups of words drawn in vector registers, kLanes blocks a register.
// The including file defines LaneWords (kLanes uint32_t), LaneWordPairs
// (kLanes / 2 uint64_t) and multiply_low_words, and includes philox.h
// before the pragma.

namespace attn::detail {
namespace {

constexpr int64_t kGroupVectors = kPhiloxGroupBlocks / kLanes;

ATTN_INLINE LaneWords splat_word(uint32_t x) {
  return LaneWords{} + x;
}

// The high and low 32 bits of a·m in each lane: two multiplies, of the
// even lanes and of the odd ones, each lane's halves moved into place.
ATTN_INLINE void multiply_high_low(
    const LaneWords& a,
    uint32_t m,
    LaneWords& high,
    LaneWords& low) {
  constexpr uint64_t kLow = 0xffffffffu;
  const auto pairs = __builtin_bit_cast(LaneWordPairs, a);
  const LaneWordPairs factor = LaneWordPairs{} + uint64_t{m};
  const LaneWordPairs even = multiply_low_words(pairs, factor);
  const LaneWordPairs odd = multiply_low_words(pairs >> 32, factor);
  high = __builtin_bit_cast(LaneWords, (even >> 32) | (odd & ~kLow));
  low = __builtin_bit_cast(LaneWords, (even & kLow) | (odd << 32));
}

// philox_group (philox.h), lane l of vector v drawing block
// 16·group + v·kLanes + l. Stored as they are, the words' halves land in
// the draws' order: x86 is little-endian.
ATTN_INLINE void philox_group_lanes(
    uint16_t* draws,
    uint64_t group,
    uint64_t seed,
    uint64_t subsequence) {
  const uint64_t first = kPhiloxGroupBlocks * group; // a multiple of 16: no carry below
  LaneWords lane{};
  for (int64_t l = 0; l < kLanes; ++l) {
    lane[l] = static_cast<uint32_t>(l);
  }
  LaneWords c[4][kGroupVectors];
  for (int64_t v = 0; v < kGroupVectors; ++v) {
    c[0][v] = splat_word(static_cast<uint32_t>(first + v * kLanes)) + lane;
    c[1][v] = splat_word(static_cast<uint32_t>(first >> 32));
    c[2][v] = splat_word(static_cast<uint32_t>(subsequence));
    c[3][v] = splat_word(static_cast<uint32_t>(subsequence >> 32));
  }
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int round = 0; round < kPhiloxRounds; ++round) {
    for (int64_t v = 0; v < kGroupVectors; ++v) {
      LaneWords high0, low0, high1, low1;
      multiply_high_low(c[0][v], kPhiloxMultiplier0, high0, low0);
      multiply_high_low(c[2][v], kPhiloxMultiplier1, high1, low1);
      c[0][v] = high1 ^ c[1][v] ^ k0;
      c[1][v] = low1;
      c[2][v] = high0 ^ c[3][v] ^ k1;
      c[3][v] = low0;
    }
    k0 += kPhiloxKeyStep0;
    k1 += kPhiloxKeyStep1;
  }
  for (int64_t m = 0; m < 4; ++m) {
    for (int64_t v = 0; v < kGroupVectors; ++v) {
      std::memcpy(draws + 2 * (m * kPhiloxGroupBlocks + v * kLanes), &c[m][v], sizeof c[m][v]);
    }
  }
}

struct VectorGroup {
  void operator()(uint16_t* draws, uint64_t group, uint64_t seed, uint64_t subsequence) const {
    philox_group_lanes(draws, group, seed, subsequence);
  }
};

void drop_row_vector(float* x, int64_t n, const DropoutRow& row) {
  drop_row_loop(x, n, row, VectorGroup{});
}

void dropout_softmax_backward_row_vector(
    float* p,
    float* ds,
    int64_t n,
    float delta,
    float keep_scale,
    const DropoutRow& row) {
  dropout_softmax_backward_loop(p, ds, n, delta, keep_scale, row, VectorGroup{});
}

} // namespace
} // namespace attn::detail
