#pragma once

// The experiment: attn::MultiHeadAttention and torch::nn::MultiheadAttention
// with the same weights, on the same random tokens and masks.

#include "arguments.h"

#include <torch/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace demo {

struct DeviceChoice {
  torch::Device device;
  /// "as requested", or why auto chose it ("CUDA not available").
  std::string reason;
};

/// The attention maps of the first sequence for the shown head(s).
struct AttentionMap {
  /// (H', L, S), float64 on the CPU; H' is 1 or every head.
  torch::Tensor weights;
  /// The head of each of the H' maps.
  std::vector<int64_t> heads;
  /// x1 … xL.
  std::vector<std::string> query_labels;
  /// x1 … xS for self-attention, y1 … yS for the second sequence.
  std::vector<std::string> key_labels;
};

struct ForwardTime {
  /// Median over `runs` forwards after one warm-up.
  double attn_ms;
  double builtin_ms;
  int runs;
};

struct Comparison {
  DeviceChoice device;
  /// (B, L, E).
  std::vector<int64_t> output_shape;
  /// (B, H, L, S).
  std::vector<int64_t> weights_shape;
  /// (B, L, E), after turning the built-in's (L, B, E) batch-first.
  std::vector<int64_t> builtin_output_shape;
  ForwardTime time;
  /// Both modules ran in the requested dtype; differences are taken in
  /// float64 so that they are not rounded again.
  double max_output_difference;
  double max_weights_difference;
  /// Each module's output against the built-in recomputed in float64 from
  /// the same (rounded) weights and inputs: the error the dtype itself costs.
  double attn_error_vs_float64;
  double builtin_error_vs_float64;
  AttentionMap map;
};

/// Runs the experiment. Throws `apps::UsageError` when the dtype cannot run
/// on the device, and `c10::Error` for a device that cannot be used.
Comparison compare_with_builtin(const DemoArguments& arguments);

} // namespace demo
