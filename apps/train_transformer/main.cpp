// train_transformer: trains a small causal transformer, built from
// attn::MultiHeadAttention, feed-forward layers and layer norm, from scratch
// to reverse strings of digits; `train_transformer --help` lists the flags.
//
// parse the flags (arguments) -> build the model (model), or resume it
//   (checkpoint) -> train on sequences drawn for every step and evaluate on
//   held-out ones (reversal_task), reporting as it goes (progress)

#include "arguments.h"
#include "checkpoint.h"
#include "model.h"
#include "progress.h"
#include "reversal_task.h"

#include <attn/device.h>

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <optional>

namespace {

constexpr int kUsageError = 2;

// 4096 digits at the default length: one more right or wrong moves the
// token accuracy by 0.02 %, fine enough to tell 99 % from 98.9 %.
constexpr int64_t kHeldOutSequences = 512;
constexpr double kTargetAccuracy = 0.99;

// AdamW at a constant rate after a linear warm-up. The rate depends on the
// step only, not on --steps, so that a run resumed towards a later step
// trains exactly as an uninterrupted one.
constexpr double kLearningRate = 3e-3;
constexpr int64_t kWarmupSteps = 100;
constexpr double kWeightDecay = 0.01;
constexpr double kMaxGradientNorm = 1.0;

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double learning_rate(int64_t step) {
  return kLearningRate * std::min(1.0, static_cast<double>(step) / kWarmupSteps);
}

// The training strings of `step`: a different, reproducible draw for every
// step of every seed.
uint64_t batch_seed(uint64_t seed, int64_t step) {
  return seed ^ (static_cast<uint64_t>(step) * 0x9E3779B97F4A7C15ULL);
}

struct Evaluation {
  double loss;
  /// Share of the reversed digits predicted right, each given the ones
  /// before it (teacher forcing).
  double token_accuracy;
};

Evaluation evaluate(
    train::Transformer& model,
    const train::ReversalTask& task,
    const train::ReversalBatch& held_out) {
  torch::NoGradGuard no_grad;
  model->eval();
  const auto logits = task.answer_logits(model(held_out.inputs)); // (B, N, V)
  const auto loss = torch::nn::functional::cross_entropy(
      logits.flatten(0, 1), held_out.targets.flatten());
  const auto right = logits.argmax(-1) == held_out.targets;
  model->train();
  return {loss.item<double>(), right.to(torch::kDouble).mean().item<double>()};
}

// The model's own reversal of the strings (B, N): it writes one token at a
// time after the separator, always taking the likeliest. The prompt goes
// through the model once; each later step feeds only the token just
// written, attending to the earlier ones through the blocks' KV caches.
// Returns (B, N).
torch::Tensor reverse_greedily(
    train::Transformer& model,
    const train::ReversalTask& task,
    const torch::Tensor& digits) {
  torch::NoGradGuard no_grad;
  model->eval();
  const auto N = task.digits();
  const auto prompt = torch::cat(
      {digits, torch::full({digits.size(0), 1}, train::ReversalTask::kSeparator,
                           digits.options())},
      1); // (B, N + 1)
  std::vector<attn::KVCache> caches;
  auto next = model->decode(prompt, caches).select(1, -1).argmax(-1, /*keepdim=*/true);
  std::vector<torch::Tensor> written = {next};
  for (int64_t i = 1; i < N; ++i) {
    next = model->decode(next, caches).select(1, -1).argmax(-1, /*keepdim=*/true);
    written.push_back(next);
  }
  model->train();
  return torch::cat(written, 1);
}

std::string digit_string(const torch::Tensor& digits) {
  const auto values = digits.cpu().contiguous();
  const auto* first = values.data_ptr<int64_t>();
  return fmt::format("{}", fmt::join(first, first + values.numel(), " "));
}

int run(int argc, const char* const* argv) {
  const auto arguments = train::parse_arguments(argc, argv);
  if (arguments.help) {
    fmt::print("{}", train::usage());
    return 0;
  }
  const auto device = attn::select_device(arguments.device);
  const train::ReversalTask task(arguments.digits);

  torch::manual_seed(arguments.seed);
  train::Transformer model(train::TransformerConfig{
      train::ReversalTask::kVocabularySize, task.input_length()});
  model->to(device);
  torch::optim::AdamW optimizer(
      model->parameters(),
      torch::optim::AdamWOptions(kLearningRate).weight_decay(kWeightDecay));
  const train::RunIdentity identity{arguments.seed, arguments.digits};

  const auto& config = model->config();
  int64_t parameter_count = 0;
  for (const auto& parameter : model->parameters()) {
    parameter_count += parameter.numel();
  }
  fmt::print(
      "Reversing {} digits with a causal transformer: {} blocks, d_model {}, "
      "{} heads, {} parameters, on {}, seed {}\n",
      arguments.digits, config.layers, config.d_model, config.heads,
      parameter_count, device.str(), arguments.seed);

  int64_t step = 0;
  if (arguments.resume) {
    step = train::load_checkpoint(
        arguments.checkpoint, identity, device, model, optimizer);
    if (step > arguments.steps) {
      throw train::UsageError(fmt::format(
          "--steps {} is before the checkpoint's step {}: expected at least "
          "{}",
          arguments.steps, step, step));
    }
    fmt::print("Resumed from step {} of '{}'\n", step, arguments.checkpoint);
  }
  const auto first_step = step + 1;

  auto held_out = task.batch(kHeldOutSequences, arguments.seed, train::Split::kHeldOut);
  held_out.inputs = held_out.inputs.to(device);
  held_out.targets = held_out.targets.to(device);

  train::Progress progress;
  const int step_width = static_cast<int>(fmt::to_string(arguments.steps).size());
  const auto tokens_per_step = arguments.batch * task.input_length();
  // Since the last milestone: the summed training loss, the steps and the
  // time spent in them.
  double window_loss = 0.0;
  int64_t window_steps = 0;
  double window_seconds = 0.0;
  double training_seconds = 0.0;
  Evaluation evaluation{};
  std::optional<std::pair<int64_t, double>> target_reached; // step, seconds
  const auto status = [&] {
    return fmt::format(
        "step {:>{}}/{}  loss {:.4f}  accuracy {:6.2f} %  {:>6.0f} tokens/s",
        step, step_width, arguments.steps, window_loss / window_steps,
        100.0 * evaluation.token_accuracy,
        tokens_per_step * window_steps / window_seconds);
  };

  while (step < arguments.steps) {
    ++step;
    const auto started = Clock::now();
    for (auto& group : optimizer.param_groups()) {
      group.options().set_lr(learning_rate(step));
    }
    auto batch = task.batch(
        arguments.batch, batch_seed(arguments.seed, step), train::Split::kTraining);
    const auto logits = task.answer_logits(model(batch.inputs.to(device)));
    const auto loss = torch::nn::functional::cross_entropy(
        logits.flatten(0, 1), batch.targets.to(device).flatten());
    optimizer.zero_grad();
    loss.backward();
    torch::nn::utils::clip_grad_norm_(model->parameters(), kMaxGradientNorm);
    optimizer.step();
    window_loss += loss.item<double>();
    ++window_steps;
    const auto step_seconds = seconds_since(started);
    window_seconds += step_seconds;
    training_seconds += step_seconds;

    if (step == first_step || step % arguments.eval_every == 0 ||
        step == arguments.steps) {
      evaluation = evaluate(model, task, held_out);
      if (!target_reached && evaluation.token_accuracy >= kTargetAccuracy) {
        target_reached = {step, training_seconds};
      }
      if (!arguments.checkpoint.empty()) {
        train::save_checkpoint(
            arguments.checkpoint, identity, step, model, optimizer);
      }
      progress.milestone(status());
      window_loss = 0.0;
      window_steps = 0;
      window_seconds = 0.0;
    } else {
      progress.update(status());
    }
  }

  if (step < first_step) {
    // Resumed at the final step: nothing to train, only to evaluate.
    evaluation = evaluate(model, task, held_out);
  } else {
    progress.line(fmt::format(
        "Trained steps {} to {} in {:.1f} s ({:.0f} tokens/s)", first_step,
        step, training_seconds,
        tokens_per_step * (step - first_step + 1) / training_seconds));
  }
  const auto strings = held_out.inputs.narrow(1, 0, task.digits()); // (B, N)
  const auto reversed = reverse_greedily(model, task, strings);
  const auto strings_right =
      (reversed == held_out.targets).all(1).to(torch::kDouble).mean();
  progress.line(fmt::format(
      "Held-out strings: token accuracy {:.2f} %, loss {:.6f}; reversed "
      "whole by greedy decoding {:.2f} %",
      100.0 * evaluation.token_accuracy, evaluation.loss,
      100.0 * strings_right.item<double>()));
  if (target_reached) {
    progress.line(fmt::format(
        "{:.0f} % token accuracy first reached at step {}, after {:.1f} s of "
        "training",
        100.0 * kTargetAccuracy, target_reached->first, target_reached->second));
  }
  progress.line(fmt::format(
      "Example: {} -> {} (right: {})", digit_string(strings[0]),
      digit_string(reversed[0]), digit_string(held_out.targets[0])));
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  // Every failure is one line: LibTorch's messages can span several.
  const auto fail = [](std::string message) {
    std::replace(message.begin(), message.end(), '\n', ' ');
    fmt::print(stderr, "train_transformer: {}\n", message);
    return kUsageError;
  };
  try {
    return run(argc, argv);
  } catch (const c10::Error& error) {
    return fail(error.what_without_backtrace());
  } catch (const std::exception& error) {
    return fail(error.what());
  }
}
