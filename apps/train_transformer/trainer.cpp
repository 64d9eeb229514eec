#include "trainer.h"

#include "common/failure.h"

#include <attn/device.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>

namespace train {
namespace {

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

Transformer new_model(
    const ReversalTask& task,
    const TrainArguments& arguments,
    const torch::Device& device,
    const Parallelism& parallelism) {
  TransformerConfig config{ReversalTask::kVocabularySize, task.input_length()};
  config.attention = arguments.attention;
  config.attention_dropout = arguments.dropout;
  config.score_modifier = arguments.modifier;
  Transformer model(config, parallelism);
  model->to(device);
  return model;
}

// The weights are drawn here, so the seed is set here: every rank draws
// the whole model's, as one process does.
Transformer seeded_model(
    const TrainArguments& arguments,
    const ReversalTask& task,
    const torch::Device& device,
    const Parallelism& parallelism) {
  torch::manual_seed(arguments.seed);
  return new_model(task, arguments, device, parallelism);
}

torch::optim::AdamW adamw(const Transformer& model) {
  return torch::optim::AdamW(
      model->parameters(), torch::optim::AdamWOptions(kLearningRate).weight_decay(kWeightDecay));
}

// Tensor parallelism runs over Gloo: CPU tensors, which `auto` then means.
torch::Device training_device(const TrainArguments& arguments) {
  if (arguments.tensor_parallel && arguments.device == "auto") {
    return torch::kCPU;
  }
  const auto device = attn::select_device(arguments.device);
  if (arguments.tensor_parallel && !device.is_cpu()) {
    throw apps::UsageError(fmt::format(
        "--tensor-parallel trains on the CPU (Gloo): expected --device cpu, got {}", device.str()));
  }
  return device;
}

ReversalBatch held_out_batch(const ReversalTask& task, uint64_t seed, const torch::Device& device) {
  auto held_out = task.batch(kHeldOutSequences, seed, Split::kHeldOut);
  return {held_out.inputs.to(device), held_out.targets.to(device)};
}

Evaluation evaluate(
    Transformer& model,
    const ReversalTask& task,
    const ReversalBatch& held_out,
    Precision precision) {
  const ScopedPrecision in_precision(precision, held_out.inputs.device());
  torch::NoGradGuard no_grad;
  model->eval();
  const auto logits = task.answer_logits(model(held_out.inputs)); // (B, N, V)
  const auto loss = torch::nn::functional::cross_entropy(
      logits.flatten(0, 1), held_out.targets.flatten());
  const auto right = logits.argmax(-1) == held_out.targets;
  model->train();
  return {loss.item<double>(), right.to(torch::kDouble).mean().item<double>()};
}

// The likeliest token after each sequence, from their logits (B, T, V):
// (B, 1).
torch::Tensor likeliest_next(const torch::Tensor& logits) {
  return logits.select(1, -1).argmax(-1, /*keepdim=*/true);
}

// `count` tokens written greedily after `prompt` (B, T): the prompt goes
// through the model once; each later step feeds only the token just
// written, attending to the earlier ones through the blocks' KV caches.
// Returns (B, count).
torch::Tensor write_with_caches(Transformer& model, const torch::Tensor& prompt, int64_t count) {
  std::vector<attn::KVCache> caches;
  std::vector<torch::Tensor> written = {likeliest_next(model->decode(prompt, caches))};
  while (static_cast<int64_t>(written.size()) < count) {
    written.push_back(likeliest_next(model->decode(written.back(), caches)));
  }
  return torch::cat(written, 1);
}

// The same for attention without a KV cache (torch::nn::MultiheadAttention):
// every step runs the model over the whole sequence written so far.
torch::Tensor write_recomputing(Transformer& model, const torch::Tensor& prompt, int64_t count) {
  auto sequence = prompt;
  for (int64_t i = 0; i < count; ++i) {
    sequence = torch::cat({sequence, likeliest_next(model(sequence))}, 1);
  }
  return sequence.narrow(1, prompt.size(1), count);
}

// The model's own reversal of the strings (B, N): it writes one token at a
// time after the separator, always taking the likeliest. Returns (B, N).
torch::Tensor reverse_greedily(
    Transformer& model,
    const ReversalTask& task,
    const torch::Tensor& digits,
    Precision precision) {
  const ScopedPrecision in_precision(precision, digits.device());
  torch::NoGradGuard no_grad;
  model->eval();
  const auto separators = torch::full(
      {digits.size(0), 1}, ReversalTask::kSeparator, digits.options());
  const auto prompt = torch::cat({digits, separators}, 1); // (B, N + 1)
  const auto reversed = model->config().attention == AttentionKind::kBuiltin
      ? write_recomputing(model, prompt, task.digits())
      : write_with_caches(model, prompt, task.digits());
  model->train();
  return reversed;
}

const char* attention_module_name(AttentionKind kind) {
  return kind == AttentionKind::kBuiltin ? "torch::nn::MultiheadAttention"
                                         : "attn::MultiHeadAttention";
}

// " (dropout 0.1, alibi)": what the attention layers do beyond plain
// attention; empty for none.
std::string describe_attention(const TransformerConfig& config) {
  std::vector<std::string> parts;
  if (config.attention_dropout > 0) {
    parts.push_back(fmt::format("dropout {}", config.attention_dropout));
  }
  if (config.score_modifier != ScoreModifier::kNone) {
    parts.emplace_back(score_modifier_name(config.score_modifier));
  }
  return parts.empty() ? "" : fmt::format(" ({})", fmt::join(parts, ", "));
}

std::string digit_string(const torch::Tensor& digits) {
  const auto values = digits.cpu().contiguous();
  const auto* first = values.data_ptr<int64_t>();
  return fmt::format("{}", fmt::join(first, first + values.numel(), " "));
}

} // namespace

Trainer::Trainer(const TrainArguments& arguments)
    : arguments_(arguments),
      parallelism_(arguments.tensor_parallel),
      device_(training_device(arguments)),
      task_(arguments.digits),
      model_(seeded_model(arguments, task_, device_, parallelism_)),
      optimizer_(adamw(model_)),
      identity_{arguments.seed, arguments.digits, arguments.attention},
      held_out_(held_out_batch(task_, arguments.seed, device_)),
      progress_(parallelism_.reports()) {}

void Trainer::print_setup() const {
  if (!parallelism_.reports()) {
    return;
  }
  const auto& config = model_->config();
  int64_t parameter_count = 0;
  for (const auto& parameter : model_->parameters()) {
    parameter_count += parameter.numel();
  }
  fmt::print(
      "Reversing {} digits with a causal transformer: {} blocks, d_model {}, "
      "{} heads of {}{}, {} parameters{}, on {}, seed {}{}\n",
      arguments_.digits, config.layers, config.d_model, config.heads,
      attention_module_name(config.attention), describe_attention(config), parameter_count,
      parallelism_.world_size() > 1 ? " on rank 0" : "", device_.str(), arguments_.seed,
      arguments_.precision == Precision::kBFloat16
          ? ", computing in bfloat16 (autocast; float32 weights)"
          : "");
  if (parallelism_.world_size() > 1) {
    fmt::print(
        "Tensor-parallel over {} ranks: each holds {} of the {} heads of every attention "
        "layer, and the other layers whole\n",
        parallelism_.world_size(), config.heads / parallelism_.world_size(), config.heads);
  }
}

void Trainer::resume_if_asked() {
  if (!arguments_.resume) {
    return;
  }
  load_whole_checkpoint();
  if (step_ > arguments_.steps) {
    throw apps::UsageError(fmt::format(
        "--steps {} is before the checkpoint's step {}: expected at least {}", arguments_.steps,
        step_, step_));
  }
  first_step_ = step_ + 1;
  progress_.line(fmt::format("Resumed from step {} of '{}'", step_, arguments_.checkpoint));
}

void Trainer::load_whole_checkpoint() {
  if (parallelism_.world_size() == 1) {
    step_ = load_checkpoint(arguments_.checkpoint, identity_, device_, model_, optimizer_);
    return;
  }
  auto whole_model = new_model(task_, arguments_, device_, Parallelism(false));
  auto whole_optimizer = adamw(whole_model);
  step_ = load_checkpoint(arguments_.checkpoint, identity_, device_, whole_model, whole_optimizer);
  parallelism_.shard(*whole_model, whole_optimizer, *model_, optimizer_);
}

void Trainer::save_checkpoint_if_asked() {
  if (arguments_.checkpoint.empty()) {
    return;
  }
  if (parallelism_.world_size() == 1) {
    save_checkpoint(arguments_.checkpoint, identity_, step_, model_, optimizer_);
    return;
  }
  auto whole_model = new_model(task_, arguments_, device_, Parallelism(false));
  auto whole_optimizer = adamw(whole_model);
  parallelism_.gather(*model_, optimizer_, *whole_model, whole_optimizer);
  if (parallelism_.reports()) {
    save_checkpoint(arguments_.checkpoint, identity_, step_, whole_model, whole_optimizer);
  }
}

void Trainer::train() {
  while (step_ < arguments_.steps) {
    ++step_;
    const auto started = Clock::now();
    const auto attention_before = model_->attention_forward_seconds();
    const auto result = train_step();
    window_.loss += result.loss.item<double>();
    window_.tokens += result.tokens;
    ++window_.steps;
    training_tokens_ += result.tokens;
    computed_positions_ += result.positions;
    const auto step_seconds = seconds_since(started);
    window_.seconds += step_seconds;
    training_seconds_ += step_seconds;
    attention_forward_seconds_ += model_->attention_forward_seconds() - attention_before;
    if (is_milestone()) {
      reach_milestone();
    } else {
      progress_.update(status());
    }
  }
}

Trainer::StepResult Trainer::step_loss() {
  const ScopedPrecision precision(arguments_.precision, device_);
  const auto seed = batch_seed(arguments_.seed, step_);
  if (arguments_.lengths == Lengths::kFixed) {
    const auto batch = task_.batch(arguments_.batch, seed, Split::kTraining);
    const auto logits = task_.answer_logits(model_(batch.inputs.to(device_)));
    const auto loss = torch::nn::functional::cross_entropy(
        logits.flatten(0, 1), batch.targets.to(device_).flatten());
    return {loss, batch.inputs.numel(), batch.inputs.numel()};
  }
  const auto rows = task_.rows(arguments_.batch, seed, arguments_.lengths);
  const auto document_ids = rows.document_ids.defined() ? rows.document_ids.to(device_)
                                                        : torch::Tensor();
  const auto logits = model_->forward_rows(
      rows.inputs.to(device_), rows.positions.to(device_), document_ids);
  const auto loss = torch::nn::functional::cross_entropy(
      logits.flatten(0, 1), rows.targets.to(device_).flatten(),
      torch::nn::functional::CrossEntropyFuncOptions().ignore_index(ReversalTask::kIgnored));
  return {loss, rows.tokens, rows.inputs.numel()};
}

Trainer::StepResult Trainer::train_step() {
  for (auto& group : optimizer_.param_groups()) {
    group.options().set_lr(learning_rate(step_));
  }
  auto result = step_loss();
  optimizer_.zero_grad();
  result.loss.backward();
  parallelism_.clip_gradients(*model_, kMaxGradientNorm);
  optimizer_.step();
  return result;
}

bool Trainer::is_milestone() const {
  return step_ == first_step_ || step_ % arguments_.eval_every == 0 || step_ == arguments_.steps;
}

void Trainer::reach_milestone() {
  evaluation_ = evaluate(model_, task_, held_out_, arguments_.precision);
  if (!target_reached_ && evaluation_.token_accuracy >= kTargetAccuracy) {
    target_reached_ = Milestone{step_, training_seconds_};
  }
  save_checkpoint_if_asked();
  progress_.milestone(status());
  window_ = Window{};
}

std::string Trainer::status() const {
  const auto step_width = fmt::to_string(arguments_.steps).size();
  return fmt::format(
      "step {:>{}}/{}  loss {:.4f}  accuracy {:6.2f} %  {:>6.0f} tokens/s", step_, step_width,
      arguments_.steps, window_.loss / window_.steps, 100.0 * evaluation_.token_accuracy,
      static_cast<double>(window_.tokens) / window_.seconds);
}

void Trainer::print_results() {
  if (step_ < first_step_) {
    // Resumed at the final step: nothing to train, only to evaluate.
    evaluation_ = evaluate(model_, task_, held_out_, arguments_.precision);
  } else {
    print_training_time();
  }
  print_decoding();
}

void Trainer::print_training_time() {
  const auto trained_steps = step_ - first_step_ + 1;
  progress_.line(fmt::format(
      "Trained steps {} to {} in {:.1f} s ({:.0f} tokens/s)", first_step_, step_, training_seconds_,
      static_cast<double>(training_tokens_) / training_seconds_));
  if (arguments_.lengths != Lengths::kFixed) {
    progress_.line(fmt::format(
        "Strings of {} to {} digits, {}: {:.1f} % of the positions computed were padding",
        ReversalTask::kMinDigits, arguments_.digits, lengths_name(arguments_.lengths),
        100.0 * static_cast<double>(computed_positions_ - training_tokens_) /
            static_cast<double>(computed_positions_)));
  }
  progress_.line(fmt::format(
      "{:.2f} steps/s; attention forward: {:.1f} % of the step's time (the attention modules' "
      "forward only: their backward is not timed)",
      trained_steps / training_seconds_, 100.0 * attention_forward_seconds_ / training_seconds_));
}

void Trainer::print_decoding() {
  const auto strings = held_out_.inputs.narrow(1, 0, task_.digits()); // (B, N)
  const auto reversed = reverse_greedily(model_, task_, strings, arguments_.precision);
  const auto strings_right = (reversed == held_out_.targets).all(1).to(torch::kDouble).mean();
  progress_.line(fmt::format(
      "Held-out strings: token accuracy {:.2f} %, loss {:.6f}; reversed "
      "whole by greedy decoding {:.2f} %",
      100.0 * evaluation_.token_accuracy, evaluation_.loss, 100.0 * strings_right.item<double>()));
  if (target_reached_) {
    progress_.line(fmt::format(
        "{:.0f} % token accuracy first reached at step {}, after {:.1f} s of "
        "training",
        100.0 * kTargetAccuracy, target_reached_->step, target_reached_->training_seconds));
  }
  progress_.line(fmt::format(
      "Example: {} -> {} (right: {})", digit_string(strings[0]), digit_string(reversed[0]),
      digit_string(held_out_.targets[0])));
}

} // namespace train
