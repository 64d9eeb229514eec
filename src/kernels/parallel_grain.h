#pragma once

// How finely the kernels' loops split their work between threads.

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace attn::detail {

// The grain for at::parallel_for, which runs a range of at most `grain`
// units inline: units per task such that each task does at least
// `min_work_per_task`, counted in the unit of `work_per_unit`. Work too
// small to pay for waking the thread pool stays on the calling thread.
inline int64_t parallel_grain(double work_per_unit, double min_work_per_task) {
  return static_cast<int64_t>(std::ceil(min_work_per_task / std::max(work_per_unit, 1.0)));
}

} // namespace attn::detail
