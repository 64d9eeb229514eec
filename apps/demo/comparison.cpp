#include "comparison.h"

#include "common/failure.h"

#include <attn/attn.h>

#include <fmt/format.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <memory>
#include <optional>

namespace demo {
namespace {

using apps::UsageError;

// Timed forwards per module: at most this many, within about this long.
constexpr int kMaxTimedRuns = 10;
constexpr double kTimingBudgetMs = 250.0;

struct Inputs {
  /// (B, L, E).
  torch::Tensor query;
  /// (B, S, E); the query itself for self-attention.
  torch::Tensor key_value;
  /// (B, S) bool, true = padding; undefined without --pad.
  torch::Tensor key_padding_mask;
  /// (L, S) additive, -inf above the diagonal, for the built-in, which takes
  /// no is_causal; undefined without --causal.
  torch::Tensor causal_mask;

  Inputs to(torch::Device device, torch::ScalarType dtype) const {
    const auto options = torch::TensorOptions(dtype).device(device);
    Inputs moved;
    moved.query = query.to(options);
    // Self-attention hands one tensor to all three arguments.
    moved.key_value = key_value.is_same(query) ? moved.query : key_value.to(options);
    if (key_padding_mask.defined()) {
      moved.key_padding_mask = key_padding_mask.to(device);
    }
    if (causal_mask.defined()) {
      moved.causal_mask = causal_mask.to(options);
    }
    return moved;
  }
};

struct Outputs {
  /// (B, L, E).
  torch::Tensor output;
  /// (B, H, L, S).
  torch::Tensor weights;
};

struct Problem {
  attn::MultiHeadAttention attn;
  torch::nn::MultiheadAttention builtin;
  /// On the CPU, float32.
  Inputs inputs;
};

// Draws the weights and tokens in a fixed order, our module, the built-in,
// then the tokens, so that a seed always gives the same problem; our
// weights are copied into the built-in.
// Everything starts as float32 on the CPU, so a seed gives the same numbers
// on every device and in every dtype.
Problem make_problem(const DemoArguments& arguments) {
  const auto B = arguments.batch, L = arguments.seq, S = arguments.key_length(),
             E = arguments.d_model, H = arguments.heads;
  torch::manual_seed(arguments.seed);
  Problem problem{
      attn::MultiHeadAttention(attn::MultiHeadAttentionOptions(E, H)),
      torch::nn::MultiheadAttention(torch::nn::MultiheadAttentionOptions(E, H)), Inputs{}};
  attn::copy_weights(*problem.attn, *problem.builtin);
  problem.attn->eval();
  problem.builtin->eval();

  auto& inputs = problem.inputs;
  inputs.query = torch::randn({B, L, E});
  inputs.key_value = arguments.cross_attention() ? torch::randn({B, S, E}) : inputs.query;
  if (arguments.pad > 0) {
    inputs.key_padding_mask = torch::zeros({B, S}, torch::kBool);
    inputs.key_padding_mask.slice(/*dim=*/1, S - arguments.pad).fill_(true);
  }
  if (arguments.causal) {
    const auto future = torch::ones({L, S}, torch::kBool).triu(1);
    inputs.causal_mask = torch::zeros({L, S}).masked_fill(
        future, -std::numeric_limits<double>::infinity());
  }
  return problem;
}

Outputs run_attn(attn::MultiHeadAttentionImpl& module, const Inputs& inputs, bool causal) {
  auto [output, weights] = module.forward(
      inputs.query, inputs.key_value, inputs.key_value,
      attn::MultiHeadAttentionForwardOptions()
          .key_padding_mask(inputs.key_padding_mask)
          .is_causal(causal)
          .need_weights(true));
  return {output, weights};
}

// The built-in is sequence-first: (L, B, E) in and out.
Outputs run_builtin(torch::nn::MultiheadAttentionImpl& module, const Inputs& inputs) {
  const auto query = inputs.query.transpose(0, 1);         // (L, B, E)
  const auto key_value = inputs.key_value.transpose(0, 1); // (S, B, E)
  auto [output, weights] = module.forward(
      query, key_value, key_value, inputs.key_padding_mask,
      /*need_weights=*/true, inputs.causal_mask,
      /*average_attn_weights=*/false);
  return {output.transpose(0, 1), weights}; // (B, L, E), (B, H, L, S)
}

std::string describe_module_error(const char* module, const c10::Error& error) {
  return fmt::format("{}: {}", module, apps::one_line(error.what_without_backtrace()));
}

// Why `dtype` cannot run on `device` with these flags, if it cannot. Whether
// a kernel exists depends on the device, the dtype and the operations (the
// masks choose some), not on the sizes: so both modules run once on a tiny
// problem of the same kind.
std::optional<std::string> why_dtype_cannot_run(
    const DemoArguments& arguments,
    torch::Device device,
    torch::ScalarType dtype) {
  DemoArguments tiny = arguments;
  tiny.batch = 1;
  tiny.seq = 2;
  tiny.kv_seq = arguments.kv_seq ? std::optional<int64_t>(2) : std::nullopt;
  tiny.pad = std::min<int64_t>(arguments.pad, 1);
  tiny.d_model = arguments.heads; // head width 1
  auto problem = make_problem(tiny);
  problem.attn->to(device, dtype);
  problem.builtin->to(device, dtype);
  const auto inputs = problem.inputs.to(device, dtype);
  torch::NoGradGuard no_grad;
  try {
    run_attn(*problem.attn, inputs, arguments.causal);
  } catch (const c10::Error& error) {
    return describe_module_error("attn::MultiHeadAttention", error);
  }
  try {
    run_builtin(*problem.builtin, inputs);
  } catch (const c10::Error& error) {
    return describe_module_error("torch::nn::MultiheadAttention", error);
  }
  return std::nullopt;
}

void check_dtype_runs(const DemoArguments& arguments, torch::Device device) {
  const auto reason = why_dtype_cannot_run(arguments, device, arguments.dtype);
  if (!reason) {
    return;
  }
  std::vector<torch::ScalarType> runnable;
  for (const auto dtype : demo_dtypes()) {
    if (dtype != arguments.dtype && !why_dtype_cannot_run(arguments, device, dtype)) {
      runnable.push_back(dtype);
    }
  }
  throw UsageError(fmt::format(
      "--dtype {} cannot run on {} with these options in this LibTorch ({}): "
      "expected {}",
      dtype_name(arguments.dtype), device.str(), *reason,
      runnable.empty() ? "another device" : dtype_names(runnable)));
}

DeviceChoice choose_device(const std::string& request) {
  const auto device = attn::select_device(request);
  if (request != "auto") {
    return {device, "as requested"};
  }
  if (!torch::cuda::is_available()) {
    return {device, "CUDA not available"};
  }
  return {device, fmt::format("{} CUDA device(s) visible", torch::cuda::device_count())};
}

struct TimedForward {
  /// The last run's result.
  Outputs outputs;
  double median_ms;
  int runs;
};

// One warm-up forward, which pays for allocations and kernel loading, then
// `runs` timed ones; without `runs`, as many as fit in kTimingBudgetMs
// judging from the first (at most kMaxTimedRuns).
template <typename Forward>
TimedForward time_forward(Forward&& forward, torch::Device device, std::optional<int> runs) {
  using Clock = std::chrono::steady_clock;
  // CUDA kernels run asynchronously: a run is over when the device is idle.
  const auto wait_for_device = [&] {
    if (device.is_cuda()) {
      torch::cuda::synchronize(device.index());
    }
  };
  TimedForward timed{forward(), 0.0, 0};
  wait_for_device();
  std::vector<double> times_ms;
  do {
    const auto start = Clock::now();
    timed.outputs = forward();
    wait_for_device();
    times_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
    if (!runs) {
      const auto fitting = static_cast<int>(kTimingBudgetMs / std::max(times_ms.front(), 1e-3));
      runs = std::clamp(fitting, 1, kMaxTimedRuns);
    }
  } while (static_cast<int>(times_ms.size()) < *runs);
  timed.runs = *runs;
  const auto middle = times_ms.begin() + timed.runs / 2;
  std::nth_element(times_ms.begin(), middle, times_ms.end());
  timed.median_ms = *middle;
  return timed;
}

double max_abs_difference(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

std::vector<std::string> token_labels(char prefix, int64_t count) {
  std::vector<std::string> labels;
  for (int64_t token = 1; token <= count; ++token) {
    labels.push_back(fmt::format("{}{}", prefix, token));
  }
  return labels;
}

AttentionMap first_sequence_map(const DemoArguments& arguments, const torch::Tensor& weights) {
  const auto all_heads = weights[0].to(torch::kCPU, torch::kFloat64); // (H, L, S)
  AttentionMap map;
  if (arguments.head) {
    const auto head = *arguments.head;
    map.weights = all_heads.slice(0, head, head + 1); // (1, L, S)
    map.heads = {head};
  } else {
    map.weights = all_heads;
    for (int64_t head = 0; head < arguments.heads; ++head) {
      map.heads.push_back(head);
    }
  }
  map.query_labels = token_labels('x', arguments.seq);
  map.key_labels = token_labels(arguments.cross_attention() ? 'y' : 'x', arguments.key_length());
  return map;
}

// The built-in again in float64, from its weights and inputs as the run's
// dtype rounded them: it measures the arithmetic, not the rounding of
// inputs.
Outputs rerun_in_float64(
    const torch::nn::MultiheadAttentionImpl& builtin,
    const Inputs& inputs,
    torch::Device device) {
  const auto module = std::dynamic_pointer_cast<torch::nn::MultiheadAttentionImpl>(builtin.clone());
  module->to(torch::kFloat64);
  return run_builtin(*module, inputs.to(device, torch::kFloat64));
}

} // namespace

Comparison compare_with_builtin(const DemoArguments& arguments) {
  const auto device_choice = choose_device(arguments.device);
  const auto device = device_choice.device;
  check_dtype_runs(arguments, device);

  auto problem = make_problem(arguments);
  problem.attn->to(device, arguments.dtype);
  problem.builtin->to(device, arguments.dtype);
  const auto inputs = problem.inputs.to(device, arguments.dtype);

  torch::NoGradGuard no_grad;
  const auto forward_attn = [&] { return run_attn(*problem.attn, inputs, arguments.causal); };
  const auto forward_builtin = [&] { return run_builtin(*problem.builtin, inputs); };
  const auto timed_attn = time_forward(forward_attn, device, std::nullopt);
  const auto timed_builtin = time_forward(forward_builtin, device, timed_attn.runs);
  const auto& ours = timed_attn.outputs;
  const auto& builtin = timed_builtin.outputs;

  const auto float64 = rerun_in_float64(*problem.builtin, inputs, device);

  return {
      device_choice,
      ours.output.sizes().vec(),
      ours.weights.sizes().vec(),
      builtin.output.sizes().vec(),
      {timed_attn.median_ms, timed_builtin.median_ms, timed_attn.runs},
      max_abs_difference(ours.output, builtin.output),
      max_abs_difference(ours.weights, builtin.weights),
      max_abs_difference(ours.output, float64.output),
      max_abs_difference(builtin.output, float64.output),
      first_sequence_map(arguments, ours.weights)};
}

} // namespace demo
