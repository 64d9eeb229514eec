#pragma once

// The demo's command line: what a run asks for, parsed strictly and checked
// before any tensor is made.

#include <torch/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace demo {

/// One run of the demo. The defaults: batch 4, 20 tokens, d_model 512,
/// 8 heads, self-attention without a mask.
struct DemoArguments {
  int64_t batch = 4;
  /// Query length L.
  int64_t seq = 20;
  /// Key/value length S; set only for cross-attention, where keys and values
  /// come from a second sequence.
  std::optional<int64_t> kv_seq;
  int64_t d_model = 512;
  int64_t heads = 8;
  std::string device = "auto";
  torch::ScalarType dtype = torch::kFloat32;
  bool causal = false;
  /// How many keys at the end of every sequence are padding.
  int64_t pad = 0;
  uint64_t seed = 0;
  /// The head whose attention map is shown; empty shows every head.
  std::optional<int64_t> head = 0;
  /// Where to write the attention map as SVG; empty writes nothing.
  std::string heatmap_path;
  bool json = false;

  bool cross_attention() const { return kv_seq.has_value(); }
  int64_t key_length() const { return kv_seq.value_or(seq); }
  int64_t shown_head_count() const { return head ? 1 : heads; }
};

/// Parses `argv` strictly, every flag known, every value present, every
/// number a plain decimal integer in range, and checks what the flags mean
/// together (divisibility, ranges, sizes). Returns nothing, having printed
/// the help, where `--help` was given. Throws `apps::UsageError`.
std::optional<DemoArguments> parse_arguments(int argc, const char* const* argv);

/// The dtypes `--dtype` accepts, in the order `--help` lists them.
const std::vector<torch::ScalarType>& demo_dtypes();

/// `float32`, `float64`, `bfloat16` or `float16`.
std::string dtype_name(torch::ScalarType dtype);

/// `"float32, float64 or bfloat16"`: a list for an error message.
std::string dtype_names(const std::vector<torch::ScalarType>& dtypes);

} // namespace demo
