// attn::MultiHeadAttention on packed input (src/modules/sequence_layout.cpp):
// documents packed into rows (document_ids, cu_seqlens), rotary positions
// restarting at each, and prompts of different lengths prefilled packed
// into a KV cache and decoded from it, each against the same module run on
// every document or prompt alone, as packed training and FlashAttention's
// varlen interface define it.

#include "test_support.h"

#include <attn/kv_cache.h>
#include <attn/modules/multi_head_attention.h>

#include <vector>

namespace {

using attn::KVCache;
using attn::MultiHeadAttention;
using attn::MultiHeadAttentionForwardOptions;
using attn::MultiHeadAttentionOptions;
using attn::RotaryEmbeddingOptions;
using attn::testing::Tolerance;

constexpr int64_t kEmbed = 32;

// Grouped-query heads with rotary positions: the options packing changes.
MultiHeadAttention packed_module(torch::ScalarType dtype) {
  torch::manual_seed(11);
  MultiHeadAttention mha(
      MultiHeadAttentionOptions(kEmbed, 4).num_kv_heads(2).rotary(RotaryEmbeddingOptions(6)));
  mha->to(dtype);
  return mha;
}

// The document ids of rows packing documents of `lengths`, written out.
torch::Tensor packed_document_ids(const std::vector<std::vector<int64_t>>& lengths) {
  std::vector<torch::Tensor> rows;
  for (const auto& row : lengths) {
    std::vector<int64_t> ids;
    for (size_t d = 0; d < row.size(); ++d) {
      ids.insert(ids.end(), row[d], static_cast<int64_t>(d));
    }
    rows.push_back(torch::tensor(ids, torch::kLong));
  }
  return torch::stack(rows);
}

std::vector<torch::Tensor> parameter_gradients(const MultiHeadAttention& mha) {
  std::vector<torch::Tensor> grads;
  for (auto& parameter : mha->parameters()) {
    grads.push_back(parameter.grad().clone());
    parameter.mutable_grad().zero_();
  }
  return grads;
}

struct PackingCase {
  bool causal;
  c10::optional<int64_t> window;
  torch::ScalarType dtype;
};

class PackedDocuments : public ::testing::TestWithParam<PackingCase> {};

// Rows of 300 tokens (3 query tiles, 5 key blocks): documents straddle
// tiles and blocks; one of a single token, one filling almost a row.
TEST_P(PackedDocuments, EachDocumentIsAttendedAsIfAlone) {
  const auto& c = GetParam();
  auto mha = packed_module(c.dtype);
  const std::vector<std::vector<int64_t>> lengths{{130, 20, 150}, {1, 299}};
  const auto x = torch::randn({2, 300, kEmbed}, c.dtype).requires_grad_();
  const auto upstream = torch::randn({2, 300, kEmbed}, c.dtype);
  const auto options = MultiHeadAttentionForwardOptions().is_causal(c.causal).window(c.window);
  auto packed_options = options;
  const auto [packed, none] = mha(
      x, x, x, packed_options.document_ids(packed_document_ids(lengths)));
  (packed * upstream).sum().backward();
  const auto packed_grads = parameter_gradients(mha);

  const Tolerance tolerance = c.dtype == torch::kDouble ? Tolerance{1e-10} : Tolerance{2e-5, 2e-5};
  for (int64_t b = 0; b < 2; ++b) {
    int64_t start = 0;
    for (const int64_t length : lengths[b]) {
      SCOPED_TRACE(testing::Message() << "row " << b << " document at " << start);
      const auto alone = x.detach()[b].narrow(0, start, length).unsqueeze(0).requires_grad_();
      const auto [expected, unused] = mha(alone, alone, alone, options);
      EXPECT_CLOSE(packed[b].narrow(0, start, length), expected[0], tolerance);
      (expected[0] * upstream[b].narrow(0, start, length)).sum().backward();
      EXPECT_CLOSE(x.grad()[b].narrow(0, start, length), alone.grad()[0], tolerance);
      start += length;
    }
  }
  // The parameters' gradients sum over the documents.
  const auto summed_grads = parameter_gradients(mha);
  for (size_t p = 0; p < packed_grads.size(); ++p) {
    EXPECT_CLOSE(packed_grads[p], summed_grads[p], tolerance) << "parameter " << p;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases,
    PackedDocuments,
    ::testing::Values(
        PackingCase{true, c10::nullopt, torch::kDouble},
        PackingCase{false, c10::nullopt, torch::kDouble},
        PackingCase{true, 40, torch::kDouble},
        PackingCase{false, 7, torch::kDouble},
        PackingCase{true, c10::nullopt, torch::kFloat}));

TEST(PackedSequences, SequenceStartsPackOneRowAsDocumentIdsDo) {
  auto mha = packed_module(torch::kDouble);
  const auto x = torch::randn({1, 300, kEmbed}, torch::kDouble);
  const auto options = MultiHeadAttentionForwardOptions().is_causal(true);
  auto with_starts = options;
  auto with_ids = options;
  const auto [by_starts, none] = mha(
      x, x, x, with_starts.cu_seqlens(torch::tensor({0, 130, 150, 150, 300})));
  const auto [by_ids, none2] = mha(
      x, x, x, with_ids.document_ids(packed_document_ids({{130, 20, 150}})));
  EXPECT_TRUE(torch::equal(by_starts, by_ids));
}

// Decodes `tokens` (N, T, E) as the ragged cache's sequences and as each
// sequence alone with its own cache; the outputs must agree.
void expect_decoding_as_alone(
    MultiHeadAttention& mha,
    KVCache& ragged,
    std::vector<KVCache>& alone,
    const torch::Tensor& tokens,
    const MultiHeadAttentionForwardOptions& options) {
  auto ragged_options = options;
  const auto [out, none] = mha(tokens, tokens, tokens, ragged_options.kv_cache(&ragged));
  for (size_t n = 0; n < alone.size(); ++n) {
    SCOPED_TRACE(testing::Message() << "sequence " << n);
    const auto own = tokens.narrow(0, static_cast<int64_t>(n), 1);
    auto alone_options = options;
    const auto [expected, unused] = mha(own, own, own, alone_options.kv_cache(&alone[n]));
    EXPECT_CLOSE(out[static_cast<int64_t>(n)], expected[0], Tolerance{1e-10});
  }
}

TEST(RaggedPrefill, PromptsFillTheCacheAsEachPromptAlone) {
  torch::NoGradGuard no_grad;
  auto mha = packed_module(torch::kDouble);
  const std::vector<int64_t> starts{0, 5, 6, 75};
  const auto prompts = torch::randn({1, 75, kEmbed}, torch::kDouble);
  const auto causal = MultiHeadAttentionForwardOptions().is_causal(true);
  KVCache ragged;
  std::vector<KVCache> alone(3);

  auto prefill = causal;
  prefill.cu_seqlens(torch::tensor(starts)).kv_cache(&ragged);
  const auto [out, none] = mha(prompts, prompts, prompts, prefill);
  EXPECT_EQ(ragged.lengths(), (std::vector<int64_t>{5, 1, 69}));
  for (size_t n = 0; n < 3; ++n) {
    const auto prompt = prompts.narrow(1, starts[n], starts[n + 1] - starts[n]);
    auto own = causal;
    const auto [expected, unused] = mha(prompt, prompt, prompt, own.kv_cache(&alone[n]));
    EXPECT_CLOSE(
        out[0].narrow(0, starts[n], starts[n + 1] - starts[n]), expected[0], Tolerance{1e-10});
  }
  // Decoding: a token per sequence, then two with a window, each after its
  // own prompt.
  for (int step = 0; step < 3; ++step) {
    expect_decoding_as_alone(
        mha, ragged, alone, torch::randn({3, 1, kEmbed}, torch::kDouble), causal);
  }
  auto windowed = causal;
  expect_decoding_as_alone(
      mha, ragged, alone, torch::randn({3, 2, kEmbed}, torch::kDouble), windowed.window(4));
  EXPECT_EQ(ragged.lengths(), (std::vector<int64_t>{10, 6, 74}));

  // A packed chunk appended to the filled cache (sequence 1 gets none).
  const std::vector<int64_t> chunk_starts{0, 2, 2, 5};
  const auto chunk = torch::randn({1, 5, kEmbed}, torch::kDouble);
  auto chunked = causal;
  const auto [chunk_out, none2] = mha(
      chunk, chunk, chunk, chunked.cu_seqlens(torch::tensor(chunk_starts)).kv_cache(&ragged));
  for (const size_t n : {0, 2}) {
    const auto part = chunk.narrow(1, chunk_starts[n], chunk_starts[n + 1] - chunk_starts[n]);
    auto own = causal;
    const auto [expected, unused] = mha(part, part, part, own.kv_cache(&alone[n]));
    EXPECT_CLOSE(
        chunk_out[0].narrow(0, chunk_starts[n], part.size(1)), expected[0], Tolerance{1e-10});
  }
  // The cache holds each sequence's keys as its own cache does (projected
  // in another batch: to rounding).
  for (size_t n = 0; n < 3; ++n) {
    const auto length = alone[n].length();
    EXPECT_EQ(ragged.lengths()[n], length);
    EXPECT_CLOSE(
        ragged.keys()[static_cast<int64_t>(n)].narrow(1, 0, length), alone[n].keys()[0],
        attn::testing::kFloat64Tolerance);
  }
}

} // namespace
