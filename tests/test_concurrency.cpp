// One attn::MultiHeadAttention shared by threads for inference, and KV
// caches across threads (include/attn/kv_cache.h: a cache is not
// thread-safe; each sequence, and so each thread, decodes with its own, or
// calls take turns). Every comparison is bitwise: with one intra-op thread
// per caller, a forward is deterministic, and the threads share only the
// module's parameters, which inference reads, and its rotary tables, which
// a mutex guards and whose values do not depend on the table's length.

#include "test_support.h"

#include <attn/functional.h>
#include <attn/kv_cache.h>
#include <attn/modules/multi_head_attention.h>

#include <condition_variable>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

namespace {

using attn::KVCache;
using attn::MultiHeadAttention;
using attn::MultiHeadAttentionForwardOptions;
using attn::MultiHeadAttentionOptions;
using attn::testing::ThreadCount;

constexpr int kThreads = 8;

// Grouped queries and rotary embeddings: the module's every shared state.
MultiHeadAttention make_module() {
  torch::manual_seed(31);
  MultiHeadAttention mha(
      MultiHeadAttentionOptions(32, 4).num_kv_heads(2).rotary(attn::RotaryEmbeddingOptions(8)));
  mha->eval();
  return mha;
}

// Runs work(t) for t < kThreads, each in its own thread at once, with one
// intra-op thread and no gradients (both are per-thread settings).
template <typename Work>
void run_in_threads(const Work& work) {
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&work, t] {
      const ThreadCount intra_op(1);
      const torch::NoGradGuard no_grad;
      work(t);
    });
  }
  for (auto& thread : threads) {
    thread.join();
  }
}

struct Result {
  torch::Tensor output, weights;
};

// LibTorch's first use of a thread's count sets it to the count last set
// by any thread, and at::parallel_for does it again the first time it runs
// from another library's code: the record of having done it is per
// library. A thread's own count must survive attn's first call: here the
// thread sets 1 (after LibTorch's first use, as ThreadCount does), another
// thread sets 2, and then the thread makes its first attention call.
TEST(ThreadCounts, AThreadKeepsItsOwnCountThroughItsFirstAttentionCall) {
  const auto x = torch::randn({1, 2, 64, 16});
  const ThreadCount restored_afterwards(at::get_num_threads());
  std::promise<void> own_count_set, other_count_set;
  int count_after_call = 0;
  std::thread caller([&] {
    const ThreadCount own(1);
    own_count_set.set_value();
    other_count_set.get_future().wait();
    attn::scaled_dot_product_attention(x, x, x);
    count_after_call = at::get_num_threads();
  });
  own_count_set.get_future().wait();
  at::set_num_threads(2);
  other_count_set.set_value();
  caller.join();
  EXPECT_EQ(count_after_call, 1);
}

TEST(SharedModuleThreads, EightThreadsOfInferenceMatchSerialCallsBitwise) {
  auto mha = make_module();
  // Lengths up to 300: the rotary tables (first 256 positions) grow while
  // other threads read them.
  std::vector<torch::Tensor> inputs;
  for (int t = 0; t < kThreads; ++t) {
    inputs.push_back(torch::randn({2, 5 + 42 * t, 32}));
  }
  const auto forward = [](MultiHeadAttention module, const torch::Tensor& x, int t) {
    const auto [output, weights] = module(
        x, x, x, MultiHeadAttentionForwardOptions().is_causal(t % 2 == 0).need_weights(t % 3 == 0));
    return Result{output, weights};
  };
  std::vector<Result> serial;
  {
    const ThreadCount intra_op(1);
    const torch::NoGradGuard no_grad;
    for (int t = 0; t < kThreads; ++t) {
      serial.push_back(forward(mha, inputs[t], t));
    }
  }
  // A copy of the module with the same parameters and empty rotary tables.
  const auto shared = MultiHeadAttention(
      std::dynamic_pointer_cast<attn::MultiHeadAttentionImpl>(mha->clone()));
  std::vector<std::vector<Result>> concurrent(kThreads);
  run_in_threads([&](int t) {
    for (int repeat = 0; repeat < 3; ++repeat) {
      concurrent[t].push_back(forward(shared, inputs[t], t));
    }
  });
  for (int t = 0; t < kThreads; ++t) {
    for (const auto& result : concurrent[t]) {
      EXPECT_TRUE(torch::equal(result.output, serial[t].output)) << "thread " << t;
      ASSERT_EQ(result.weights.defined(), serial[t].weights.defined());
      if (result.weights.defined()) {
        EXPECT_TRUE(torch::equal(result.weights, serial[t].weights)) << "thread " << t;
      }
    }
  }
}

