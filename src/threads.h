#pragma once

// The CPU thread pools: ATen's intra-op pool, sized when the library loads
// (attn/threads.h), and OpenBLAS's own when it keeps one.

namespace attn::detail {

// While alive, keeps a pthreads OpenBLAS to one thread, if ATen's pool has
// more than one: the kernels parallelise over tiles themselves, and a
// threaded BLAS inside each task would oversubscribe the cores. An OpenMP
// OpenBLAS, like MKL, runs single-threaded inside OpenMP regions on its
// own (lowering its count would lower ATen's too: they share the pool);
// other BLAS libraries are left alone. Guards may overlap across threads:
// the setting is restored when the last one ends.
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
