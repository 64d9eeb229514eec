#pragma once

// One training run: the model and its optimizer, trained step by step on
// sequences drawn for every step, measured on held-out ones.

#include "arguments.h"
#include "checkpoint.h"
#include "model.h"
#include "parallelism.h"
#include "progress.h"
#include "reversal_task.h"

#include <torch/optim/adamw.h>

#include <cstdint>
#include <optional>

namespace train {

struct Evaluation {
  double loss;
  /// Share of the reversed digits predicted right, each given the ones
  /// before it (teacher forcing).
  double token_accuracy;
};

class Trainer {
 public:
  /// A fresh model, seeded by --seed, on the device --device names; with
  /// --tensor-parallel, this rank's share of it. Only rank 0 reports.
  explicit Trainer(const TrainArguments& arguments);

  /// "Reversing 8 digits with a causal transformer: ...".
  void print_setup() const;
  /// Continues from the checkpoint where --resume asks for it.
  void resume_if_asked();
  /// Trains up to step --steps, evaluating (and saving a checkpoint) every
  /// --eval-every steps.
  void train();
  /// The training's speed (steps per second, and the share of its time in
  /// the attention modules' forward), then how the held-out strings fare,
  /// token by token and reversed whole.
  void print_results();

 private:
  // Since the last milestone: the summed training loss, the steps and the
  // time spent in them.
  struct Window {
    double loss = 0.0;
    int64_t steps = 0;
    int64_t tokens = 0;
    double seconds = 0.0;
  };

  // One step's loss, the strings' tokens it trained on and the positions
  // it computed (the tokens and any padding).
  struct StepResult {
    torch::Tensor loss;
    int64_t tokens, positions;
  };

  struct Milestone {
    int64_t step;
    double training_seconds;
  };

  /// One optimizer step on a fresh batch.
  StepResult train_step();
  /// The step's loss, on strings of --digits or of the lengths --lengths
  /// draws.
  StepResult step_loss();
  bool is_milestone() const;
  /// Evaluates, saves the checkpoint if asked, and reports.
  void reach_milestone();
  /// The checkpoint of the whole model, as one process saves it, from
  /// rank 0; every rank gathers.
  void save_checkpoint_if_asked();
  /// Loads the checkpoint of the whole model and takes this rank's share.
  void load_whole_checkpoint();
  std::string status() const;
  void print_training_time();
  void print_decoding();

  TrainArguments arguments_;
  Parallelism parallelism_;
  torch::Device device_;
  ReversalTask task_;
  Transformer model_;
  torch::optim::AdamW optimizer_;
  RunIdentity identity_;
  ReversalBatch held_out_;
  Progress progress_;

  int64_t step_ = 0;
  /// The first step this process trains: after the checkpoint's, if any.
  int64_t first_step_ = 1;
  Window window_;
  double training_seconds_ = 0.0;
  /// The strings' tokens trained on, and the positions computed for them.
  int64_t training_tokens_ = 0, computed_positions_ = 0;
  /// The part of training_seconds_ spent in the attention modules' forward.
  double attention_forward_seconds_ = 0.0;
  Evaluation evaluation_{};
  /// When the token accuracy first reached the target, if it did.
  std::optional<Milestone> target_reached_;
};

} // namespace train
