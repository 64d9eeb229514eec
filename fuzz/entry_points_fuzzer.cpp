// libFuzzer target: attn's public entry points (scaled_dot_product_attention,
// MultiHeadAttention with and without a KV cache, RotaryEmbedding), fed the
// calls that entry_points_input.h decodes and checked against its oracle.
// A refusal is a c10::Error with a message; a wrong result (an
// OracleViolation), another exception, a crash, a sanitizer report, a
// timeout or running out of memory is a finding.
//
// ATTN_FUZZ_PRODUCT_LOOPS=AVX2 (or AVX-512, BLAS) in the environment runs
// the float products and the short heads' loops on those loops for the
// whole run, as on a CPU whose widest they are: loops of narrower vectors
// offset their operands by other widths. ATTN_FUZZ_PRODUCT_LOOPS=list
// prints those this build and CPU run, the widest first, and exits
// (scripts/fuzz.sh fuzzes on each).

#include "entry_points_input.h"
#include "fuzz_support.h"
#include "kernels/cpu/tile_product.h"

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

namespace {

// The loops named by ATTN_FUZZ_PRODUCT_LOOPS, chosen until the process
// ends; none where it is unset or empty. An unknown name, or loops this
// CPU cannot run, end the process before fuzzing starts.
std::unique_ptr<attn::detail::ScopedProductLoops> chosen_product_loops() {
  const char* wanted = std::getenv("ATTN_FUZZ_PRODUCT_LOOPS");
  if (wanted == nullptr || *wanted == '\0') {
    return nullptr;
  }
  const auto available = attn::detail::available_product_loops();
  if (std::string(wanted) == "list") {
    for (auto loops = available.rbegin(); loops != available.rend(); ++loops) {
      std::printf("%s\n", attn::detail::product_loops_name(*loops));
    }
    std::exit(0);
  }
  for (const auto loops : available) {
    if (std::string(wanted) == attn::detail::product_loops_name(loops)) {
      std::fprintf(stderr, "INFO: %s products (ATTN_FUZZ_PRODUCT_LOOPS)\n", wanted);
      return std::make_unique<attn::detail::ScopedProductLoops>(loops);
    }
  }
  std::fprintf(stderr, "ATTN_FUZZ_PRODUCT_LOOPS=%s: no such loops in this build or CPU\n", wanted);
  std::exit(2);
}

} // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  attn::fuzz::prepare_libtorch();
  static const auto product_loops = chosen_product_loops();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  attn::fuzz::expect_success_or_torch_error(
      [&] { attn::fuzz::run_entry_points_input(data, size); });
  return 0;
}
