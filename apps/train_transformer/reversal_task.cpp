#include "reversal_task.h"

#include <torch/torch.h>

#include <algorithm>
#include <random>
#include <utility>
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

// Digits for `digits` (its size the string's length), drawn again while
// they are a string of the other split: 7 in 8 are training strings, so
// a held-out one takes 8 draws on average.
void draw_string(std::mt19937_64& generator, std::vector<int64_t>& digits, Split split) {
  std::uniform_int_distribution<int64_t> digit(0, 9);
  do {
    for (auto& d : digits) {
      d = digit(generator);
    }
  } while (is_held_out(digits) != (split == Split::kHeldOut));
}

// Writes the sequence of `digits` (2N tokens) and its targets at `column`
// of `row`: the digits, the separator, the reversal but its last digit;
// positions N to 2N - 1 predict the reversal.
void write_sequence(
    const std::vector<int64_t>& digits,
    torch::TensorAccessor<int64_t, 1> inputs,
    torch::TensorAccessor<int64_t, 1> targets,
    int64_t column) {
  const auto N = static_cast<int64_t>(digits.size());
  for (int64_t i = 0; i < N; ++i) {
    inputs[column + i] = digits[i];
    targets[column + N + i] = digits[N - 1 - i];
  }
  inputs[column + N] = ReversalTask::kSeparator;
  for (int64_t i = 0; i + 1 < N; ++i) {
    inputs[column + N + 1 + i] = digits[N - 1 - i];
  }
}

// Each string's place: its row and first column.
struct Placement {
  int64_t row, column;
};

// The strings (2N tokens each) in order: packed into rows of `width`
// tokens, a new row where one does not fit, or one per row.
std::vector<Placement> place(
    const std::vector<std::vector<int64_t>>& strings,
    bool packed,
    int64_t width) {
  std::vector<Placement> places;
  places.reserve(strings.size());
  int64_t row = 0, column = 0;
  for (const auto& digits : strings) {
    const auto tokens = 2 * static_cast<int64_t>(digits.size());
    if (!places.empty() && (!packed || column + tokens > width)) {
      ++row;
      column = 0;
    }
    places.push_back({row, column});
    column += tokens;
  }
  return places;
}

} // namespace

const char* lengths_name(Lengths lengths) {
  switch (lengths) {
    case Lengths::kFixed: return "fixed";
    case Lengths::kPadded: return "padded";
    case Lengths::kPacked: return "packed";
  }
  return "?";
}

ReversalTask::ReversalTask(int64_t digits) : digits_(digits) {
  // Of the ten one-digit strings none is held out: there would be nothing
  // to evaluate on. Every longer length has strings in both splits.
  TORCH_CHECK(
      digits >= kMinDigits, "ReversalTask: digits must be at least ", kMinDigits, ", got ", digits);
}

ReversalBatch ReversalTask::batch(int64_t size, uint64_t seed, Split split) const {
  const auto N = digits_;
  std::mt19937_64 generator(seed);
  auto inputs = torch::empty({size, 2 * N}, torch::kLong);
  auto targets = torch::empty({size, 2 * N}, torch::kLong);
  auto input_rows = inputs.accessor<int64_t, 2>();
  auto target_rows = targets.accessor<int64_t, 2>();
  std::vector<int64_t> digits(N);
  for (int64_t row = 0; row < size; ++row) {
    draw_string(generator, digits, split);
    write_sequence(digits, input_rows[row], target_rows[row], 0);
  }
  return {inputs, targets.narrow(1, N, N).contiguous()};
}

LabelledRows ReversalTask::rows(int64_t size, uint64_t seed, Lengths lengths) const {
  TORCH_CHECK(lengths != Lengths::kFixed, "ReversalTask: fixed lengths are batch()'s");
  std::mt19937_64 generator(seed);
  std::uniform_int_distribution<int64_t> length(kMinDigits, digits_);
  std::vector<std::vector<int64_t>> strings;
  int64_t longest = 0, tokens = 0;
  for (int64_t s = 0; s < size; ++s) {
    strings.emplace_back(length(generator));
    draw_string(generator, strings.back(), Split::kTraining);
    longest = std::max<int64_t>(longest, strings.back().size());
    tokens += 2 * static_cast<int64_t>(strings.back().size());
  }
  const bool packed = lengths == Lengths::kPacked;
  const int64_t width = packed ? kStringsPerRow * input_length() : 2 * longest;
  const auto places = place(strings, packed, width);
  const int64_t row_count = places.empty() ? 0 : places.back().row + 1;
  LabelledRows rows;
  rows.inputs = torch::zeros({row_count, width}, torch::kLong);
  rows.targets = torch::full({row_count, width}, kIgnored, torch::kLong);
  rows.positions = packed ? torch::zeros({row_count, width}, torch::kLong)
                          : torch::arange(width, torch::kLong).expand({row_count, width}).clone();
  auto document_ids = torch::zeros({row_count, width}, torch::kLong);
  auto inputs = rows.inputs.accessor<int64_t, 2>();
  auto targets = rows.targets.accessor<int64_t, 2>();
  auto positions = rows.positions.accessor<int64_t, 2>();
  auto documents = document_ids.accessor<int64_t, 2>();
  for (size_t s = 0; s < strings.size(); ++s) {
    const auto [row, column] = places[s];
    write_sequence(strings[s], inputs[row], targets[row], column);
    const int64_t document = s > 0 && places[s - 1].row == row ? documents[row][column - 1] + 1 : 0;
    const int64_t end = s + 1 < strings.size() && places[s + 1].row == row ? places[s + 1].column
                                                                           : width;
    for (int64_t t = column; t < end; ++t) {
      // The padding after a row's last string: a document of its own.
      const bool padding = t - column >= 2 * static_cast<int64_t>(strings[s].size());
      documents[row][t] = padding ? document + 1 : document;
      if (packed) {
        positions[row][t] = padding ? 0 : t - column;
      }
    }
  }
  if (packed) {
    rows.document_ids = std::move(document_ids);
  }
  rows.tokens = tokens;
  return rows;
}

torch::Tensor ReversalTask::answer_logits(const torch::Tensor& logits) const {
  return logits.narrow(1, digits_, digits_); // (B, N, V)
}

} // namespace train
