#pragma once

// The kernels' parallel loops: how finely they split their work between
// threads (every threshold, in one place), and the loop that runs them.

#include "runtime/threads.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace attn::detail {

// The least work of one task of each loop; less stays on the calling
// thread.
//
// The tiled kernels' tasks, in FLOPs: waking the thread pool, with
// OpenBLAS's workers still spinning from the projection before, costs
// milliseconds on two cores, while a decoding step's attention (one query
// against 512 keys, 8 heads) takes about 0.5 MFLOP.
constexpr double kMinTiledTaskFlops = 4e6;
// The short-head loops' tasks (whole heads), in FLOPs.
constexpr double kMinShortHeadsTaskFlops = 1e6;
// The batched kernel's row passes, in scores: a few microseconds of work,
// so that short calls stay on the calling thread.
constexpr double kMinRowPassScores = 32768;
// The batched kernel's loop of small products, in multiply-adds.
constexpr double kMinSmallProductWork = 262144;
// transpose_heads' tasks, and the float loops' Kᵀ and Vᵀ copies'
// (operands_float.h), in elements.
constexpr double kMinParallelTranspose = 1 << 16;
// Multiply-adds from which a product outside the kernels' parallel tasks
// goes to the BLAS, which shares it between threads: as much work as the
// tiled kernels give one task (kMinTiledTaskFlops).
constexpr double kMinSharedProduct = 2e6;

// The grain for parallel_for, which runs a range of at most `grain` units
// inline: units per task such that each task does at least
// `min_work_per_task`, counted in the unit of `work_per_unit`. Work too
// small to pay for waking the thread pool stays on the calling thread.
inline int64_t parallel_grain(double work_per_unit, double min_work_per_task) {
  return static_cast<int64_t>(std::ceil(min_work_per_task / std::max(work_per_unit, 1.0)));
}

// at::parallel_for, keeping the calling thread's count of intra-op threads
// (keep_thread_count in threads.h).
template <typename Body>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const Body& body) {
  keep_thread_count();
  at::parallel_for(begin, end, grain, body);
}

} // namespace attn::detail
