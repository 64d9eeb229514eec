// attn::MultiHeadAttention's features beyond the built-in: grouped-query
// attention, rotary embeddings, the KV cache and sliding windows, each
// against a plainer computation of the same thing.

#include "test_support.h"

#include <attn/kv_cache.h>
#include <attn/modules/multi_head_attention.h>

#include <sstream>
#include <type_traits>

namespace {

using attn::KVCache;
using attn::MultiHeadAttention;
using attn::MultiHeadAttentionForwardOptions;
using attn::MultiHeadAttentionOptions;
using attn::RotaryEmbeddingOptions;
using attn::testing::band_mask;
using attn::testing::max_abs_diff;

// `grouped`'s K/V projections with every kv head's rows repeated for the
// query heads that share it: the ordinary multi-head module it equals.
MultiHeadAttention with_repeated_kv_heads(const attn::MultiHeadAttentionImpl& grouped) {
  const auto& o = grouped.options;
  const int64_t D = o.embed_dim() / o.num_heads();
  const int64_t kv_heads = o.num_kv_heads().value_or(o.num_heads());
  const int64_t group = o.num_heads() / kv_heads;
  MultiHeadAttention full(MultiHeadAttentionOptions(o.embed_dim(), o.num_heads())
                              .kdim(o.kdim())
                              .vdim(o.vdim())
                              .bias(o.bias())
                              .rotary(o.rotary()));
  torch::NoGradGuard no_grad;
  const auto repeat = [&](const torch::Tensor& t) { // (H_kv·D, ...) -> (H·D, ...)
    auto heads = t.unflatten(0, {kv_heads, D});
    return heads.repeat_interleave(group, 0).flatten(0, 1);
  };
  full->q_proj->weight.copy_(grouped.q_proj->weight);
  full->out_proj->weight.copy_(grouped.out_proj->weight);
  full->k_proj->weight.copy_(repeat(grouped.k_proj->weight));
  full->v_proj->weight.copy_(repeat(grouped.v_proj->weight));
  if (o.bias()) {
    full->q_proj->bias.copy_(grouped.q_proj->bias);
    full->out_proj->bias.copy_(grouped.out_proj->bias);
    full->k_proj->bias.copy_(repeat(grouped.k_proj->bias));
    full->v_proj->bias.copy_(repeat(grouped.v_proj->bias));
  }
  return full;
}

TEST(GroupedQueryAttention, EqualsMultiHeadAttentionWithRepeatedKeyValueWeights) {
  torch::manual_seed(1);
  for (const int64_t kv_heads : {1, 2, 4}) {
    for (const bool self : {true, false}) {
      SCOPED_TRACE(::testing::Message() << "num_kv_heads=" << kv_heads << " self=" << self);
      MultiHeadAttention grouped(
          MultiHeadAttentionOptions(32, 8).num_kv_heads(kv_heads).kdim(self ? 32 : 12).vdim(self ? 32 : 20));
      EXPECT_EQ(grouped->k_proj->weight.sizes(), torch::IntArrayRef({kv_heads * 4, self ? 32 : 12}));
      auto full = with_repeated_kv_heads(*grouped);
      auto x = torch::randn({3, 9, 32}, torch::requires_grad());
      auto k = self ? x : torch::randn({3, 11, 12}, torch::requires_grad());
      auto v = self ? x : torch::randn({3, 11, 20}, torch::requires_grad());
      for (const bool need_weights : {true, false}) {
        const auto options =
            MultiHeadAttentionForwardOptions().is_causal(true).need_weights(need_weights);
        const auto [out, w] = grouped(x, k, v, options);
        const auto [expected, expected_w] = full(x, k, v, options);
        EXPECT_LE(max_abs_diff(out, expected), 1e-5);
        if (need_weights) {
          EXPECT_EQ(w.sizes(), torch::IntArrayRef({3, 8, 9, self ? 9 : 11}));
          EXPECT_LE(max_abs_diff(w, expected_w), 1e-6);
        }
        const auto upstream = torch::randn(out.sizes());
        const auto grads = torch::autograd::grad({out}, {x}, {upstream});
        const auto expected_grads = torch::autograd::grad({expected}, {x}, {upstream});
        EXPECT_LE(max_abs_diff(grads[0], expected_grads[0]), 1e-5);
      }
    }
  }
}

TEST(RotaryMultiHeadAttention, RotatesQueriesAndKeysOfEveryHeadBeforeAttention) {
  torch::manual_seed(2);
  MultiHeadAttention mha(MultiHeadAttentionOptions(32, 4).rotary(RotaryEmbeddingOptions(6)));
  ASSERT_TRUE(mha->rotary);
  mha->to(torch::kDouble);
  const auto x = torch::randn({2, 7, 32}, torch::kDouble);
  const auto [out, w] = mha(x, x, x, MultiHeadAttentionForwardOptions().is_causal(true));

  // The same computation written out: project, split heads, rotate, attend
  // (the float64 loop reference), merge, project.
  const auto heads = [](const torch::Tensor& t) { return t.view({2, 7, 4, 8}).transpose(1, 2); };
  const auto q = mha->rotary(heads(mha->q_proj(x)));
  const auto k = mha->rotary(heads(mha->k_proj(x)));
  const auto v = heads(mha->v_proj(x));
  const auto causal = torch::zeros({7, 7}, torch::kDouble)
                          .masked_fill(band_mask(7, 7, 0, true, 0).logical_not(), -INFINITY);
  const auto [ref_heads, ref_w] = attn::testing::reference_attention(
      q.reshape({8, 7, 8}), k.reshape({8, 7, 8}), v.reshape({8, 7, 8}),
      causal.expand({8, 7, 7}), 1.0 / std::sqrt(8.0));
  const auto expected = mha->out_proj(ref_heads.view({2, 4, 7, 8}).transpose(1, 2).reshape({2, 7, 32}));
  EXPECT_LE(max_abs_diff(out, expected), 1e-12);
  EXPECT_LE(max_abs_diff(w, ref_w.view({2, 4, 7, 7})), 1e-12);
}

struct DecodeCase {
  int64_t kv_heads;
  bool rotary;
  int64_t window; // 0: none
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
    options.rotary(RotaryEmbeddingOptions(8));
  }
  MultiHeadAttention mha(options);
  mha->eval();
  torch::NoGradGuard no_grad;
  constexpr int64_t B = 3, T = 21, prefill = 6;
  const auto x = torch::randn({B, T, 32});
  auto forward_options = MultiHeadAttentionForwardOptions().is_causal(true).need_weights(c.need_weights);
  if (c.window > 0) {
    forward_options.window(c.window);
  }
  const auto [full, full_w] = mha(x, x, x, forward_options);

