#pragma once

/// \file
/// How attn sizes LibTorch's CPU thread pool.
///
/// Attention's kernels run in ATen's intra-op pool, and the projections in the
/// BLAS. When attn's library is loaded, it gives ATen's pool one thread per CPU
/// the process may run on, as LibTorch 2.x does by default, if all of these
/// hold:
/// - neither `OMP_NUM_THREADS` nor `MKL_NUM_THREADS` is set (a count set there
///   is kept);
/// - ATen's pool is smaller than that (LibTorch 1.13 counts physical cores
///   through cpuinfo, which reports one core on some virtual machines);
/// - the BLAS does not keep a pool of its own that would compete for the same
///   cores: OpenBLAS built with pthreads does, and then ATen's count is left
///   alone (`scripts/setup.sh` installs Debian's OpenMP build of OpenBLAS,
///   which shares ATen's pool).
///
/// A program that wants fewer threads calls `at::set_num_threads` in `main`,
/// which runs after the library is loaded, or sets `OMP_NUM_THREADS`. A
/// thread that sets a count of its own (one intra-op thread per serving
/// thread, say) keeps it through attn's calls.

#include <string>

namespace attn {

/// What attn found and did when it was loaded.
struct ThreadSetup {
  int threads_found = 0;  ///< ATen's intra-op threads as LibTorch started them
  int threads_chosen = 0; ///< the count attn left or set
  int cpus = 0;           ///< CPUs this process may run on
  std::string blas;       ///< the BLAS's threading: "openmp", "pthreads", "sequential" or "other"
  /// OpenBLAS's kernels for this CPU, as it names them ("SkylakeX", "Haswell",
  /// ...); empty for another BLAS. OpenBLAS releases older than the CPU may
  /// not recognise it and fall back to old kernels: Debian 12's 0.3.21 runs
  /// its SSE3 "Prescott" kernels on Xeons of family 6, model 207 (Emerald
  /// Rapids), 6-9x slower than its "SkylakeX" ones, which the environment
  /// variable `OPENBLAS_CORETYPE=SkylakeX` selects.
  std::string blas_core;
  std::string reason; ///< why the count was changed or kept, in one sentence
};

/// The thread setup made when attn was loaded.
const ThreadSetup& thread_setup();

} // namespace attn
