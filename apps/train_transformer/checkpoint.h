#pragma once

// A training run saved to one file with torch's serialization archives: the
// model's parameters, the optimizer's moments, the step reached, and what
// the run was (seed and task) so that a resume cannot silently mix runs.
// The data of every step derives from (seed, step), so these make the
// resumed run continue exactly as the uninterrupted one would have.

#include "model.h"

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <string>

namespace train {

/// What identifies a run besides its weights.
struct RunIdentity {
  uint64_t seed = 0;
  int64_t digits = 0;
  /// Whose parameters the checkpoint holds: a run resumes with the same
  /// --attention only. Checkpoints that do not say are of attn's.
  AttentionKind attention = AttentionKind::kAttn;
};

/// Writes the checkpoint to `path` through a temporary file and a rename,
/// so that an interrupted write leaves the previous checkpoint intact.
/// Throws `apps::UsageError` where `path` cannot be written.
void save_checkpoint(
    const std::string& path,
    const RunIdentity& identity,
    int64_t step,
    const Transformer& model,
    const torch::optim::Optimizer& optimizer);

/// Loads a checkpoint of the run `identity` into `model` and `optimizer`
/// (placing tensors on `device`) and returns its step. A missing or
/// unreadable file, or one of another run, throws a c10::Error that says so.
int64_t load_checkpoint(
    const std::string& path,
    const RunIdentity& identity,
    const torch::Device& device,
    Transformer& model,
    torch::optim::Optimizer& optimizer);

} // namespace train
