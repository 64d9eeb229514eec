#pragma once

namespace attn::detail {

// While alive, keeps OpenBLAS (when it is the BLAS in use) to one thread,
// if ATen's own pool has more than one: the kernels parallelise over tiles
// themselves, and a threaded BLAS inside each task would oversubscribe the
// cores. MKL does this on its own inside OpenMP regions; other BLAS
// libraries are left alone. Guards may overlap across threads: the
// setting is restored when the last one ends.
class ScopedSingleThreadedBlas {
 public:
  ScopedSingleThreadedBlas();
  ~ScopedSingleThreadedBlas();
  ScopedSingleThreadedBlas(const ScopedSingleThreadedBlas&) = delete;
  ScopedSingleThreadedBlas& operator=(const ScopedSingleThreadedBlas&) = delete;

 private:
  bool active_ = false; // whether this guard counts among the live ones
};

} // namespace attn::detail
