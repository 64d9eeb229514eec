#pragma once

// The CPU thread pools: ATen's intra-op pool, sized when the library loads
// (attn/threads.h) and kept at each thread's own count, and OpenBLAS's own
// pool when it keeps one.

namespace attn::detail {

// Keeps the calling thread's count of intra-op threads through attn's first
// at::parallel_for in this thread. That loop first sets the thread's count
// to the count any thread last passed to at::set_num_threads, once per
// thread; the record of having done so is a thread_local in an inline
// function of LibTorch's headers, and where LibTorch hides its symbols (the
// PyPI wheels; Debian's 1.13 shares them) attn has a copy of its own. A
// thread that chose its own count would then lose it to attn's first call.
// Putting the count back makes it, too, the count last set. Called before
// each of attn's parallel loops.
void keep_thread_count();

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
