#pragma once

// The band of keys that `is_causal` and `window` leave visible to each
// query, as index bounds: what every kernel skips blocks by, and the bounds
// that keep position arithmetic in int64. Below the API boundary, below
// every other part of attn: it includes nothing of attn's.

#include <algorithm>
#include <cstdint>

namespace attn::detail {

// Query offsets are bounded by 2^60 (no tensor is that long), so every
// query-key distance is below 2^61 and a window of 2^62 reaches every key:
// with both bounds, positions and distances stay in int64.
constexpr int64_t kMaxQueryOffset = int64_t{1} << 60;
constexpr int64_t kUnboundedWindow = int64_t{1} << 62;

// The keys [begin(i), end(i)) that query i sees under SDPAOptions' rules:
// query i stands at key position i + query_offset; `causal` hides the keys
// after it, a positive `window` the keys at a distance of `window` or more.
// Both bounds are nondecreasing in i, so a tile of queries sees
// [begin(first row), end(last row)).
struct KeyBand {
  bool causal = false;
  int64_t query_offset = 0;
  int64_t window = 0; // 0: none; at most kUnboundedWindow
  int64_t S = 0;

  int64_t begin(int64_t i) const {
    return window > 0 ? std::clamp<int64_t>(i + query_offset - window + 1, 0, S) : 0;
  }

  int64_t end(int64_t i) const {
    if (causal) {
      return std::clamp<int64_t>(i + query_offset + 1, 0, S);
    }
    return window > 0 ? std::clamp<int64_t>(i + query_offset + window, 0, S) : S;
  }
};

} // namespace attn::detail
