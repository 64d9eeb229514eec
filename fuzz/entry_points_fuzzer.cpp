// libFuzzer target: attn's public entry points (scaled_dot_product_attention,
// MultiHeadAttention with and without a KV cache, RotaryEmbedding), fed the
// calls that entry_points_input.h decodes and checked against its oracle.
// A refusal is a c10::Error with a message; a wrong result (an
// OracleViolation), another exception, a crash, a sanitizer report, a
// timeout or running out of memory is a finding.
//
// ATTN_CPU_CAPABILITY=avx2 (any of attn::cpu_capabilities()' names) in the
// environment runs the whole process as on a CPU that has no more: loops
// of narrower vectors offset their operands by other widths (scripts/fuzz.sh
// fuzzes at several). ATTN_FUZZ_LIST_CAPABILITIES=1 prints the
// capabilities this CPU runs, the widest first, and exits.

#include "entry_points_input.h"
#include "fuzz_support.h"

#include <attn/backend.h>

#include <cstdio>
#include <cstdlib>

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  if (std::getenv("ATTN_FUZZ_LIST_CAPABILITIES") != nullptr) {
    const auto capabilities = attn::cpu_capabilities();
    for (auto c = capabilities.rbegin(); c != capabilities.rend(); ++c) {
      std::printf("%s\n", attn::cpu_capability_name(*c));
    }
    std::exit(0);
  }
  attn::fuzz::prepare_libtorch();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  attn::fuzz::expect_success_or_torch_error(
      [&] { attn::fuzz::run_entry_points_input(data, size); });
  return 0;
}
