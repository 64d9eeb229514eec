#pragma once

// The textbook attention, in C++ as a few lines of Python would write it: matmul,
// masked_fill, softmax, matmul. The benchmarks' baseline for the core.

#include <torch/torch.h>

#include <cmath>
#include <limits>

namespace attn::bench {

// q (…, L, D), k (…, S, D), v (…, S, Dv); `allowed` undefined or a
// (broadcastable) mask where 0 forbids a pair.
inline torch::Tensor naive_attention(
    const torch::Tensor& q,
    const torch::Tensor& k,
    const torch::Tensor& v,
    const torch::Tensor& allowed) {
  auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(-1)));
  if (allowed.defined()) {
    scores = scores.masked_fill(allowed == 0, -std::numeric_limits<float>::infinity());
  }
  return torch::matmul(torch::softmax(scores, -1), v);
}

} // namespace attn::bench
