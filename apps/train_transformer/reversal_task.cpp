#include "reversal_task.h"

#include <torch/torch.h>

#include <random>
#include <vector>

namespace train {
namespace {

// One string in kHeldOutShare is held out.
constexpr uint64_t kHeldOutShare = 8;

// FNV-1a over the digits, then MurmurHash3's finaliser so that the low
// bits depend on every bit of every digit: a fixed, well-spread split.
bool is_held_out(const std::vector<int64_t>& digits) {
  uint64_t hash = 14695981039346656037ULL;
  for (const auto digit : digits) {
    hash = (hash ^ static_cast<uint64_t>(digit)) * 1099511628211ULL;
  }
  hash ^= hash >> 33;
  hash *= 0xff51afd7ed558ccdULL;
  hash ^= hash >> 33;
  return hash % kHeldOutShare == 0;
}

} // namespace

ReversalTask::ReversalTask(int64_t digits) : digits_(digits) {
  // Of the ten one-digit strings none is held out: there would be nothing
  // to evaluate on. Every longer length has strings in both splits.
  TORCH_CHECK(
      digits >= kMinDigits, "ReversalTask: digits must be at least ", kMinDigits, ", got ", digits);
}

ReversalBatch ReversalTask::batch(int64_t size, uint64_t seed, Split split) const {
  const auto N = digits_;
  std::mt19937_64 generator(seed);
  std::uniform_int_distribution<int64_t> digit(0, 9);
  auto inputs = torch::empty({size, 2 * N}, torch::kLong);
  auto targets = torch::empty({size, N}, torch::kLong);
  auto input_rows = inputs.accessor<int64_t, 2>();
  auto target_rows = targets.accessor<int64_t, 2>();
  std::vector<int64_t> digits(N);
  for (int64_t row = 0; row < size; ++row) {
    // A string of the other split is drawn again: 7 in 8 are training
    // strings, so a held-out one takes 8 draws on average.
    do {
      for (auto& d : digits) {
        d = digit(generator);
      }
    } while (is_held_out(digits) != (split == Split::kHeldOut));
    for (int64_t i = 0; i < N; ++i) {
      input_rows[row][i] = digits[i];
      target_rows[row][i] = digits[N - 1 - i];
    }
    input_rows[row][N] = kSeparator;
    for (int64_t i = 0; i + 1 < N; ++i) {
      input_rows[row][N + 1 + i] = digits[N - 1 - i];
    }
  }
  return {inputs, targets};
}

torch::Tensor ReversalTask::answer_logits(const torch::Tensor& logits) const {
  return logits.narrow(1, digits_, digits_); // (B, N, V)
}

} // namespace train
