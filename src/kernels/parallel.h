#pragma once

// The kernels' parallel loops: how finely they split their work between
// threads, and the loop that runs them.

#include "threads.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace attn::detail {

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
