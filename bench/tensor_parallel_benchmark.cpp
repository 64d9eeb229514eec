// Times attn::distributed::TensorParallelMultiHeadAttention on the ranks of
// a group started the way torchrun starts them (docs/DISTRIBUTED.md has
// the table it printed):
//
//   build/apps/attn_launch_ranks 2 600 build/bench/attn_tensor_parallel_bench
//
// Each rank runs on cores / W intra-op threads, so that W = 1 and W = 2 use
// the same cores. Rank 0 prints the median forward and forward+backward
// times of a self-attention layer and the bytes it contributed to them.

#include <attn/attn.h>
#include <attn/distributed/mappings.h>
#include <attn/distributed/tensor_parallel_multi_head_attention.h>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <thread>
#include <vector>

namespace {

namespace dist = attn::distributed;

// The median of `repeats` timed runs of `step`, in milliseconds, after two
// untimed ones; the ranks start each run together.
double median_ms(const dist::Group& group, int repeats, const std::function<void()>& step) {
  std::vector<double> times;
  for (int run = -2; run < repeats; ++run) {
    dist::reduce_from_parallel(torch::zeros({1}), group); // a barrier
    const auto start = std::chrono::steady_clock::now();
    step();
    const std::chrono::duration<double, std::milli> elapsed = std::chrono::steady_clock::now() -
        start;
    if (run >= 0) {
      times.push_back(elapsed.count());
    }
  }
  std::nth_element(times.begin(), times.begin() + repeats / 2, times.end());
  return times[repeats / 2];
}

void report(const dist::Group& group, int64_t B, int64_t L, int64_t E, int64_t H) {
  torch::manual_seed(0);
  dist::TensorParallelMultiHeadAttention mha(attn::MultiHeadAttentionOptions(E, H), group);
  const auto x = torch::randn({B, L, E}).requires_grad_();
  const auto no_weights = attn::MultiHeadAttentionForwardOptions().need_weights(false);
  const auto forward = [&] {
    torch::NoGradGuard no_grad;
    mha(x, x, x, no_weights);
  };
  const auto forward_backward = [&] { std::get<0>(mha(x, x, x, no_weights)).sum().backward(); };
  const auto forward_ms = median_ms(group, 10, forward);
  const auto both_ms = median_ms(group, 10, forward_backward);
  dist::reset_communication_count();
  forward_backward();
  const auto bytes = dist::communication_count().bytes;
  if (group.rank() == 0) {
    std::printf(
        "| %lld | %lld | B=%lld L=%lld E=%lld H=%lld | %.1f | %.1f | %lld |\n",
        static_cast<long long>(group.size()), static_cast<long long>(at::get_num_threads()),
        static_cast<long long>(B), static_cast<long long>(L), static_cast<long long>(E),
        static_cast<long long>(H), forward_ms, both_ms, static_cast<long long>(bytes));
  }
}

} // namespace

int main() {
  const auto group = dist::init_process_group();
  const auto cores = static_cast<int64_t>(std::thread::hardware_concurrency());
  at::set_num_threads(static_cast<int>(std::max<int64_t>(cores / group.size(), 1)));
  if (group.rank() == 0) {
    std::printf(
        "| W | threads per rank | layer | forward ms | forward+backward ms | bytes per rank |\n");
    std::printf("|---|---|---|---|---|---|\n");
  }
  report(group, 4, 256, 512, 8);
  report(group, 1, 1024, 1024, 16);
  return 0;
}
