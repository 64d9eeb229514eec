// attn::MultiHeadAttention's own behaviour: shapes, layouts, masks, dropout,
// devices, printing and errors. Parity with the built-in is in
// test_parity.cpp.

#include "test_support.h"

#include <attn/modules/multi_head_attention.h>

#include <cmath>
#include <limits>
#include <sstream>

namespace {

using attn::MultiHeadAttention;
using attn::MultiHeadAttentionForwardOptions;
using attn::MultiHeadAttentionOptions;
using attn::testing::max_abs_diff;
using attn::testing::reference_attention;

constexpr double kInf = std::numeric_limits<double>::infinity();

TEST(MultiHeadAttention, ReproducesTheReferenceDemoShapes) {
  // batch 4, 20 tokens, d_model 512, 8 heads, self-attention.
  MultiHeadAttention mha(MultiHeadAttentionOptions(512, 8));
  torch::nn::MultiheadAttention builtin(torch::nn::MultiheadAttentionOptions(512, 8));
  const auto x = torch::randn({4, 20, 512});
  const auto [out, w] = mha(x, x, x);
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
  const auto [out, w] = mha(q, k, v);

  const auto project = [](const torch::Tensor& x, const torch::nn::Linear& p) {
    return torch::matmul(x, p->weight.t()) + p->bias;
  };
  const auto heads = [&](const torch::Tensor& x, int64_t T, int64_t h) {
    return x.reshape({B, T, H, D}).select(2, h); // (B, T, D)
  };
  const auto Q = project(q, mha->q_proj), K = project(k, mha->k_proj), V = project(v, mha->v_proj);
  std::vector<torch::Tensor> head_outputs, head_weights;
  for (int64_t h = 0; h < H; ++h) {
    const auto [o, hw] = reference_attention(heads(Q, L, h), heads(K, S, h), heads(V, S, h), {}, 1.0 / std::sqrt(D));
    head_outputs.push_back(o);
    head_weights.push_back(hw);
  }
  const auto expected = project(torch::cat(head_outputs, -1), mha->out_proj);
  EXPECT_LE(max_abs_diff(out, expected), 1e-12);
  EXPECT_LE(max_abs_diff(w, torch::stack(head_weights, 1)), 1e-12);
}

TEST(MultiHeadAttention, SequenceFirstLayoutIsTheTransposeOfBatchFirst) {
  torch::manual_seed(21);
  MultiHeadAttention batch_first(MultiHeadAttentionOptions(16, 4));
  MultiHeadAttention seq_first(MultiHeadAttentionOptions(16, 4).batch_first(false));
  attn::testing::copy_parameters(*batch_first, *seq_first);
  const auto q = torch::randn({3, 5, 16});
  const auto kv = torch::randn({3, 7, 16});
  const auto [out_bf, w_bf] = batch_first(q, kv, kv);
  const auto [out_sf, w_sf] = seq_first(q.transpose(0, 1), kv.transpose(0, 1), kv.transpose(0, 1));
  EXPECT_EQ(out_sf.sizes(), torch::IntArrayRef({5, 3, 16}));
  EXPECT_TRUE(out_sf.is_contiguous());
  EXPECT_LE(max_abs_diff(out_sf.transpose(0, 1), out_bf), 1e-6);
  EXPECT_LE(max_abs_diff(w_sf, w_bf), 1e-6);
}

TEST(MultiHeadAttention, AveragedWeightsAreTheMeanOverHeads) {
  torch::manual_seed(22);
  MultiHeadAttention mha(MultiHeadAttentionOptions(16, 4));
  const auto x = torch::randn({2, 5, 16});
  const auto [out, per_head] = mha(x, x, x);
  const auto [out_avg, averaged] =
      mha(x, x, x, MultiHeadAttentionForwardOptions().average_attn_weights(true));
  EXPECT_EQ(per_head.sizes(), torch::IntArrayRef({2, 4, 5, 5}));
  EXPECT_EQ(averaged.sizes(), torch::IntArrayRef({2, 5, 5}));
  EXPECT_TRUE(torch::equal(out, out_avg));
  EXPECT_LE(max_abs_diff(averaged, per_head.mean(1)), 1e-7);
}

TEST(MultiHeadAttention, NeedWeightsFalseReturnsUndefinedWeightsAndSameOutput) {
  torch::manual_seed(23);
  MultiHeadAttention mha(MultiHeadAttentionOptions(16, 2));
  const auto x = torch::randn({2, 5, 16});
  const auto [out, w] = mha(x, x, x);
  const auto [out_only, no_w] = mha(x, x, x, MultiHeadAttentionForwardOptions().need_weights(false));
  EXPECT_FALSE(no_w.defined());
  EXPECT_LE(max_abs_diff(out, out_only), 1e-6); // fused vs materialised kernel
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

  const auto [out, w] = mha(x, x, x,
      MultiHeadAttentionForwardOptions().key_padding_mask(padding).attn_mask(allowed));
  const auto bias = mha->out_proj->bias.expand({5, 16});
  EXPECT_LE(max_abs_diff(out[1], bias), 1e-7);
  EXPECT_LE(max_abs_diff(out[0][2], mha->out_proj->bias), 1e-7);
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
  const auto padding_float = torch::zeros({3, 6}).masked_fill(padding, -kInf);
  const auto allowed_float = torch::zeros({4, 6}).masked_fill(~allowed, -kInf);

  const auto run = [&](const torch::Tensor& pad, const torch::Tensor& mask) {
    return mha(q, kv, kv, MultiHeadAttentionForwardOptions().key_padding_mask(pad).attn_mask(mask));
  };
  const auto [out, w] = run(padding, allowed);
  for (const auto& [pad, mask] : {std::pair{padding_float, allowed}, std::pair{padding, allowed_float},
                                  std::pair{padding_float, allowed_float}}) {
    const auto [out2, w2] = run(pad, mask);
    EXPECT_LE(max_abs_diff(out2, out), 1e-7);
    EXPECT_LE(max_abs_diff(w2, w), 1e-7);
  }
  // Padding keys get no weight from any query.
  EXPECT_EQ(w.masked_select(padding.view({3, 1, 1, 6}).expand_as(w)).abs().max().item<float>(), 0.0f);
}

TEST(MultiHeadAttention, AttnMaskShapesAreEquivalent) {
  torch::manual_seed(26);
  constexpr int64_t B = 2, H = 4, L = 3, S = 5;
  MultiHeadAttention mha(MultiHeadAttentionOptions(16, H));
  const auto q = torch::randn({B, L, 16});
  const auto kv = torch::randn({B, S, 16});
  const auto mask = torch::randn({L, S});
  const auto run = [&](const torch::Tensor& m) {
    return std::get<0>(mha(q, kv, kv, MultiHeadAttentionForwardOptions().attn_mask(m)));
  };
  const auto expected = run(mask);
  EXPECT_LE(max_abs_diff(run(mask.expand({B * H, L, S})), expected), 1e-7);
  EXPECT_LE(max_abs_diff(run(mask.expand({B, H, L, S})), expected), 1e-7);
  EXPECT_LE(max_abs_diff(run(mask.view({1, 1, L, S})), expected), 1e-7);

  // (B·H, L, S) is batch-major: entry b·H + h belongs to batch b, head h.
  auto per_head = torch::zeros({B, H, L, S}, torch::kBool).logical_not();
  per_head[1][2][0].fill_(false);
  per_head[1][2][0][4] = true; // batch 1, head 2, query 0 sees only key 4
  const auto [out, w] = mha(q, kv, kv, MultiHeadAttentionForwardOptions().attn_mask(per_head.view({B * H, L, S})));
  EXPECT_FLOAT_EQ(w[1][2][0][4].item<float>(), 1.0f);
  EXPECT_LT(w[0][2][0][4].item<float>(), 1.0f);
}

TEST(MultiHeadAttention, CausalEqualsALowerTriangularMask) {
  torch::manual_seed(27);
  MultiHeadAttention mha(MultiHeadAttentionOptions(16, 2));
  const auto x = torch::randn({2, 6, 16});
  const auto [out_causal, w_causal] = mha(x, x, x, MultiHeadAttentionForwardOptions().is_causal(true));
  const auto lower = torch::ones({6, 6}, torch::kBool).tril();
  const auto [out_mask, w_mask] = mha(x, x, x, MultiHeadAttentionForwardOptions().attn_mask(lower));
  EXPECT_TRUE(torch::equal(out_causal, out_mask));
  EXPECT_TRUE(torch::equal(w_causal, w_mask));
}

TEST(MultiHeadAttention, DropsWeightsOnlyInTrainingMode) {
  torch::manual_seed(28);
  MultiHeadAttention mha(MultiHeadAttentionOptions(16, 2).dropout(0.5));
  const auto x = torch::randn({2, 8, 16});
  mha->eval();
  const auto [out_a, w_a] = mha(x, x, x);
  const auto [out_b, w_b] = mha(x, x, x);
  EXPECT_TRUE(torch::equal(out_a, out_b));
  EXPECT_EQ((w_a == 0).sum().item<int64_t>(), 0);
  mha->train();
  const auto [out_train, w_train] = mha(x, x, x);
  EXPECT_GT((w_train == 0).sum().item<int64_t>(), 0);
}

TEST(MultiHeadAttention, FollowsToDtypeAndRejectsInputsOfAnotherDtype) {
  MultiHeadAttention mha(MultiHeadAttentionOptions(16, 2));
  mha->to(torch::kDouble);
  const auto x = torch::randn({2, 3, 16}, torch::kDouble);
  const auto [out, w] = mha(x, x, x);
  EXPECT_EQ(out.scalar_type(), torch::kDouble);
  const auto x32 = x.to(torch::kFloat);
  EXPECT_ATTN_ERROR(mha(x32, x32, x32),
      "MultiHeadAttention: inputs must have the module's dtype Double, got query Float, key Float, value Float (convert one with .to())");
}

TEST(MultiHeadAttention, RejectsInputsOnAnotherDevice) {
  ATTN_SKIP_IF_UNAVAILABLE(torch::Device(torch::kCUDA));
  MultiHeadAttention mha(MultiHeadAttentionOptions(16, 2));
  const auto x = torch::randn({2, 3, 16}, torch::kCUDA);
  EXPECT_ATTN_ERROR(mha(x, x, x), "MultiHeadAttention: inputs must be on the module's device cpu, got query on cuda:0");
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
  EXPECT_EQ(printed.str(),
      "attn::MultiHeadAttention(embed_dim=512, num_heads=8, dropout=0.1, bias=true, kdim=256, vdim=512, batch_first=true)(\n"
      "  (q_proj): torch::nn::Linear(in_features=512, out_features=512, bias=true)\n"
      "  (k_proj): torch::nn::Linear(in_features=256, out_features=512, bias=true)\n"
      "  (v_proj): torch::nn::Linear(in_features=512, out_features=512, bias=true)\n"
      "  (out_proj): torch::nn::Linear(in_features=512, out_features=512, bias=true)\n"
      ")");
}

TEST(MultiHeadAttentionErrors, ConstructionNamesTheBadOption) {
  EXPECT_ATTN_ERROR(MultiHeadAttention(MultiHeadAttentionOptions(512, 7)),
      "MultiHeadAttention: embed_dim must be divisible by num_heads, got embed_dim=512 and num_heads=7 (remainder 1)");
  EXPECT_ATTN_ERROR(MultiHeadAttention(MultiHeadAttentionOptions(0, 1)),
      "MultiHeadAttention: embed_dim must be positive, got 0");
  EXPECT_ATTN_ERROR(MultiHeadAttention(MultiHeadAttentionOptions(8, -2)),
      "MultiHeadAttention: num_heads must be positive, got -2");
  EXPECT_ATTN_ERROR(MultiHeadAttention(MultiHeadAttentionOptions(8, 2).kdim(0)),
      "MultiHeadAttention: kdim and vdim must be positive, got kdim=0 and vdim=8");
  EXPECT_ATTN_ERROR(MultiHeadAttention(MultiHeadAttentionOptions(8, 2).dropout(1.0)),
      "MultiHeadAttention: dropout must be in [0, 1), got 1");
}

TEST(MultiHeadAttentionErrors, ForwardNamesExpectedAndActualShapes) {
  MultiHeadAttention mha(MultiHeadAttentionOptions(16, 4).kdim(12).vdim(10));
  MultiHeadAttention seq_first(MultiHeadAttentionOptions(16, 4).batch_first(false));
  const auto q = torch::randn({2, 3, 16});
  const auto k = torch::randn({2, 5, 12});
  const auto v = torch::randn({2, 5, 10});
  const auto with = [](const torch::Tensor& pad, const torch::Tensor& mask) {
    return MultiHeadAttentionForwardOptions().key_padding_mask(pad).attn_mask(mask);
  };
  EXPECT_ATTN_ERROR(mha(torch::randn({3, 16}), k, v), "query must be (B, L, E) with E == 16, got [3, 16]");
  EXPECT_ATTN_ERROR(mha(torch::randn({2, 3, 8}), k, v), "query must be (B, L, E) with E == 16, got [2, 3, 8]");
  EXPECT_ATTN_ERROR(seq_first(torch::randn({2, 3, 8}), q, q), "query must be (L, B, E) with E == 16, got [2, 3, 8]");
  EXPECT_ATTN_ERROR(mha(q, torch::randn({2, 5, 16}), v), "key must be (B, S, kdim) with kdim == 12, got [2, 5, 16]");
  EXPECT_ATTN_ERROR(mha(q, k, torch::randn({2, 5})), "value must be (B, S, vdim) with vdim == 10, got [2, 5]");
  EXPECT_ATTN_ERROR(mha(q, torch::randn({3, 5, 12}), torch::randn({3, 5, 10})),
      "query, key and value must have the same batch size B, got query [2, 3, 16], key [3, 5, 12], value [3, 5, 10]");
  EXPECT_ATTN_ERROR(mha(q, k, torch::randn({2, 4, 10})),
      "key and value must have the same length S, got key [2, 5, 12], value [2, 4, 10]");
  EXPECT_ATTN_ERROR(mha(q, k, v, with(torch::zeros({2, 4}, torch::kBool), {})),
      "key_padding_mask must be (B, S) = [2, 5], got [2, 4]");
  EXPECT_ATTN_ERROR(mha(q, k, v, with(torch::zeros({2, 5}, torch::kLong), {})),
      "key_padding_mask must be bool or have the query's dtype Float, got Long");
  EXPECT_ATTN_ERROR(mha(q, k, v, with({}, torch::zeros({5, 3}))),
      "attn_mask must be (L, S) = [3, 5], (B·H, L, S) = [8, 3, 5] or (B, H, L, S) = [2, 4, 3, 5] (B and H may be 1), got [5, 3]");
  EXPECT_ATTN_ERROR(mha(q, k, v, with({}, torch::zeros({4, 3, 5}))),
      "attn_mask must be (L, S) = [3, 5], (B·H, L, S) = [8, 3, 5] or (B, H, L, S) = [2, 4, 3, 5] (B and H may be 1), got [4, 3, 5]");
  EXPECT_ATTN_ERROR(mha(q, k, v, with({}, torch::zeros({3, 5}, torch::kDouble))),
      "attn_mask must be bool or have the query's dtype Float, got Double");
  EXPECT_ATTN_ERROR(mha(q, torch::Tensor(), v), "query, key and value must be defined tensors");
}

} // namespace
