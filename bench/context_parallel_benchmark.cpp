// Context parallelism's time and memory, run as the ranks of a group
// started the way torchrun starts them (docs/CONTEXT_PARALLEL.md has what
// it printed):
//
//   build/apps/attn_launch_ranks W 1800 build/bench/attn_context_parallel_bench table
//   build/apps/attn_launch_ranks 4 900 build/bench/attn_context_parallel_bench memory
//   build/apps/attn_launch_ranks 4 900 build/bench/attn_context_parallel_bench memory-forward
//
// `table`: causal self-attention over T = 8192 tokens (B = 1, H = 8,
// D = 64, float32) per strategy and layout: the median forward and
// forward+backward times, each rank's peak tensor memory, and what one rank
// sends. With W = 1 it also times attn::scaled_dot_product_attention on the
// whole sequence, the one-process baseline. Each rank runs on cores / W
// threads (at least one), in ATen's pool and in OpenBLAS's, so that W ranks
// share the machine's cores rather than oversubscribe them.
//
// `memory`: one causal forward+backward over T = 65536 tokens (B = 1,
// H = 8, D = 64, float32, zigzag ring); prints each rank's peak tensor
// memory and fails (exit 1) unless every rank's stays below the bytes one
// process must hold for the same sequence: its queries, keys, values,
// output and their four gradients, 8·B·H·T·D floats; ctest runs it.
// `memory-forward`: the forward alone (no gradient), against Q, K, V and
// O, 4·B·H·T·D floats, in a quarter of the time.

#include <attn/attn.h>
#include <attn/distributed/context_parallel.h>
#include <attn/distributed/mappings.h>

#include "peak_memory.h"

