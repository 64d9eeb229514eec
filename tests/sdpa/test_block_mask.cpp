// Block masks (<attn/block_mask.h>), the blocks of bool masks that the
// tiled loops skip, and packed sequences (attn::varlen_attention): every
// kernel against the float64 oracle of test_support under the dense mask
// that each predicate's definition gives, written out here pair by pair;
// packed sequences against each sequence attended alone (FlashAttention-2's
// definition of its varlen API: sequence n's queries see its keys only,
// causal aligned at the bottom-right corner of its own scores).

#include "bad_input_catalogue.h"
#include "test_support.h"

#include "kernels/cpu/mask_blocks.h"
#include "kernels/cpu/tile_product.h"
#include "kernels/cpu/tiled_attention.h"
#include "sdpa/backend.h"
#include "sdpa/block_mask.h"

#include <attn/attn.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace {

using attn::AttentionBackend;
using attn::SDPAOptions;
using attn::testing::additive_bias;
using attn::testing::band_mask;
using attn::testing::reference_attention;
using attn::testing::reference_attention_gradients;
using attn::testing::Tolerance;

using Definition = std::function<bool(int64_t b, int64_t h, int64_t i, int64_t j)>;

// (B, H, L, S) bool: the definition at every pair.
torch::Tensor dense_of(const Definition& allows, int64_t B, int64_t H, int64_t L, int64_t S) {
  auto dense = torch::empty({B, H, L, S}, torch::kBool);
  auto a = dense.accessor<bool, 4>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t i = 0; i < L; ++i) {
        for (int64_t j = 0; j < S; ++j) {
          a[b][h][i][j] = allows(b, h, i, j);
        }
      }
    }
  }
  return dense;
}

// Document ids of a row of T tokens whose documents end at `ends`.
std::vector<int64_t> ids_of(const std::vector<int64_t>& ends) {
  std::vector<int64_t> ids;
  for (size_t n = 0; n < ends.size(); ++n) {
    while (static_cast<int64_t>(ids.size()) < ends[n]) {
      ids.push_back(static_cast<int64_t>(n));
    }
  }
  return ids;
}

struct PredicateCase {
  std::string name;
  attn::MaskPredicate predicate;
  Definition definition;
  int64_t batch = 1, heads = 1; // the block mask's
};

constexpr int64_t kB = 2, kH = 2, kL = 300, kS = 300;

// Each built-in predicate and combinations, with their definitions.
std::vector<PredicateCase> predicate_cases() {
  const auto row0 = ids_of({40, 170, 171, 300}), row1 = ids_of({128, 256, 300});
  const auto ids = torch::stack({torch::tensor(row0), torch::tensor(row1)});
  const auto same_document = [=](int64_t b, int64_t /*h*/, int64_t i, int64_t j) {
    const auto& row = b == 0 ? row0 : row1;
    return row[i] == row[j];
  };
  const auto causal = [](int64_t, int64_t, int64_t i, int64_t j) { return j <= i; };
  const auto window = [](int64_t, int64_t, int64_t i, int64_t j) { return j <= i && i - j < 70; };
  const auto prefix = [](int64_t b, int64_t, int64_t i, int64_t j) {
    return j < (b == 0 ? 100 : 0) || j <= i;
  };
  const auto user = [](int64_t b, int64_t h, int64_t i, int64_t j) {
    return (i + 2 * j + 3 * h + b) % 5 != 0 && j < 200 + 50 * h;
  };
  const auto prefix_lengths = torch::tensor({100, 0});
  return {
      {"causal", attn::causal_mask(), causal},
      {"window", attn::sliding_window_mask(70), window},
      {"documents", attn::document_mask(ids), same_document, kB},
      {"documents_of_one_row", attn::document_mask(torch::tensor(row0)),
       [=](int64_t, int64_t, int64_t i, int64_t j) { return row0[i] == row0[j]; }},
      {"causal_documents", attn::causal_mask() & attn::document_mask(ids),
       [=](int64_t b, int64_t h, int64_t i, int64_t j) {
         return causal(b, h, i, j) && same_document(b, h, i, j);
       },
       kB},
      {"windowed_documents", attn::document_mask(ids) & attn::sliding_window_mask(70),
       [=](int64_t b, int64_t h, int64_t i, int64_t j) {
         return window(b, h, i, j) && same_document(b, h, i, j);
       },
       kB},
      {"prefix_lm", attn::prefix_lm_mask(prefix_lengths), prefix, kB},
      {"prefix_or_documents", attn::prefix_lm_mask(prefix_lengths) | attn::document_mask(ids),
       [=](int64_t b, int64_t h, int64_t i, int64_t j) {
         return prefix(b, h, i, j) || same_document(b, h, i, j);
       },
       kB},
      {"user_per_head", attn::MaskPredicate(user) & attn::causal_mask(),
       [=](int64_t b, int64_t h, int64_t i, int64_t j) {
         return user(b, h, i, j) && causal(b, h, i, j);
       },
       kB, kH},
  };
}

