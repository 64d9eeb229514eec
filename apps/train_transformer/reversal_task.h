#pragma once

// The task: reverse a string of digits. A sequence is the string, a
// separator, then the string reversed; the model reads it left to right and
// predicts each next token, and only the predictions of the reversed part
// are scored. Copying the digit at a distance that changes with every
// position cannot be done without attention.
//
//   tokens   3 0 5 7 | 7 5 0 3     (digits 0-9, separator 10)
//   input    3 0 5 7 | 7 5 0       (B, 2N): the sequence without its end
//   targets          7 5 0 3       (B, N): what positions N..2N-1 predict
//
// Training can also draw strings of lengths from kMinDigits to N (Lengths):
// each in its own row padded to the step's longest, or packed one after
// another into rows, each a document with its own positions.
//
// Sequences are generated on the fly from a seed. Held-out strings, a fixed
// eighth of all strings chosen by a hash of their digits, never appear in
// training, so evaluation measures reversal rather than memory.

#include <torch/types.h>

#include <cstdint>

namespace train {

/// The inputs of a batch of sequences and the tokens they must predict.
struct ReversalBatch {
  /// (B, 2N) token ids: the digits, the separator, the reversal but its
  /// last digit.
  torch::Tensor inputs;
  /// (B, N): the reversed digits.
  torch::Tensor targets;
};

/// Which strings a batch draws from.
enum class Split { kTraining, kHeldOut };

/// How the strings of a training step are laid out.
enum class Lengths {
  /// Every string N digits long, one per row: ReversalBatch.
  kFixed,
  /// Lengths drawn uniformly from kMinDigits to N, one string per row,
  /// padded after its end to the step's longest (causal attention keeps
  /// the padding from the string; it is computed, never scored).
  kPadded,
  /// The same strings packed one after another into rows of
  /// kStringsPerRow · 2N tokens, each a document whose positions start at
  /// 0; only the end of a row that fits no further string is padding.
  kPacked,
};

/// "fixed", "padded" or "packed", as --lengths names them.
const char* lengths_name(Lengths lengths);

/// Rows of strings of several lengths and what each position must predict.
struct LabelledRows {
  /// (R, T) token ids.
  torch::Tensor inputs;
  /// (R, T): the digit each answer position predicts, kIgnored elsewhere.
  torch::Tensor targets;
  /// (R, T): each token's position within its own string (0 for padding).
  torch::Tensor positions;
  /// (R, T) each token's string within its row, for packed rows (padding
  /// is a document of its own); undefined where a row holds one string.
  torch::Tensor document_ids;
  /// Tokens of the strings, padding not counted.
  int64_t tokens = 0;
};

class ReversalTask {
 public:
  /// Token ids 0-9 are the digits; this one separates string and reversal.
  static constexpr int64_t kSeparator = 10;
  static constexpr int64_t kVocabularySize = 11;
  /// The shortest strings with both training and held-out ones.
  static constexpr int64_t kMinDigits = 2;
  /// Targets that no position is scored on.
  static constexpr int64_t kIgnored = -100;
  /// Packed rows hold this many strings of the longest length.
  static constexpr int64_t kStringsPerRow = 4;

  explicit ReversalTask(int64_t digits);

  int64_t digits() const { return digits_; }
  /// Length of a model input: 2N.
  int64_t input_length() const { return 2 * digits_; }

  /// `size` sequences of `split`, the same ones for the same `seed`, on
  /// the CPU.
  ReversalBatch batch(int64_t size, uint64_t seed, Split split) const;

  /// `size` training strings of lengths drawn from kMinDigits to N, laid
  /// out as `lengths` says (kPadded or kPacked: the same strings for the
  /// same `seed`), on the CPU.
  LabelledRows rows(int64_t size, uint64_t seed, Lengths lengths) const;

  /// The logits (B, 2N, V) at the positions that predict the targets:
  /// (B, N, V).
  torch::Tensor answer_logits(const torch::Tensor& logits) const;

 private:
  int64_t digits_;
};

} // namespace train
