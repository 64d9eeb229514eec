// attn::MultiHeadAttention (src/modules/multi_head_attention.cpp): shapes,
// layouts, masks, dropout, devices, printing and errors, and its features
// beyond the built-in (grouped-query attention, rotary embeddings, sliding
// windows), each against a plainer computation of the same thing. Parity
// with the built-in is in test_parity.cpp, decoding with a KV cache in
// test_kv_cache.cpp.

#include "bad_input_catalogue.h"
#include "test_support.h"

#include <attn/functional.h>
#include <attn/kv_cache.h>
#include <attn/modules/multi_head_attention.h>

#include <cmath>
#include <sstream>

namespace {

using attn::KVCache;
using attn::MultiHeadAttention;
using attn::MultiHeadAttentionForwardOptions;
using attn::MultiHeadAttentionOptions;
using attn::RotaryEmbeddingOptions;
using attn::testing::additive_bias;
using attn::testing::band_mask;
using attn::testing::kFloat64Tolerance;
using attn::testing::Tolerance;

// Most of these tests read the weights, which a call returns when asked.
MultiHeadAttentionForwardOptions mha_with_weights() {
  return MultiHeadAttentionForwardOptions().need_weights(true);
}

TEST(MultiHeadAttention, GivesTheShapesOfTheDemoConfiguration) {
  // batch 4, 20 tokens, d_model 512, 8 heads, self-attention.
  MultiHeadAttention mha(MultiHeadAttentionOptions(512, 8));
  torch::nn::MultiheadAttention builtin(torch::nn::MultiheadAttentionOptions(512, 8));
  const auto x = torch::randn({4, 20, 512});
  const auto [out, w] = mha(x, x, x, mha_with_weights());
  EXPECT_EQ(out.sizes(), torch::IntArrayRef({4, 20, 512}));
  EXPECT_EQ(w.sizes(), torch::IntArrayRef({4, 8, 20, 20}));
  const auto x_seq_first = x.transpose(0, 1);
  const auto builtin_out = std::get<0>(builtin(x_seq_first, x_seq_first, x_seq_first));
  EXPECT_EQ(builtin_out.transpose(0, 1).sizes(), torch::IntArrayRef({4, 20, 512}));
}

TEST(MultiHeadAttention, MatchesAPlainFloat64CompositionWithDistinctKdimAndVdim) {
  // The built-in needs key and value of one width; check kdim != vdim
  // against projections and per-head attention written out here.
  torch::manual_seed(20);
  constexpr int64_t B = 2, L = 3, S = 5, E = 8, H = 2, D = E / H, kdim = 6, vdim = 10;
  MultiHeadAttention mha(MultiHeadAttentionOptions(E, H).kdim(kdim).vdim(vdim));
  mha->to(torch::kDouble);
  {
    torch::NoGradGuard no_grad;
    for (auto& p : mha->parameters()) {
      p.normal_(); // non-zero biases too
    }
  }
  const auto q = torch::randn({B, L, E}, torch::kDouble);
  const auto k = torch::randn({B, S, kdim}, torch::kDouble);
  const auto v = torch::randn({B, S, vdim}, torch::kDouble);
  const auto [out, w] = mha(q, k, v, mha_with_weights());

  const auto project = [](const torch::Tensor& x, const torch::nn::Linear& p) {
    return torch::matmul(x, p->weight.t()) + p->bias;
  };
  const auto heads = [&](const torch::Tensor& x, int64_t T, int64_t h) {
    return x.reshape({B, T, H, D}).select(2, h); // (B, T, D)
  };
  const auto Q = project(q, mha->q_proj), K = project(k, mha->k_proj), V = project(v, mha->v_proj);
  std::vector<torch::Tensor> head_outputs, head_weights;
  for (int64_t h = 0; h < H; ++h) {
    const auto [o, hw] = attn::testing::reference_attention(
        heads(Q, L, h), heads(K, S, h), heads(V, S, h), {}, 1.0 / std::sqrt(D));
    head_outputs.push_back(o);
    head_weights.push_back(hw);
  }
  const auto expected = project(torch::cat(head_outputs, -1), mha->out_proj);
  EXPECT_CLOSE(out, expected, kFloat64Tolerance);
  EXPECT_CLOSE(w, torch::stack(head_weights, 1), kFloat64Tolerance);
}

TEST(MultiHeadAttention, SequenceFirstLayoutIsTheTransposeOfBatchFirst) {
  torch::manual_seed(21);
  MultiHeadAttention batch_first(MultiHeadAttentionOptions(16, 4));
  MultiHeadAttention seq_first(MultiHeadAttentionOptions(16, 4).batch_first(false));
  attn::testing::copy_parameters(*batch_first, *seq_first);
  const auto q = torch::randn({3, 5, 16});
  const auto kv = torch::randn({3, 7, 16});
  const auto [out_bf, w_bf] = batch_first(q, kv, kv, mha_with_weights());
  const auto [out_sf, w_sf] = seq_first(
      q.transpose(0, 1), kv.transpose(0, 1), kv.transpose(0, 1), mha_with_weights());
  EXPECT_EQ(out_sf.sizes(), torch::IntArrayRef({5, 3, 16}));
  EXPECT_TRUE(out_sf.is_contiguous());
  EXPECT_CLOSE(out_sf.transpose(0, 1), out_bf, Tolerance{1e-6});
  EXPECT_CLOSE(w_sf, w_bf, Tolerance{1e-6});
}

TEST(MultiHeadAttention, AveragedWeightsAreTheMeanOverHeads) {
  torch::manual_seed(22);
  MultiHeadAttention mha(MultiHeadAttentionOptions(16, 4));
  const auto x = torch::randn({2, 5, 16});
  const auto [out, per_head] = mha(x, x, x, mha_with_weights());
  const auto [out_avg, averaged] = mha(x, x, x, mha_with_weights().average_attn_weights(true));
  EXPECT_EQ(per_head.sizes(), torch::IntArrayRef({2, 4, 5, 5}));
  EXPECT_EQ(averaged.sizes(), torch::IntArrayRef({2, 5, 5}));
  EXPECT_TRUE(torch::equal(out, out_avg));
  EXPECT_CLOSE(averaged, per_head.mean(1), Tolerance{1e-7});
}

TEST(MultiHeadAttention, WeightsOnlyWhenAskedForAndTheSameOutputEitherWay) {
  torch::manual_seed(23);
  MultiHeadAttention mha(MultiHeadAttentionOptions(16, 2));
  const auto x = torch::randn({2, 5, 16});
  const auto [out, w] = mha(x, x, x, mha_with_weights());
  const auto [out_default, none] = mha(x, x, x);
  EXPECT_TRUE(w.defined());
  EXPECT_FALSE(none.defined());
  EXPECT_CLOSE(out, out_default, Tolerance{1e-6}); // fused vs materialised kernel
}

TEST(MultiHeadAttention, FullyMaskedQueriesGetZeroAttentionAndFiniteGradients) {
  // The built-in returns NaN here; a query with nothing to attend to gets a
  // zero attention output, so the module returns out_proj's bias.
  torch::manual_seed(24);
  MultiHeadAttention mha(MultiHeadAttentionOptions(16, 4));
  {
    torch::NoGradGuard no_grad;
    mha->out_proj->bias.normal_();
  }
  const auto x = torch::randn({2, 5, 16}, torch::requires_grad());
  auto padding = torch::zeros({2, 5}, torch::kBool);
  padding[1].fill_(true); // every key of sequence 1 is padding
  auto allowed = torch::ones({5, 5}, torch::kBool);
  allowed[2].fill_(false); // query 2 may attend to nothing

  const auto [out, w] = mha(
      x, x, x, mha_with_weights().key_padding_mask(padding).attn_mask(allowed));
  const auto bias = mha->out_proj->bias.expand({5, 16});
  EXPECT_CLOSE(out[1], bias, Tolerance{1e-7});
  EXPECT_CLOSE(out[0][2], mha->out_proj->bias, Tolerance{1e-7});
  EXPECT_EQ(w[1].abs().max().item<float>(), 0.0f);
  EXPECT_EQ(w[0].select(1, 2).abs().max().item<float>(), 0.0f);
  EXPECT_TRUE(torch::isfinite(out).all().item<bool>());

  (out.pow(2).sum() + w.pow(2).sum()).backward();
  EXPECT_TRUE(torch::isfinite(x.grad()).all().item<bool>());
  for (const auto& parameter : mha->parameters()) {
    EXPECT_TRUE(torch::isfinite(parameter.grad()).all().item<bool>());
  }
}

TEST(MultiHeadAttention, BoolAndFloatMasksAgree) {
  torch::manual_seed(25);
  MultiHeadAttention mha(MultiHeadAttentionOptions(16, 4));
  const auto q = torch::randn({3, 4, 16});
  const auto kv = torch::randn({3, 6, 16});
  auto padding = torch::rand({3, 6}) > 0.7;
  padding.select(1, 0).fill_(false);
  const auto allowed = torch::rand({4, 6}) > 0.3;
  const auto padding_float = additive_bias(padding.logical_not()).to(torch::kFloat);
  const auto allowed_float = additive_bias(allowed).to(torch::kFloat);

  const auto run = [&](const torch::Tensor& pad, const torch::Tensor& mask) {
    return mha(q, kv, kv, mha_with_weights().key_padding_mask(pad).attn_mask(mask));
  };
  const auto [out, w] = run(padding, allowed);
  for (const auto& [pad, mask] :
       {std::pair{padding_float, allowed}, std::pair{padding, allowed_float},
        std::pair{padding_float, allowed_float}}) {
    const auto [out2, w2] = run(pad, mask);
    EXPECT_CLOSE(out2, out, Tolerance{1e-7});
    EXPECT_CLOSE(w2, w, Tolerance{1e-7});
  }
  // Padding keys get no weight from any query.
  EXPECT_EQ(
      w.masked_select(padding.view({3, 1, 1, 6}).expand_as(w)).abs().max().item<float>(), 0.0f);
}

TEST(MultiHeadAttention, AttnMaskShapesAreEquivalent) {
  torch::manual_seed(26);
  constexpr int64_t B = 2, H = 4, L = 3, S = 5;
  MultiHeadAttention mha(MultiHeadAttentionOptions(16, H));
  const auto q = torch::randn({B, L, 16});
  const auto kv = torch::randn({B, S, 16});
  const auto mask = torch::randn({L, S});
  const auto run = [&](const torch::Tensor& m) {
    return std::get<0>(mha(q, kv, kv, mha_with_weights().attn_mask(m)));
  };
  const auto expected = run(mask);
  EXPECT_CLOSE(run(mask.expand({B * H, L, S})), expected, Tolerance{1e-7});
  EXPECT_CLOSE(run(mask.expand({B, H, L, S})), expected, Tolerance{1e-7});
  EXPECT_CLOSE(run(mask.view({1, 1, L, S})), expected, Tolerance{1e-7});

  // (B·H, L, S) is batch-major: entry b·H + h belongs to batch b, head h.
  auto per_head = torch::zeros({B, H, L, S}, torch::kBool).logical_not();
  per_head[1][2][0].fill_(false);
  per_head[1][2][0][4] = true; // batch 1, head 2, query 0 sees only key 4
  const auto [out, w] = mha(q, kv, kv, mha_with_weights().attn_mask(per_head.view({B * H, L, S})));
  EXPECT_FLOAT_EQ(w[1][2][0][4].item<float>(), 1.0f);
  EXPECT_LT(w[0][2][0][4].item<float>(), 1.0f);
}

TEST(MultiHeadAttention, CausalEqualsALowerTriangularMask) {
  torch::manual_seed(27);
  MultiHeadAttention mha(MultiHeadAttentionOptions(16, 2));
  const auto x = torch::randn({2, 6, 16});
  const auto [out_causal, w_causal] = mha(x, x, x, mha_with_weights().is_causal(true));
  const auto lower = torch::ones({6, 6}, torch::kBool).tril();
  const auto [out_mask, w_mask] = mha(x, x, x, mha_with_weights().attn_mask(lower));
  EXPECT_TRUE(torch::equal(out_causal, out_mask));
  EXPECT_TRUE(torch::equal(w_causal, w_mask));
}

TEST(MultiHeadAttention, DropsWeightsOnlyInTrainingMode) {
  torch::manual_seed(28);
  MultiHeadAttention mha(MultiHeadAttentionOptions(16, 2).dropout(0.5));
  const auto x = torch::randn({2, 8, 16});
  mha->eval();
  const auto [out_a, w_a] = mha(x, x, x, mha_with_weights());
  const auto [out_b, w_b] = mha(x, x, x, mha_with_weights());
  EXPECT_TRUE(torch::equal(out_a, out_b));
  EXPECT_EQ((w_a == 0).sum().item<int64_t>(), 0);
  mha->train();
  const auto [out_train, w_train] = mha(x, x, x, mha_with_weights());
  EXPECT_GT((w_train == 0).sum().item<int64_t>(), 0);
}

TEST(MultiHeadAttention, FollowsToDtypeAndRejectsInputsOfAnotherDtype) {
  MultiHeadAttention mha(MultiHeadAttentionOptions(16, 2));
  mha->to(torch::kDouble);
  const auto x = torch::randn({2, 3, 16}, torch::kDouble);
  const auto [out, w] = mha(x, x, x, mha_with_weights());
  EXPECT_EQ(out.scalar_type(), torch::kDouble);
  const auto x32 = x.to(torch::kFloat);
  EXPECT_ATTN_ERROR(
      mha(x32, x32, x32, mha_with_weights()),
      "MultiHeadAttention: inputs must have the module's dtype Double, got query Float, key Float, value Float (convert one with .to())");
}

TEST(MultiHeadAttention, RejectsInputsOnAnotherDevice) {
  ATTN_SKIP_IF_UNAVAILABLE(torch::Device(torch::kCUDA));
  MultiHeadAttention mha(MultiHeadAttentionOptions(16, 2));
  const auto x = torch::randn({2, 3, 16}, torch::kCUDA);
  EXPECT_ATTN_ERROR(
      mha(x, x, x, mha_with_weights()),
      "MultiHeadAttention: inputs must be on the module's device cpu, got query on cuda:0");
}

TEST(MultiHeadAttention, CloneHasEqualButIndependentParameters) {
  MultiHeadAttention mha(MultiHeadAttentionOptions(16, 2).dropout(0.1));
  auto copy = std::dynamic_pointer_cast<attn::MultiHeadAttentionImpl>(mha->clone());
  ASSERT_TRUE(copy);
  EXPECT_EQ(copy->options.dropout(), 0.1);
  EXPECT_TRUE(torch::equal(copy->q_proj->weight, mha->q_proj->weight));
  {
    torch::NoGradGuard no_grad;
    copy->q_proj->weight.add_(1.0);
  }
  EXPECT_FALSE(torch::equal(copy->q_proj->weight, mha->q_proj->weight));
}

TEST(MultiHeadAttention, InitialisesLikeTheBuiltin) {
  // Xavier-uniform over the packed (3E, E) in-projection: bound
  // sqrt(6 / (E + 3E)); biases start at zero.
  constexpr int64_t E = 64;
  MultiHeadAttention mha(MultiHeadAttentionOptions(E, 4));
  const double bound = std::sqrt(6.0 / (4 * E));
  for (const auto& projection : {mha->q_proj, mha->k_proj, mha->v_proj}) {
    const double largest = projection->weight.abs().max().item<double>();
    EXPECT_LE(largest, bound);
    EXPECT_GT(largest, 0.95 * bound); // 4096 uniform draws reach near the bound
  }
  for (const auto& projection : {mha->q_proj, mha->k_proj, mha->v_proj, mha->out_proj}) {
    EXPECT_EQ(projection->bias.abs().max().item<float>(), 0.0f);
  }
}

TEST(MultiHeadAttention, PrettyPrintsLikeATorchModule) {
  std::ostringstream printed;
  printed << *MultiHeadAttention(MultiHeadAttentionOptions(512, 8).dropout(0.1).kdim(256));
  EXPECT_EQ(
      printed.str(),
      "attn::MultiHeadAttention(embed_dim=512, num_heads=8, dropout=0.1, bias=true, kdim=256, vdim=512, batch_first=true)(\n"
      "  (q_proj): torch::nn::Linear(in_features=512, out_features=512, bias=true)\n"
      "  (k_proj): torch::nn::Linear(in_features=256, out_features=512, bias=true)\n"
      "  (v_proj): torch::nn::Linear(in_features=512, out_features=512, bias=true)\n"
      "  (out_proj): torch::nn::Linear(in_features=512, out_features=512, bias=true)\n"
      ")");
}

TEST(MultiHeadAttention, PrettyPrintsTheModernOptions) {
  std::ostringstream printed;
  printed << *MultiHeadAttention(MultiHeadAttentionOptions(64, 8)
                                     .num_kv_heads(2)
                                     .rotary(RotaryEmbeddingOptions(8))
                                     .add_bias_kv(true)
                                     .add_zero_attn(true));
  EXPECT_EQ(
      printed.str(),
      "attn::MultiHeadAttention(embed_dim=64, num_heads=8, num_kv_heads=2, dropout=0, bias=true, "
      "kdim=64, vdim=64, batch_first=true, rotary_dim=8, add_bias_kv=true, add_zero_attn=true)(\n"
      "  (q_proj): torch::nn::Linear(in_features=64, out_features=64, bias=true)\n"
      "  (k_proj): torch::nn::Linear(in_features=64, out_features=16, bias=true)\n"
      "  (v_proj): torch::nn::Linear(in_features=64, out_features=16, bias=true)\n"
      "  (out_proj): torch::nn::Linear(in_features=64, out_features=64, bias=true)\n"
      "  (rotary): attn::RotaryEmbedding(dim=8, base=10000, interleaved=false)\n"
      ")");
}

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
      MultiHeadAttention grouped(MultiHeadAttentionOptions(32, 8)
                                     .num_kv_heads(kv_heads)
                                     .kdim(self ? 32 : 12)
                                     .vdim(self ? 32 : 20));
      EXPECT_EQ(
          grouped->k_proj->weight.sizes(), torch::IntArrayRef({kv_heads * 4, self ? 32 : 12}));
      auto full = with_repeated_kv_heads(*grouped);
      auto x = torch::randn({3, 9, 32}, torch::requires_grad());
      auto k = self ? x : torch::randn({3, 11, 12}, torch::requires_grad());
      auto v = self ? x : torch::randn({3, 11, 20}, torch::requires_grad());
      for (const bool need_weights : {true, false}) {
        const auto options = MultiHeadAttentionForwardOptions().is_causal(true).need_weights(
            need_weights);
        const auto [out, w] = grouped(x, k, v, options);
        const auto [expected, expected_w] = full(x, k, v, options);
        EXPECT_CLOSE(out, expected, Tolerance{1e-5});
        if (need_weights) {
          EXPECT_EQ(w.sizes(), torch::IntArrayRef({3, 8, 9, self ? 9 : 11}));
          EXPECT_CLOSE(w, expected_w, Tolerance{1e-6});
        }
        const auto upstream = torch::randn(out.sizes());
        const auto grads = torch::autograd::grad({out}, {x}, {upstream});
        const auto expected_grads = torch::autograd::grad({expected}, {x}, {upstream});
        EXPECT_CLOSE(grads[0], expected_grads[0], Tolerance{1e-5});
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
  const auto [out, w] = mha(x, x, x, mha_with_weights().is_causal(true));

  // The same computation written out: project, split heads, rotate, attend
  // (the float64 loop reference), merge, project.
  const auto heads = [](const torch::Tensor& t) { return t.view({2, 7, 4, 8}).transpose(1, 2); };
  const auto q = mha->rotary(heads(mha->q_proj(x)));
  const auto k = mha->rotary(heads(mha->k_proj(x)));
  const auto v = heads(mha->v_proj(x));
  const auto causal = additive_bias(band_mask(7, 7, 0, /*causal=*/true, 0));
  const auto [ref_heads, ref_w] = attn::testing::reference_attention(
      q.reshape({8, 7, 8}), k.reshape({8, 7, 8}), v.reshape({8, 7, 8}), causal.expand({8, 7, 7}),
      1.0 / std::sqrt(8.0));
  const auto expected = mha->out_proj(
      ref_heads.view({2, 4, 7, 8}).transpose(1, 2).reshape({2, 7, 32}));
  EXPECT_CLOSE(out, expected, kFloat64Tolerance);
  EXPECT_CLOSE(w, ref_w.view({2, 4, 7, 7}), kFloat64Tolerance);
}

TEST(SlidingWindowAttention, EqualsAnExplicitBandMask) {
  torch::manual_seed(4);
  for (const bool extra_keys : {false, true}) {
    MultiHeadAttention mha(
        MultiHeadAttentionOptions(16, 2).add_bias_kv(extra_keys).add_zero_attn(extra_keys));
    const auto x = torch::randn({2, 140, 16});
    for (const bool causal : {true, false}) {
      for (const bool need_weights : {true, false}) {
        SCOPED_TRACE(
            ::testing::Message() << "extra_keys=" << extra_keys << " causal=" << causal
                                 << " need_weights=" << need_weights);
        const auto [windowed, w] = mha(
            x, x, x,
            MultiHeadAttentionForwardOptions().is_causal(causal).window(9).need_weights(
                need_weights));
        const auto [masked, w_masked] = mha(
            x, x, x,
            MultiHeadAttentionForwardOptions()
                .attn_mask(band_mask(140, 140, 0, causal, 9))
                .need_weights(need_weights));
        EXPECT_CLOSE(windowed, masked, Tolerance{1e-6});
        if (need_weights) {
          EXPECT_CLOSE(w, w_masked, Tolerance{1e-7});
          // The appended keys stay visible to every query.
          const auto S = 140 + (extra_keys ? 2 : 0);
          EXPECT_EQ(w.size(3), S);
          const auto outside_window = band_mask(140, 140, 0, causal, 9).logical_not();
          EXPECT_EQ(
              w.narrow(3, 0, 140).masked_select(outside_window).abs().max().item<float>(), 0.0f);
        }
      }
    }
  }
}

TEST(MultiHeadAttentionErrors, ConstructionNamesTheBadOption) {
  const auto cases = attn::testing::multi_head_attention_construction_cases();
  attn::testing::expect_catalogued_outcomes(attn::testing::error_cases(cases));
}

TEST(MultiHeadAttentionErrors, ForwardNamesExpectedAndActualShapes) {
  const auto cases = attn::testing::multi_head_attention_forward_cases();
  attn::testing::expect_catalogued_outcomes(attn::testing::error_cases(cases));
}

TEST(MultiHeadAttentionErrors, CallsWithAKVCacheNameWhatWasExpectedAndWhatArrived) {
  torch::NoGradGuard no_grad;
  MultiHeadAttention mha(MultiHeadAttentionOptions(16, 4).num_kv_heads(2));
  const auto x = torch::randn({2, 3, 16});
  KVCache small(4);
  mha(x, x, x, mha_with_weights().kv_cache(&small));
  EXPECT_ATTN_ERROR(
      mha(x, x, x, mha_with_weights().kv_cache(&small)),
      "KVCache: appending 3 tokens to the 3 cached would exceed max_length 4");
  KVCache cache;
  mha(x, x, x, mha_with_weights().kv_cache(&cache));
  const auto other_batch = torch::randn({5, 1, 16});
  EXPECT_ATTN_ERROR(
      mha(other_batch, other_batch, other_batch, mha_with_weights().kv_cache(&cache)),
      "KVCache: keys must be (B, H, T, D) = (2, 2, T, 4)");
  const auto as_double = x.to(torch::kDouble);
  mha->to(torch::kDouble);
  EXPECT_ATTN_ERROR(
      mha(as_double, as_double, as_double, mha_with_weights().kv_cache(&cache)),
      "KVCache: keys and values must have the cached dtype Float");
  mha->to(torch::kFloat);
  EXPECT_ATTN_ERROR(
      mha(x, x, x,
          mha_with_weights().kv_cache(&cache).attn_mask(torch::ones({3, 3}, torch::kBool))),
      "attn_mask must be (L, S) = [3, 6], (B·H, L, S) = [8, 3, 6] or (B, H, L, S) = [2, 4, 3, 6] "
      "(B and H may be 1), S counting the cached keys, got [3, 3]");
  EXPECT_ATTN_ERROR(
      mha(x, x, x, mha_with_weights().kv_cache(&cache).window(0)),
      "MultiHeadAttention: window must be a positive number of keys, got 0");
  EXPECT_EQ(cache.length(), 3); // a call that fails leaves the cache as it was
  MultiHeadAttention extra(MultiHeadAttentionOptions(16, 4).add_bias_kv(true));
  EXPECT_ATTN_ERROR(
      extra(x, x, x, mha_with_weights().kv_cache(&cache)),
      "MultiHeadAttention: a kv_cache cannot be combined with add_bias_kv or add_zero_attn");
}

// attn::multi_head_attention_forward against LibTorch's own
// torch::nn::functional::multi_head_attention_forward with the same
// tensors, in float64: separate projections (kdim = vdim = 12, as
// LibTorch's takes them), bias_k,
// bias_v and a zero key, a float mask and key padding, sequence-first.
TEST(FunctionalMultiHeadAttention, MatchesLibTorchsFunctionalWithTheSameTensors) {
  namespace F = torch::nn::functional;
  torch::manual_seed(41);
  const int64_t E = 16, H = 4, L = 5, S = 7, B = 3;
  const auto options = MultiHeadAttentionOptions(E, H)
                           .kdim(12)
                           .vdim(12)
                           .batch_first(false)
                           .add_bias_kv(true)
                           .add_zero_attn(true);
  MultiHeadAttention module(options);
  module->to(torch::kDouble);
  const auto p = module->functional_parameters();
  for (auto* bias : {&p.q_bias, &p.k_bias, &p.v_bias, &p.out_bias}) {
    torch::NoGradGuard no_grad;
    bias->uniform_(-0.5, 0.5); // nonzero, unlike their initial values
  }
  const auto opts = torch::TensorOptions(torch::kDouble);
  const auto q = torch::randn({L, B, E}, opts), k = torch::randn({S, B, 12}, opts);
  const auto v = torch::randn({S, B, 12}, opts);
  const auto mask = torch::randn({L, S}, opts);
  auto padding = torch::zeros({B, S}, torch::kBool);
  padding[1][S - 1] = true;
  const auto [out, weights] = attn::multi_head_attention_forward(
      q, k, v, options, p,
      MultiHeadAttentionForwardOptions().attn_mask(mask).key_padding_mask(padding).need_weights(
          true),
      /*training=*/false);
  const auto [expected, expected_weights] = F::multi_head_attention_forward(
      q, k, v,
      F::MultiheadAttentionForwardFuncOptions(
          E, H, torch::Tensor(), torch::cat({p.q_bias, p.k_bias, p.v_bias}), p.bias_k, p.bias_v,
          /*add_zero_attn=*/true, /*dropout_p=*/0.0, p.out_weight, p.out_bias)
          .training(false)
          .key_padding_mask(padding)
          .attn_mask(mask)
          .need_weights(true)
          .average_attn_weights(false)
          .use_separate_proj_weight(true)
          .q_proj_weight(p.q_weight)
          .k_proj_weight(p.k_weight)
          .v_proj_weight(p.v_weight));
  EXPECT_CLOSE(out, expected, kFloat64Tolerance);
  EXPECT_CLOSE(weights, expected_weights, kFloat64Tolerance);
}

// The function with a module's parameters is the module: the same output,
// weights and gradients, bit for bit (grouped heads, rotary positions,
// causal self-attention).
TEST(FunctionalMultiHeadAttention, WithAModulesParametersIsTheModule) {
  torch::manual_seed(43);
  const auto options = MultiHeadAttentionOptions(32, 4).num_kv_heads(2).rotary(
      RotaryEmbeddingOptions(8));
  MultiHeadAttention module(options);
  const auto x = torch::randn({2, 9, 32}, torch::requires_grad());
  const auto forward = MultiHeadAttentionForwardOptions().is_causal(true).need_weights(true);
  const auto [out, weights] = module(x, x, x, forward);
  const auto [f_out, f_weights] = attn::multi_head_attention_forward(
      x, x, x, module->options, module->functional_parameters(), forward, module->is_training());
  EXPECT_TRUE(torch::equal(out, f_out));
  EXPECT_TRUE(torch::equal(weights, f_weights));
  const auto upstream = torch::randn(out.sizes());
  auto inputs = module->parameters();
  inputs.push_back(x);
  const auto grads = torch::autograd::grad({out}, inputs, {upstream});
  const auto f_grads = torch::autograd::grad({f_out}, inputs, {upstream});
  for (size_t i = 0; i < grads.size(); ++i) {
    EXPECT_TRUE(torch::equal(grads[i], f_grads[i])) << "gradient " << i;
  }
}

} // namespace

