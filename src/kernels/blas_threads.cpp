#include "blas_threads.h"

#include <ATen/Parallel.h>

#include <mutex>

#ifndef _WIN32
#include <dlfcn.h>
#endif

namespace attn::detail {
namespace {

struct OpenBlasThreadControl {
  using Get = int (*)();
  using Set = void (*)(int);
#ifndef _WIN32
  // Found at run time: LibTorch links whichever BLAS the system selected.
  Get get = reinterpret_cast<Get>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  Set set = reinterpret_cast<Set>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
#else
  Get get = nullptr;
  Set set = nullptr;
#endif
};

const OpenBlasThreadControl& openblas() {
  static const OpenBlasThreadControl control;
  return control;
}

// OpenBLAS's thread count is process-wide while the guards live in whichever
// threads call the kernels, so they share one count of live guards: the
// first saves and lowers the setting, the last restores it, in any order.
struct LiveGuards {
  std::mutex mutex;
  int count = 0;
  int saved_threads = 0;
};

LiveGuards& live_guards() {
  static LiveGuards guards;
  return guards;
}

} // namespace

ScopedSingleThreadedBlas::ScopedSingleThreadedBlas() {
  const auto& blas = openblas();
  active_ = blas.get != nullptr && blas.set != nullptr && at::get_num_threads() > 1;
  if (!active_) {
    return;
  }
  auto& guards = live_guards();
  const std::lock_guard<std::mutex> lock(guards.mutex);
  if (guards.count++ == 0) {
    guards.saved_threads = blas.get();
    blas.set(1);
  }
}

ScopedSingleThreadedBlas::~ScopedSingleThreadedBlas() {
  if (!active_) {
    return;
  }
  auto& guards = live_guards();
  const std::lock_guard<std::mutex> lock(guards.mutex);
  if (--guards.count == 0) {
    openblas().set(guards.saved_threads);
  }
}

} // namespace attn::detail
