// libFuzzer target: attn's public entry points (scaled_dot_product_attention,
// MultiHeadAttention with and without a KV cache, RotaryEmbedding), fed the
// calls that entry_points_input.h decodes and checked against its oracle.
// A refusal is a c10::Error with a message; a wrong result (an
// OracleViolation), another exception, a crash, a sanitizer report, a
// timeout or running out of memory is a finding.

#include "entry_points_input.h"
#include "fuzz_support.h"

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  attn::fuzz::prepare_libtorch();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  attn::fuzz::expect_success_or_torch_error(
      [&] { attn::fuzz::run_entry_points_input(data, size); });
  return 0;
}
