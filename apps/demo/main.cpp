// attn_demo: attn::MultiHeadAttention beside torch::nn::MultiheadAttention
// with the same weights. With no flags it runs the reference example (batch
// 4, 20 tokens, d_model 512, 8 heads); `attn_demo --help` lists the flags.
//
// parse and check the flags (arguments) -> run both modules (comparison)
//   -> write the heatmap, if asked (heatmap) -> print the report (report)

#include "arguments.h"
#include "comparison.h"
#include "errors.h"
#include "heatmap.h"
#include "report.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <exception>

namespace {

constexpr int kUsageError = 2;

int run(int argc, const char* const* argv) {
  const auto arguments = demo::parse_arguments(argc, argv);
  if (arguments.help) {
    fmt::print("{}", demo::usage());
    return 0;
  }
  demo::validate(arguments);
  const auto comparison = demo::compare_with_builtin(arguments);
  // Written before anything is printed, so that a path that cannot be
  // written fails the run before a report claims it.
  if (!arguments.heatmap_path.empty()) {
    const auto caption = fmt::format(
        "{}, {}, seed {}", demo::describe_attention(arguments),
        demo::dtype_name(arguments.dtype), arguments.seed);
    demo::write_file_atomically(
        arguments.heatmap_path, demo::heatmap_svg(comparison.map, caption));
  }
  fmt::print(
      "{}",
      arguments.json ? demo::json_report(arguments, comparison)
                     : demo::text_report(arguments, comparison));
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const c10::Error& error) {
    fmt::print(
        stderr, "attn_demo: {}\n",
        demo::one_line(error.what_without_backtrace()));
  } catch (const std::exception& error) {
    fmt::print(stderr, "attn_demo: {}\n", demo::one_line(error.what()));
  }
  return kUsageError;
}
