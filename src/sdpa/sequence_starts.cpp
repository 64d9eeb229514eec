#include "sdpa/sequence_starts.h"

#include "sdpa/block_mask.h"

#include <torch/torch.h>

#include <algorithm>

namespace attn::detail {

std::vector<int64_t> sequence_starts(
    const char* caller,
    const char* name,
    const torch::Tensor& starts,
    int64_t total,
    const c10::optional<int64_t>& longest) {
  TORCH_CHECK(starts.defined(), caller, ": ", name, " must be a defined tensor");
  TORCH_CHECK(
      starts.dim() == 1 && starts.numel() >= 1, caller, ": ", name,
      " must be (N + 1) for N sequences, got ", starts.sizes());
  check_integers(caller, name, starts);
  const auto copy = starts.to(torch::kCPU, torch::kLong).contiguous();
  const std::vector<int64_t> values(
      copy.data_ptr<int64_t>(), copy.data_ptr<int64_t>() + copy.numel());
  TORCH_CHECK(values.front() == 0, caller, ": ", name, " must start at 0, got ", values.front());
  for (size_t n = 1; n < values.size(); ++n) {
    const int64_t length = values[n] - values[n - 1];
    TORCH_CHECK(
        length >= 0, caller, ": ", name, " must be nondecreasing, got ", values[n - 1], " then ",
        values[n], " at index ", n);
    TORCH_CHECK(
        !longest || length <= *longest, caller, ": sequence ", n - 1, " is ", length, " long by ",
        name, ", longer than the stated maximum ", *longest);
  }
  TORCH_CHECK(
      values.back() == total, caller, ": ", name, " must end at the total length ", total, ", got ",
      values.back());
  return values;
}

torch::Tensor document_ids_of(const std::vector<int64_t>& starts) {
  auto ids = torch::empty({starts.back()}, torch::kLong);
  auto* data = ids.data_ptr<int64_t>();
  for (size_t n = 0; n + 1 < starts.size(); ++n) {
    std::fill(data + starts[n], data + starts[n + 1], static_cast<int64_t>(n));
  }
  return ids;
}

} // namespace attn::detail
