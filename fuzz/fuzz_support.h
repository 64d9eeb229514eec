#pragma once

// What both fuzz targets do around each input.

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <c10/util/Logging.h>
#include <torch/version.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

namespace attn::fuzz {

// One intra-op thread, so that a run is deterministic and a finding
// reproduces; and no C++ backtrace in c10::Errors, which LibTorch 1.13
// symbolises as each is thrown: most fuzz inputs are refused, and the
// backtraces would take most of the time.
inline void prepare_libtorch() {
  at::set_num_threads(1);
#if TORCH_VERSION_MAJOR < 2
  c10::SetStackTraceFetcher([] { return std::string(); });
#endif
}

// Runs `run`: a normal return or a c10::Error with a message is fine; a
// c10::Error without one, or any other exception, aborts, which libFuzzer
// reports as a crash with the input that caused it.
// With ATTN_FUZZ_VERBOSE set in the environment, each outcome is printed:
// run a target on one input file to see why it is refused.
template <typename Run>
void expect_success_or_torch_error(const Run& run) {
  static const bool verbose = std::getenv("ATTN_FUZZ_VERBOSE") != nullptr;
  try {
    run();
    if (verbose) {
      std::fprintf(stderr, "returned normally\n");
    }
  } catch (const c10::Error& error) {
    if (std::strlen(error.what_without_backtrace()) == 0) {
      std::fprintf(stderr, "a c10::Error without a message\n");
      std::abort();
    }
    if (verbose) {
      std::fprintf(stderr, "refused: %s\n", error.what_without_backtrace());
    }
  } catch (const std::exception& error) {
    std::fprintf(stderr, "an exception that is not a c10::Error: %s\n", error.what());
    std::abort();
  }
}

} // namespace attn::fuzz
