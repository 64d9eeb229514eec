#include "report.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include <cmath>

namespace demo {
namespace {

// Longer maps do not fit a terminal as a table; --heatmap draws them.
constexpr int64_t kMaxTableTokens = 12;

// "[4, 20, 512]": for a person and valid JSON alike.
std::string format_shape(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

std::string describe_device(
    const DemoArguments& arguments,
    const DeviceChoice& choice) {
  if (arguments.device == "auto") {
    return fmt::format("auto → {} ({})", choice.device.str(), choice.reason);
  }
  return fmt::format("{} ({})", choice.device.str(), choice.reason);
}

std::string describe_input(const DemoArguments& arguments) {
  const auto query = format_shape(
      {arguments.batch, arguments.seq, arguments.d_model});
  if (!arguments.cross_attention()) {
    return fmt::format("x {} as query, key and value", query);
  }
  return fmt::format(
      "x {} as query, y {} as key and value", query,
      format_shape(
          {arguments.batch, arguments.key_length(), arguments.d_model}));
}

// The attention map of one head of the first sequence, as in the reference:
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

std::string json_string(const std::string& text) {
  std::string quoted = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      quoted += '\\';
      quoted += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      quoted += fmt::format("\\u{:04x}", static_cast<int>(c));
    } else {
      quoted += c;
    }
  }
  return quoted + "\"";
}

// JSON has no NaN or infinity.
std::string json_number(double value) {
  return std::isfinite(value) ? fmt::format("{}", value) : "null";
}

} // namespace

std::string describe_attention(const DemoArguments& arguments) {
  std::string text = fmt::format(
      "{}, {} heads of width {}",
      arguments.cross_attention() ? "cross-attention" : "self-attention",
      arguments.heads, arguments.d_model / arguments.heads);
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

std::string text_report(
    const DemoArguments& arguments,
    const Comparison& comparison) {
  const auto dtype = dtype_name(arguments.dtype);
  std::string report = fmt::format(
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
      describe_device(arguments, comparison.device), dtype,
      describe_attention(arguments), describe_input(arguments),
      format_shape(comparison.output_shape),
      format_shape(comparison.weights_shape),
      format_shape(comparison.builtin_output_shape),
      comparison.time.attn_ms, comparison.time.builtin_ms,
      comparison.time.runs == 1
          ? std::string("one run")
          : fmt::format("median of {} runs", comparison.time.runs),
      comparison.max_output_difference, dtype,
      comparison.max_weights_difference, comparison.attn_error_vs_float64,
      comparison.builtin_error_vs_float64);
  if (!arguments.heatmap_path.empty()) {
    report += fmt::format("Heatmap:         {}\n", arguments.heatmap_path);
  }

  const auto& map = comparison.map;
  if (arguments.seq > kMaxTableTokens ||
      arguments.key_length() > kMaxTableTokens) {
    report += fmt::format(
        "\nThe attention map ({} x {}) is printed as a table for up to {} "
        "tokens;\ndraw it with --heatmap FILE.svg.\n",
        arguments.seq, arguments.key_length(), kMaxTableTokens);
    return report;
  }
  for (int64_t panel = 0; panel < static_cast<int64_t>(map.heads.size());
       ++panel) {
    report += "\n" + attention_table(map, panel);
  }
  return report;
}

std::string json_report(
    const DemoArguments& arguments,
    const Comparison& comparison) {
  const auto& time = comparison.time;
  return fmt::format(
      "{{\"batch\": {}, \"seq\": {}, \"kv_seq\": {}, \"d_model\": {}, "
      "\"heads\": {}, \"attention\": {}, \"causal\": {}, \"pad\": {}, "
      "\"seed\": {}, \"device\": {}, \"device_request\": {}, "
      "\"device_reason\": {}, \"dtype\": {}, "
      "\"shapes\": {{\"output\": {}, \"weights\": {}, "
      "\"builtin_output\": {}}}, "
      "\"forward_ms\": {{\"attn\": {}, \"builtin\": {}, \"runs\": {}}}, "
      "\"max_abs_difference\": {{\"output\": {}, \"weights\": {}}}, "
      "\"max_abs_error_vs_float64\": {{\"attn\": {}, \"builtin\": {}}}, "
      "\"heatmap\": {}}}\n",
      arguments.batch, arguments.seq, arguments.key_length(),
      arguments.d_model, arguments.heads,
      json_string(arguments.cross_attention() ? "cross" : "self"),
      arguments.causal, arguments.pad, arguments.seed,
      json_string(comparison.device.device.str()),
      json_string(arguments.device), json_string(comparison.device.reason),
      json_string(dtype_name(arguments.dtype)),
      format_shape(comparison.output_shape),
      format_shape(comparison.weights_shape),
      format_shape(comparison.builtin_output_shape), json_number(time.attn_ms),
      json_number(time.builtin_ms), time.runs,
      json_number(comparison.max_output_difference),
      json_number(comparison.max_weights_difference),
      json_number(comparison.attn_error_vs_float64),
      json_number(comparison.builtin_error_vs_float64),
      arguments.heatmap_path.empty() ? "null"
                                     : json_string(arguments.heatmap_path));
}

} // namespace demo