namespace {

// A module with every score modifier, its table and sinks drawn at random
// (they start at zero), in float64.
MultiHeadAttention module_with_score_modifiers() {
  torch::manual_seed(41);
  MultiHeadAttention mha(MultiHeadAttentionOptions(32, 4)
                             .alibi(true)
                             .softcap(3.0)
                             .position_buckets(attn::PositionBuckets()
                                                   .bucketing(attn::PositionBucketing::t5_causal)
                                                   .num_buckets(16)
                                                   .max_distance(40))
                             .sinks(true));
  mha->to(torch::kDouble);
  const torch::NoGradGuard no_grad;
  mha->position_bias.normal_();
  mha->sinks.normal_();
  return mha;
}

} // namespace

TEST(ScoreModifierMultiHeadAttention, IsTheFunctionOverItsHeadsWithItsParameters) {
  auto mha = module_with_score_modifiers();
  const auto x = torch::randn({2, 20, 32}, torch::kDouble);
  const auto [out, none] = mha(x, x, x, MultiHeadAttentionForwardOptions().is_causal(true));
  out.sum().backward();
  const auto table_grad = mha->position_bias.grad().clone();
  const auto sinks_grad = mha->sinks.grad().clone();
  mha->zero_grad();

  // The same layer written out: projections, heads, attention with the
  // module's modifiers on the math path, merged heads, out_proj.
  namespace F = torch::nn::functional;
  const auto heads = [](const torch::Tensor& t) { return t.view({2, 20, 4, 8}).transpose(1, 2); };
  const auto q = heads(F::linear(x, mha->q_proj->weight, mha->q_proj->bias));
  const auto k = heads(F::linear(x, mha->k_proj->weight, mha->k_proj->bias));
  const auto v = heads(F::linear(x, mha->v_proj->weight, mha->v_proj->bias));
  const auto options = attn::SDPAOptions()
                           .is_causal(true)
                           .alibi_slopes(attn::alibi_slopes(4).to(torch::kDouble))
                           .softcap(3.0)
                           .position_bias(mha->position_bias)
                           .position_buckets(*mha->options.position_buckets())
                           .sinks(mha->sinks)
                           .backend(attn::AttentionBackend::math);
  const auto [attended, unused] = attn::scaled_dot_product_attention(q, k, v, options);
  const auto expected = F::linear(
      attended.transpose(1, 2).reshape({2, 20, 32}), mha->out_proj->weight, mha->out_proj->bias);
  expected.sum().backward();
  EXPECT_CLOSE(out, expected, kFloat64Tolerance);
  EXPECT_CLOSE(table_grad, mha->position_bias.grad(), kFloat64Tolerance);
  EXPECT_CLOSE(sinks_grad, mha->sinks.grad(), kFloat64Tolerance);
}

