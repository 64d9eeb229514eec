// attn_demo: attn::MultiHeadAttention beside torch::nn::MultiheadAttention
// with the same weights. With no flags it runs batch 4, 20 tokens, d_model
// 512, 8 heads; `attn_demo --help` lists the flags.
//
// parse and check the flags (arguments) -> run both modules (comparison)
//   -> write the heatmap, if asked (heatmap) -> print the report (report)

#include "arguments.h"
#include "comparison.h"
#include "heatmap.h"
#include "report.h"

#include "common/atomic_file.h"
#include "common/failure.h"

#include <fmt/format.h>

namespace {

// Written before anything is printed, so that a path that cannot be written
// fails the run before a report claims it.
void write_heatmap(const demo::DemoArguments& arguments, const demo::Comparison& comparison) {
  const auto caption = fmt::format(
      "{}, {}, seed {}", demo::describe_attention(arguments), demo::dtype_name(arguments.dtype),
      arguments.seed);
  apps::write_file_atomically(
      arguments.heatmap_path, "--heatmap", demo::heatmap_svg(comparison.map, caption));
}

int run(int argc, const char* const* argv) {
  const auto arguments = demo::parse_arguments(argc, argv);
  if (!arguments) {
    return 0; // --help
  }
  const auto comparison = demo::compare_with_builtin(*arguments);
  if (!arguments->heatmap_path.empty()) {
    write_heatmap(*arguments, comparison);
  }
  fmt::print(
      "{}",
      arguments->json ? demo::json_report(*arguments, comparison)
                      : demo::text_report(*arguments, comparison));
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  return apps::run_reporting_failures("attn_demo", [&] { return run(argc, argv); });
}
