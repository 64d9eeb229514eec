#include "arguments.h"

#include "reversal_task.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <limits>

namespace train {
namespace {

// Position embeddings grow with the length, and a longer string needs
// proportionally more steps: beyond this a run would take hours.
constexpr int64_t kMaxDigits = 64;

// A plain decimal integer in [minimum, maximum]: no sign, no spaces, no
// suffix, no overflow.
template <typename Integer>
Integer parse_count(
    const std::string& flag,
    const std::string& text,
    Integer minimum,
    Integer maximum = std::numeric_limits<Integer>::max()) {
  Integer value{};
  const auto* end = text.data() + text.size();
  const bool decimal = !text.empty() &&
      std::all_of(text.begin(), text.end(),
                  [](unsigned char c) { return std::isdigit(c) != 0; });
  const auto [stop, error] = std::from_chars(text.data(), end, value);
  if (!decimal || stop != end || error != std::errc() || value < minimum ||
      value > maximum) {
    throw UsageError(fmt::format(
        "{} expects an integer from {} to {}, got '{}'", flag, minimum,
        maximum, text));
  }
  return value;
}

} // namespace

TrainArguments parse_arguments(int argc, const char* const* argv) {
  TrainArguments arguments;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    // The value of a flag that takes one: the next argument.
    const auto value = [&]() -> std::string {
      if (i + 1 == argc) {
        throw UsageError(fmt::format(
            "{} needs a value; see train_transformer --help", flag));
      }
      return argv[++i];
    };
    if (flag == "--device") {
      arguments.device = value();
    } else if (flag == "--steps") {
      arguments.steps = parse_count<int64_t>(flag, value(), 1);
    } else if (flag == "--seed") {
      arguments.seed = parse_count<uint64_t>(flag, value(), 0);
    } else if (flag == "--digits") {
      arguments.digits = parse_count<int64_t>(
          flag, value(), ReversalTask::kMinDigits, kMaxDigits);
    } else if (flag == "--batch") {
      arguments.batch = parse_count<int64_t>(flag, value(), 1, 1 << 16);
    } else if (flag == "--eval-every") {
      arguments.eval_every = parse_count<int64_t>(flag, value(), 1);
    } else if (flag == "--checkpoint") {
      arguments.checkpoint = value();
      if (arguments.checkpoint.empty()) {
        throw UsageError("--checkpoint expects a file name, got ''");
      }
    } else if (flag == "--resume") {
      arguments.resume = true;
    } else if (flag == "--help") {
      arguments.help = true;
    } else {
      throw UsageError(fmt::format(
          "unknown option '{}': see train_transformer --help for the "
          "accepted flags",
          flag));
    }
  }
  if (arguments.resume && arguments.checkpoint.empty()) {
    throw UsageError(
        "--resume reads the file given by --checkpoint, and none was given");
  }
  return arguments;
}

std::string usage() {
  const TrainArguments defaults;
  return fmt::format(
      "usage: train_transformer [options]\n"
      "\n"
      "Trains a small causal transformer, built from attn::MultiHeadAttention,\n"
      "feed-forward layers and layer norm, to reverse strings of digits:\n"
      "after '3 0 5 7 |' it must continue '7 5 0 3'. Sequences are drawn at\n"
      "random for every step; a fixed eighth of all digit strings is held\n"
      "out of training and measures the token accuracy.\n"
      "\n"
      "options:\n"
      "  --device D         auto (CUDA when available), cpu, cuda or cuda:N\n"
      "                     (default {})\n"
      "  --steps N          train up to step N (default {})\n"
      "  --seed N           seed for the weights and the data (default {})\n"
      "  --digits N         length of the strings, {} to {} (default {})\n"
      "  --batch N          sequences per step (default {})\n"
      "  --eval-every N     steps between evaluations and checkpoints\n"
      "                     (default {})\n"
      "  --checkpoint FILE  save the model, the optimizer and the step there\n"
      "                     at every evaluation (default: no checkpoint)\n"
      "  --resume           continue from --checkpoint FILE\n"
      "  --help             show this help and exit\n",
      defaults.device, defaults.steps, defaults.seed,
      ReversalTask::kMinDigits, kMaxDigits,
      defaults.digits, defaults.batch, defaults.eval_every);
}

} // namespace train
