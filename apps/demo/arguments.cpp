#include "arguments.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <functional>
#include <limits>
#include <sstream>

namespace demo {
namespace {

// Larger tensors would not fit beside the copies the demo keeps (both
// modules' outputs and weights, and a float64 reference): 2^28 elements is
// 1 GiB in float32.
constexpr int64_t kMaxTensorElements = int64_t{1} << 28;

// One cell per attention weight: beyond this an SVG grows past ~10 MB and
// viewers slow to a crawl.
constexpr int64_t kMaxHeatmapCells = 65536;

constexpr const char* kSvgSuffix = ".svg";

// --help fits an 80-column terminal: flag names, then their help text.
constexpr int kHelpIndent = 19;
constexpr int kHelpWidth = 79;

struct Flag {
  const char* name;
  // What the value looks like in --help; empty for a switch.
  const char* value;
  std::string help;
  // Shown as "(default ...)"; empty for a flag without one.
  std::string default_value;
  std::function<void(DemoArguments&, const std::string& value)> apply;
};

bool is_decimal(const std::string& text) {
  return !text.empty() &&
      std::all_of(text.begin(), text.end(), [](unsigned char c) {
           return std::isdigit(c) != 0;
         });
}

// Only plain decimal digits: no sign, no spaces, no suffix, no overflow.
template <typename Integer>
Integer parse_integer(
    const std::string& flag, const std::string& text, Integer minimum) {
  const char* expected =
      minimum > 0 ? "a positive integer" : "a non-negative integer";
  if (!is_decimal(text)) {
    throw UsageError(
        fmt::format("{} expects {}, got '{}'", flag, expected, text));
  }
  Integer value{};
  const auto parsed =
      std::from_chars(text.data(), text.data() + text.size(), value);
  if (parsed.ec == std::errc::result_out_of_range) {
    throw UsageError(fmt::format(
        "{} expects {}, got '{}', which is too large (at most {})", flag,
        expected, text, std::numeric_limits<Integer>::max()));
  }
  if (value < minimum) {
    throw UsageError(
        fmt::format("{} expects {}, got '{}'", flag, expected, text));
  }
  return value;
}

torch::ScalarType parse_dtype(const std::string& text) {
  for (const auto dtype : demo_dtypes()) {
    if (dtype_name(dtype) == text) {
      return dtype;
    }
  }
  throw UsageError(fmt::format(
      "unknown dtype '{}': expected {}", text, dtype_names(demo_dtypes())));
}

std::optional<int64_t> parse_head(const std::string& text) {
  if (text == "all") {
    return std::nullopt;
  }
  if (!is_decimal(text)) {
    throw UsageError(fmt::format(
        "--head expects a head index (0, 1, ...) or all, got '{}'", text));
  }
  return parse_integer<int64_t>("--head", text, 0);
}

// A flag whose value is a count stored in `field`, at least `minimum`.
template <typename Integer>
Flag count_flag(
    const char* name,
    std::string help,
    Integer DemoArguments::*field,
    Integer minimum) {
  const DemoArguments defaults;
  return {
      name, "N", std::move(help), fmt::to_string(defaults.*field),
      [name, field, minimum](DemoArguments& a, const std::string& v) {
        a.*field = parse_integer<Integer>(name, v, minimum);
      }};
}

const std::vector<Flag>& flags() {
  const DemoArguments defaults;
  static const std::vector<Flag> table = {
      count_flag<int64_t>(
          "--batch", "sequences per batch B", &DemoArguments::batch, 1),
      count_flag<int64_t>(
          "--seq", "query length L in tokens", &DemoArguments::seq, 1),
      {"--kv-seq", "N",
       "key/value length S: cross-attention to a second sequence of N tokens",
       "self-attention, S = L",
       [](DemoArguments& a, const std::string& v) {
         a.kv_seq = parse_integer<int64_t>("--kv-seq", v, 1);
       }},
      count_flag<int64_t>(
          "--d-model", "model width E", &DemoArguments::d_model, 1),
      count_flag<int64_t>(
          "--heads", "attention heads H, dividing E", &DemoArguments::heads,
          1),
      {"--device", "D", "auto (CUDA when available), cpu, cuda or cuda:N",
       defaults.device,
       [](DemoArguments& a, const std::string& v) { a.device = v; }},
      {"--dtype", "T", dtype_names(demo_dtypes()), dtype_name(defaults.dtype),
       [](DemoArguments& a, const std::string& v) {
         a.dtype = parse_dtype(v);
       }},
      {"--causal", "", "query i attends only to keys j <= i", "off",
       [](DemoArguments& a, const std::string&) { a.causal = true; }},
      count_flag<int64_t>(
          "--pad", "mask the last N keys of each sequence as padding",
          &DemoArguments::pad, 0),
      count_flag<uint64_t>(
          "--seed", "seed for the weights and inputs", &DemoArguments::seed,
          0),
      {"--head", "H", "head whose attention map is shown: 0 to H-1, or all",
       fmt::to_string(*defaults.head),
       [](DemoArguments& a, const std::string& v) { a.head = parse_head(v); }},
      {"--heatmap", "FILE",
       "draw the shown attention map(s) of the first sequence as an SVG image",
       "none",
       [](DemoArguments& a, const std::string& v) { a.heatmap_path = v; }},
      {"--json", "", "print one JSON object instead of the text report", "",
       [](DemoArguments& a, const std::string&) { a.json = true; }},
      {"--help", "", "show this help and exit", "",
       [](DemoArguments& a, const std::string&) { a.help = true; }},
  };
  return table;
}

const Flag* find_flag(const std::string& name) {
  const auto& table = flags();
  const auto found =
      std::find_if(table.begin(), table.end(), [&](const Flag& flag) {
        return name == flag.name;
      });
  return found == table.end() ? nullptr : &*found;
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

} // namespace

DemoArguments parse_arguments(int argc, const char* const* argv) {
  DemoArguments arguments;
  for (int i = 1; i < argc; ++i) {
    std::string name = argv[i];
    std::optional<std::string> value;
    // --flag=value as well as --flag value.
    if (const auto equals = name.find('='); name.rfind("--", 0) == 0 &&
        equals != std::string::npos) {
      value = name.substr(equals + 1);
      name.erase(equals);
    }
    const Flag* flag = find_flag(name);
    if (flag == nullptr) {
      throw UsageError(fmt::format(
          "unknown option '{}': see attn_demo --help for the accepted flags",
          name));
    }
    const bool takes_value = *flag->value != '\0';
    if (!takes_value && value) {
      throw UsageError(
          fmt::format("{} takes no value, got '{}'", name, *value));
    }
    if (takes_value && !value) {
      if (i + 1 == argc) {
        throw UsageError(fmt::format(
            "{} needs a value: {} {}; see attn_demo --help", name, name,
            flag->value));
      }
      value = argv[++i];
    }
    flag->apply(arguments, value.value_or(""));
  }
  return arguments;
}

void validate(const DemoArguments& arguments) {
  const auto E = arguments.d_model;
  const auto H = arguments.heads;
  if (E % H != 0) {
    const auto below = E / H * H;
    throw UsageError(fmt::format(
        "--d-model {} is not divisible by --heads {}: expected a multiple of "
        "{}, such as {}",
        E, H, H,
        below > 0 ? fmt::format("{} or {}", below, below + H)
                  : fmt::to_string(H)));
  }
  if (arguments.head && *arguments.head >= H) {
    throw UsageError(fmt::format(
        "--head {} is out of range: expected 0 to {} or all", *arguments.head,
        H - 1));
  }
  const auto S = arguments.key_length();
  if (arguments.pad >= S) {
    throw UsageError(fmt::format(
        "--pad {} masks all {} keys, leaving the queries nothing to attend "
        "to: expected 0 to {}",
        arguments.pad, S, S - 1));
  }

  const auto L = arguments.seq;
  const auto B = arguments.batch;
  const auto largest = std::max(
      {product({B, H, L, S}), product({B, L, E}), product({B, S, E}),
       product({E, E})});
  if (largest > static_cast<double>(kMaxTensorElements)) {
    throw UsageError(fmt::format(
        "B={} L={} S={} E={} H={} need a tensor of {:.0f} elements: expected "
        "at most {} in each of B·H·L·S, B·L·E, B·S·E and E·E",
        B, L, S, E, H, largest, kMaxTensorElements));
  }

  if (arguments.heatmap_path.empty()) {
    return;
  }
  const auto& path = arguments.heatmap_path;
  const std::string suffix = kSvgSuffix;
  if (path.size() <= suffix.size() ||
      path.compare(path.size() - suffix.size(), suffix.size(), suffix) != 0) {
    throw UsageError(fmt::format(
        "--heatmap writes SVG: expected a file name ending in {}, got '{}'",
        suffix, path));
  }
  const auto cells = arguments.shown_head_count() * L * S;
  if (cells > kMaxHeatmapCells) {
    throw UsageError(fmt::format(
        "--heatmap draws one cell per weight, {} head(s) x {} x {} = {}: "
        "expected at most {}; choose one --head or shorter sequences",
        arguments.shown_head_count(), L, S, cells, kMaxHeatmapCells));
  }
}

std::string usage() {
  std::string text =
      "usage: attn_demo [options]\n"
      "\n"
      "Runs attn::MultiHeadAttention and torch::nn::MultiheadAttention with\n"
      "the same weights on random tokens and reports the shapes, the forward\n"
      "time, how far apart the two outputs are, and the attention map of one\n"
      "head: row i holds how much query token xi attends to each key token.\n"
      "With no options it runs the reference example.\n"
      "\n"
      "options:\n";
  for (const auto& flag : flags()) {
    const auto name = *flag.value == '\0'
        ? std::string(flag.name)
        : fmt::format("{} {}", flag.name, flag.value);
    text += fmt::format("  {:<{}} ", name, kHelpIndent - 3);
    // Wrapped to kHelpWidth columns under the first line; the default stays
    // in one piece.
    std::vector<std::string> pieces;
    std::istringstream words(flag.help);
    for (std::string word; words >> word;) {
      pieces.push_back(word);
    }
    if (!flag.default_value.empty()) {
      pieces.push_back(fmt::format("(default {})", flag.default_value));
    }
    int column = kHelpIndent;
    for (const auto& piece : pieces) {
      const int width = static_cast<int>(piece.size());
      if (column > kHelpIndent && column + 1 + width > kHelpWidth) {
        text += fmt::format("\n{:{}}", "", kHelpIndent);
        column = kHelpIndent;
      }
      if (column > kHelpIndent) {
        text += ' ';
        ++column;
      }
      text += piece;
      column += width;
    }
    text += '\n';
  }
  return text;
}

const std::vector<torch::ScalarType>& demo_dtypes() {
  static const std::vector<torch::ScalarType> dtypes = {
      torch::kFloat32, torch::kFloat64, torch::kBFloat16, torch::kFloat16};
  return dtypes;
}

std::string dtype_name(torch::ScalarType dtype) {
  switch (dtype) {
    case torch::kFloat32:
      return "float32";
    case torch::kFloat64:
      return "float64";
    case torch::kBFloat16:
      return "bfloat16";
    case torch::kFloat16:
      return "float16";
    default:
      return c10::toString(dtype);
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
