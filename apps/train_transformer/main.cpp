// train_transformer: trains a small causal transformer, built from
// attn::MultiHeadAttention, feed-forward layers and layer norm, from scratch
// to reverse strings of digits; `train_transformer --help` lists the flags.
//
// parse the flags (arguments) -> build the model (model; with
//   --tensor-parallel, each rank a share of its heads: parallelism), or resume it
//   (checkpoint) -> train on sequences drawn for every step and evaluate on
//   held-out ones (trainer, reversal_task), reporting as it goes (progress)

#include "arguments.h"
#include "trainer.h"

#include "common/failure.h"

namespace {

int run(int argc, const char* const* argv) {
  const auto arguments = train::parse_arguments(argc, argv);
  if (!arguments) {
    return 0; // --help
  }
  train::Trainer trainer(*arguments);
  trainer.print_setup();
  trainer.resume_if_asked();
  trainer.train();
  trainer.print_results();
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  return apps::run_reporting_failures("train_transformer", [&] { return run(argc, argv); });
}