// attn's output and gradients for q, k, v against the oracle's under `dense`.
void expect_oracle_results(
    const std::string& label,
    const SDPAOptions& options,
    const torch::Tensor& dense,
    torch::ScalarType dtype,
    bool with_gradients) {
  const int64_t B = dense.size(0), H = dense.size(1), L = dense.size(2), S = dense.size(3);
  const int64_t D = 16;
  torch::manual_seed(7);
  const auto q = torch::randn({B, H, L, D}, torch::kDouble);
  const auto k = torch::randn({B, H, S, D}, torch::kDouble);
  const auto v = torch::randn({B, H, S, D}, torch::kDouble);
  const auto upstream = torch::randn({B, H, L, D}, torch::kDouble);
  const double scale = 1.0 / 4.0;
  const auto bias = additive_bias(dense.expand({B, H, L, S}).reshape({B * H, L, S}));
  const auto flat = [&](const torch::Tensor& t) { return t.reshape({B * H, t.size(2), D}); };
  const auto expected = reference_attention(flat(q), flat(k), flat(v), bias, scale).first;

  const auto qa = q.to(dtype).requires_grad_(with_gradients);
  const auto ka = k.to(dtype).requires_grad_(with_gradients);
  const auto va = v.to(dtype).requires_grad_(with_gradients);
  const auto [out, weights] = attn::scaled_dot_product_attention(qa, ka, va, options);
  const Tolerance tolerance = attn::testing::tolerance_for(dtype);
  SCOPED_TRACE(label);
  EXPECT_CLOSE(out.reshape({B * H, L, D}), expected, tolerance);
  if (!with_gradients) {
    return;
  }
  (out * upstream.to(dtype)).sum().backward();
  const auto grads = reference_attention_gradients(
      flat(q), flat(k), flat(v), bias, scale, flat(upstream));
  EXPECT_CLOSE(qa.grad().reshape({B * H, L, D}), grads[0], tolerance);
  EXPECT_CLOSE(ka.grad().reshape({B * H, S, D}), grads[1], tolerance);
  EXPECT_CLOSE(va.grad().reshape({B * H, S, D}), grads[2], tolerance);
}