  KVCache cache = c.max_length > 0 ? KVCache(c.max_length) : KVCache();
  std::vector<torch::Tensor> outputs;
  for (int64_t t = 0; t < T;) {
    const int64_t n = t == 0 ? prefill : 1; // a prompt, then one token per step
    const auto chunk = x.narrow(1, t, n);
    const auto [out, w] = mha(chunk, chunk, chunk, MultiHeadAttentionForwardOptions(forward_options).kv_cache(&cache));
    outputs.push_back(out);
    if (c.need_weights) {
      ASSERT_EQ(w.sizes(), torch::IntArrayRef({B, 4, n, t + n}));
      EXPECT_LE(max_abs_diff(w, full_w.narrow(2, t, n).narrow(3, 0, t + n)), 1e-6) << "t=" << t;
    }
    t += n;
    EXPECT_EQ(cache.length(), t);
  }
  EXPECT_LE(max_abs_diff(torch::cat(outputs, 1), full), 1e-5);
  EXPECT_EQ(cache.keys().sizes(), torch::IntArrayRef({B, c.kv_heads, T, 8}));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, KVCacheDecoding,
    ::testing::Values(DecodeCase{4, false, 0, 0, false}, DecodeCase{4, false, 0, 21, true},
                      DecodeCase{2, false, 0, 0, true}, DecodeCase{1, true, 0, 32, false},
                      DecodeCase{4, true, 0, 0, true}, DecodeCase{2, true, 0, 0, false},
                      DecodeCase{2, true, 5, 0, false}, DecodeCase{4, false, 3, 0, true}));

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
  EXPECT_ATTN_ERROR(cache.append(k.narrow(2, 0, 1), k.narrow(2, 0, 1)),
                    "KVCache: appending 1 tokens to the 8 cached would exceed max_length 8 "
                    "(reset() to start another sequence)");
  cache.reset();
  const auto [again, unused2] = cache.append(k, k);
  EXPECT_EQ(again.data_ptr(), storage);
}

