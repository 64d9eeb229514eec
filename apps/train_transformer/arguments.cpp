#include "arguments.h"

#include "reversal_task.h"

#include "common/command_line.h"

#include <fmt/format.h>

namespace train {
namespace {

// Position embeddings grow with the length, and a longer string needs
// proportionally more steps: beyond this a run would take hours.
constexpr int64_t kMaxDigits = 64;

constexpr int64_t kMaxBatch = int64_t{1} << 16;

constexpr const char* kDescription =
    "Trains a small causal transformer, built from attn::MultiHeadAttention,\n"
    "feed-forward layers and layer norm, to reverse strings of digits:\n"
    "after '3 0 5 7 |' it must continue '7 5 0 3'. Sequences are drawn at\n"
    "random for every step; a fixed eighth of all digit strings is held\n"
    "out of training and measures the token accuracy.\n";

// A file name: CLI11 takes an empty argument as a value.
CLI::Validator non_empty() {
  const auto check = [](std::string& text) -> std::string {
    return text.empty() ? "expected a file name, got ''" : "";
  };
  return CLI::Validator(check, /*validator_desc=*/"");
}

void add_options(CLI::App& app, TrainArguments& arguments) {
  apps::add_device_option(app, arguments.device);
  apps::add_integer_option(app, "--steps", arguments.steps, "train up to step N", int64_t{1});
  apps::add_integer_option(
      app, "--seed", arguments.seed, "seed for the weights and the data", uint64_t{0});
  apps::add_integer_option(
      app, "--digits", arguments.digits,
      fmt::format("length of the strings, {} to {}", ReversalTask::kMinDigits, kMaxDigits),
      ReversalTask::kMinDigits, kMaxDigits);
  apps::add_integer_option(
      app, "--batch", arguments.batch, "sequences per step", int64_t{1}, kMaxBatch);
  apps::add_integer_option(
      app, "--eval-every", arguments.eval_every, "steps between evaluations and\ncheckpoints",
      int64_t{1});
  // Saving the run, and carrying on from it.
  auto* checkpoint = app.add_option(
                            "--checkpoint", arguments.checkpoint,
                            "save the model, the optimizer and the\nstep there at every "
                            "evaluation")
                         ->type_name("FILE")
                         ->check(non_empty())
                         ->default_str("none");
  app.add_flag("--resume", arguments.resume, "continue from --checkpoint FILE")->needs(checkpoint);
  app.add_flag(
      "--tensor-parallel", arguments.tensor_parallel,
      "split the attention heads over the ranks\nthat attn_launch_ranks or torchrun started\n"
      "(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)");
}

} // namespace

std::optional<TrainArguments> parse_arguments(int argc, const char* const* argv) {
  return apps::parse_command_line<TrainArguments>(
      "train_transformer", kDescription, argc, argv, add_options);
}

} // namespace train
