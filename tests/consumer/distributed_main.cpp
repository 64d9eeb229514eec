// A program that uses the installed attn::distributed as a project that
// depends on it would: its headers, its target. ctest starts it as the one
// rank of a group on the loopback, through attn_launch_ranks.
//
//   consumer <expected attn version>
//
// Exit code 0 when the headers carry that version and the one-rank
// tensor-parallel module computes what its whole module computes.

#include "expected_version.h"

#include <attn/attn.h>
#include <attn/distributed/tensor_parallel_multi_head_attention.h>

#include <iostream>

int main(int argc, char** argv) {
  if (const int failed = check_expected_version(argc, argv)) {
    return failed;
  }
  const auto group = attn::distributed::init_process_group();

  attn::MultiHeadAttention whole(attn::MultiHeadAttentionOptions(16, 4));
  attn::distributed::TensorParallelMultiHeadAttention parallel(whole, group);
  const auto x = torch::randn({2, 5, 16}); // (B, T, E)
  const auto expected = std::get<0>(whole(x, x, x));
  const auto actual = std::get<0>(parallel(x, x, x));
  const bool same = torch::allclose(actual, expected, 1e-5, 1e-6);
  std::cout << "attn " << ATTN_VERSION << ": " << group.size() << " rank, output " << actual.sizes()
            << (same ? ", as the whole module's" : ", NOT the whole module's") << "\n";
  return same ? 0 : 1;
}