TEST(KVCache, ClonesBranchIndependentlyAndCopiesAreRefused) {
  static_assert(!std::is_copy_constructible_v<KVCache> && !std::is_copy_assignable_v<KVCache>,
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

TEST(KVCacheErrors, NameWhatWasExpectedAndWhatArrived) {
  torch::NoGradGuard no_grad;
  EXPECT_ATTN_ERROR(KVCache(0), "KVCache: max_length must be positive, got 0");
  KVCache cache;
  const auto k = torch::randn({2, 3, 4, 8});
  cache.append(k, k);
  EXPECT_ATTN_ERROR(cache.append(torch::randn({3, 3, 1, 8}), torch::randn({3, 3, 1, 8})),
                    "KVCache: keys must be (B, H, T, D) = (2, 3, T, 8) and values (B, H, T, Dv) with "
                    "Dv = 8 as the cached ones (reset() to start another batch), got keys [3, 3, 1, 8]");
  EXPECT_ATTN_ERROR(cache.append(k.to(torch::kDouble), k.to(torch::kDouble)),
                    "KVCache: keys and values must have the cached dtype Float and device cpu, got Double on cpu");
  EXPECT_ATTN_ERROR(cache.append(torch::randn({2, 3, 8}), torch::randn({2, 3, 8})),
                    "KVCache: keys must be (B, H, T, D) and values (B, H, T, Dv), got keys [2, 3, 8]");
  EXPECT_ATTN_ERROR(cache.append(k, k.to(torch::kDouble)),
                    "KVCache: keys and values must share dtype and device, got keys Float on cpu and values Double on cpu");
  EXPECT_ATTN_ERROR(cache.append(k, torch::Tensor()), "KVCache: keys and values must be defined tensors");
  torch::AutoGradMode grad(true);
  const auto tracked = k.clone().requires_grad_();
  EXPECT_ATTN_ERROR(cache.append(tracked, tracked),
                    "KVCache: the cache holds inference state and cannot carry gradients; decode under "
                    "torch::NoGradGuard");
  EXPECT_EQ(cache.length(), 4); // failed appends change nothing
}

TEST(SlidingWindowAttention, EqualsAnExplicitBandMask) {
  torch::manual_seed(4);
  for (const bool extra_keys : {false, true}) {
    MultiHeadAttention mha(MultiHeadAttentionOptions(16, 2).add_bias_kv(extra_keys).add_zero_attn(extra_keys));
    const auto x = torch::randn({2, 140, 16});
    for (const bool causal : {true, false}) {
      for (const bool need_weights : {true, false}) {
        SCOPED_TRACE(::testing::Message() << "extra_keys=" << extra_keys << " causal=" << causal
                                          << " need_weights=" << need_weights);
        const auto [windowed, w] = mha(
            x, x, x,
            MultiHeadAttentionForwardOptions().is_causal(causal).window(9).need_weights(need_weights));
        const auto [masked, w_masked] = mha(
            x, x, x,
            MultiHeadAttentionForwardOptions().attn_mask(band_mask(140, 140, 0, causal, 9)).need_weights(need_weights));
        EXPECT_LE(max_abs_diff(windowed, masked), 1e-6);
        if (need_weights) {
          EXPECT_LE(max_abs_diff(w, w_masked), 1e-7);
          // The appended keys stay visible to every query.
          const auto S = 140 + (extra_keys ? 2 : 0);
          EXPECT_EQ(w.size(3), S);
          const auto outside_window = band_mask(140, 140, 0, causal, 9).logical_not();
          EXPECT_EQ(w.narrow(3, 0, 140).masked_select(outside_window).abs().max().item<float>(), 0.0f);
        }
      }
    }
  }
}

TEST(MultiHeadAttention, PrettyPrintsTheModernOptions) {
  std::ostringstream printed;
  printed << *MultiHeadAttention(MultiHeadAttentionOptions(64, 8)
                                     .num_kv_heads(2)
                                     .rotary(RotaryEmbeddingOptions(8))
                                     .add_bias_kv(true)
                                     .add_zero_attn(true));
  EXPECT_EQ(printed.str(),
            "attn::MultiHeadAttention(embed_dim=64, num_heads=8, num_kv_heads=2, dropout=0, bias=true, "
            "kdim=64, vdim=64, batch_first=true, rotary_dim=8, add_bias_kv=true, add_zero_attn=true)(\n"
            "  (q_proj): torch::nn::Linear(in_features=64, out_features=64, bias=true)\n"
            "  (k_proj): torch::nn::Linear(in_features=64, out_features=16, bias=true)\n"
            "  (v_proj): torch::nn::Linear(in_features=64, out_features=16, bias=true)\n"
            "  (out_proj): torch::nn::Linear(in_features=64, out_features=64, bias=true)\n"
            "  (rotary): attn::RotaryEmbedding(dim=8, base=10000, interleaved=false)\n"
            ")");
}

TEST(MultiHeadAttentionErrors, ModernOptionsNameWhatWasExpectedAndWhatArrived) {
  EXPECT_ATTN_ERROR(MultiHeadAttention(MultiHeadAttentionOptions(64, 8).num_kv_heads(3)),
                    "MultiHeadAttention: num_kv_heads must be positive and divide num_heads, got num_heads=8 "
                    "and num_kv_heads=3");
  EXPECT_ATTN_ERROR(MultiHeadAttention(MultiHeadAttentionOptions(64, 8).num_kv_heads(0)),
                    "num_kv_heads must be positive and divide num_heads");
  EXPECT_ATTN_ERROR(MultiHeadAttention(MultiHeadAttentionOptions(64, 8).rotary(RotaryEmbeddingOptions(16))),
                    "MultiHeadAttention: rotary dim must be at most the head width embed_dim / num_heads = 8, got 16");
  EXPECT_ATTN_ERROR(MultiHeadAttention(MultiHeadAttentionOptions(64, 8).rotary(RotaryEmbeddingOptions(5))),
                    "RotaryEmbedding: dim must be a positive even number of features (they rotate in pairs), got 5");

  torch::NoGradGuard no_grad;
  MultiHeadAttention mha(MultiHeadAttentionOptions(16, 4).num_kv_heads(2));
  const auto x = torch::randn({2, 3, 16});
  KVCache small(4);
  mha(x, x, x, MultiHeadAttentionForwardOptions().kv_cache(&small));
  EXPECT_ATTN_ERROR(mha(x, x, x, MultiHeadAttentionForwardOptions().kv_cache(&small)),
                    "KVCache: appending 3 tokens to the 3 cached would exceed max_length 4");
  KVCache cache;
  mha(x, x, x, MultiHeadAttentionForwardOptions().kv_cache(&cache));
  const auto other_batch = torch::randn({5, 1, 16});
  EXPECT_ATTN_ERROR(mha(other_batch, other_batch, other_batch, MultiHeadAttentionForwardOptions().kv_cache(&cache)),
                    "KVCache: keys must be (B, H, T, D) = (2, 2, T, 4)");
  const auto as_double = x.to(torch::kDouble);
  mha->to(torch::kDouble);
  EXPECT_ATTN_ERROR(mha(as_double, as_double, as_double, MultiHeadAttentionForwardOptions().kv_cache(&cache)),
                    "KVCache: keys and values must have the cached dtype Float");
  mha->to(torch::kFloat);
  EXPECT_ATTN_ERROR(mha(x, x, x, MultiHeadAttentionForwardOptions().kv_cache(&cache).attn_mask(torch::ones({3, 3}, torch::kBool))),
                    "attn_mask must be (L, S) = [3, 6], (B·H, L, S) = [8, 3, 6] or (B, H, L, S) = [2, 4, 3, 6] "
                    "(B and H may be 1), S counting the cached keys, got [3, 3]");
  EXPECT_ATTN_ERROR(mha(x, x, x, MultiHeadAttentionForwardOptions().kv_cache(&cache).window(0)),
                    "MultiHeadAttention: window must be a positive number of keys, got 0");
  EXPECT_EQ(cache.length(), 3); // a call that fails leaves the cache as it was
  MultiHeadAttention extra(MultiHeadAttentionOptions(16, 4).add_bias_kv(true));
  EXPECT_ATTN_ERROR(extra(x, x, x, MultiHeadAttentionForwardOptions().kv_cache(&cache)),
                    "MultiHeadAttention: a kv_cache cannot be combined with add_bias_kv or add_zero_attn");
}

} // namespace