#include <torch/torch.h>

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace {

namespace dist = attn::distributed;

constexpr int64_t kBatch = 1, kHeads = 8, kHeadDim = 64;

// Counts every CPU tensor of the run; never destroyed, so that tensors
// freed during the program's exit still find it.
attn::bench::PeakTensorMemory& meter() {
  static auto* meter = new attn::bench::PeakTensorMemory;
  return *meter;
}

// ATen's intra-op threads and, where LibTorch uses OpenBLAS (Debian's
// does), OpenBLAS's own pool, which the kernels' inline GEMMs run on.
void set_threads(int threads) {
  at::set_num_threads(threads);
  using SetThreads = void (*)(int);
  const auto set_blas_threads = reinterpret_cast<SetThreads>(
      dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (set_blas_threads != nullptr) {
    set_blas_threads(threads);
  }
}

double elapsed_ms(const std::function<void()>& step) {
  const auto start = std::chrono::steady_clock::now();
  step();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

void barrier(const dist::Group& group) {
  dist::reduce_from_parallel(torch::zeros({1}), group);
}

// The median of `repeats` timed runs of `step` after one untimed one; the
// ranks start each run together, and a run ends when the last rank is done
// (a rank with less work, such as the first under causal attention laid out
// contiguously, finishes its own part early).
double median_ms(const dist::Group& group, int repeats, const std::function<void()>& step) {
  std::vector<double> times;
  for (int run = -1; run < repeats; ++run) {
    barrier(group);
    const double ms = elapsed_ms([&] {
      step();
      barrier(group);
    });
    if (run >= 0) {
      times.push_back(ms);
    }
  }
  std::nth_element(times.begin(), times.begin() + repeats / 2, times.end());
  return times[repeats / 2];
}

// The largest value of `value` over the ranks.
int64_t max_over_ranks(int64_t value, const dist::Group& group) {
  const auto all = dist::gather_from_parallel(torch::tensor({value}), 0, group);
  return all.max().item<int64_t>();
}

double mib(int64_t bytes) {
  return static_cast<double>(bytes) / (1 << 20);
}

// This rank's rows of a causal self-attention problem over `length` tokens.
struct Problem {
  torch::Tensor q, k, v;
  dist::ContextParallelOptions options;
};

Problem problem(
    const dist::Group& group,
    int64_t length,
    dist::ContextParallelStrategy strategy,
    dist::SequenceLayout layout) {
  const dist::SequenceSharding sharding(length, group.size(), layout);
  const auto draw = [&] {
    return torch::randn({kBatch, kHeads, sharding.local_length(), kHeadDim}).requires_grad_();
  };
  return {
      draw(), draw(), draw(),
      dist::ContextParallelOptions(sharding).is_causal(true).strategy(strategy)};
}

torch::Tensor attend(const Problem& p, const dist::Group& group) {
  return dist::context_parallel_attention(p.q, p.k, p.v, group, p.options);
}

void forward_backward(const Problem& p, const dist::Group& group) {
  attend(p, group).sum().backward();
}

void print_row(
    const dist::Group& group,
    const std::string& what,
    double forward_ms,
    double both_ms,
    int64_t peak_bytes,
    const dist::CommunicationCount& sent) {
  if (group.rank() == 0) {
    std::printf(
        "| %lld | %s | %.0f | %.0f | %.0f | %lld | %.1f |\n", static_cast<long long>(group.size()),
        what.c_str(), forward_ms, both_ms, mib(peak_bytes),
        static_cast<long long>(sent.collectives), mib(sent.bytes));
    std::fflush(stdout);
  }
}

void table_row(
    const dist::Group& group,
    dist::ContextParallelStrategy strategy,
    dist::SequenceLayout layout) {
  constexpr int64_t kLength = 8192;
  constexpr int kRepeats = 3;
  const auto p = problem(group, kLength, strategy, layout);
  const double forward = median_ms(group, kRepeats, [&] {
    torch::NoGradGuard no_grad;
    attend(p, group);
  });
  const double both = median_ms(group, kRepeats, [&] { forward_backward(p, group); });
  meter().reset_peak();
  dist::reset_communication_count();
  forward_backward(p, group);
  const auto sent = dist::communication_count();
  std::string what = c10::str(strategy, ", ", layout);
  print_row(group, what, forward, both, max_over_ranks(meter().peak_bytes(), group), sent);
}

// One process, attn's fused attention on the whole sequence.
void one_process_row(const dist::Group& group) {
  constexpr int64_t kLength = 8192;
  const auto draw = [&] {
    return torch::randn({kBatch, kHeads, kLength, kHeadDim}).requires_grad_();
  };
  const auto q = draw(), k = draw(), v = draw();
  const auto options = attn::SDPAOptions().is_causal(true).need_weights(false);
  const auto attend_whole = [&] {
    return std::get<0>(attn::scaled_dot_product_attention(q, k, v, options));
  };
  const double forward = median_ms(group, 3, [&] {
    torch::NoGradGuard no_grad;
    attend_whole();
  });
  const double both = median_ms(group, 3, [&] { attend_whole().sum().backward(); });
  meter().reset_peak();
  attend_whole().sum().backward();
  print_row(
      group, "scaled_dot_product_attention, one process", forward, both, meter().peak_bytes(), {});
}

int table(const dist::Group& group) {
  if (group.rank() == 0) {
    std::printf(
        "| W | strategy, layout | forward ms | forward+backward ms | peak MiB per rank | "
        "messages per rank | MiB sent per rank |\n|---|---|---|---|---|---|---|\n");
  }
  if (group.size() == 1) {
    one_process_row(group);
  }
  table_row(group, dist::ContextParallelStrategy::ring, dist::SequenceLayout::zigzag);
  table_row(group, dist::ContextParallelStrategy::ring, dist::SequenceLayout::contiguous);
  if (kHeads % group.size() == 0) {
    table_row(group, dist::ContextParallelStrategy::all_to_all, dist::SequenceLayout::zigzag);
  }
  return 0;
}

int memory(const dist::Group& group, bool backward) {
  constexpr int64_t kLength = 65536;
  const auto p = problem(
      group, kLength, dist::ContextParallelStrategy::ring, dist::SequenceLayout::zigzag);
  meter().reset_peak();
  const double ms = elapsed_ms([&] {
    if (backward) {
      forward_backward(p, group);
    } else {
      const torch::NoGradGuard no_grad;
      attend(p, group);
    }
    barrier(group);
  });
  const auto peaks = dist::gather_from_parallel(torch::tensor({meter().peak_bytes()}), 0, group);
  // Q, K, V, O and, with the backward, their gradients, in float32.
  const int64_t one_process = (backward ? 8 : 4) * kBatch * kHeads * kLength * kHeadDim * 4;
  const bool below = peaks.max().item<int64_t>() < one_process;
  if (group.rank() == 0) {
    std::printf(
        "T = %lld, B = %lld, H = %lld, D = %lld, float32, causal, zigzag ring over %lld ranks: "
        "%s %.1f s\n",
        static_cast<long long>(kLength), static_cast<long long>(kBatch),
        static_cast<long long>(kHeads), static_cast<long long>(kHeadDim),
        static_cast<long long>(group.size()), backward ? "forward+backward" : "forward", ms / 1000);
    for (int64_t rank = 0; rank < group.size(); ++rank) {
      std::printf(
          "rank %lld: peak tensor memory %.0f MiB\n", static_cast<long long>(rank),
          mib(peaks[rank].item<int64_t>()));
    }
    std::printf(
        "one process holds at least %.0f MiB (Q, K, V, O%s): %s\n", mib(one_process),
        backward ? " and their gradients" : "",
        below ? "every rank is below" : "A RANK IS NOT BELOW");
  }
  return below ? 0 : 1;
}

} // namespace

int main(int argc, char** argv) {
  const std::string mode = argc == 2 ? argv[1] : "";
  if (mode != "table" && mode != "memory" && mode != "memory-forward") {
    std::fprintf(stderr, "usage: attn_context_parallel_bench table|memory|memory-forward\n");
    return 2;
  }
  meter();
  const auto group = dist::init_process_group(
      dist::InitOptions().timeout(std::chrono::minutes(10)));
  const auto cores = static_cast<int64_t>(std::thread::hardware_concurrency());
  set_threads(static_cast<int>(std::max<int64_t>(cores / group.size(), 1)));
  torch::manual_seed(group.rank());
  return mode == "table" ? table(group) : memory(group, /*backward=*/mode == "memory");
}
