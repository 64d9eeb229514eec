#pragma once

// The public entry points' fuzz input: bytes decoded into one call of
// attn::scaled_dot_product_attention, attn::MultiHeadAttention (with or
// without a KV cache, decoding a sequence step by step),
// attn::multi_head_attention_forward (with a module's parameters, whole or
// with one refused) or attn::RotaryEmbedding, with the call's shapes (zeros, odd sizes, and
// leading dims up to 2^40 where every tensor is empty), strides
// (transposed, expanded, overlapping, stepped), dtypes, masks and option
// values, valid or not. Shared by the fuzz target
// (fuzz/entry_points_fuzzer.cpp) and the GoogleTest that replays the
// seeds and regressions in the ordinary build
// (tests/test_fuzz_regressions.cpp).
//
// The oracle: attn either refuses the call with a c10::Error, or returns
// results of the documented shapes and dtype that are finite wherever the
// inputs are, and that match the same call on float64 copies of the
// inputs (the math backend, for the function) within a tolerance derived
// from the dtype's rounding and the scores' magnitude. Cases whose tensors
// would exceed kMostElements are skipped, so that a run stays within a
// few hundred MB and milliseconds per input.

#include <cstddef>
#include <cstdint>
#include <stdexcept>

namespace attn::fuzz {

// The most elements any tensor of a decoded case may hold.
inline constexpr int64_t kMostElements = int64_t{1} << 14;

// A result that contradicts the oracle; the message describes the call.
class OracleViolation : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

// Decodes `data` into a call, makes it, and checks its result. Throws the
// c10::Error of a call attn refuses, and OracleViolation for a wrong
// result.
void run_entry_points_input(const uint8_t* data, size_t size);

} // namespace attn::fuzz
