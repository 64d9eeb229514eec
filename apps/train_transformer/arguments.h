#pragma once

// The trainer's command line, parsed strictly: an unknown flag, a missing
// or malformed value, or flags that contradict each other is an
// apps::UsageError.

#include "model.h"
#include "precision.h"
#include "reversal_task.h"

#include <cstdint>
#include <optional>
#include <string>

namespace train {

/// One training run. The defaults reach 99 % held-out token accuracy.
struct TrainArguments {
  std::string device = "auto";
  /// The step to train up to, counted from the start of training (so a
  /// resumed run continues from the checkpoint's step to this one).
  int64_t steps = 600;
  uint64_t seed = 0;
  /// Length of the digit strings to reverse.
  int64_t digits = 8;
  /// Sequences per training step.
  int64_t batch = 64;
  /// Steps between evaluations on the held-out sequences (and checkpoints).
  int64_t eval_every = 50;
  /// Where the checkpoint is written (and read with `resume`); empty: none.
  std::string checkpoint;
  bool resume = false;
  /// Split every attention layer's heads over the ranks a launcher
  /// started (parallelism.h).
  bool tensor_parallel = false;
  /// The module every block attends with.
  AttentionKind attention = AttentionKind::kAttn;
  /// The probability of dropping an attention weight while training.
  double dropout = 0.0;
  /// What every attention layer adds to its scores.
  ScoreModifier modifier = ScoreModifier::kNone;
  /// The training strings' lengths and their layout in rows.
  Lengths lengths = Lengths::kFixed;
  /// What the model computes in (precision.h).
  Precision precision = Precision::kFloat32;
};

/// Parses and checks `argv`. Returns nothing, having printed the help,
/// where `--help` was given. Throws `apps::UsageError`.
std::optional<TrainArguments> parse_arguments(int argc, const char* const* argv);

} // namespace train
