// ContextParallelMultiHeadAttention against attn::MultiHeadAttention on the
// whole sequence in one process: each test runs on every rank of a group
// that attn_launch_ranks starts. Every rank draws the same module and whole
// sequence, keeps its rows, and the gathered output and input gradient,
// and every parameter's gradient (summed over the ranks by the module),
// are compared with the single process's.

#include <attn/distributed/context_parallel.h>
#include <attn/distributed/context_parallel_multi_head_attention.h>
#include <attn/distributed/mappings.h>
#include <attn/kv_cache.h>
#include <attn/modules/multi_head_attention.h>

#include "distributed_test_support.h"
#include "test_support.h"

#include <algorithm>
#include <ostream>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

namespace attn::testing {
namespace {

namespace dist = attn::distributed;
using dist::ContextParallelForwardOptions;
using dist::ContextParallelMultiHeadAttention;
using dist::ContextParallelStrategy;
using dist::SequenceLayout;
using dist::SequenceSharding;

// The strategies every case runs with (all_to_all skips the cases whose
// head counts the ranks do not divide).
std::vector<ContextParallelStrategy> strategies() {
  return {ContextParallelStrategy::ring, ContextParallelStrategy::all_to_all};
}

struct ModuleCase {
  std::string name;
  MultiHeadAttentionOptions options = MultiHeadAttentionOptions(32, 4);
  int64_t length = 24; // T
  bool is_causal = false;
  c10::optional<int64_t> window;
  bool key_padding = false;
  SequenceLayout layout = SequenceLayout::zigzag;
  // The masks given as a MultiHeadAttention call's options, converted.
  bool from_attention_options = false;
  // Packed: document ids of the whole sequence.
  bool documents = false;
};

void PrintTo(const ModuleCase& test_case, std::ostream* stream) {
  *stream << test_case.name;
}

// Every mask and layout, grouped heads, rotary positions (which differ
// between a rank's local rows and their places in the sequence), lengths
// that the chunks do not divide (23 and 21 for 2 and 4 ranks) and the
// sequence-first layout.
std::vector<ModuleCase> cases() {
  NamedCases<ModuleCase> named;
  const auto add = [&](std::string name, auto&& customise) {
    named.add(std::move(name), customise);
  };
  const auto rotary = MultiHeadAttentionOptions(32, 4).rotary(RotaryEmbeddingOptions(8));
  add("plain", [](ModuleCase&) {});
  add("causal", [](ModuleCase& c) { c.is_causal = true; });
  add("causal_contiguous", [](ModuleCase& c) {
    c.is_causal = true;
    c.layout = SequenceLayout::contiguous;
  });
  add("grouped_query_causal", [](ModuleCase& c) {
    c.options = MultiHeadAttentionOptions(32, 8).num_kv_heads(2);
    c.is_causal = true;
  });
  add("multi_query",
      [](ModuleCase& c) { c.options = MultiHeadAttentionOptions(32, 4).num_kv_heads(1); });
  add("rotary_causal", [&](ModuleCase& c) {
    c.options = rotary;
    c.is_causal = true;
  });
  add("rotary_causal_contiguous", [&](ModuleCase& c) {
    c.options = rotary;
    c.is_causal = true;
    c.layout = SequenceLayout::contiguous;
  });
  add("partial_rotary_grouped_query", [](ModuleCase& c) {
    c.options = MultiHeadAttentionOptions(32, 4).num_kv_heads(2).rotary(
        RotaryEmbeddingOptions(4).interleaved(true));
  });
  add("key_padding", [](ModuleCase& c) { c.key_padding = true; });
  add("causal_key_padding_from_attention_options", [](ModuleCase& c) {
    c.is_causal = true;
    c.key_padding = true;
    c.from_attention_options = true;
  });
  add("window", [](ModuleCase& c) { c.window = 5; });
  add("causal_rotary_documents", [&](ModuleCase& c) {
    c.options = rotary;
    c.is_causal = true;
    c.documents = true;
  });
  add("uneven_rotary_documents_from_attention_options", [&](ModuleCase& c) {
    c.options = rotary;
    c.length = 23;
    c.documents = true;
    c.from_attention_options = true;
  });
  add("causal_window_rotary", [&](ModuleCase& c) {
    c.options = rotary;
    c.is_causal = true;
    c.window = 4;
  });
  add("no_bias", [](ModuleCase& c) { c.options = MultiHeadAttentionOptions(32, 4).bias(false); });
  add("uneven_rotary_causal", [&](ModuleCase& c) {
    c.options = rotary;
    c.length = 23;
    c.is_causal = true;
  });
  add("uneven_padding_window_contiguous", [](ModuleCase& c) {
    c.length = 21;
    c.key_padding = true;
    c.window = 6;
    c.layout = SequenceLayout::contiguous;
  });
  add("sequence_first", [](ModuleCase& c) {
    c.options = MultiHeadAttentionOptions(32, 4).batch_first(false);
    c.is_causal = true;
  });
  add("sequence_first_uneven_rotary", [](ModuleCase& c) {
    c.options = MultiHeadAttentionOptions(32, 4).batch_first(false).rotary(
        RotaryEmbeddingOptions(8));
    c.length = 23;
    c.is_causal = true;
    c.key_padding = true;
  });
  return named.cases;
}

// Only the order of the sums changes: float64 agrees to far below 1e-10,
// float32 to a few roundings of O(1) values.
Tolerance module_tolerance(torch::ScalarType dtype) {
  return dtype == torch::kFloat64 ? Tolerance{1e-10, 1e-10} : Tolerance{1e-5, 1e-5};
}

// The dimension of the sequence in the module's inputs.
int64_t sequence_dim(const MultiHeadAttentionOptions& options) {
  return options.batch_first() ? 1 : 0;
}

// The whole problem, drawn alike on every rank.
struct ModuleSequence {
  torch::Tensor x, padding, upstream;
  torch::Tensor document_ids = {}; // (B, T)
};

ModuleSequence draw_module_sequence(const ModuleCase& test_case, torch::ScalarType dtype) {
  const int64_t B = 2, T = test_case.length, E = test_case.options.embed_dim();
  const auto shape = test_case.options.batch_first() ? std::vector<int64_t>{B, T, E}
                                                     : std::vector<int64_t>{T, B, E};
  ModuleSequence whole{torch::randn(shape, dtype), {}, torch::randn(shape, dtype)};
  if (test_case.key_padding) {
    whole.padding = torch::rand({B, T}) < 0.3;
  }
  if (test_case.documents) {
    // Row 0: documents of 7 tokens; row 1: one token, then two documents.
    const auto t = torch::arange(T, torch::kLong);
    whole.document_ids = torch::stack({t.div(7, "floor"), t.ge(1).to(torch::kLong) + t.ge(15)});
  }
  return whole;
}

// The whole module's output for the whole sequence and its input gradient;
// the parameters' gradients are left in `full`.
std::tuple<torch::Tensor, torch::Tensor> one_process(
    MultiHeadAttention& full,
    const ModuleCase& test_case,
    const ModuleSequence& whole) {
  const auto x = whole.x.clone().requires_grad_();
  const auto options = MultiHeadAttentionForwardOptions()
                           .is_causal(test_case.is_causal)
                           .window(test_case.window)
                           .key_padding_mask(whole.padding)
                           .document_ids(whole.document_ids)
                           .need_weights(false);
  const auto out = std::get<0>(full(x, x, x, options));
  (out * whole.upstream).sum().backward();
  return {out.detach(), x.grad()};
}

ContextParallelForwardOptions forward_options(
    const ModuleCase& test_case,
    const SequenceSharding& sharding,
    const torch::Tensor& local_padding,
    const torch::Tensor& document_ids,
    ContextParallelStrategy strategy) {
  if (test_case.from_attention_options) {
    return ContextParallelForwardOptions(
               sharding,
               MultiHeadAttentionForwardOptions()
                   .is_causal(test_case.is_causal)
                   .window(test_case.window)
                   .key_padding_mask(local_padding)
                   .document_ids(document_ids))
        .strategy(strategy);
  }
  return ContextParallelForwardOptions(sharding)
      .is_causal(test_case.is_causal)
      .window(test_case.window)
      .key_padding_mask(local_padding)
      .document_ids(document_ids)
      .strategy(strategy);
}

// The module's output and input gradient, gathered into the whole sequence.
std::tuple<torch::Tensor, torch::Tensor> context_parallel(
    ContextParallelMultiHeadAttention& parallel,
    const ModuleCase& test_case,
    const ModuleSequence& whole,
    ContextParallelStrategy strategy) {
  const SequenceSharding sharding(test_case.length, group().size(), test_case.layout);
  const auto dim = sequence_dim(test_case.options);
  const auto local = [&](const torch::Tensor& tensor, int64_t tensor_dim) {
    return sharding.shard(tensor, tensor_dim, group().rank());
  };
  const auto x = local(whole.x, dim).requires_grad_();
  const auto padding = whole.padding.defined() ? local(whole.padding, 1) : torch::Tensor();
  const auto [out, weights] = parallel(
      x, forward_options(test_case, sharding, padding, whole.document_ids, strategy));
  EXPECT_EQ(out.sizes(), x.sizes());
  EXPECT_FALSE(weights.defined());
  (out * local(whole.upstream, dim)).sum().backward();
  const auto gathered = [&](const torch::Tensor& part) {
    return dist::gather_sequence(part, dim, sharding, group());
  };
  return {gathered(out.detach()), gathered(x.grad())};
}

using Param = std::tuple<ModuleCase, ContextParallelStrategy, torch::ScalarType>;

class ContextParallelModule : public ::testing::TestWithParam<Param> {};

TEST_P(ContextParallelModule, OutputAndGradientsMatchTheWholeModule) {
  const auto& [test_case, strategy, dtype] = GetParam();
  const auto H = test_case.options.num_heads();
  const auto H_kv = test_case.options.num_kv_heads().value_or(H);
  if (strategy == ContextParallelStrategy::all_to_all &&
      (H % group().size() != 0 || H_kv % group().size() != 0)) {
    GTEST_SKIP() << "all_to_all needs the ranks to divide the head counts";
  }
  torch::manual_seed(7);
  MultiHeadAttention full(test_case.options);
  full->to(dtype);
  ContextParallelMultiHeadAttention parallel(full, group());
  const auto whole = draw_module_sequence(test_case, dtype);

  const auto [expected_out, expected_dx] = one_process(full, test_case, whole);
  const auto [actual_out, actual_dx] = context_parallel(parallel, test_case, whole, strategy);
  const auto tolerance = module_tolerance(dtype);
  EXPECT_CLOSE(actual_out, expected_out, tolerance);
  EXPECT_CLOSE(actual_dx, expected_dx, tolerance);
  const auto expected_parameters = full->named_parameters();
  for (const auto& parameter : parallel->named_parameters()) {
    SCOPED_TRACE(parameter.key());
    EXPECT_TRUE(torch::equal(parameter.value(), expected_parameters[parameter.key()]));
    EXPECT_CLOSE(parameter.value().grad(), expected_parameters[parameter.key()].grad(), tolerance);
  }
}

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  std::ostringstream name;
  name << std::get<0>(info.param).name << "_" << std::get<1>(info.param) << "_"
       << (std::get<2>(info.param) == torch::kFloat64 ? "float64" : "float32");
  return name.str();
}

INSTANTIATE_TEST_SUITE_P(
    Cases,
    ContextParallelModule,
    ::testing::Combine(
        ::testing::ValuesIn(cases()),
        ::testing::ValuesIn(strategies()),
        ::testing::Values(torch::kFloat64, torch::kFloat32)),
    param_name);

TEST(ContextParallelModulePadding, RowsPastTheEndAreZerosAndAddNoGradient) {
  const SequenceSharding sharding(23, group().size());
  torch::manual_seed(5);
  MultiHeadAttention full(MultiHeadAttentionOptions(16, 2).rotary(RotaryEmbeddingOptions(8)));
  full->to(torch::kFloat64);
  ContextParallelMultiHeadAttention parallel(full, group());
  const auto x = torch::randn({2, 23, 16}, torch::kFloat64);
  std::get<0>(full(x, x, x, MultiHeadAttentionForwardOptions().is_causal(true))).sum().backward();

  // A loss over every local row, padding included.
  const auto out = std::get<0>(parallel(
      sharding.shard(x, 1, group().rank()),
      ContextParallelForwardOptions(sharding).is_causal(true)));
  out.sum().backward();
  int64_t row = 0;
  for (const auto& segment : sharding.segments(group().rank())) {
    const auto inside = std::clamp<int64_t>(23 - segment.start, 0, segment.length);
    EXPECT_TRUE(torch::all(out.narrow(1, row + inside, segment.length - inside) == 0).item<bool>());
    row += segment.length;
  }
  const auto expected = full->named_parameters();
  for (const auto& parameter : parallel->named_parameters()) {
    SCOPED_TRACE(parameter.key());
    EXPECT_CLOSE(
        parameter.value().grad(), expected[parameter.key()].grad(), (Tolerance{1e-10, 1e-10}));
  }
}

TEST(ContextParallelModuleConstruction, FromOptionsIsTheWholeModuleOfTheSameRandomState) {
  const auto options = MultiHeadAttentionOptions(16, 4).num_kv_heads(2);
  torch::manual_seed(11);
  MultiHeadAttention full(options);
  const auto drawn_after_full = torch::rand({4});
  torch::manual_seed(11);
  ContextParallelMultiHeadAttention parallel(options, group());
  EXPECT_TRUE(torch::equal(torch::rand({4}), drawn_after_full));
  const auto expected = full->named_parameters();
  ASSERT_EQ(parallel->named_parameters().size(), expected.size());
  for (const auto& parameter : parallel->named_parameters()) {
    SCOPED_TRACE(parameter.key());
    EXPECT_TRUE(torch::equal(parameter.value(), expected[parameter.key()]));
  }
}

TEST(ContextParallelModuleConstruction, CopiesTheParametersAndTheModeOfTheWholeModule) {
  torch::manual_seed(2);
  MultiHeadAttention full(MultiHeadAttentionOptions(16, 2));
  full->to(torch::kFloat64);
  full->eval();
  ContextParallelMultiHeadAttention parallel(full, group());
  EXPECT_FALSE(parallel->is_training());
  for (const auto& parameter : parallel->named_parameters()) {
    EXPECT_EQ(parameter.value().scalar_type(), torch::kFloat64) << parameter.key();
  }
  // A copy: changing one leaves the other.
  torch::NoGradGuard no_grad;
  parallel->q_proj->weight.add_(1);
  EXPECT_FALSE(torch::equal(parallel->q_proj->weight, full->q_proj->weight));
}

// torch::nn::Cloneable's clone: the same parameters in storage of its own,
// the same output, on the same group.
TEST(ContextParallelModuleConstruction, CloneIsAnIndependentCopyThatComputesTheSame) {
  torch::manual_seed(4);
  ContextParallelMultiHeadAttention parallel(
      MultiHeadAttentionOptions(16, 4).num_kv_heads(2).rotary(RotaryEmbeddingOptions(4)), group());
  const auto copy = std::dynamic_pointer_cast<dist::ContextParallelMultiHeadAttentionImpl>(
      parallel->clone());
  ASSERT_TRUE(copy);
  attn::testing::expect_same_parameters_in_own_tensors(*copy, *parallel);
  const SequenceSharding sharding(6 * group().size(), group().size());
  const auto x = torch::randn({2, sharding.local_length(), 16});
  const auto options = ContextParallelForwardOptions(sharding).is_causal(true);
  EXPECT_TRUE(
      torch::equal(std::get<0>(copy->forward(x, options)), std::get<0>(parallel(x, options))));
  torch::NoGradGuard no_grad;
  copy->q_proj->weight.add_(1);
  EXPECT_FALSE(torch::equal(copy->q_proj->weight, parallel->q_proj->weight));
}

TEST(ContextParallelModulePrinting, NamesTheHeadsAndTheRank) {
  torch::manual_seed(0);
  ContextParallelMultiHeadAttention parallel(
      MultiHeadAttentionOptions(32, 8).num_kv_heads(2).rotary(RotaryEmbeddingOptions(4)), group());
  std::ostringstream printed;
  parallel->pretty_print(printed);
  EXPECT_EQ(
      printed.str(),
      "attn::distributed::ContextParallelMultiHeadAttention(embed_dim=32, num_heads=8, "
      "num_kv_heads=2, rotary_dim=4, rank=" +
          std::to_string(group().rank()) + ", world_size=" + std::to_string(group().size()) + ")");
}

TEST(ContextParallelModuleCommunication, ForwardAndBackwardMakeTheDocumentedCollectives) {
  const int64_t W = group().size();
  const SequenceSharding sharding(8 * W, W);
  torch::manual_seed(0);
  ContextParallelMultiHeadAttention parallel(MultiHeadAttentionOptions(16, 4), group());
  const auto x = torch::randn({1, sharding.local_length(), 16}).requires_grad_();
  dist::reset_communication_count();
  const auto out = std::get<0>(parallel(x, ContextParallelForwardOptions(sharding)));
  // The sizes' all-gather, then W - 1 steps of a key and a value.
  EXPECT_EQ(dist::communication_count().collectives, 1 + 2 * (W - 1));
  dist::reset_communication_count();
  out.sum().backward();
  // W - 1 steps of the keys and values, W of their gradients, and one
  // all-reduce for each of the 8 parameters; nothing with one rank.
  EXPECT_EQ(dist::communication_count().collectives, W == 1 ? 0 : 2 * (W - 1) + 2 * W + 8);
}

class ContextParallelModuleErrors : public ::testing::Test {
 protected:
  const SequenceSharding sharding{8 * group().size(), group().size()};
};

TEST_F(ContextParallelModuleErrors, OptionsThatCannotBeSplitBySequenceAreRefused) {
  const auto base = MultiHeadAttentionOptions(16, 2);
  EXPECT_ATTN_ERROR(
      ContextParallelMultiHeadAttention(MultiHeadAttentionOptions(base).add_bias_kv(true), group()),
      "attn::distributed::ContextParallelMultiHeadAttention: add_bias_kv cannot be split by "
      "sequence, expected add_bias_kv=false, got true");
  EXPECT_ATTN_ERROR(
      ContextParallelMultiHeadAttention(
          MultiHeadAttention(MultiHeadAttentionOptions(base).add_zero_attn(true)), group()),
      "add_zero_attn cannot be split by sequence, expected add_zero_attn=false, got true");
  EXPECT_ATTN_ERROR(
      ContextParallelMultiHeadAttention(MultiHeadAttentionOptions(base).kdim(8), group()),
      "self-attention only, expected kdim and vdim equal to embed_dim=16, got kdim=8 and vdim=16");
  EXPECT_ATTN_ERROR(
      ContextParallelMultiHeadAttention(MultiHeadAttentionOptions(base).vdim(4), group()),
      "got kdim=16 and vdim=4");
}

TEST_F(ContextParallelModuleErrors, DropoutIsRefusedWhileTrainingOnly) {
  torch::manual_seed(0);
  ContextParallelMultiHeadAttention parallel(
      MultiHeadAttentionOptions(16, 2).dropout(0.1), group());
  const auto x = torch::randn({1, sharding.local_length(), 16});
  EXPECT_ATTN_ERROR(
      parallel(x, ContextParallelForwardOptions(sharding)),
      "attention dropout cannot be split by sequence, expected dropout=0 or eval(), got "
      "dropout=0.1 while training");
  parallel->eval();
  EXPECT_EQ(std::get<0>(parallel(x, ContextParallelForwardOptions(sharding))).sizes(), x.sizes());
}

TEST_F(ContextParallelModuleErrors, AttnMaskAndKVCacheAreRefused) {
  EXPECT_ATTN_ERROR(
      ContextParallelForwardOptions(
          sharding,
          MultiHeadAttentionForwardOptions().attn_mask(torch::ones({8, 8}, torch::kBool))),
      "attn::distributed::ContextParallelMultiHeadAttention: an attn_mask of arbitrary (query, "
      "key) pairs cannot be split by sequence, expected none (is_causal, window and "
      "key_padding_mask can be), got one of sizes [8, 8]");
  KVCache cache;
  EXPECT_ATTN_ERROR(
      ContextParallelForwardOptions(sharding, MultiHeadAttentionForwardOptions().kv_cache(&cache)),
      "a kv_cache cannot be split by sequence, expected none, got one");
  EXPECT_ATTN_ERROR(
      ContextParallelForwardOptions(
          sharding, MultiHeadAttentionForwardOptions().cu_seqlens(torch::tensor({0, 8}))),
      "cu_seqlens pack one row, which is split by sequence here: give the whole sequence's "
      "document_ids instead");
  EXPECT_ATTN_ERROR(
      ContextParallelForwardOptions(
          sharding, MultiHeadAttentionForwardOptions().key_padding_mask(torch::zeros({1, 8}))),
      "key_padding_mask must be bool (true = padding) to be split by sequence, got Float");
}

TEST_F(ContextParallelModuleErrors, InputsThatDoNotFitAreNamed) {
  torch::manual_seed(0);
  ContextParallelMultiHeadAttention parallel(MultiHeadAttentionOptions(16, 2), group());
  const auto N = sharding.local_length();
  const auto x = torch::randn({1, N, 16});
  const auto options = ContextParallelForwardOptions(sharding);
  EXPECT_ATTN_ERROR(
      parallel(x.narrow(1, 0, N - 1), options),
      "expected x_local (B, N, E) with N = " + std::to_string(N) + " (this rank's rows of the " +
          std::to_string(sharding.length()) + "-token sequence) and E = 16, got [1, " +
          std::to_string(N - 1) + ", 16]");
  EXPECT_ATTN_ERROR(
      parallel(x.to(torch::kFloat64), options),
      "expected x_local with the module's dtype Float on cpu, got Double on cpu");
  EXPECT_ATTN_ERROR(
      parallel(x, ContextParallelForwardOptions(SequenceSharding(8, group().size() + 1))),
      "expected a sharding for the group's " + std::to_string(group().size()) +
          " ranks, got one for " + std::to_string(group().size() + 1));
  EXPECT_ATTN_ERROR(parallel(torch::Tensor(), options), "expected x_local to be a defined tensor");
}

} // namespace
} // namespace attn::testing
