#include <attn/threads.h>

#include "runtime/threads.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <mutex>
#include <thread>

#ifndef _WIN32
#include <dlfcn.h>
#include <sched.h>
#endif

namespace attn {
namespace detail {
namespace {

// OpenBLAS's controls, found at run time: LibTorch links whichever BLAS the
// system selected.
struct OpenBlasControl {
  using Get = int (*)();
  using Set = void (*)(int);
  using Name = const char* (*)();
#ifndef _WIN32
  Get get = reinterpret_cast<Get>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  Set set = reinterpret_cast<Set>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  // 0: sequential, 1: pthreads, 2: OpenMP.
  Get parallel = reinterpret_cast<Get>(dlsym(RTLD_DEFAULT, "openblas_get_parallel"));
  // The kernel family OpenBLAS chose for this CPU ("SkylakeX", "Haswell", ...).
  Name core = reinterpret_cast<Name>(dlsym(RTLD_DEFAULT, "openblas_get_corename"));
#else
  Get get = nullptr;
  Set set = nullptr;
  Get parallel = nullptr;
  Name core = nullptr;
#endif

  bool found() const {
    return get != nullptr && set != nullptr && parallel != nullptr;
  }
  bool has_own_pool() const {
    return found() && parallel() == 1;
  }
};

const OpenBlasControl& openblas() {
  static const OpenBlasControl control;
  return control;
}

const char* blas_threading() {
  const auto& blas = openblas();
  if (!blas.found()) {
    return "other";
  }
  switch (blas.parallel()) {
    case 0: return "sequential";
    case 1: return "pthreads";
    case 2: return "openmp";
    default: return "other";
  }
}

int cpus_available() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    return CPU_COUNT(&set);
  }
#endif
  return static_cast<int>(std::thread::hardware_concurrency());
}

bool thread_count_in_environment() {
  return std::getenv("OMP_NUM_THREADS") != nullptr || std::getenv("MKL_NUM_THREADS") != nullptr;
}

ThreadSetup size_aten_pool() {
  ThreadSetup setup;
  setup.threads_found = at::get_num_threads();
  setup.threads_chosen = setup.threads_found;
  setup.cpus = cpus_available();
  setup.blas = blas_threading();
  const auto& blas = openblas();
  if (blas.core != nullptr && blas.core() != nullptr) {
    setup.blas_core = blas.core();
  }
  if (thread_count_in_environment()) {
    setup.reason = "kept: the environment sets a thread count";
  } else if (setup.threads_found >= setup.cpus) {
    setup.reason = "kept: one thread per CPU already";
  } else if (openblas().has_own_pool()) {
    setup.reason =
        "kept: OpenBLAS keeps its own pthreads pool, which more ATen threads would "
        "compete with (install Debian's libopenblas0-openmp)";
  } else {
    try {
      at::set_num_threads(setup.cpus);
      setup.threads_chosen = at::get_num_threads();
      setup.reason = "raised to one thread per CPU";
    } catch (const c10::Error& error) {
      setup.reason = std::string("kept: LibTorch refused a new count: ") +
          error.what_without_backtrace();
    }
  }
  return setup;
}

// Sizes the pool while the library loads, before `main` can set a count
// of its own. A failure leaves LibTorch's count and must not end the
// program: thread_setup() tries again when asked.
bool size_pool_at_load() noexcept {
  try {
    thread_setup();
  } catch (...) {
    return false;
  }
  return true;
}

[[maybe_unused]] const bool sized_at_load = size_pool_at_load();

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

void keep_thread_count() {
  thread_local bool kept = false;
  if (kept) {
    return;
  }
  kept = true;
  const int own = at::get_num_threads();
  at::internal::lazy_init_num_threads(); // attn's copy: may set the process-wide count
  if (at::get_num_threads() != own) {
    at::set_num_threads(own);
  }
}

ScopedSingleThreadedBlas::ScopedSingleThreadedBlas() {
  const auto& blas = openblas();
  active_ = blas.has_own_pool() && at::get_num_threads() > 1;
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

} // namespace detail

const ThreadSetup& thread_setup() {
  static const ThreadSetup setup = detail::size_aten_pool();
  return setup;
}

} // namespace attn
