// Context parallelism against one process: each test runs on every rank of
// a group that attn_launch_ranks starts. Every rank draws the same whole
// sequence, keeps its rows as SequenceSharding lays them out, and the
// gathered output and gradients are compared with attn's fused attention
// over the whole sequence in one process.

#include <attn/block_mask.h>
#include <attn/distributed/context_parallel.h>
#include <attn/distributed/mappings.h>
#include <attn/functional.h>

#include "distributed_test_support.h"
#include "test_support.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ostream>
#include <sstream>
#include <string>
#include <tuple>

namespace attn::testing {
namespace {

namespace dist = attn::distributed;
using dist::ContextParallelOptions;
using dist::ContextParallelStrategy;
using dist::SequenceLayout;
using dist::SequenceSharding;

struct Case {
  std::string name;
  int64_t length = 24; // T
  int64_t heads = 4;   // H
  int64_t kv_heads = 4;
  int64_t value_dim = 8; // Dv; D is 8
  bool is_causal = false;
  c10::optional<int64_t> window;
  int64_t query_offset = 0;
  bool key_padding = false;
  bool second_sequence_all_padding = false; // its queries see no key
  bool documents = false;                   // packed: document_ids of the whole sequence
  SequenceLayout layout = SequenceLayout::zigzag;
  ContextParallelStrategy strategy = ContextParallelStrategy::ring;
};

void PrintTo(const Case& test_case, std::ostream* stream) {
  *stream << test_case.name;
}

// The ring cases: every mask and layout, grouped heads, and lengths that
// the chunks do not divide (24 divides into 2W chunks for W = 2 and 4;
// 23 and 21 do not).
std::vector<Case> ring_cases() {
  NamedCases<Case> named;
  const auto add = [&](std::string name, auto&& customise) {
    named.add(std::move(name), customise);
  };
  add("plain", [](Case&) {});
  add("plain_contiguous", [](Case& c) { c.layout = SequenceLayout::contiguous; });
  add("causal", [](Case& c) { c.is_causal = true; });
  add("causal_contiguous", [](Case& c) {
    c.is_causal = true;
    c.layout = SequenceLayout::contiguous;
  });
  add("causal_grouped_heads", [](Case& c) {
    c.is_causal = true;
    c.kv_heads = 2;
  });
  add("multi_query", [](Case& c) { c.kv_heads = 1; });
  add("key_padding", [](Case& c) { c.key_padding = true; });
  add("causal_key_padding", [](Case& c) {
    c.is_causal = true;
    c.key_padding = true;
  });
  add("window", [](Case& c) { c.window = 5; });
  add("causal_window", [](Case& c) {
    c.is_causal = true;
    c.window = 4;
  });
  add("causal_query_offset", [](Case& c) {
    c.is_causal = true;
    c.query_offset = -3;
  });
  add("uneven_causal", [](Case& c) {
    c.length = 23;
    c.is_causal = true;
  });
  add("uneven_padding_window_contiguous", [](Case& c) {
    c.length = 21;
    c.key_padding = true;
    c.window = 6;
    c.layout = SequenceLayout::contiguous;
  });
  add("uneven_causal_key_padding", [](Case& c) {
    c.length = 23;
    c.is_causal = true;
    c.key_padding = true;
  });
  add("window_query_offset", [](Case& c) {
    c.window = 5;
    c.query_offset = 4;
  });
  add("value_width_differs", [](Case& c) {
    c.value_dim = 6;
    c.is_causal = true;
  });
  add("causal_documents", [](Case& c) {
    c.is_causal = true;
    c.documents = true;
  });
  add("documents_key_padding_contiguous", [](Case& c) {
    c.documents = true;
    c.key_padding = true;
    c.layout = SequenceLayout::contiguous;
  });
  add("uneven_causal_window_documents", [](Case& c) {
    c.length = 23;
    c.is_causal = true;
    c.window = 4;
    c.documents = true;
  });
  add("a_sequence_all_padding", [](Case& c) {
    c.key_padding = true;
    c.second_sequence_all_padding = true;
  });
  return named.cases;
}

// The ring cases for the all-to-all strategy, whose W (2 or 4) must divide
// the query and the key/value heads: twice as many heads of both, 8 and 8,
// or 8 and 4 in the grouped case. Multi-query attention (one key/value
// head) cannot be split over heads, and is left out.
std::vector<Case> all_to_all_cases() {
  std::vector<Case> cases;
  for (auto test_case : ring_cases()) {
    if (test_case.kv_heads == 1) {
      continue;
    }
    test_case.strategy = ContextParallelStrategy::all_to_all;
    test_case.heads *= 2;
    test_case.kv_heads *= 2;
    cases.push_back(test_case);
  }
  return cases;
}

// The whole problem, drawn alike on every rank.
struct WholeSequence {
  torch::Tensor query, key, value, padding, grad_out;
  torch::Tensor document_ids = {}; // (B, T)
};

WholeSequence draw(const Case& test_case, torch::ScalarType dtype) {
  torch::manual_seed(7);
  const int64_t B = 2, T = test_case.length, D = 8;
  const auto options = torch::TensorOptions().dtype(dtype);
  WholeSequence whole{
      torch::randn({B, test_case.heads, T, D}, options),
      torch::randn({B, test_case.kv_heads, T, D}, options),
      torch::randn({B, test_case.kv_heads, T, test_case.value_dim}, options), torch::Tensor(),
      torch::randn({B, test_case.heads, T, test_case.value_dim}, options)};
  if (test_case.key_padding) {
    whole.padding = torch::rand({B, T}) < 0.3;
  }
  if (test_case.second_sequence_all_padding) {
    whole.padding[1].fill_(true);
  }
  if (test_case.documents) {
    // Row 0: documents of 7 tokens; row 1: one token, then two documents.
    const auto t = torch::arange(T, torch::kLong);
    whole.document_ids = torch::stack({t.div(7, "floor"), t.ge(1).to(torch::kLong) + t.ge(15)});
  }
  return whole;
}

// Output and input gradients, whole.
struct Result {
  torch::Tensor out, dq, dk, dv;
};

Result one_process(const Case& test_case, const WholeSequence& whole) {
  auto q = whole.query.clone().requires_grad_();
  auto k = whole.key.clone().requires_grad_();
  auto v = whole.value.clone().requires_grad_();
  auto options = SDPAOptions()
                     .is_causal(test_case.is_causal)
                     .window(test_case.window)
                     .query_offset(test_case.query_offset)
                     .enable_gqa(true)
                     .need_weights(false)
                     .backend(AttentionBackend::fused_cpu);
  if (whole.padding.defined()) {
    options.attn_mask(whole.padding.logical_not().view({whole.padding.size(0), 1, 1, -1}));
  }
  if (whole.document_ids.defined()) {
    const int64_t T = test_case.length;
    options.block_mask(block_mask(document_mask(whole.document_ids), 2, 1, T, T));
  }
  auto out = std::get<0>(scaled_dot_product_attention(q, k, v, options));
  (out * whole.grad_out).sum().backward();
  return {out.detach(), q.grad(), k.grad(), v.grad()};
}

Result context_parallel(const Case& test_case, const WholeSequence& whole) {
  const SequenceSharding sharding(test_case.length, group().size(), test_case.layout);
  const auto local = [&](const torch::Tensor& tensor, int64_t dim) {
    return sharding.shard(tensor, dim, group().rank());
  };
  auto q = local(whole.query, 2).requires_grad_();
  auto k = local(whole.key, 2).requires_grad_();
  auto v = local(whole.value, 2).requires_grad_();
  auto options = ContextParallelOptions(sharding)
                     .is_causal(test_case.is_causal)
                     .window(test_case.window)
                     .query_offset(test_case.query_offset)
                     .strategy(test_case.strategy);
  if (whole.padding.defined()) {
    options.key_padding_mask(local(whole.padding, 1));
  }
  options.document_ids(whole.document_ids); // the whole sequence's
  auto out = dist::context_parallel_attention(q, k, v, group(), options);
  (out * local(whole.grad_out, 2)).sum().backward();
  const auto gathered = [&](const torch::Tensor& part) {
    return dist::gather_sequence(part, 2, sharding, group());
  };
  return {gathered(out.detach()), gathered(q.grad()), gathered(k.grad()), gathered(v.grad())};
}

Tolerance context_parallel_tolerance(torch::ScalarType dtype) {
  return dtype == torch::kFloat64 ? Tolerance{1e-10, 1e-10} : Tolerance{1e-5, 1e-5};
}

class ContextParallelAttention
    : public ::testing::TestWithParam<std::tuple<Case, torch::ScalarType>> {};

TEST_P(ContextParallelAttention, OutputAndGradientsMatchOneProcess) {
  const auto& [test_case, dtype] = GetParam();
  if (test_case.strategy == ContextParallelStrategy::all_to_all &&
      (test_case.heads % group().size() != 0 || test_case.kv_heads % group().size() != 0)) {
    GTEST_SKIP() << "all_to_all needs the ranks to divide the head counts";
  }
  const auto whole = draw(test_case, dtype);
  const auto expected = one_process(test_case, whole);
  const auto actual = context_parallel(test_case, whole);
  const auto tolerance = context_parallel_tolerance(dtype);
  EXPECT_CLOSE(actual.out, expected.out, tolerance);
  EXPECT_CLOSE(actual.dq, expected.dq, tolerance);
  EXPECT_CLOSE(actual.dk, expected.dk, tolerance);
  EXPECT_CLOSE(actual.dv, expected.dv, tolerance);
}

std::string case_name(const ::testing::TestParamInfo<std::tuple<Case, torch::ScalarType>>& info) {
  return std::get<0>(info.param).name +
      (std::get<1>(info.param) == torch::kFloat64 ? "_float64" : "_float32");
}

INSTANTIATE_TEST_SUITE_P(
    Ring,
    ContextParallelAttention,
    ::testing::Combine(
        ::testing::ValuesIn(ring_cases()),
        ::testing::Values(torch::kFloat64, torch::kFloat32)),
    case_name);

INSTANTIATE_TEST_SUITE_P(
    AllToAll,
    ContextParallelAttention,
    ::testing::Combine(
        ::testing::ValuesIn(all_to_all_cases()),
        ::testing::Values(torch::kFloat64, torch::kFloat32)),
    case_name);

TEST(ContextParallelSharding, ShardThenUnshardGivesTheSequenceBack) {
  const auto whole = torch::arange(23).view({1, 23});
  for (const auto layout : {SequenceLayout::contiguous, SequenceLayout::zigzag}) {
    const SequenceSharding sharding(23, 4, layout);
    std::vector<torch::Tensor> parts;
    for (int64_t rank = 0; rank < 4; ++rank) {
      parts.push_back(sharding.shard(whole, 1, rank));
      EXPECT_EQ(parts.back().size(1), sharding.local_length());
    }
    EXPECT_TRUE(torch::equal(sharding.unshard(parts, 1), whole)) << layout;
  }
}

TEST(ContextParallelSharding, ZigzagGivesEachRankAnEarlyAndALateChunk) {
  const SequenceSharding sharding(16, 4, SequenceLayout::zigzag);
  EXPECT_EQ(sharding.local_length(), 4);
  EXPECT_EQ(sharding.padded_length(), 16);
  const auto segments = sharding.segments(1);
  ASSERT_EQ(segments.size(), 2U);
  EXPECT_EQ(segments[0].start, 2);
  EXPECT_EQ(segments[1].start, 12);
  const auto rows = sharding.shard(torch::arange(16), 0, 1);
  EXPECT_TRUE(torch::equal(rows, torch::tensor({2, 3, 12, 13}, torch::kLong)));
}

TEST(ContextParallelSharding, PaddingIsAtTheEndOfTheSequence) {
  const SequenceSharding sharding(10, 4, SequenceLayout::contiguous);
  EXPECT_EQ(sharding.local_length(), 3);
  EXPECT_EQ(sharding.padded_length(), 12);
  const auto last = sharding.shard(torch::arange(1, 11), 0, 3);
  EXPECT_TRUE(torch::equal(last, torch::tensor({10, 0, 0}, torch::kLong)));
}

TEST(ContextParallelSharding, BadArgumentsAreNamed) {
  EXPECT_ATTN_ERROR(SequenceSharding(0, 2), "the sequence length must be at least 1, got 0");
  EXPECT_ATTN_ERROR(SequenceSharding(8, 0), "the world size must be at least 1, got 0");
  const SequenceSharding sharding(8, 2);
  EXPECT_ATTN_ERROR(sharding.shard(torch::zeros({7}), 0, 0), "must be the sequence length 8");
  EXPECT_ATTN_ERROR(sharding.segments(2), "rank must be in [0, 2), got 2");
  EXPECT_ATTN_ERROR(
      sharding.unshard({torch::zeros({4})}, 0), "expected the parts of 2 ranks, got 1");
}

TEST(ContextParallelHalfPrecision, BFloat16IsComputedInFloat32) {
  const SequenceSharding sharding(16, group().size());
  torch::manual_seed(3);
  const auto q = sharding.shard(torch::randn({1, 2, 16, 8}), 2, group().rank());
  const auto k = sharding.shard(torch::randn({1, 2, 16, 8}), 2, group().rank());
  const auto v = sharding.shard(torch::randn({1, 2, 16, 8}), 2, group().rank());
  const auto options = ContextParallelOptions(sharding).is_causal(true);
  const auto half = dist::context_parallel_attention(
      q.to(torch::kBFloat16), k.to(torch::kBFloat16), v.to(torch::kBFloat16), group(), options);
  EXPECT_EQ(half.scalar_type(), torch::kBFloat16);
  const auto full = dist::context_parallel_attention(
      q.to(torch::kBFloat16).to(torch::kFloat), k.to(torch::kBFloat16).to(torch::kFloat),
      v.to(torch::kBFloat16).to(torch::kFloat), group(), options);
  EXPECT_CLOSE(half.to(torch::kFloat), full, (Tolerance{0, 1.0 / 128}));
}

// Heads split from a projection are strided views: the backward's key and
// value gradients, which travel as messages, must still be contiguous.
TEST(ContextParallelLayout, StridedInputsGiveTheGradientsOfContiguousOnes) {
  const SequenceSharding sharding(8 * group().size(), group().size());
  const int64_t N = sharding.local_length();
  torch::manual_seed(4);
  const auto projected = torch::randn({2, N, 3, 4, 8}, torch::kFloat64); // (B, N, qkv, H, D)
  const auto run = [&](bool strided) {
    auto leaf = projected.clone().requires_grad_();
    auto heads = leaf.permute({2, 0, 3, 1, 4}); // (qkv, B, H, N, D), strided
    if (!strided) {
      heads = heads.contiguous();
    }
    const auto options = ContextParallelOptions(sharding).is_causal(true);
    dist::context_parallel_attention(heads[0], heads[1], heads[2], group(), options)
        .sum()
        .backward();
    return leaf.grad();
  };
  EXPECT_CLOSE(run(true), run(false), (Tolerance{1e-12, 1e-12}));
}

TEST(ContextParallelCommunication, RingPassesKeysAndValuesWMinus1Times) {
  const int64_t W = group().size();
  const SequenceSharding sharding(8 * W, W);
  const auto q = torch::randn({1, 4, sharding.local_length(), 8});
  const auto kv = torch::randn({1, 2, sharding.local_length(), 8});
  dist::reset_communication_count();
  dist::context_parallel_attention(q, kv, kv, group(), ContextParallelOptions(sharding));
  const auto count = dist::communication_count();
  // One all-gather of the sizes, then W - 1 steps of a key and a value.
  EXPECT_EQ(count.collectives, 1 + 2 * (W - 1));
  const int64_t kv_bytes = 2 * kv.numel() * 4;
  EXPECT_EQ(count.bytes - 25 * 8, (W - 1) * kv_bytes);
}

TEST(ContextParallelEdgeCases, EmptyBatchGivesAnEmptyOutputAndGradients) {
  const SequenceSharding sharding(4 * group().size(), group().size());
  const auto x = torch::zeros({0, 2, sharding.local_length(), 8}).requires_grad_();
  const auto out = dist::context_parallel_attention(
      x, x, x, group(), ContextParallelOptions(sharding));
  EXPECT_EQ(out.sizes(), x.sizes());
  out.sum().backward();
  EXPECT_EQ(x.grad().sizes(), x.sizes());
}

TEST(ContextParallelEdgeCases, StridedInputsGiveTheContiguousResult) {
  const SequenceSharding sharding(6 * group().size(), group().size());
  torch::manual_seed(11);
  // (B, N, H, D) memory seen as (B, H, N, D), as a module's projections are.
  const auto q = torch::randn({2, sharding.local_length(), 4, 8}).transpose(1, 2);
  const auto k = torch::randn({2, sharding.local_length(), 2, 8}).transpose(1, 2);
  const auto options = ContextParallelOptions(sharding).is_causal(true);
  EXPECT_TRUE(torch::equal(
      dist::context_parallel_attention(q, k, k, group(), options),
      dist::context_parallel_attention(
          q.contiguous(), k.contiguous(), k.contiguous(), group(), options)));
}

// Per rank and forward, with q (B, H, N, D), k (B, H_kv, N, D),
// v (B, H_kv, N, Dv), e bytes per element and W > 1:
//   the all-gather of the sizes and options (25 int64), 200 bytes;
//   with a key padding mask, its all-gather, B·N bytes;
//   an all-to-all of each of q, k and v, of its own size, and one of the
//   output (B, H, N, Dv): e·B·N·(H·D + H_kv·D + H_kv·Dv + H·Dv) bytes.
// That is 5 collectives (6 with the mask), whatever W. The backward makes
// the four all-to-alls again, in reverse, on the gradients of the same
// sizes, and nothing else.
TEST(ContextParallelCommunication, AllToAllExchangesEachTensorOnceEachWay) {
  const int64_t W = group().size();
  if (W == 1) {
    GTEST_SKIP() << "one rank exchanges nothing";
  }
  const SequenceSharding sharding(8 * W, W);
  const int64_t B = 2, H = 2 * W, H_kv = W, N = sharding.local_length(), D = 8, Dv = 6;
  const auto q = torch::randn({B, H, N, D}).requires_grad_();
  const auto k = torch::randn({B, H_kv, N, D}).requires_grad_();
  const auto v = torch::randn({B, H_kv, N, Dv}).requires_grad_();
  const auto options = ContextParallelOptions(sharding)
                           .key_padding_mask(torch::zeros({B, N}, torch::kBool))
                           .strategy(ContextParallelStrategy::all_to_all);
  const int64_t all_to_all_bytes = 4 * B * N * (H * D + H_kv * D + H_kv * Dv + H * Dv);

  dist::reset_communication_count();
  const auto out = dist::context_parallel_attention(q, k, v, group(), options);
  const auto forward = dist::communication_count();
  EXPECT_EQ(forward.collectives, 1 + 1 + 4);
  EXPECT_EQ(forward.bytes, 25 * 8 + B * N + all_to_all_bytes);

  dist::reset_communication_count();
  out.sum().backward();
  const auto backward = dist::communication_count();
  EXPECT_EQ(backward.collectives, 4);
  EXPECT_EQ(backward.bytes, all_to_all_bytes);
}

TEST(ContextParallelErrors, InputsThatDoNotFitTheShardingAreRefused) {
  const SequenceSharding sharding(8 * group().size(), group().size());
  const auto x = torch::zeros({1, 4, sharding.local_length(), 8});
  const auto options = ContextParallelOptions(sharding);
  EXPECT_ATTN_ERROR(
      dist::context_parallel_attention(
          x.narrow(2, 0, 3), x.narrow(2, 0, 3), x.narrow(2, 0, 3), group(), options),
      "must hold this rank's N = 8 rows of the");
  EXPECT_ATTN_ERROR(
      dist::context_parallel_attention(x, x.narrow(1, 0, 3), x.narrow(1, 0, 3), group(), options),
      "dividing the query's H");
  EXPECT_ATTN_ERROR(
      dist::context_parallel_attention(
          x, x, x, group(), ContextParallelOptions(SequenceSharding(8, 7))),
      "the sharding is for 7 ranks, the group has");
  EXPECT_ATTN_ERROR(
      dist::context_parallel_attention(
          x, x, x, group(), ContextParallelOptions(sharding).window(0)),
      "window must be a positive number of keys, got 0");
  const int64_t T = sharding.length();
  EXPECT_ATTN_ERROR(
      dist::context_parallel_attention(
          x, x, x, group(),
          ContextParallelOptions(sharding).document_ids(torch::zeros({8}, torch::kLong))),
      "document_ids must be the whole sequence's, (T) = (" + std::to_string(T) +
          ") or (B, T) = (1, " + std::to_string(T) + "), got [8]");
  EXPECT_ATTN_ERROR(
      dist::context_parallel_attention(
          x, x, x, group(),
          ContextParallelOptions(sharding).document_ids(torch::arange(T, 0, -1, torch::kLong))),
      "document_ids must be nondecreasing along each row");
  EXPECT_ATTN_ERROR(
      dist::context_parallel_attention(
          x, x, x, group(),
          ContextParallelOptions(sharding).key_padding_mask(torch::zeros({1, 8}))),
      "key_padding_mask must be a bool CPU tensor");
  EXPECT_ATTN_ERROR(
      dist::context_parallel_attention(
          x, x, x, group(),
          ContextParallelOptions(sharding).key_padding_mask(torch::zeros({2, 8}, torch::kBool))),
      "key_padding_mask must be (B, N) = [1, 8]");
  EXPECT_ATTN_ERROR(
      dist::context_parallel_attention(x, x, x.to(torch::kDouble), group(), options),
      "must have the same floating dtype");
}

TEST(ContextParallelErrors, RankThatRefusesItsArgumentsFailsTheOthersAtOnce) {
  if (group().size() == 1) {
    GTEST_SKIP() << "no other rank to fail";
  }
  const SequenceSharding sharding(4 * group().size(), group().size());
  const auto x = torch::zeros({1, 2, sharding.local_length(), 8});
  auto options = ContextParallelOptions(sharding);
  if (group().rank() == 1) {
    options.key_padding_mask(torch::zeros({1, 3}, torch::kBool)); // not (B, N)
  }
  const auto start = std::chrono::steady_clock::now();
  EXPECT_ATTN_ERROR(
      dist::context_parallel_attention(x, x, x, group(), options),
      group().rank() == 1 ? "key_padding_mask must be (B, N)"
                          : "a lone 0: a rank that refused its arguments");
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
}

TEST(ContextParallelErrors, RanksThatDisagreeOnTheOptionsFailOnEveryRank) {
  if (group().size() == 1) {
    GTEST_SKIP() << "one rank cannot disagree with another";
  }
  const SequenceSharding sharding(4 * group().size(), group().size());
  const auto x = torch::zeros({1, 2, sharding.local_length(), 8});
  const auto options = ContextParallelOptions(sharding).is_causal(group().rank() == 0);
  EXPECT_ATTN_ERROR(
      dist::context_parallel_attention(x, x, x, group(), options),
      "the ranks disagree on the sizes of");
  EXPECT_ATTN_ERROR(
      dist::context_parallel_attention(
          group().rank() == 0 ? x : x.to(torch::kDouble),
          group().rank() == 0 ? x : x.to(torch::kDouble),
          group().rank() == 0 ? x : x.to(torch::kDouble), group(),
          ContextParallelOptions(sharding)),
      "the ranks disagree on the sizes of query, key, value, their dtype");
}

TEST(ContextParallelErrors, RanksThatDisagreeOnTheSizesFailOnEveryRank) {
  if (group().size() == 1) {
    GTEST_SKIP() << "one rank cannot disagree with another";
  }
  const SequenceSharding sharding(4 * group().size(), group().size());
  const int64_t batch = group().rank() == 0 ? 2 : 1;
  const auto x = torch::zeros({batch, 2, sharding.local_length(), 8});
  EXPECT_ATTN_ERROR(
      dist::context_parallel_attention(x, x, x, group(), ContextParallelOptions(sharding)),
      "the ranks disagree on the sizes of query, key, value");
}

TEST(ContextParallelErrors, AllToAllNeedsTheRanksToDivideTheHeads) {
  const int64_t W = group().size();
  if (W == 1) {
    GTEST_SKIP() << "one rank divides every head count";
  }
  const SequenceSharding sharding(4 * W, W);
  const int64_t N = sharding.local_length();
  const auto options = ContextParallelOptions(sharding).strategy(
      ContextParallelStrategy::all_to_all);
  const auto attend = [&](int64_t heads, int64_t kv_heads) {
    const auto q = torch::zeros({1, heads, N, 8});
    const auto kv = torch::zeros({1, kv_heads, N, 8});
    return dist::context_parallel_attention(q, kv, kv, group(), options);
  };
  const auto expected = [&](int64_t heads, int64_t kv_heads) {
    std::ostringstream message;
    message << "the all_to_all strategy needs the group's " << W
            << " ranks to divide the query heads H and the key/value heads H_kv (the ring "
               "strategy takes any head count), got H = "
            << heads << " and H_kv = " << kv_heads;
    return message.str();
  };
  // The key/value heads alone, then both.
  EXPECT_ATTN_ERROR(attend(2 * W, 1), expected(2 * W, 1));
  EXPECT_ATTN_ERROR(attend(W + 1, W + 1), expected(W + 1, W + 1));
  // Refused before any of the strategy's collectives: only the sizes were
  // compared, and the group is still in step.
  dist::reset_communication_count();
  EXPECT_ATTN_ERROR(attend(W + 1, 1), expected(W + 1, 1));
  EXPECT_EQ(dist::communication_count().collectives, 1);
  EXPECT_EQ(attend(2 * W, W).size(1), 2 * W);
}

// Run alone (ctest's context_parallel.rank_leaves_mid_ring_W): rank 1
// takes part in the forward and leaves; the backward's ring must fail on
// every other rank within the timeout, naming the transfer.
TEST(ContextParallelFailure, RankThatLeavesMidRingFailsTheOthersWithinTheTimeout) {
  const dist::Group three_seconds(group().process_group(), std::chrono::seconds(3));
  const SequenceSharding sharding(8 * three_seconds.size(), three_seconds.size());
  const auto q = torch::randn({1, 2, sharding.local_length(), 8}).requires_grad_();
  const auto out = dist::context_parallel_attention(
      q, q, q, three_seconds, ContextParallelOptions(sharding));
  if (three_seconds.rank() == 1) {
    std::_Exit(0);
  }
  const auto start = std::chrono::steady_clock::now();
  try {
    out.sum().backward();
    ADD_FAILURE() << "the backward succeeded without rank 1";
  } catch (const c10::Error& error) {
    std::printf(
        "rank %lld: %s\n", static_cast<long long>(three_seconds.rank()),
        error.what_without_backtrace());
    std::ostringstream where;
    where << "failed on rank " << three_seconds.rank() << " of " << three_seconds.size()
          << " (timeout 3000 ms)";
    EXPECT_THAT(
        error.what_without_backtrace(),
        ::testing::AllOf(
            ::testing::StartsWith("attn::distributed: "), ::testing::HasSubstr(where.str())));
  }
  // Within the timeout, and a margin for a loaded machine.
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  // Without destroying the group, which would wait for the rank that left.
  std::fflush(stdout);
  std::_Exit(::testing::Test::HasFailure() ? 1 : 0);
}

} // namespace
} // namespace attn::testing
