#include "report.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

namespace demo {
namespace {

// Keys in the order written; NaN and infinity, which JSON lacks, become null.
using Json = nlohmann::ordered_json;

// Longer maps do not fit a terminal as a table; --heatmap draws them.
constexpr int64_t kMaxTableTokens = 12;

// "[4, 20, 512]".
std::string format_shape(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

std::string describe_device(const DemoArguments& arguments, const DeviceChoice& choice) {
  if (arguments.device == "auto") {
    return fmt::format("auto → {} ({})", choice.device.str(), choice.reason);
  }
  return fmt::format("{} ({})", choice.device.str(), choice.reason);
}

std::string describe_input(const DemoArguments& arguments) {
  const auto query = format_shape({arguments.batch, arguments.seq, arguments.d_model});
  if (!arguments.cross_attention()) {
    return fmt::format("x {} as query, key and value", query);
  }
  return fmt::format(
      "x {} as query, y {} as key and value", query,
      format_shape({arguments.batch, arguments.key_length(), arguments.d_model}));
}

// The attention map of one head of the first sequence, as a table:
//           x1    x2     sum
//   x1 [  0.54  0.46 ]  1.00
std::string attention_table(const AttentionMap& map, int64_t panel) {
  const auto weights = map.weights[panel]; // (L, S)
  size_t label_width = 0;
  for (const auto& label : map.query_labels) {
    label_width = std::max(label_width, label.size());
  }
  std::string table = fmt::format(
      "Attention weights of head {}, first sequence (rows: queries, "
      "columns: keys)\n  {:>{}}  ",
      map.heads[panel], "", label_width);
  for (const auto& label : map.key_labels) {
    table += fmt::format(" {:>5}", label);
  }
  table += fmt::format("   {:>5}\n", "sum");
  for (size_t query = 0; query < map.query_labels.size(); ++query) {
    const auto row = weights[static_cast<int64_t>(query)];
    table += fmt::format("  {:>{}} [", map.query_labels[query], label_width);
    for (int64_t key = 0; key < row.size(0); ++key) {
      table += fmt::format(" {:5.2f}", row[key].item<double>());
    }
    table += fmt::format(" ] {:5.2f}\n", row.sum().item<double>());
  }
  return table;
}

// "one run" or "median of 10 runs".
std::string describe_timing(const ForwardTime& time) {
  return time.runs == 1 ? std::string("one run") : fmt::format("median of {} runs", time.runs);
}

// The report's first lines: what ran, the shapes, the times and errors.
std::string summary(const DemoArguments& arguments, const Comparison& comparison) {
  const auto dtype = dtype_name(arguments.dtype);
  return fmt::format(
      "Device:          {}\n"
      "Dtype:           {}\n"
      "Attention:       {}\n"
      "Input:           {}\n"
      "Output:          {}\n"
      "Weights:         {}\n"
      "Built-in output: {}\n"
      "Forward time:    attn {:.3g} ms, built-in {:.3g} ms ({})\n"
      "Max |output - built-in output|: {:.3g} (both in {})\n"
      "Max |weights - built-in weights|: {:.3g}\n"
      "Max |output - float64 reference|: attn {:.3g}, built-in {:.3g}\n"
      "  (reference: the built-in rerun in float64 on the same weights and "
      "inputs)\n",
      describe_device(arguments, comparison.device), dtype, describe_attention(arguments),
      describe_input(arguments), format_shape(comparison.output_shape),
      format_shape(comparison.weights_shape), format_shape(comparison.builtin_output_shape),
      comparison.time.attn_ms, comparison.time.builtin_ms, describe_timing(comparison.time),
      comparison.max_output_difference, dtype, comparison.max_weights_difference,
      comparison.attn_error_vs_float64, comparison.builtin_error_vs_float64);
}

// The shown head(s) as tables, or where to draw them when they are long.
std::string attention_tables(const DemoArguments& arguments, const AttentionMap& map) {
  if (arguments.seq > kMaxTableTokens || arguments.key_length() > kMaxTableTokens) {
    return fmt::format(
        "\nThe attention map ({} x {}) is printed as a table for up to {} "
        "tokens;\ndraw it with --heatmap FILE.svg.\n",
        arguments.seq, arguments.key_length(), kMaxTableTokens);
  }
  std::string tables;
  for (int64_t panel = 0; panel < static_cast<int64_t>(map.heads.size()); ++panel) {
    tables += '\n';
    tables += attention_table(map, panel);
  }
  return tables;
}

Json shapes_json(const Comparison& comparison) {
  return {
      {"output", comparison.output_shape},
      {"weights", comparison.weights_shape},
      {"builtin_output", comparison.builtin_output_shape}};
}

Json timing_json(const ForwardTime& time) {
  return {{"attn", time.attn_ms}, {"builtin", time.builtin_ms}, {"runs", time.runs}};
}

} // namespace

std::string describe_attention(const DemoArguments& arguments) {
  std::string text = fmt::format(
      "{}, {} heads of width {}",
      arguments.cross_attention() ? "cross-attention" : "self-attention", arguments.heads,
      arguments.d_model / arguments.heads);
  if (arguments.causal) {
    text += ", causal";
  }
  if (arguments.pad > 0) {
    text += fmt::format(", last {} keys padded", arguments.pad);
  }
  if (!arguments.causal && arguments.pad == 0) {
    text += ", no mask";
  }
  return text;
}

std::string text_report(const DemoArguments& arguments, const Comparison& comparison) {
  auto report = summary(arguments, comparison);
  if (!arguments.heatmap_path.empty()) {
    report += fmt::format("Heatmap:         {}\n", arguments.heatmap_path);
  }
  return report + attention_tables(arguments, comparison.map);
}

std::string json_report(const DemoArguments& arguments, const Comparison& comparison) {
  const Json report = {
      {"batch", arguments.batch},
      {"seq", arguments.seq},
      {"kv_seq", arguments.key_length()},
      {"d_model", arguments.d_model},
      {"heads", arguments.heads},
      {"attention", arguments.cross_attention() ? "cross" : "self"},
      {"causal", arguments.causal},
      {"pad", arguments.pad},
      {"seed", arguments.seed},
      {"device", comparison.device.device.str()},
      {"device_request", arguments.device},
      {"device_reason", comparison.device.reason},
      {"dtype", dtype_name(arguments.dtype)},
      {"shapes", shapes_json(comparison)},
      {"forward_ms", timing_json(comparison.time)},
      {"max_abs_difference",
       {{"output", comparison.max_output_difference},
        {"weights", comparison.max_weights_difference}}},
      {"max_abs_error_vs_float64",
       {{"attn", comparison.attn_error_vs_float64},
        {"builtin", comparison.builtin_error_vs_float64}}},
      {"heatmap", arguments.heatmap_path.empty() ? Json(nullptr) : Json(arguments.heatmap_path)},
  };
  // A path or device name that is not UTF-8 is printed with U+FFFD in
  // place of its bad bytes rather than failing the run.
  return report.dump(-1, ' ', false, Json::error_handler_t::replace) + "\n";
}

} // namespace demo
