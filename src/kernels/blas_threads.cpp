#include "blas_threads.h"

#include <ATen/Parallel.h>

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

} // namespace

ScopedSingleThreadedBlas::ScopedSingleThreadedBlas() {
  const auto& blas = openblas();
  if (blas.get != nullptr && blas.set != nullptr && at::get_num_threads() > 1) {
    previous_threads_ = blas.get();
    blas.set(1);
  }
}

ScopedSingleThreadedBlas::~ScopedSingleThreadedBlas() {
  if (previous_threads_ > 0) {
    openblas().set(previous_threads_);
  }
}

} // namespace attn::detail