TEST(ScoreModifierMultiHeadAttention, DecodingWithACacheSeesTheSamePositions) {
  auto mha = module_with_score_modifiers();
  mha->eval();
  const torch::NoGradGuard no_grad;
  const auto x = torch::randn({2, 20, 32}, torch::kDouble);
  const auto causal = MultiHeadAttentionForwardOptions().is_causal(true);
  const auto whole = std::get<0>(mha(x, x, x, causal));
  KVCache cache;
  const auto cached = MultiHeadAttentionForwardOptions(causal).kv_cache(&cache);
  const auto prompt = x.narrow(1, 0, 12);
  std::vector<torch::Tensor> steps{std::get<0>(mha(prompt, prompt, prompt, cached))};
  for (int64_t t = 12; t < 20; ++t) {
    const auto token = x.narrow(1, t, 1);
    steps.push_back(std::get<0>(mha(token, token, token, cached)));
  }
  EXPECT_CLOSE(torch::cat(steps, 1), whole, kFloat64Tolerance);
}

TEST(ScoreModifierMultiHeadAttention, SavesAndLoadsItsTableAndSinks) {
  auto mha = module_with_score_modifiers();
  const auto names = mha->named_parameters().keys();
  EXPECT_NE(std::find(names.begin(), names.end(), "position_bias"), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "sinks"), names.end());
  std::stringstream archive;
  torch::save(mha, archive);
  MultiHeadAttention loaded(mha->options);
  loaded->to(torch::kDouble);
  torch::load(loaded, archive);
  EXPECT_TRUE(torch::equal(loaded->position_bias, mha->position_bias));
  EXPECT_TRUE(torch::equal(loaded->sinks, mha->sinks));
  const auto x = torch::randn({1, 7, 32}, torch::kDouble);
  EXPECT_TRUE(torch::equal(std::get<0>(loaded(x, x, x)), std::get<0>(mha(x, x, x))));
}