// A causal decoding of `sequence` (B, T, E) through `cache`: a prompt of 5
// tokens, then one token at a time. Returns the outputs (B, T, E).
torch::Tensor decode(MultiHeadAttention mha, const torch::Tensor& sequence, KVCache& cache) {
  const auto options = MultiHeadAttentionForwardOptions().kv_cache(&cache).is_causal(true);
  std::vector<torch::Tensor> outputs;
  const auto prompt = sequence.narrow(1, 0, 5);
  outputs.push_back(std::get<0>(mha(prompt, prompt, prompt, options)));
  for (int64_t i = 5; i < sequence.size(1); ++i) {
    const auto token = sequence.narrow(1, i, 1);
    outputs.push_back(std::get<0>(mha(token, token, token, options)));
  }
  return torch::cat(outputs, 1);
}

TEST(KVCacheThreads, EachThreadDecodingWithItsOwnCacheMatchesSerialDecoding) {
  auto mha = make_module();
  std::vector<torch::Tensor> sequences;
  for (int t = 0; t < kThreads; ++t) {
    sequences.push_back(torch::randn({1 + t % 2, 24, 32}));
  }
  std::vector<torch::Tensor> serial;
  {
    const ThreadCount intra_op(1);
    const torch::NoGradGuard no_grad;
    for (const auto& sequence : sequences) {
      KVCache cache;
      serial.push_back(decode(mha, sequence, cache));
    }
  }
  std::vector<torch::Tensor> concurrent(kThreads);
  run_in_threads([&](int t) {
    KVCache cache(/*max_length=*/24); // one per sequence, so one per thread
    concurrent[t] = decode(mha, sequences[t], cache);
  });
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_TRUE(torch::equal(concurrent[t], serial[t])) << "thread " << t;
  }
}

TEST(KVCacheThreads, ThreadsTakingTurnsOnOneCacheMatchOneThread) {
  // A cache is not thread-safe, but calls from different threads that do
  // not overlap are fine: here two threads decode the tokens of one
  // sequence alternately, each waiting for its turn under a mutex.
  auto mha = make_module();
  const auto sequence = torch::randn({2, 21, 32});
  torch::Tensor expected;
  {
    const ThreadCount intra_op(1);
    const torch::NoGradGuard no_grad;
    KVCache cache;
    expected = decode(mha, sequence, cache);
  }
  KVCache cache;
  const auto options = MultiHeadAttentionForwardOptions().kv_cache(&cache).is_causal(true);
  std::vector<torch::Tensor> outputs(sequence.size(1));
  std::mutex mutex;
  std::condition_variable turn_changed;
  int64_t next = 0; // the next token to decode; thread t takes those with next % 2 == t
  const auto take_turns = [&](int t) {
    const ThreadCount intra_op(1);
    const torch::NoGradGuard no_grad;
    while (true) {
      std::unique_lock<std::mutex> lock(mutex);
      turn_changed.wait(lock, [&] { return next >= sequence.size(1) || next % 2 == t; });
      if (next >= sequence.size(1)) {
        return;
      }
      // The prompt, tokens 0-4, in one call as decode() does.
      const int64_t count = next == 0 ? 5 : 1;
      const auto tokens = sequence.narrow(1, next, count);
      outputs[next] = std::get<0>(mha(tokens, tokens, tokens, options));
      next += count;
      turn_changed.notify_all();
    }
  };
  std::thread first(take_turns, 0), second(take_turns, 1);
  first.join();
  second.join();
  std::vector<torch::Tensor> decoded;
  for (const auto& output : outputs) {
    if (output.defined()) {
      decoded.push_back(output);
    }
  }
  EXPECT_TRUE(torch::equal(torch::cat(decoded, 1), expected));
  EXPECT_EQ(cache.length(), sequence.size(1));
}

} // namespace