// attn's half-precision output and gradients against the oracle under
// `dense` (test_support.h): bfloat16 by FlashAttention's rule, float16
// within float32's tolerance plus one rounding into float16 (and what the
// stored output's rounding carries into dQ and dK).
void expect_half_precision_within_its_rule(
    const std::string& label,
    const SDPAOptions& options,
    const torch::Tensor& dense,
    torch::ScalarType dtype) {
  const int64_t B = dense.size(0), H = dense.size(1), L = dense.size(2), S = dense.size(3);
  const int64_t D = 16;
  torch::manual_seed(7);
  const auto leaf = [](const torch::Tensor& t, torch::ScalarType dtype) {
    return t.detach().to(dtype).requires_grad_();
  };
  const auto q = leaf(torch::randn({B, H, L, D}), dtype),
             k = leaf(torch::randn({B, H, S, D}), dtype);
  const auto v = leaf(torch::randn({B, H, S, D}), dtype);
  const auto upstream = torch::randn({B * H, L, D}).to(dtype);
  const double scale = 1.0 / 4.0;
  const auto bias = additive_bias(dense.expand({B, H, L, S}).reshape({B * H, L, S}));
  const auto flat = [&](const torch::Tensor& t) { return t.reshape({B * H, t.size(2), D}); };
  const auto q64 = leaf(flat(q), torch::kDouble), k64 = leaf(flat(k), torch::kDouble);
  const auto v64 = leaf(flat(v), torch::kDouble);
  const auto [expected, weights] = reference_attention(q64, k64, v64, bias, scale);
  const auto grads64 = reference_attention_gradients(
      q64, k64, v64, bias, scale, upstream.to(torch::kDouble));

  SCOPED_TRACE(label + " in " + std::string(c10::toString(dtype)));
  const bool bfloat16 = dtype == torch::kBFloat16;
  // On the half-precision loops, where they run.
  const auto plan = attn::testing::plan_of(q, k, v, options);
  if (attn::detail::half_products_pay(attn::testing::widest_loops(), dtype)) {
    EXPECT_EQ(plan.compute_dtype, dtype);
    EXPECT_EQ(plan.kernel.fused_loops, attn::detail::FusedLoops::tiled);
  }
  const auto out = std::get<0>(attn::scaled_dot_product_attention(q, k, v, options));
  const auto grads = torch::autograd::grad({flat(out)}, {q, k, v}, {upstream});
  if (bfloat16) {
    const auto q16 = leaf(flat(q), dtype), k16 = leaf(flat(k), dtype), v16 = leaf(flat(v), dtype);
    const auto libtorch = attn::testing::composite_attention(q16, k16, v16, bias, scale);
    const auto grads16 = torch::autograd::grad({libtorch}, {q16, k16, v16}, {upstream});
    EXPECT_WITHIN_TWICE_LIBTORCHS_ERROR(flat(out), libtorch, expected);
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_WITHIN_TWICE_LIBTORCHS_ERROR(flat(grads[i]), grads16[i], grads64[i])
          << "gradient " << i;
    }
    return;
  }
  const Tolerance float32 = attn::testing::tolerance_for(torch::kFloat);
  const auto carried = attn::testing::float16_delta_error(
      q64, k64, expected, weights, upstream, scale);
  const torch::Tensor carried_into[] = {carried.dq, carried.dk, {}};
  EXPECT_TRUE(attn::testing::WithinFloat32RoundedToFloat16(flat(out), expected, float32));
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_TRUE(attn::testing::WithinFloat32RoundedToFloat16(
        flat(grads[i]), grads64[i], float32, carried_into[i]))
        << "gradient " << i;
  }
}

TEST(BlockMask, EveryPredicateHoldsTheDenseMaskOfItsDefinition) {
  for (const auto& c : predicate_cases()) {
    SCOPED_TRACE(c.name);
    const auto mask = attn::block_mask(c.predicate, c.batch, c.heads, kL, kS);
    const auto expected = dense_of(c.definition, c.batch, c.heads, kL, kS);
    EXPECT_TRUE(mask.to_dense().equal(expected));
    EXPECT_EQ(mask.batch(), c.batch);
    EXPECT_EQ(mask.heads(), c.heads);
  }
}

TEST(BlockMask, EveryKernelGivesTheOraclesResultsUnderIt) {
  const struct {
    AttentionBackend backend;
    bool gradients;
  } kernels[] = {
      {AttentionBackend::fused_cpu, true},
      {AttentionBackend::fused_cpu_weights, false},
      {AttentionBackend::batched_cpu, true},
      {AttentionBackend::math, true},
  };
  for (const auto& c : predicate_cases()) {
    const auto mask = attn::block_mask(c.predicate, c.batch, c.heads, kL, kS);
    const auto dense = dense_of(c.definition, kB, kH, kL, kS);
    for (const auto& kernel : kernels) {
      const auto options = SDPAOptions().block_mask(mask).backend(kernel.backend).scale(0.25);
      const auto label = c.name + " on " + attn::backend_name(kernel.backend);
      expect_oracle_results(label, options, dense, torch::kDouble, kernel.gradients);
      if (kernel.backend == AttentionBackend::fused_cpu) {
        expect_oracle_results(label + " in float32", options, dense, torch::kFloat, true);
        expect_half_precision_within_its_rule(label, options, dense, torch::kBFloat16);
        expect_half_precision_within_its_rule(label, options, dense, torch::kHalf);
      }
    }
  }
}

TEST(BlockMask, ShortHeadsGiveTheOraclesResultsUnderIt) {
  // 100 queries, 60 keys: the fused kernel's short loops.
  const auto query_ids = torch::tensor(ids_of({50, 100})),
             key_ids = torch::tensor(ids_of({30, 60}));
  const auto dense = dense_of(
      [](int64_t, int64_t, int64_t i, int64_t j) { return (i < 50) == (j < 30); }, 1, 1, 100, 60);
  const auto mask = attn::block_mask(attn::document_mask(query_ids, key_ids), 1, 1, 100, 60);
  expect_oracle_results(
      "short heads", SDPAOptions().block_mask(mask).scale(0.25), dense.expand({2, 2, 100, 60}),
      torch::kFloat, true);
}

