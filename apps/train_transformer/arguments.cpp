#include "arguments.h"

#include "reversal_task.h"

#include "common/command_line.h"
#include "common/failure.h"

#include <fmt/format.h>

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

// --attention attn|builtin.
void add_modifier_option(CLI::App& app, ScoreModifier& modifier) {
  std::map<std::string, ScoreModifier> kinds;
  std::vector<std::string> names;
  for (const auto kind :
       {ScoreModifier::kNone, ScoreModifier::kAlibi, ScoreModifier::kSoftcap,
        ScoreModifier::kRelativeBias, ScoreModifier::kSinks}) {
    kinds[score_modifier_name(kind)] = kind;
    names.emplace_back(score_modifier_name(kind));
  }
  app.add_option_function<std::string>(
         "--modifier", [&modifier, kinds](const std::string& name) { modifier = kinds.at(name); },
         "what attention adds to its scores:\nnone, alibi, softcap (5), t5 (a learned\n"
         "relative-position table) or sinks")
      ->type_name("M")
      ->check(CLI::IsMember(names).description(""))
      ->default_str("none");
}

// --lengths fixed|padded|packed.
void add_lengths_option(CLI::App& app, Lengths& lengths) {
  std::map<std::string, Lengths> kinds;
  std::vector<std::string> names;
  for (const auto kind : {Lengths::kFixed, Lengths::kPadded, Lengths::kPacked}) {
    kinds[lengths_name(kind)] = kind;
    names.emplace_back(lengths_name(kind));
  }
  app.add_option_function<std::string>(
         "--lengths", [&lengths, kinds](const std::string& name) { lengths = kinds.at(name); },
         "training strings: fixed (--digits each),\nor of 2 to --digits digits, padded (a row\n"
         "each, padded to the longest) or packed\n(rows of documents, positions restarting)")
      ->type_name("L")
      ->check(CLI::IsMember(names).description(""))
      ->default_str("fixed");
}

void add_attention_option(CLI::App& app, AttentionKind& attention) {
  const std::map<std::string, AttentionKind> kinds = {
      {attention_name(AttentionKind::kAttn), AttentionKind::kAttn},
      {attention_name(AttentionKind::kBuiltin), AttentionKind::kBuiltin}};
  std::vector<std::string> names;
  names.reserve(kinds.size());
  for (const auto& entry : kinds) {
    names.push_back(entry.first);
  }
  app.add_option_function<std::string>(
         "--attention",
         [&attention, kinds](const std::string& name) { attention = kinds.at(name); },
         "attn: attn::MultiHeadAttention; builtin:\n"
         "torch::nn::MultiheadAttention from the\nsame initial weights, without KV cache")
      ->type_name("A")
      ->check(CLI::IsMember(names).description(""))
      ->default_str(attention_name(attention));
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
  add_attention_option(app, arguments.attention);
  apps::add_fraction_option(
      app, "--dropout", arguments.dropout, "attention dropout while training");
  add_modifier_option(app, arguments.modifier);
  add_lengths_option(app, arguments.lengths);
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
