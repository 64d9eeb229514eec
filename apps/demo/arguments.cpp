#include "arguments.h"

#include "common/command_line.h"
#include "common/failure.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <map>

namespace demo {
namespace {

using apps::UsageError;

// Larger tensors would not fit beside the copies the demo keeps (both
// modules' outputs and weights, and a float64 reference): 2^28 elements is
// 1 GiB in float32.
constexpr int64_t kMaxTensorElements = int64_t{1} << 28;

// One cell per attention weight: beyond this an SVG grows past ~10 MB and
// viewers slow to a crawl.
constexpr int64_t kMaxHeatmapCells = 65536;

constexpr const char* kSvgSuffix = ".svg";

constexpr const char* kDescription =
    "Runs attn::MultiHeadAttention and torch::nn::MultiheadAttention with\n"
    "the same weights on random tokens and reports the shapes, the forward\n"
    "time, how far apart the two outputs are, and the attention map of one\n"
    "head: row i holds how much query token xi attends to each key token.\n"
    "With no options it runs batch 4, 20 tokens, d_model 512, 8 heads.\n";

// The sizes of the problem: B, L, S, E and H.
void add_size_options(CLI::App& app, DemoArguments& arguments) {
  apps::add_integer_option(app, "--batch", arguments.batch, "sequences per batch B", int64_t{1});
  apps::add_integer_option(app, "--seq", arguments.seq, "query length L in tokens", int64_t{1});
  apps::add_integer_option(
      app, "--kv-seq", arguments.kv_seq,
      "key/value length S: cross-attention to\na second sequence of N tokens", int64_t{1})
      ->default_str("L, self-attention");
  apps::add_integer_option(app, "--d-model", arguments.d_model, "model width E", int64_t{1});
  apps::add_integer_option(
      app, "--heads", arguments.heads, "attention heads H, dividing E", int64_t{1});
}

// Where and how it runs: device, dtype, masks and the seed.
void add_run_options(CLI::App& app, DemoArguments& arguments) {
  apps::add_device_option(app, arguments.device);
  std::map<std::string, torch::ScalarType> dtypes;
  std::vector<std::string> names;
  for (const auto dtype : demo_dtypes()) {
    dtypes.emplace(dtype_name(dtype), dtype);
    names.push_back(dtype_name(dtype));
  }
  app.add_option_function<std::string>(
         "--dtype",
         [&arguments, dtypes](const std::string& name) { arguments.dtype = dtypes.at(name); },
         dtype_names(demo_dtypes()))
      ->type_name("T")
      ->check(CLI::IsMember(names).description(""))
      ->default_str(dtype_name(arguments.dtype));
  app.add_flag("--causal", arguments.causal, "query i attends only to keys j <= i")
      ->default_str("off");
  apps::add_integer_option(
      app, "--pad", arguments.pad, "mask the last N keys of each sequence\nas padding", int64_t{0});
  apps::add_integer_option(
      app, "--seed", arguments.seed, "seed for the weights and inputs", uint64_t{0});
}

// `--head`: a head index, or all of them.
CLI::Validator head_or_all() {
  const auto index = apps::decimal_integer(
      static_cast<uint64_t>(std::numeric_limits<int64_t>::max()));
  const auto check = [index](std::string& text) -> std::string {
    if (text == "all" || index(text).empty()) {
      return {};
    }
    return fmt::format("expected a head index (0, 1, ...) or all, got '{}'", text);
  };
  return CLI::Validator(check, /*validator_desc=*/"");
}

// What it shows: which head, drawn where, as text or JSON.
void add_output_options(CLI::App& app, DemoArguments& arguments) {
  app.add_option_function<std::string>(
         "--head",
         [&arguments](const std::string& head) {
           arguments.head = head == "all" ? std::nullopt : std::optional<int64_t>(std::stoll(head));
         },
         "head whose attention map is shown:\n0 to H-1, or all")
      ->type_name("H")
      ->transform(head_or_all())
      ->default_str(arguments.head ? fmt::to_string(*arguments.head) : "all");
  app.add_option(
         "--heatmap", arguments.heatmap_path,
         "draw the shown attention map(s) of the\nfirst sequence as an SVG "
         "image")
      ->type_name("FILE")
      ->default_str("none");
  app.add_flag("--json", arguments.json, "print one JSON object instead of the\ntext report");
}

// The product as a double: exact far beyond the limits it is compared with,
// and it cannot overflow.
double product(std::initializer_list<int64_t> factors) {
  double result = 1.0;
  for (const auto factor : factors) {
    result *= static_cast<double>(factor);
  }
  return result;
}

void add_options(CLI::App& app, DemoArguments& arguments) {
  add_size_options(app, arguments);
  add_run_options(app, arguments);
  add_output_options(app, arguments);
}

// H divides E, and --head names one of the H heads.
void check_heads(const DemoArguments& arguments) {
  const auto E = arguments.d_model;
  const auto H = arguments.heads;
  if (E % H != 0) {
    const auto below = E / H * H;
    throw UsageError(fmt::format(
        "--d-model {} is not divisible by --heads {}: expected a multiple of "
        "{}, such as {}",
        E, H, H, below > 0 ? fmt::format("{} or {}", below, below + H) : fmt::to_string(H)));
  }
  if (arguments.head && *arguments.head >= H) {
    throw UsageError(
        fmt::format("--head {} is out of range: expected 0 to {} or all", *arguments.head, H - 1));
  }
}

// Some key is left unmasked, and every tensor fits in memory.
void check_sizes(const DemoArguments& arguments) {
  const auto S = arguments.key_length();
  if (arguments.pad >= S) {
    throw UsageError(fmt::format(
        "--pad {} masks all {} keys, leaving the queries nothing to attend "
        "to: expected 0 to {}",
        arguments.pad, S, S - 1));
  }
  const auto B = arguments.batch, L = arguments.seq, E = arguments.d_model, H = arguments.heads;
  const auto largest = std::max(
      {product({B, H, L, S}), product({B, L, E}), product({B, S, E}), product({E, E})});
  if (largest > static_cast<double>(kMaxTensorElements)) {
    throw UsageError(fmt::format(
        "B={} L={} S={} E={} H={} need a tensor of {:.0f} elements: expected "
        "at most {} in each of B·H·L·S, B·L·E, B·S·E and E·E",
        B, L, S, E, H, largest, kMaxTensorElements));
  }
}

// An .svg file name, and a map small enough to draw.
void check_heatmap(const DemoArguments& arguments) {
  const auto& path = arguments.heatmap_path;
  const std::string suffix = kSvgSuffix;
  if (path.size() <= suffix.size() ||
      path.compare(path.size() - suffix.size(), suffix.size(), suffix) != 0) {
    throw UsageError(fmt::format(
        "--heatmap writes SVG: expected a file name ending in {}, got '{}'", suffix, path));
  }
  const auto L = arguments.seq, S = arguments.key_length();
  const auto cells = arguments.shown_head_count() * L * S;
  if (cells > kMaxHeatmapCells) {
    throw UsageError(fmt::format(
        "--heatmap draws one cell per weight, {} head(s) x {} x {} = {}: "
        "expected at most {}; choose one --head or shorter sequences",
        arguments.shown_head_count(), L, S, cells, kMaxHeatmapCells));
  }
}

// What the flags mean together: divisibility, ranges, sizes.
void validate(const DemoArguments& arguments) {
  check_heads(arguments);
  check_sizes(arguments);
  if (!arguments.heatmap_path.empty()) {
    check_heatmap(arguments);
  }
}

} // namespace

std::optional<DemoArguments> parse_arguments(int argc, const char* const* argv) {
  auto arguments = apps::parse_command_line<DemoArguments>(
      "attn_demo", kDescription, argc, argv, add_options);
  if (arguments) {
    validate(*arguments);
  }
  return arguments;
}

const std::vector<torch::ScalarType>& demo_dtypes() {
  static const std::vector<torch::ScalarType> dtypes = {
      torch::kFloat32, torch::kFloat64, torch::kBFloat16, torch::kFloat16};
  return dtypes;
}

std::string dtype_name(torch::ScalarType dtype) {
  switch (dtype) {
    case torch::kFloat32: return "float32";
    case torch::kFloat64: return "float64";
    case torch::kBFloat16: return "bfloat16";
    case torch::kFloat16: return "float16";
    default: return c10::toString(dtype);
  }
}

std::string dtype_names(const std::vector<torch::ScalarType>& dtypes) {
  std::string text;
  for (size_t i = 0; i < dtypes.size(); ++i) {
    if (i > 0) {
      text += i + 1 == dtypes.size() ? " or " : ", ";
    }
    text += dtype_name(dtypes[i]);
  }
  return text;
}

} // namespace demo
