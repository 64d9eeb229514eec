#include "arguments.h"

#include "reversal_task.h"

#include "common/command_line.h"
#include "common/failure.h"

#include <fmt/format.h>

#include <initializer_list>
#include <map>
#include <string>
#include <vector>

namespace train {
namespace {

// Position embeddings grow with the length, and a longer string needs
// proportionally more steps: beyond this a run would take hours.
constexpr int64_t kMaxDigits = 64;

constexpr int64_t kMaxBatch = int64_t{1} << 16;

constexpr const char* kDescription =
    "Trains a small causal transformer, built from attn::MultiHeadAttention\n"
    "(or torch::nn::MultiheadAttention), feed-forward layers and layer norm,\n"
    "to reverse strings of digits: after '3 0 5 7 |' it must continue\n"
    "'7 5 0 3'. Sequences are drawn at random for every step; a fixed\n"
    "eighth of all digit strings is held out of training and measures the\n"
    "token accuracy.\n";

// A file name: CLI11 takes an empty argument as a value.
CLI::Validator non_empty() {
  const auto check = [](std::string& text) -> std::string {
    return text.empty() ? "expected a file name, got ''" : "";
  };
  return CLI::Validator(check, /*validator_desc=*/"");
}

// An option `flag` that takes one of `choices` by the name `name_of`
// gives it, and sets `value` to it; `value`'s own name is the default.
template <typename Choice>
void add_choice_option(
    CLI::App& app,
    const char* flag,
    Choice& value,
    std::initializer_list<Choice> choices,
    const char* (*name_of)(Choice),
    const char* type_name,
    const char* description) {
  std::map<std::string, Choice> kinds;
  std::vector<std::string> names;
  for (const auto kind : choices) {
    kinds[name_of(kind)] = kind;
    names.emplace_back(name_of(kind));
  }
  app.add_option_function<std::string>(
         flag, [&value, kinds](const std::string& name) { value = kinds.at(name); }, description)
      ->type_name(type_name)
      ->check(CLI::IsMember(names).description(""))
      ->default_str(name_of(value));
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
  add_choice_option(
      app, "--attention", arguments.attention, {AttentionKind::kAttn, AttentionKind::kBuiltin},
      attention_name, "A",
      "attn: attn::MultiHeadAttention; builtin:\n"
      "torch::nn::MultiheadAttention from the\nsame initial weights, without KV cache");
  apps::add_fraction_option(
      app, "--dropout", arguments.dropout, "attention dropout while training");
  add_choice_option(
      app, "--modifier", arguments.modifier,
      {ScoreModifier::kNone, ScoreModifier::kAlibi, ScoreModifier::kSoftcap,
       ScoreModifier::kRelativeBias, ScoreModifier::kSinks},
      score_modifier_name, "M",
      "what attention adds to its scores:\nnone, alibi, softcap (5), t5 (a learned\n"
      "relative-position table) or sinks");
  add_choice_option(
      app, "--lengths", arguments.lengths, {Lengths::kFixed, Lengths::kPadded, Lengths::kPacked},
      lengths_name, "L",
      "training strings: fixed (--digits each),\nor of 2 to --digits digits, padded (a row\n"
      "each, padded to the longest) or packed\n(rows of documents, positions restarting)");
  add_choice_option(
      app, "--dtype", arguments.precision, {Precision::kFloat32, Precision::kBFloat16},
      precision_name, "T",
      "what the model computes in: float32, or\nbfloat16 (LibTorch's autocast: matrix\n"
      "products and attention in bfloat16,\nfloat32 weights and optimizer)");
}

// What the flags cannot do together, beyond what CLI11 checks.
void check_combination(const TrainArguments& arguments) {
  if (arguments.tensor_parallel && arguments.attention == AttentionKind::kBuiltin) {
    throw apps::UsageError(
        "--tensor-parallel splits attn::MultiHeadAttention only: expected --attention attn, got "
        "builtin");
  }
  if (arguments.modifier != ScoreModifier::kNone &&
      (arguments.attention == AttentionKind::kBuiltin || arguments.tensor_parallel)) {
    throw apps::UsageError(fmt::format(
        "--modifier {} runs on attn::MultiHeadAttention on one process only: expected "
        "--attention attn without --tensor-parallel",
        score_modifier_name(arguments.modifier)));
  }
  if (arguments.tensor_parallel && arguments.precision != Precision::kFloat32) {
    throw apps::UsageError(fmt::format(
        "--tensor-parallel trains in float32: expected --dtype float32, got {}",
        precision_name(arguments.precision)));
  }
  if (arguments.lengths == Lengths::kPacked && arguments.attention == AttentionKind::kBuiltin) {
    throw apps::UsageError(
        "--lengths packed attends within documents on attn::MultiHeadAttention only: expected "
        "--attention attn, got builtin");
  }
}

} // namespace

std::optional<TrainArguments> parse_arguments(int argc, const char* const* argv) {
  auto arguments = apps::parse_command_line<TrainArguments>(
      "train_transformer", kDescription, argc, argv, add_options);
  if (arguments) {
    check_combination(*arguments);
  }
  return arguments;
}

} // namespace train