TEST(BlockMask, CombinesWithACausalRequestAndABoolMask) {
  const auto ids = ids_of({50, 200, 300});
  const auto documents = attn::block_mask(attn::document_mask(torch::tensor(ids)), 1, 1, kL, kS);
  torch::manual_seed(3);
  const auto extra = torch::rand({kB, 1, 1, kS}) > 0.2; // key padding of its own
  const auto options = SDPAOptions()
                           .block_mask(documents)
                           .is_causal(true)
                           .attn_mask(extra)
                           .backend(AttentionBackend::fused_cpu)
                           .scale(0.25);
  const auto definition = dense_of(
      [&](int64_t, int64_t, int64_t i, int64_t j) { return ids[i] == ids[j] && j <= i; }, 1, 1, kL,
      kS);
  expect_oracle_results(
      "documents, is_causal and a bool mask", options, definition & extra, torch::kDouble, true);
}

// A block mask without partial blocks (documents at multiples of the
// blocks' sizes, the band taken out; or one document) still lets the
// attn_mask apply, on every kernel.
TEST(BlockMask, AnAttnMaskAppliesBesidesABlockMaskWithoutPartialBlocks) {
  const auto ids = ids_of({128, 256, 300});
  const auto mask = attn::block_mask(
      attn::causal_mask() & attn::document_mask(torch::tensor(ids)), 1, 1, kL, kS);
  ASSERT_EQ(mask.data()->blocks.tiles.size(0), 0);
  torch::manual_seed(17);
  const auto padding = torch::rand({kB, 1, 1, kS}) > 0.3;
  const auto dense = dense_of(
      [&](int64_t, int64_t, int64_t i, int64_t j) { return ids[i] == ids[j] && j <= i; }, 1, 1, kL,
      kS);
  for (const auto backend : {AttentionBackend::fused_cpu, AttentionBackend::batched_cpu}) {
    expect_oracle_results(
        std::string("documents at block edges on ") + attn::backend_name(backend),
        SDPAOptions().block_mask(mask).attn_mask(padding).backend(backend).scale(0.25),
        dense & padding, torch::kDouble, true);
  }
  // Short heads (60 queries and keys), one document: every block full.
  const auto one = attn::block_mask(
      attn::document_mask(torch::zeros({60}, torch::kLong)), 1, 1, 60, 60);
  const auto keys = torch::rand({1, 1, 1, 60}) > 0.3;
  expect_oracle_results(
      "one document, short heads", SDPAOptions().block_mask(one).attn_mask(keys).scale(0.25),
      keys.expand({2, 2, 60, 60}), torch::kFloat, true);
}

TEST(BlockMask, CausalThroughABlockMaskIsTheBandOfIsCausal) {
  const auto mask = attn::block_mask(
      attn::causal_mask() & attn::sliding_window_mask(100), 1, 1, 512, 512);
  const auto& data = *mask.data();
  EXPECT_TRUE(data.band.causal);
  EXPECT_EQ(data.band.window, 100);
  // Nothing left to test pair by pair: the band does it, as for is_causal.
  EXPECT_EQ(data.blocks.tiles.size(0), 0);
  // Of 4 × 8 blocks, those wholly above the diagonal or beyond the window are empty.
  int64_t empty = 0;
  for (int64_t q = 0; q < 4; ++q) {
    for (int64_t k = 0; k < 8; ++k) {
      const int64_t first_row = q * 128, last_row = first_row + 127;
      const int64_t first_key = k * 64, last_key = first_key + 63;
      empty += (first_key > last_row || last_key <= first_row - 100) ? 1 : 0;
    }
  }
  EXPECT_DOUBLE_EQ(mask.sparsity(), static_cast<double>(empty) / 32.0);
}

