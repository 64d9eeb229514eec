#include "kernels/cpu/mask_view.h"

#include <algorithm>
#include <cstdint>

namespace attn::detail {

[[gnu::noinline]] void add_half_mask_row(
    float* scores,
    int64_t n,
    const uint16_t* from,
    int64_t stride,
    void (*widen)(const uint16_t* from, int64_t n, float* to)) {
  constexpr int64_t kRun = 64;
  float widened[kRun];
  uint16_t gathered[kRun];
  for (int64_t j0 = 0; j0 < n; j0 += kRun) {
    const int64_t m = std::min(kRun, n - j0);
    const uint16_t* run = from + j0 * stride;
    if (stride != 1) { // broadcast or strided keys
      for (int64_t j = 0; j < m; ++j) {
        gathered[j] = run[j * stride];
      }
      run = gathered;
    }
    widen(run, m, widened);
#pragma omp simd
    for (int64_t j = 0; j < m; ++j) {
      scores[j0 + j] += widened[j];
    }
  }
}

} // namespace attn::detail
