// attn::KVCache (src/modules/kv_cache.cpp): its storage on its own, and decoding
// through MultiHeadAttention token by token against one causal forward.

#include "test_support.h"

#include <attn/kv_cache.h>
#include <attn/modules/multi_head_attention.h>

#include <ostream>
#include <type_traits>

namespace {

using attn::KVCache;
using attn::MultiHeadAttention;
using attn::MultiHeadAttentionOptions;

TEST(KVCache, GrowsKeepingItsContentsAndResetsForAnotherBatch) {
  torch::NoGradGuard no_grad;
  KVCache cache;
  EXPECT_FALSE(cache.keys().defined());
  EXPECT_EQ(cache.max_length(), 0);
  const auto k = torch::randn({2, 3, 100, 4});
  const auto v = torch::randn({2, 3, 100, 5});
  for (int64_t t = 0; t < 100; t += 25) { // past the first 64-token storage
    const auto [keys, values] = cache.append(k.narrow(2, t, 25), v.narrow(2, t, 25));
    EXPECT_TRUE(torch::equal(keys, k.narrow(2, 0, t + 25)));
    EXPECT_TRUE(torch::equal(values, v.narrow(2, 0, t + 25)));
  }
  cache.reset();
  EXPECT_EQ(cache.length(), 0);
  const auto other = torch::randn({5, 1, 2, 4}); // another batch size, heads
  const auto [keys, values] = cache.append(other, other);
  EXPECT_TRUE(torch::equal(keys, other));
  EXPECT_EQ(cache.length(), 2);
}

TEST(KVCache, PreallocatedStorageIsReusedAndNeverOverflows) {
  torch::NoGradGuard no_grad;
  KVCache cache(8);
  const auto k = torch::randn({1, 2, 8, 4});
  const auto [first, unused] = cache.append(k.narrow(2, 0, 5), k.narrow(2, 0, 5));
  const auto storage = first.data_ptr();
  const auto [keys, values] = cache.append(k.narrow(2, 5, 3), k.narrow(2, 5, 3));
  EXPECT_EQ(keys.data_ptr(), storage); // no reallocation up to max_length
  EXPECT_TRUE(torch::equal(keys, k));
  EXPECT_ATTN_ERROR(
      cache.append(k.narrow(2, 0, 1), k.narrow(2, 0, 1)),
      "KVCache: appending 1 tokens to the 8 cached would exceed max_length 8 "
      "(reset() to start another sequence)");
  cache.reset();
  const auto [again, unused2] = cache.append(k, k);
  EXPECT_EQ(again.data_ptr(), storage);
}

TEST(KVCache, ClonesBranchIndependentlyAndCopiesAreRefused) {
  static_assert(
      !std::is_copy_constructible_v<KVCache> && !std::is_copy_assignable_v<KVCache>,
      "copies would share storage");
  static_assert(std::is_move_constructible_v<KVCache>);
  torch::NoGradGuard no_grad;
  KVCache prompt(16);
  const auto k = torch::randn({1, 2, 6, 4});
  prompt.append(k.narrow(2, 0, 4), k.narrow(2, 0, 4));
  auto branch = prompt.clone();
  EXPECT_EQ(branch.max_length(), 16);
  const auto [a, unused_a] = prompt.append(k.narrow(2, 4, 1), k.narrow(2, 4, 1));
  const auto [b, unused_b] = branch.append(k.narrow(2, 5, 1), k.narrow(2, 5, 1));
  EXPECT_TRUE(torch::equal(a.narrow(2, 4, 1), k.narrow(2, 4, 1)));
  EXPECT_TRUE(torch::equal(b.narrow(2, 4, 1), k.narrow(2, 5, 1)));
  EXPECT_TRUE(torch::equal(a.narrow(2, 0, 4), b.narrow(2, 0, 4)));
}

TEST(KVCache, MovesTakeTheTokensAndLeaveTheSourceEmpty) {
  static_assert(std::is_nothrow_move_constructible_v<KVCache>);
  static_assert(std::is_nothrow_move_assignable_v<KVCache>);
  torch::NoGradGuard no_grad;
  KVCache source(16);
  const auto k = torch::randn({1, 2, 3, 4});
  source.append(k, k);
  KVCache moved(std::move(source));
  EXPECT_EQ(moved.length(), 3);
  EXPECT_EQ(source.length(), 0); // NOLINT(bugprone-use-after-move): documented state
  // The emptied source starts a new sequence of any shape.
  const auto other = torch::randn({2, 1, 5, 8});
  EXPECT_TRUE(torch::equal(source.append(other, other).first, other));
  KVCache assigned;
  assigned = std::move(moved);
  EXPECT_EQ(assigned.length(), 3);
  EXPECT_EQ(moved.length(), 0); // NOLINT(bugprone-use-after-move): documented state
}

TEST(KVCache, StorageFromInferenceModeIsReplacedWhenAppendedToOutsideIt) {
  KVCache cache;
  const auto k = torch::randn({1, 1, 3, 2});
  {
    c10::InferenceMode inference;
    cache.append(k.narrow(2, 0, 2), k.narrow(2, 0, 2));
  }
  torch::NoGradGuard no_grad;
  const auto [keys, values] = cache.append(k.narrow(2, 2, 1), k.narrow(2, 2, 1));
  EXPECT_TRUE(torch::equal(keys, k));
}

TEST(KVCache, PackedAppendsGiveEachSequenceItsOwnLength) {
  torch::NoGradGuard no_grad;
  KVCache cache;
  const auto k = torch::randn({9, 2, 4}), v = torch::randn({9, 2, 3}); // (total, H, ·)
  const auto packed = cache.append_packed(k, v, torch::tensor({0, 6, 6, 9}));
  EXPECT_EQ(cache.lengths(), (std::vector<int64_t>{6, 0, 3}));
  EXPECT_TRUE(cache.ragged());
  EXPECT_EQ(cache.length(), 6);
  EXPECT_TRUE(torch::equal(packed.keys, k));
  EXPECT_TRUE(torch::equal(packed.values, v));
  EXPECT_TRUE(torch::equal(packed.cu_seqlens, torch::tensor({0, 6, 6, 9}, torch::kLong)));
  // (B, H, T, ·): sequence 1 empty, sequence 2 its 3 tokens, zeros after.
  const auto keys = cache.keys();
  EXPECT_EQ(keys.sizes(), torch::IntArrayRef({3, 2, 6, 4}));
  EXPECT_TRUE(torch::equal(keys[0], k.narrow(0, 0, 6).transpose(0, 1)));
  EXPECT_TRUE(torch::equal(keys[2].narrow(1, 0, 3), k.narrow(0, 6, 3).transpose(0, 1)));
  EXPECT_EQ(keys[1].abs().sum().item<float>(), 0.0F);
  EXPECT_EQ(keys[2].narrow(1, 3, 3).abs().sum().item<float>(), 0.0F);
  // A token per sequence lands after each one's own last.
  const auto step = torch::randn({3, 2, 1, 4});
  const auto [after, unused] = cache.append(step, torch::randn({3, 2, 1, 3}));
  EXPECT_EQ(cache.lengths(), (std::vector<int64_t>{7, 1, 4}));
  EXPECT_TRUE(torch::equal(after[0].narrow(1, 6, 1), step[0]));
  EXPECT_TRUE(torch::equal(after[1].narrow(1, 0, 1), step[1]));
  EXPECT_TRUE(torch::equal(after[2].narrow(1, 3, 1), step[2]));
  // A second packed append continues each sequence.
  const auto more = cache.append_packed(
      torch::randn({2, 2, 4}), torch::randn({2, 2, 3}), torch::tensor({0, 0, 2, 2}));
  EXPECT_EQ(cache.lengths(), (std::vector<int64_t>{7, 3, 4}));
  EXPECT_TRUE(torch::equal(more.cu_seqlens, torch::tensor({0, 7, 10, 14}, torch::kLong)));
  EXPECT_TRUE(torch::equal(more.keys.narrow(0, 0, 7), after[0].transpose(0, 1)));
}

TEST(KVCacheErrors, NameWhatWasExpectedAndWhatArrived) {
  torch::NoGradGuard no_grad;
  EXPECT_ATTN_ERROR(KVCache(0), "KVCache: max_length must be positive, got 0");
  KVCache cache;
  const auto k = torch::randn({2, 3, 4, 8});
  cache.append(k, k);
  EXPECT_ATTN_ERROR(
      cache.append(torch::randn({3, 3, 1, 8}), torch::randn({3, 3, 1, 8})),
      "KVCache: keys must be (B, H, T, D) = (2, 3, T, 8) and values (B, H, T, Dv) with "
      "Dv = 8 as the cached ones (reset() to start another batch), got keys [3, 3, 1, 8]");
  EXPECT_ATTN_ERROR(
      cache.append_packed(torch::randn({4, 3, 8}), torch::randn({4, 3, 8}), torch::tensor({0, 4})),
      "KVCache: cu_seqlens must count the cache's 2 sequences, got 1");
  KVCache short_cache(6);
  EXPECT_ATTN_ERROR(
      short_cache.append_packed(
          torch::randn({13, 3, 8}), torch::randn({13, 3, 8}), torch::tensor({0, 6, 13})),
      "KVCache: appending 7 tokens to sequence 1's 0 cached would exceed max_length 6 (reset() to "
      "start another sequence)");
  EXPECT_TRUE(short_cache.lengths().empty()); // refused before anything changed
  EXPECT_ATTN_ERROR(
      cache.append_packed(
          torch::randn({4, 1, 8}), torch::randn({4, 1, 8}), torch::tensor({0, 1, 4})),
      "KVCache: packed keys must be (total, H, D) = (total, 3, 8) and values (total, H, Dv) with "
      "Dv = 8 as the cached ones, got keys [4, 1, 8]");
  EXPECT_ATTN_ERROR(
      cache.append_packed(
          torch::randn({4, 3, 8}), torch::randn({4, 3, 8}), torch::tensor({0, 1, 3})),
      "KVCache: cu_seqlens must end at the total length 4, got 3");
  EXPECT_ATTN_ERROR(
      cache.append_packed(
          torch::randn({2, 4, 3, 8}), torch::randn({2, 4, 3, 8}), torch::tensor({0, 4})),
      "KVCache: packed keys must be (total, H, D) and values (total, H, Dv), got keys [2, 4, 3, 8]");
  EXPECT_ATTN_ERROR(
      cache.append(k.to(torch::kDouble), k.to(torch::kDouble)),
      "KVCache: keys and values must have the cached dtype Float and device cpu, got Double on cpu");
  EXPECT_ATTN_ERROR(
      cache.append(torch::randn({2, 3, 8}), torch::randn({2, 3, 8})),
      "KVCache: keys must be (B, H, T, D) and values (B, H, T, Dv), got keys [2, 3, 8]");
  EXPECT_ATTN_ERROR(
      cache.append(k, k.to(torch::kDouble)),
      "KVCache: keys and values must share dtype and device, got keys Float on cpu and values Double on cpu");
  EXPECT_ATTN_ERROR(
      cache.append(k, torch::Tensor()), "KVCache: keys and values must be defined tensors");
  torch::AutoGradMode grad(true);
  const auto tracked = k.clone().requires_grad_();
  EXPECT_ATTN_ERROR(
      cache.append(tracked, tracked),
      "KVCache: the cache holds inference state and cannot carry gradients; decode under "
      "torch::NoGradGuard");
  EXPECT_EQ(cache.length(), 4); // failed appends change nothing
}

struct DecodeCase {
  int64_t kv_heads;
  bool rotary;
  int64_t window;     // 0: none
  int64_t max_length; // 0: growing cache
  bool need_weights;
};

std::ostream& operator<<(std::ostream& os, const DecodeCase& c) {
  return os << "kv_heads=" << c.kv_heads << " rotary=" << c.rotary << " window=" << c.window
            << " max_length=" << c.max_length << " need_weights=" << c.need_weights;
}

class KVCacheDecoding : public ::testing::TestWithParam<DecodeCase> {};

TEST_P(KVCacheDecoding, PrefillThenTokenByTokenEqualsOneCausalForward) {
  const auto& c = GetParam();
  torch::manual_seed(3);
  auto options = MultiHeadAttentionOptions(32, 4).num_kv_heads(c.kv_heads);
  if (c.rotary) {
    options.rotary(attn::RotaryEmbeddingOptions(8));
  }
  MultiHeadAttention mha(options);
  mha->eval();
  torch::NoGradGuard no_grad;
  constexpr int64_t B = 3, T = 21, prefill = 6;
  const auto x = torch::randn({B, T, 32});
  auto forward_options = attn::MultiHeadAttentionForwardOptions().is_causal(true).need_weights(
      c.need_weights);
  if (c.window > 0) {
    forward_options.window(c.window);
  }
  const auto [full, full_w] = mha(x, x, x, forward_options);

  KVCache cache = c.max_length > 0 ? KVCache(c.max_length) : KVCache();
  std::vector<torch::Tensor> outputs;
  for (int64_t t = 0; t < T;) {
    const int64_t n = t == 0 ? prefill : 1; // a prompt, then one token per step
    const auto chunk = x.narrow(1, t, n);
    const auto [out, w] = mha(
        chunk, chunk, chunk,
        attn::MultiHeadAttentionForwardOptions(forward_options).kv_cache(&cache));
    outputs.push_back(out);
    if (c.need_weights) {
      ASSERT_EQ(w.sizes(), torch::IntArrayRef({B, 4, n, t + n}));
      EXPECT_CLOSE(w, full_w.narrow(2, t, n).narrow(3, 0, t + n), attn::testing::Tolerance{1e-6})
          << "t=" << t;
    }
    t += n;
    EXPECT_EQ(cache.length(), t);
  }
  EXPECT_CLOSE(torch::cat(outputs, 1), full, attn::testing::Tolerance{1e-5});
  EXPECT_EQ(cache.keys().sizes(), torch::IntArrayRef({B, c.kv_heads, T, 8}));
}

INSTANTIATE_TEST_SUITE_P(
    Cases,
    KVCacheDecoding,
    ::testing::Values(
        DecodeCase{4, false, 0, 0, false},
        DecodeCase{4, false, 0, 21, true},
        DecodeCase{2, false, 0, 0, true},
        DecodeCase{1, true, 0, 32, false},
        DecodeCase{4, true, 0, 0, true},
        DecodeCase{2, true, 0, 0, false},
        DecodeCase{2, true, 5, 0, false},
        DecodeCase{4, false, 3, 0, true}));

} // namespace