// The blocks of dense bool masks against a count written here: empty where
// no pair of the block may attend, full where all may.
TEST(BlockMask, ABoolMasksBlocksAreClassifiedByTheirPairs) {
  torch::manual_seed(5);
  const int64_t L = 300, S = 200;
  auto block_diagonal = torch::zeros({L, S}, torch::kBool);
  block_diagonal.narrow(0, 0, 128).narrow(1, 0, 64).fill_(true);
  block_diagonal.narrow(0, 128, 172).narrow(1, 64, 136).fill_(true);
  block_diagonal[200][10] = true; // one pair in an otherwise empty block
  const std::vector<torch::Tensor> masks = {
      torch::arange(S).lt(150).view({1, 1, 1, S}).expand({2, 1, 1, S}).clone(), // key padding
      block_diagonal.view({1, 1, L, S}),
      torch::rand({2, 3, L, S}) > 0.5,
  };
  for (const auto& mask : masks) {
    const auto expanded = mask.expand({2, 3, L, S});
    const auto blocks = attn::detail::blocks_of_bool_mask(expanded);
    const auto kinds = blocks.kinds.expand({2, 3, blocks.kinds.size(2), blocks.kinds.size(3)});
    for (int64_t b = 0; b < 2; ++b) {
      for (int64_t h = 0; h < 3; ++h) {
        for (int64_t i0 = 0; i0 < L; i0 += 128) {
          for (int64_t j0 = 0; j0 < S; j0 += 64) {
            const auto pairs = expanded[b][h]
                                   .narrow(0, i0, std::min<int64_t>(128, L - i0))
                                   .narrow(1, j0, std::min<int64_t>(64, S - j0));
            const int64_t allowed = pairs.sum().item<int64_t>();
            const int expected = allowed == 0 ? 0 : allowed == pairs.numel() ? 1 : 2;
            const int64_t row = blocks.kinds.size(2) == 1 ? 0 : i0 / 128;
            EXPECT_EQ(kinds[b][h][row][j0 / 64].item<int>(), expected)
                << "block (" << b << ", " << h << ", " << i0 << ", " << j0 << ")";
          }
        }
      }
    }
    const auto definition = mask.expand({2, 3, L, S});
    expect_oracle_results(
        "bool mask " + std::to_string(mask.dim()), SDPAOptions().attn_mask(mask).scale(0.25),
        definition, torch::kDouble, true);
  }
}

TEST(BlockMask, AUserPredicateThatThrowsIsAnError) {
  const attn::MaskPredicate throwing([](int64_t, int64_t, int64_t i, int64_t) -> bool {
    if (i == 200) {
      throw std::runtime_error("no row 200");
    }
    return true;
  });
  EXPECT_ATTN_ERROR(
      attn::block_mask(throwing, 1, 1, 300, 300),
      "block_mask: the mask predicate threw: no row 200");
}

// ---- Packed sequences ----

struct PackedCase {
  std::string name;
  std::vector<int64_t> q_lengths, k_lengths;
  int64_t heads = 4, kv_heads = 4;
  bool causal = false;
  int64_t window = 0;
};

std::vector<PackedCase> packed_cases() {
  return {
      {"self", {130, 1, 200, 0, 69}, {130, 1, 200, 0, 69}},
      {"causal", {130, 1, 200, 0, 69}, {130, 1, 200, 0, 69}, 4, 4, true},
      {"causal_window_gqa", {250, 70, 100}, {250, 70, 100}, 4, 2, true, 40},
      {"window", {180, 90}, {180, 90}, 4, 4, false, 30},
      {"more_keys", {100, 3, 140}, {160, 70, 141}, 4, 4, false},
      {"more_keys_causal", {100, 3, 140, 5}, {160, 70, 141, 0}, 4, 1, true},
      {"fewer_keys_causal_window", {150, 80}, {90, 80}, 4, 2, true, 50},
      // 30 queries without keys between two sequences: blocks of queries
      // that see no key inside a tile whose other queries do.
      {"queries_without_keys", {40, 30, 60}, {50, 0, 70}, 2, 2, false},
  };
}

torch::Tensor starts_of(const std::vector<int64_t>& lengths) {
  std::vector<int64_t> starts{0};
  for (const auto length : lengths) {
    starts.push_back(starts.back() + length);
  }
  return torch::tensor(starts);
}

