// attn::distributed against one process: each test runs on every rank of a
// group that attn_launch_ranks starts (RANK, WORLD_SIZE, MASTER_ADDR and
// MASTER_PORT set), and compares the tensor-parallel module's output and
// gathered gradients with attn::MultiHeadAttention's on the same inputs.
// Every rank makes the same random draws, so all hold the same full module
// and inputs.

#include <attn/distributed/mappings.h>
#include <attn/distributed/process_group.h>
#include <attn/distributed/tensor_parallel_multi_head_attention.h>
#include <attn/interop.h>
#include <attn/kv_cache.h>

#include "distributed_test_support.h"
#include "test_support.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <ostream>
#include <string>
#include <thread>

namespace attn::testing {
namespace {

namespace dist = attn::distributed;

// Splitting the heads changes only the order of the sums over heads (and
// over ranks): float64 agrees to far below 1e-10, float32 to a few
// roundings of O(1) values.
Tolerance parallel_tolerance(torch::ScalarType dtype) {
  return dtype == torch::kFloat64 ? Tolerance{1e-10, 1e-10} : Tolerance{1e-5, 1e-5};
}

struct Case {
  std::string name;
  MultiHeadAttentionOptions options;
  bool is_causal = false;
  c10::optional<int64_t> window;
  // 0: no attn_mask; 3: (B·H, L, S); 4: (B, H, L, S), with key padding.
  int mask_dims = 0;
  // Rows packing several documents (document_ids).
  bool documents = false;
};

// gtest names a failing case by this instead of its bytes.
void PrintTo(const Case& test_case, std::ostream* stream) {
  *stream << test_case.name;
}

Case make_case(std::string name, MultiHeadAttentionOptions options) {
  return {std::move(name), std::move(options), /*is_causal=*/false, /*window=*/c10::nullopt,
          /*mask_dims=*/0, /*documents=*/false};
}

std::vector<Case> cases() {
  const auto base = MultiHeadAttentionOptions(32, 4);
  auto causal = make_case("causal", base);
  causal.is_causal = true;
  auto causal_window = make_case("causal_window", base);
  causal_window.is_causal = true;
  causal_window.window = 2;
  auto masked = make_case("masked", base);
  masked.mask_dims = 4;
  auto masked_flat = make_case("masked_flat_heads", base);
  masked_flat.mask_dims = 3;
  auto packed_documents = make_case(
      "packed_documents", MultiHeadAttentionOptions(32, 4).rotary(RotaryEmbeddingOptions(8)));
  packed_documents.is_causal = true;
  packed_documents.documents = true;
  return {
      make_case("plain", base),
      causal,
      causal_window,
      masked,
      masked_flat,
      make_case("grouped_query", MultiHeadAttentionOptions(32, 8).num_kv_heads(2)),
      make_case("rotary", MultiHeadAttentionOptions(32, 4).rotary(RotaryEmbeddingOptions(8))),
      packed_documents,
      make_case(
          "bias_kv_zero_attn",
          MultiHeadAttentionOptions(32, 4).add_bias_kv(true).add_zero_attn(true))};
}

class TensorParallelAttention
    : public ::testing::TestWithParam<std::tuple<Case, torch::ScalarType>> {};

TEST_P(TensorParallelAttention, OutputAndGatheredGradientsMatchOneProcess) {
  const auto& [test_case, dtype] = GetParam();
  const int64_t B = 2, L = 5, E = test_case.options.embed_dim();
  const auto H = test_case.options.num_heads();
  torch::manual_seed(7);
  MultiHeadAttention full(test_case.options);
  full->to(dtype);
  dist::TensorParallelMultiHeadAttention parallel(full, group());
  const auto x = torch::randn({B, L, E}, dtype).requires_grad_();
  const auto x_parallel = x.detach().clone().requires_grad_();
  auto forward_options = MultiHeadAttentionForwardOptions()
                             .is_causal(test_case.is_causal)
                             .window(test_case.window)
                             .need_weights(true);
  if (test_case.mask_dims == 3) {
    forward_options.attn_mask(torch::rand({B * H, L, L}, dtype) > 0.3);
  } else if (test_case.mask_dims == 4) {
    forward_options.attn_mask(torch::rand({B, H, L, L}, dtype))
        .key_padding_mask(torch::tensor(
            {{false, false, false, true, true}, {false, false, false, false, false}}));
  }
  if (test_case.documents) {
    forward_options.document_ids(torch::tensor({{0, 0, 1, 1, 1}, {0, 1, 1, 1, 2}}));
  }
  const auto [expected, expected_weights] = full(x, x, x, forward_options);
  const auto [actual, actual_weights] = parallel(
      x_parallel, x_parallel, x_parallel, forward_options);
  const auto tolerance = parallel_tolerance(dtype);
  EXPECT_CLOSE(actual, expected, tolerance);
  EXPECT_CLOSE(actual_weights, expected_weights, tolerance);

  const auto upstream = torch::randn_like(expected);
  (expected * upstream).sum().backward();
  (actual * upstream).sum().backward();
  EXPECT_CLOSE(x_parallel.grad(), x.grad(), tolerance);
  const auto gathered = parallel->gather();
  const auto expected_parameters = full->named_parameters();
  for (const auto& parameter : gathered->named_parameters()) {
    SCOPED_TRACE(parameter.key());
    EXPECT_CLOSE(parameter.value(), expected_parameters[parameter.key()], tolerance);
    EXPECT_CLOSE(parameter.value().grad(), expected_parameters[parameter.key()].grad(), tolerance);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Configurations,
    TensorParallelAttention,
    ::testing::Combine(
        ::testing::ValuesIn(cases()),
        ::testing::Values(torch::kFloat64, torch::kFloat32)),
    [](const auto& info) {
      return std::get<0>(info.param).name + "_" +
          (std::get<1>(info.param) == torch::kFloat64 ? "float64" : "float32");
    });

TEST(TensorParallelDecoding, KVCacheOfEachRanksHeadsDecodesAsOneProcess) {
  torch::manual_seed(3);
  const auto options = MultiHeadAttentionOptions(32, 8).num_kv_heads(4).rotary(
      RotaryEmbeddingOptions(4));
  MultiHeadAttention full(options);
  full->to(torch::kFloat64);
  dist::TensorParallelMultiHeadAttention parallel(full, group());
  full->eval();
  parallel->eval();
  torch::NoGradGuard no_grad;
  KVCache full_cache, parallel_cache;
  const auto prompt = torch::randn({2, 4, 32}, torch::kFloat64);
  const auto causal = MultiHeadAttentionForwardOptions().is_causal(true).need_weights(true);
  full(prompt, prompt, prompt, MultiHeadAttentionForwardOptions(causal).kv_cache(&full_cache));
  parallel(
      prompt, prompt, prompt, MultiHeadAttentionForwardOptions(causal).kv_cache(&parallel_cache));
  for (int step = 0; step < 8; ++step) {
    SCOPED_TRACE("decoding step " + std::to_string(step));
    const auto token = torch::randn({2, 1, 32}, torch::kFloat64);
    const auto [expected, expected_weights] = full(
        token, token, token, MultiHeadAttentionForwardOptions(causal).kv_cache(&full_cache));
    const auto [actual, actual_weights] = parallel(
        token, token, token, MultiHeadAttentionForwardOptions(causal).kv_cache(&parallel_cache));
    EXPECT_CLOSE(actual, expected, parallel_tolerance(torch::kFloat64));
    EXPECT_CLOSE(actual_weights, expected_weights, parallel_tolerance(torch::kFloat64));
  }
}

// A module Python trained (the state_dict of tests/fixtures/python, written
// by torch.save) splits over the ranks, computes what it computes whole,
// and gathers back to exactly the loaded parameters.
TEST(TensorParallelCheckpoints, PythonStateDictSplitsAndGathersBackExactly) {
  MultiHeadAttention full(MultiHeadAttentionOptions(16, 4).add_bias_kv(true).add_zero_attn(true));
  attn::load_pytorch_state_dict(
      *full, std::string(ATTN_TEST_FIXTURES) + "/python/block_with_bias_kv.pt", "attention");
  full->eval();
  dist::TensorParallelMultiHeadAttention parallel(full, group());
  EXPECT_FALSE(parallel->is_training());
  torch::manual_seed(2);
  const auto x = torch::randn({2, 7, 16});
  const auto weights = MultiHeadAttentionForwardOptions().need_weights(true);
  const auto [expected, expected_weights] = full(x, x, x, weights);
  const auto [actual, actual_weights] = parallel(x, x, x, weights);
  EXPECT_CLOSE(actual, expected, parallel_tolerance(torch::kFloat32));
  EXPECT_CLOSE(actual_weights, expected_weights, parallel_tolerance(torch::kFloat32));
  const auto loaded = full->named_parameters();
  for (const auto& parameter : parallel->gather()->named_parameters()) {
    EXPECT_TRUE(torch::equal(parameter.value(), loaded[parameter.key()])) << parameter.key();
  }
}

// A model built of these layers draws, after each, what a single process
// draws after the whole layer: the layers after it start the same.
TEST(TensorParallelCheckpoints, SplittingLeavesTheRandomStateAsTheWholeLayerDoes) {
  torch::manual_seed(3);
  MultiHeadAttention whole(MultiHeadAttentionOptions(32, 4));
  const auto after_whole = torch::rand({8});
  torch::manual_seed(3);
  dist::TensorParallelMultiHeadAttention parallel(MultiHeadAttentionOptions(32, 4), group());
  EXPECT_TRUE(torch::equal(torch::rand({8}), after_whole));
}

// torch::nn::Cloneable's clone: the rank's part in storage of its own, the
// same output, on the same group.
TEST(TensorParallelCheckpoints, CloneIsAnIndependentCopyThatComputesTheSame) {
  torch::manual_seed(5);
  dist::TensorParallelMultiHeadAttention parallel(
      MultiHeadAttentionOptions(32, 4 * group().size()).num_kv_heads(2).add_bias_kv(true), group());
  const auto copy = std::dynamic_pointer_cast<dist::TensorParallelMultiHeadAttentionImpl>(
      parallel->clone());
  ASSERT_TRUE(copy);
  attn::testing::expect_same_parameters_in_own_tensors(*copy, *parallel);
  // 4 query heads per rank; the 2 key/value heads split, or each copied on
  // W / 2 ranks.
  const int64_t W = group().size();
  for (const auto* module : {parallel.get(), copy.get()}) {
    EXPECT_EQ(module->local_heads(), 4);
    EXPECT_EQ(module->local_kv_heads(), W <= 2 ? 2 / W : 1);
    EXPECT_EQ(module->kv_ranks_per_head(), W <= 2 ? 1 : W / 2);
  }
  const auto x = torch::randn({2, 5, 32});
  const auto weights = MultiHeadAttentionForwardOptions().is_causal(true).need_weights(true);
  const auto [out, w] = copy->forward(x, x, x, weights);
  const auto [expected, expected_w] = parallel(x, x, x, weights);
  EXPECT_TRUE(torch::equal(out, expected));
  EXPECT_TRUE(torch::equal(w, expected_w));
  torch::NoGradGuard no_grad;
  copy->q_proj->weight.add_(1);
  EXPECT_FALSE(torch::equal(copy->q_proj->weight, parallel->q_proj->weight));
}

// shard() and gather() of a per-parameter tensor (an optimizer's moment)
// are each other's inverse, and gather() of the parameters is the whole
// module's.
TEST(TensorParallelCheckpoints, ShardAndGatherOfPerParameterTensorsAreInverse) {
  torch::manual_seed(4);
  MultiHeadAttention whole(MultiHeadAttentionOptions(32, 4).num_kv_heads(1).add_bias_kv(true));
  dist::TensorParallelMultiHeadAttention parallel(whole, group());
  for (const auto& parameter : whole->named_parameters()) {
    const auto moment = torch::randn_like(parameter.value());
    const auto part = parallel->shard(parameter.key(), moment);
    EXPECT_EQ(part.sizes(), parallel->named_parameters()[parameter.key()].sizes());
    EXPECT_TRUE(torch::equal(parallel->gather(parameter.key(), part), moment)) << parameter.key();
  }
  EXPECT_THROW(parallel->shard("q_proj.weight", torch::zeros({3, 32})), c10::Error);
}

// The whole module's squared gradient norm, each key/value head copied on
// several ranks and out_proj's bias counted once.
TEST(TensorParallelCheckpoints, SquaredGradientNormIsTheWholeModules) {
  torch::manual_seed(6);
  MultiHeadAttention whole(MultiHeadAttentionOptions(32, 4).num_kv_heads(1));
  dist::TensorParallelMultiHeadAttention parallel(whole, group());
  const auto x = torch::randn({2, 5, 32});
  std::get<0>(whole(x, x, x)).square().sum().backward();
  std::get<0>(parallel(x, x, x)).square().sum().backward();
  double expected = 0.0;
  for (const auto& parameter : whole->parameters()) {
    expected += parameter.grad().to(torch::kDouble).square().sum().item<double>();
  }
  EXPECT_NEAR(parallel->squared_gradient_norm().item<double>(), expected, 1e-6 * expected);
}

TEST(TensorParallelDropout, SameSeedGivesTheSameOutputEveryRun) {
  torch::manual_seed(5);
  dist::TensorParallelMultiHeadAttention parallel(
      MultiHeadAttentionOptions(32, 4).dropout(0.5), group());
  const auto x = torch::randn({2, 6, 32});
  torch::manual_seed(11);
  const auto first = std::get<0>(parallel(x, x, x));
  torch::manual_seed(11);
  const auto second = std::get<0>(parallel(x, x, x));
  EXPECT_TRUE(torch::equal(first, second));
  // The dropout is live: a third draw differs.
  EXPECT_FALSE(torch::equal(std::get<0>(parallel(x, x, x)), first));
}

TEST(TensorParallelMappings, ConjugatePairsSumGatherAndScatter) {
  const auto W = group().size(), r = group().rank();
  const auto part =
      torch::full({2, 3}, static_cast<double>(r + 1), torch::kFloat64).requires_grad_();
  const auto sum = dist::reduce_from_parallel(part, group());
  EXPECT_CLOSE(sum, torch::full({2, 3}, W * (W + 1) / 2.0, torch::kFloat64), Tolerance{});
  const auto whole = dist::gather_from_parallel(part, 1, group());
  ASSERT_EQ(whole.size(1), 3 * W);
  EXPECT_CLOSE(dist::scatter_to_parallel(whole, 1, group()), part, Tolerance{});
  // copy_to_parallel's backward sums the ranks' gradients.
  const auto replicated = torch::ones({4}, torch::kFloat64).requires_grad_();
  (dist::copy_to_parallel(replicated, group()) * static_cast<double>(r + 1)).sum().backward();
  EXPECT_CLOSE(
      replicated.grad(), torch::full({4}, W * (W + 1) / 2.0, torch::kFloat64), Tolerance{});
}

// docs/DISTRIBUTED.md's count for a self-attention layer: forward, the
// query's sizes (9 int64), the output's all-reduce (B·L·E elements) and,
// with weights, the rank's B·H/W·L·S of them; backward, the input
// gradient's all-reduce (B·L·E).
TEST(TensorParallelCommunication, SelfAttentionContributesTheDocumentedBytes) {
  const int64_t B = 2, L = 6, E = 32, H = 4 * group().size(), element = 4;
  const auto local_heads = H / group().size();
  dist::TensorParallelMultiHeadAttention parallel(MultiHeadAttentionOptions(E, H), group());
  const auto x = torch::randn({B, L, E}).requires_grad_();
  dist::reset_communication_count();
  const auto output = std::get<0>(
      parallel(x, x, x, MultiHeadAttentionForwardOptions().need_weights(true)));
  auto count = dist::communication_count();
  EXPECT_EQ(count.collectives, 3);
  EXPECT_EQ(count.bytes, 9 * 8 + B * L * E * element + B * local_heads * L * L * element);
  dist::reset_communication_count();
  output.sum().backward();
  count = dist::communication_count();
  EXPECT_EQ(count.collectives, 1);
  EXPECT_EQ(count.bytes, B * L * E * element);
  dist::reset_communication_count();
  parallel(x, x, x); // no weights by default
  count = dist::communication_count();
  EXPECT_EQ(count.collectives, 2);
  EXPECT_EQ(count.bytes, 9 * 8 + B * L * E * element);
}

TEST(TensorParallelErrors, HeadsNotDivisibleByTheRanksAreRefused) {
  if (group().size() == 1) {
    GTEST_SKIP() << "one rank divides every head count";
  }
  const int64_t H = group().size() + 1;
  EXPECT_ATTN_ERROR(
      dist::TensorParallelMultiHeadAttention(MultiHeadAttentionOptions(8 * H, H), group()),
      "num_heads must be divisible by the number of ranks, got num_heads=" + std::to_string(H));
}

TEST(TensorParallelErrors, RanksThatDisagreeOnTheQuerySizesFailOnEveryRank) {
  dist::TensorParallelMultiHeadAttention parallel(
      MultiHeadAttentionOptions(16, 4 * group().size()), group());
  const auto x = torch::randn({1, 3 + group().rank(), 16});
  EXPECT_ATTN_ERROR(
      parallel(x, x, x), "the ranks disagree on the sizes of the query: rank 0 has [1, 3, 16]");
}

// Sets an environment variable for one scope.
class ScopedVariable {
 public:
  ScopedVariable(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) {
      old_ = old;
    }
    value ? setenv(name, value, 1) : unsetenv(name);
  }
  ~ScopedVariable() { old_ ? setenv(name_, old_->c_str(), 1) : unsetenv(name_); }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST(TensorParallelErrors, MissingOrMalformedLaunchVariablesAreNamed) {
  for (const char* name : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) {
    ScopedVariable missing(name, nullptr);
    EXPECT_ATTN_ERROR(
        dist::init_process_group(), std::string("environment variable ") + name + " is not set");
  }
  ScopedVariable malformed("RANK", "one");
  EXPECT_ATTN_ERROR(
      dist::init_process_group(), "environment variable RANK must be an integer in [0, ");
}

// On rank 0 of two, with rank 1 gone or silent: an all-reduce that must
// fail with a message naming it and `timeout`. Returns how long it took.
std::chrono::steady_clock::duration failing_all_reduce(const dist::Group& group) {
  const auto start = std::chrono::steady_clock::now();
  try {
    dist::reduce_from_parallel(torch::ones({8}), group);
    ADD_FAILURE() << "the all-reduce succeeded without rank 1";
  } catch (const c10::Error& error) {
    std::printf("rank 0: %s\n", error.what_without_backtrace());
    EXPECT_THAT(
        error.what_without_backtrace(),
        ::testing::HasSubstr(
            "attn::distributed: all_reduce failed on rank 0 of 2 (timeout " +
            std::to_string(group.timeout().count()) + " ms)"));
  }
  return std::chrono::steady_clock::now() - start;
}

// Ends the process with the test's result, without destroying the group:
// that would wait for the rank that is gone or for the unfinished
// all-reduce.
[[noreturn]] void exit_with_the_test_result() {
  std::fflush(stdout);
  std::_Exit(::testing::Test::HasFailure() ? 1 : 0);
}

// Run alone (ctest's distributed.silent_rank): rank 1 stays alive but
// makes no call, so only the timeout can end rank 0's wait.
TEST(DistributedFailure, SilentRankFailsTheOthersAtTheTimeout) {
  const dist::Group one_second(group().process_group(), std::chrono::seconds(1));
  if (group().rank() == 1) {
    std::this_thread::sleep_for(std::chrono::seconds(4));
    std::_Exit(0);
  }
  const auto elapsed = failing_all_reduce(one_second);
  EXPECT_GE(elapsed, std::chrono::milliseconds(900));
  EXPECT_LT(elapsed, std::chrono::seconds(3));
  exit_with_the_test_result();
}

// Run alone (ctest's distributed.rank_exits_early): rank 1 leaves, and the
// group cannot be used after.
TEST(DistributedFailure, RankThatExitsEarlyFailsTheOthersWithinTheTimeout) {
  const dist::Group three_seconds(group().process_group(), std::chrono::seconds(3));
  if (group().rank() == 1) {
    std::_Exit(0);
  }
  // Within the timeout, and a margin for a loaded machine.
  EXPECT_LT(failing_all_reduce(three_seconds), std::chrono::seconds(5));
  exit_with_the_test_result();
}

} // namespace
} // namespace attn::testing
