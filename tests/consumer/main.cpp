// A program that uses attn the way a project that depends on it would: one
// include, one target to link. Built three ways by ctest: against the
// installed package (find_package), the source tree (add_subdirectory) and
// a clone of the repository (FetchContent).
//
//   consumer <expected attn version>
//
// Exit code 0 when the headers carry that version and a causal
// multi-head attention forward gives what causal attention means.

#include "expected_version.h"

#include <attn/attn.h>

#include <iostream>
#include <string>

int main(int argc, char** argv) {
  if (const int failed = check_expected_version(argc, argv)) {
    return failed;
  }

  attn::MultiHeadAttention mha(attn::MultiHeadAttentionOptions(16, 4));
  const auto x = torch::randn({2, 5, 16}); // (B, T, E)
  const auto [out, weights] = mha(
      x, x, x, attn::MultiHeadAttentionForwardOptions().is_causal(true).need_weights(true));

  // Each query's weights form a distribution over the keys up to itself.
  const auto row_sums = weights.sum(-1);
  const auto future = torch::ones({5, 5}, torch::kBool).triu(1);
  const bool shapes_right = out.sizes() == x.sizes() &&
      weights.sizes() == torch::IntArrayRef({2, 4, 5, 5});
  const bool rows_sum_to_one = torch::allclose(row_sums, torch::ones_like(row_sums));
  const bool future_ignored =
      weights.masked_select(future.expand_as(weights)).abs().max().item<float>() == 0.0f;
  std::cout << "attn " << ATTN_VERSION << ": output " << out.sizes() << ", weights "
            << weights.sizes() << (rows_sum_to_one ? ", rows sum to 1" : ", rows do NOT sum to 1")
            << (future_ignored ? ", future keys ignored" : ", future keys ATTENDED") << "\n";
  return shapes_right && rows_sum_to_one && future_ignored ? 0 : 1;
}