void expect_each_sequence_alone(const PackedCase& c, torch::ScalarType dtype) {
  SCOPED_TRACE(c.name + " in " + std::string(c10::toString(dtype)));
  const auto q_starts = starts_of(c.q_lengths), k_starts = starts_of(c.k_lengths);
  const int64_t total_q = q_starts[-1].item<int64_t>(), total_k = k_starts[-1].item<int64_t>();
  const int64_t D = 16, group = c.heads / c.kv_heads;
  torch::manual_seed(11);
  const auto q = torch::randn({total_q, c.heads, D}, torch::kDouble);
  const auto k = torch::randn({total_k, c.kv_heads, D}, torch::kDouble);
  const auto v = torch::randn({total_k, c.kv_heads, D}, torch::kDouble);
  const auto upstream = torch::randn({total_q, c.heads, D}, torch::kDouble);
  const auto qa = q.to(dtype).requires_grad_(), ka = k.to(dtype).requires_grad_(),
             va = v.to(dtype).requires_grad_();
  auto options = SDPAOptions().is_causal(c.causal).scale(0.25);
  if (c.window > 0) {
    options.window(c.window);
  }
  const auto out = attn::varlen_attention(
      qa, ka, va, attn::PackedSequences(q_starts, k_starts), options);
  (out * upstream.to(dtype)).sum().backward();

  const Tolerance tolerance = attn::testing::tolerance_for(dtype);
  for (size_t n = 0; n < c.q_lengths.size(); ++n) {
    const int64_t L = c.q_lengths[n], S = c.k_lengths[n];
    const int64_t i0 = q_starts[n].item<int64_t>(), j0 = k_starts[n].item<int64_t>();
    // (H, ·, D) per sequence; each query head reads its group's key head.
    const auto heads = [&](const torch::Tensor& t, int64_t from, int64_t length, bool repeat) {
      auto h = t.narrow(0, from, length).transpose(0, 1);
      return repeat ? h.repeat_interleave(group, 0) : h;
    };
    const auto bias = additive_bias(
        band_mask(L, S, S - L, c.causal, c.window).expand({c.heads, L, S}));
    const auto sq = heads(q, i0, L, false), sk = heads(k, j0, S, true), sv = heads(v, j0, S, true);
    const auto expected = reference_attention(sq, sk, sv, bias, 0.25).first;
    EXPECT_CLOSE(heads(out, i0, L, false), expected, tolerance) << "sequence " << n;
    const auto grads = reference_attention_gradients(
        sq, sk, sv, bias, 0.25, heads(upstream, i0, L, false));
    const auto per_kv_head = [&](const torch::Tensor& g) { // (H, S, D) summed over each group
      return g.view({c.kv_heads, group, S, D}).sum(1);
    };
    EXPECT_CLOSE(heads(qa.grad(), i0, L, false), grads[0], tolerance) << "sequence " << n;
    EXPECT_CLOSE(heads(ka.grad(), j0, S, false), per_kv_head(grads[1]), tolerance)
        << "sequence " << n;
    EXPECT_CLOSE(heads(va.grad(), j0, S, false), per_kv_head(grads[2]), tolerance)
        << "sequence " << n;
  }
}

TEST(VarlenAttention, EachSequenceIsAttendedAsIfAlone) {
  for (const auto& c : packed_cases()) {
    expect_each_sequence_alone(c, torch::kDouble);
    expect_each_sequence_alone(c, torch::kFloat);
  }
}

// With the score modifiers, each sequence as attn's own function computes
// it alone (whose modifiers the ScoreModifiers suite checks against the
// float64 oracle of the papers).
TEST(VarlenAttention, ScoreModifiersApplyWithinEachSequence) {
  const std::vector<int64_t> lengths = {150, 40, 200};
  const auto starts = starts_of(lengths);
  torch::manual_seed(13);
  const int64_t H = 4, D = 16, total = starts[-1].item<int64_t>();
  const auto q = torch::randn({total, H, D}, torch::kDouble);
  const auto k = torch::randn({total, H, D}, torch::kDouble);
  const auto v = torch::randn({total, H, D}, torch::kDouble);
  const auto options = SDPAOptions()
                           .is_causal(true)
                           .alibi_slopes(attn::alibi_slopes(H).to(torch::kDouble))
                           .softcap(5.0)
                           .sinks(torch::randn({H}, torch::kDouble));
  const auto out = attn::varlen_attention(q, k, v, attn::PackedSequences(starts), options);
  for (size_t n = 0; n < lengths.size(); ++n) {
    const int64_t from = starts[n].item<int64_t>(), L = lengths[n];
    const auto heads = [&](const torch::Tensor& t) { return t.narrow(0, from, L).transpose(0, 1); };
    const auto [alone, none] = attn::scaled_dot_product_attention(
        heads(q), heads(k), heads(v), SDPAOptions(options).backend(AttentionBackend::math));
    EXPECT_CLOSE(heads(out), alone, attn::testing::kFloat64Tolerance) << "sequence " << n;
  }
}

// The bad inputs of both entry points: the catalogue's tables.
TEST(VarlenAttention, BadInputsAreTheCataloguesErrors) {
  attn::testing::expect_catalogued_outcomes(
      attn::testing::error_cases(attn::testing::varlen_attention_cases()));
  attn::testing::expect_catalogued_outcomes(
      attn::testing::error_cases(attn::testing::block_mask_cases()));
}

} // namespace
