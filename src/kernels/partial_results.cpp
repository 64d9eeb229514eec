#include "kernels/partial_results.h"

#include <torch/torch.h>

#include <limits>

namespace attn::detail {

void merge_partial(
    const torch::Tensor& out,
    const torch::Tensor& lse,
    const torch::Tensor& out_part,
    const torch::Tensor& lse_part) {
  const auto largest = torch::maximum(lse, lse_part);
  // Rows that have seen no key yet stay at -inf; exp(-inf - 0) is 0.
  const auto shift = largest.masked_fill(largest == -std::numeric_limits<double>::infinity(), 0);
  const auto old_share = torch::exp(lse - shift);
  const auto new_share = torch::exp(lse_part - shift);
  // The sum is 0 (no key seen) or at least 1 (its largest term is exp(0)).
  const auto total = (old_share + new_share).clamp_min(1);
  out.mul_((old_share / total).unsqueeze(-1)).add_(out_part * (new_share / total).unsqueeze(-1));
  lse.copy_(shift + torch::log(old_share + new_share));
}

} // namespace attn::detail
