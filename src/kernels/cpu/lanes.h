#pragma once

// The vector helpers of attn's loops written over GCC's vector extensions
// (row_ops_vector.h, short_heads_vector.h): loads and stores, lane
// selection, reductions and the vectorised exp. Included, like those, by
// the files of each instruction set (vector_loops_avx512.cpp,
// vector_loops_avx2.cpp) after they define, in attn::detail's anonymous
// namespace, kLanes and the vector types Lanes (kLanes floats) and
// LaneBits (kLanes int32_t) of its registers' width, under the instruction
// set's target pragma. (Vector code in a function without the target,
// inlined into one with it, arrives already split into pieces: GCC lowers
// it first.) It includes nothing: the including file includes <array>,
// <cstring> and <limits> before the pragma.

namespace attn::detail {
namespace {

constexpr float kInfinity = std::numeric_limits<float>::infinity();
// Added and subtracted, rounds a float below 2^22 to the nearest integer.
constexpr float kRoundingShift = 12582912.0f; // 1.5 · 2^23

// The exp's constants (exp_lanes below).
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kExpLowest = -87.3f;
constexpr std::array<float, 8> kExpTaylor{
    1.0f / 5040.0f, 1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f};

// The small helpers are inlined wherever they are used, so that their
// vectors stay in registers; the loops that hold a block of accumulators
// (a product's columns, a head) are functions of their own, ATTN_OWN_CODE,
// which GCC would otherwise inline into one function so large that its
// register allocation put AVX2's accumulators on the stack (3x slower).
#define ATTN_INLINE inline __attribute__((always_inline))
#define ATTN_OWN_CODE __attribute__((noinline))

ATTN_INLINE Lanes load(const float* from) {
  Lanes v;
  std::memcpy(&v, from, sizeof v);
  return v;
}

ATTN_INLINE void store(float* to, const Lanes& v) {
  std::memcpy(to, &v, sizeof v);
}

// x in every lane: one broadcast. (Lanes{} + x costs a scalar addition
// first, 0 + x not being x for x = -0; a list of sixteen x, sixteen
// inserts.)
ATTN_INLINE Lanes splat(float x) {
  return x - Lanes{};
}

ATTN_INLINE LaneBits bits_of(const Lanes& v) {
  return __builtin_bit_cast(LaneBits, v);
}

ATTN_INLINE Lanes floats_of(const LaneBits& v) {
  return __builtin_bit_cast(Lanes, v);
}

// a where `keep` is set, b elsewhere: one blend.
ATTN_INLINE Lanes select(const LaneBits& keep, const Lanes& a, const Lanes& b) {
  return keep ? a : b;
}

// a where a > b, else b (b where either is NaN): one max instruction.
ATTN_INLINE Lanes lane_max(const Lanes& a, const Lanes& b) {
  return a > b ? a : b;
}

template <bool kMax>
ATTN_INLINE Lanes fold(const Lanes& a, const Lanes& b) {
  return kMax ? lane_max(a, b) : a + b;
}

// The sum or the largest of the lanes, halves folded onto each other. (V
// is Lanes: a template, so that only its width's shuffles are compiled.)
template <bool kMax, typename V>
ATTN_INLINE float reduce(V v) {
  if constexpr (sizeof(V) == 16 * sizeof(float)) {
    v = fold<kMax>(
        v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    v = fold<kMax>(
        v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    v = fold<kMax>(
        v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    v = fold<kMax>(
        v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  } else {
    static_assert(sizeof(V) == 8 * sizeof(float));
    v = fold<kMax>(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
    v = fold<kMax>(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
    v = fold<kMax>(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6));
  }
  return v[0];
}

// 0, 1, ..., kLanes - 1.
ATTN_INLINE LaneBits lane_indices() {
  LaneBits lanes{};
  for (int32_t i = 0; i < static_cast<int32_t>(kLanes); ++i) {
    lanes[i] = i;
  }
  return lanes;
}

// p·2^k, where k holds integers, in the lanes where x >= kExpLowest; 0
// where x < kExpLowest (-inf included); NaN where x is NaN. The last step of
// exp_lanes, and the one that each instruction set does its own way (AVX-512
// in one scalef, 1.3x faster there than building 2^k in the exponent bits):
// the file of each instruction set defines it after including this header.
ATTN_INLINE Lanes times_two_to_or_zero(const Lanes& p, const Lanes& k, const Lanes& x);

// exp(x) per lane: x = k·ln2 + r with |r| <= ln2/2 (ln2 split in two for
// an exact k·ln2_hi), exp(r) by its Taylor polynomial to degree 7
// (truncation below 1e-8 relative), highest coefficient first, times 2^k.
// Below kExpLowest (-inf included) 0, NaN stays NaN; the attention kernels
// never pass values above 0. The one vector exp of the kernels: the row
// operations (row_ops_vector.h) and the short-head loops use it, at every
// width.
ATTN_INLINE Lanes exp_lanes(const Lanes& x) {
  const Lanes k = (x * kLog2e + kRoundingShift) - kRoundingShift;
  Lanes r = x - k * kLn2Hi;
  r = r - k * kLn2Lo;
  Lanes p = splat(kExpTaylor[0]);
#pragma GCC unroll 8
  for (size_t i = 1; i < kExpTaylor.size(); ++i) {
    p = p * r + kExpTaylor[i];
  }
  return times_two_to_or_zero(p, k, x);
}

} // namespace
} // namespace attn::detail
