#include "bad_input_catalogue.h"

#include "test_support.h"

#include <attn/block_mask.h>
#include <attn/device.h>
#include <attn/functional.h>
#include <attn/interop.h>
#include <attn/modules/multi_head_attention.h>
#include <attn/modules/scaled_dot_product_attention.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <stdexcept>
#include <tuple>

namespace attn::testing {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// A tensor on the meta device: another device than the CPU, available
// without a GPU, so that device checks are exercised everywhere.
torch::Tensor on_meta(torch::IntArrayRef shape, torch::ScalarType dtype = torch::kFloat) {
  return torch::empty(shape, torch::TensorOptions(dtype).device(torch::kMeta));
}

torch::Tensor output_of(const std::tuple<torch::Tensor, torch::Tensor>& result) {
  return std::get<0>(result);
}

// An entry point's output for query, key and value.
using Forward = std::function<torch::Tensor(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value)>;

// Inputs stored with dims a and b swapped (non-contiguous), and keys and
// values expanded from one batch entry (stride 0): both give what
// contiguous inputs give.
std::vector<BadInput> layout_cases(
    const Forward& forward,
    const torch::Tensor& q,
    const torch::Tensor& k,
    const torch::Tensor& v,
    int64_t a,
    int64_t b) {
  const auto stored_swapped = [a, b](const torch::Tensor& x) {
    return x.transpose(a, b).contiguous().transpose(a, b);
  };
  const auto expanded = [](const torch::Tensor& x) { return x[0].expand(x.sizes()); };
  const auto repeated = [](const torch::Tensor& x) { return x[0].repeat({x.size(0), 1, 1}); };
  return {
      {"transposed (non-contiguous) inputs",
       [=] {
         EXPECT_CLOSE(
             forward(stored_swapped(q), stored_swapped(k), stored_swapped(v)), forward(q, k, v),
             Tolerance{1e-6});
       },
       ""},
      {"expanded (stride 0) inputs",
       [=] {
         EXPECT_CLOSE(
             forward(q, expanded(k), expanded(v)), forward(q, repeated(k), repeated(v)),
             Tolerance{1e-6});
       },
       ""},
  };
}

std::vector<BadInput> joined(std::vector<BadInput> first, const std::vector<BadInput>& second) {
  first.insert(first.end(), second.begin(), second.end());
  return first;
}

} // namespace

void expect_catalogued_outcomes(const std::vector<BadInput>& cases) {
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    if (c.error.empty()) {
      EXPECT_NO_THROW(c.call());
    } else {
      EXPECT_ATTN_ERROR(c.call(), c.error);
    }
  }
}

std::vector<BadInput> error_cases(std::vector<BadInput> cases) {
  const auto works = [](const BadInput& c) { return c.error.empty(); };
  cases.erase(std::remove_if(cases.begin(), cases.end(), works), cases.end());
  return cases;
}

// q (2, 4, 8), k (2, 6, 8), v (2, 6, 5), as docs/BAD_INPUTS.md's heading says.
std::vector<BadInput> scaled_dot_product_attention_cases() {
  torch::manual_seed(30);
  const auto q = torch::randn({2, 4, 8});
  const auto k = torch::randn({2, 6, 8});
  const auto v = torch::randn({2, 6, 5});
  const auto sdpa = [](const torch::Tensor& query, const torch::Tensor& key,
                       const torch::Tensor& value, const SDPAOptions& options = {}) {
    return attn::scaled_dot_product_attention(query, key, value, options);
  };
  const Forward output =
      [sdpa](const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value) {
        return output_of(sdpa(query, key, value));
      };
  const auto expected = output(q, k, v);
  const auto with_mask = [](const torch::Tensor& mask) { return SDPAOptions().attn_mask(mask); };
  const auto gqa = SDPAOptions().enable_gqa(true);
  const auto weights = SDPAOptions().need_weights(true);
  const std::vector<BadInput> cases = {
      {"undefined key", [=] { sdpa(q, torch::Tensor(), v); },
       "scaled_dot_product_attention: query, key and value must be defined tensors"},
      {"0-d query", [=] { sdpa(torch::tensor(1.0f), k, v); },
       "query must be (..., L, E) with at least 2 dims, got []"},
      {"1-d query", [=] { sdpa(torch::randn({8}), k, v); },
       "query must be (..., L, E) with at least 2 dims, got [8]"},
      {"ranks differ",
       [=] {
         sdpa(q, torch::randn({6, 8}), v);
       },
       "query, key and value must have the same number of dims, got query [2, 4, 8], key [6, 8], value [2, 6, 5]"},
      {"batch sizes differ",
       [=] {
         sdpa(q, torch::randn({3, 6, 8}), torch::randn({3, 6, 5}));
       },
       "query, key and value must have the same leading dims, got query [2, 4, 8], key [3, 6, 8], value [3, 6, 5]"},
      {"key feature size differs",
       [=] {
         sdpa(q, torch::randn({2, 6, 7}), v);
       },
       "key must be (..., S, E) with E == 8 (the query's feature size), got [2, 6, 7]"},
      {"key and value lengths differ",
       [=] {
         sdpa(q, k, torch::randn({2, 5, 5}));
       },
       "value must be (..., S, Ev) with S == 6 (the key's length), got [2, 5, 5]"},
      {"feature size E = 0",
       [=] {
         sdpa(torch::zeros({2, 4, 0}), torch::zeros({2, 6, 0}), v);
       },
       "query must have a feature size E > 0, got [2, 4, 0]"},
      {"integer inputs", [=] { sdpa(q.to(torch::kLong), k.to(torch::kLong), v.to(torch::kLong)); },
       "query must have a floating-point dtype, got Long"},
      {"bool inputs", [=] { sdpa(q > 0, k > 0, v > 0); },
       "query must have a floating-point dtype, got Bool"},
      {"dtypes differ", [=] { sdpa(q, k.to(torch::kDouble), v); },
       "key and value must have the query's dtype Float, got key Double and value Float"},
      {"devices differ",
       [=] {
         sdpa(q, on_meta({2, 6, 8}), v);
       },
       "key and value must be on the query's device cpu, got key on meta and value on cpu"},
      {"mask of a wrong shape",
       [=] {
         sdpa(q, k, v, with_mask(torch::zeros({4, 5})));
       },
       "attn_mask must be broadcastable to the scores' shape (..., L, S) = [2, 4, 6], got [4, 5]"},
      {"mask with more dims than the scores",
       [=] {
         sdpa(q, k, v, with_mask(torch::zeros({3, 2, 4, 6})));
       },
       "attn_mask must be broadcastable to the scores' shape (..., L, S) = [2, 4, 6], got [3, 2, 4, 6]"},
      {"integer mask",
       [=] {
         sdpa(q, k, v, with_mask(torch::zeros({4, 6}, torch::kInt)));
       },
       "attn_mask must be bool or have the query's dtype Float, got Int"},
      {"float mask of another dtype",
       [=] {
         sdpa(q, k, v, with_mask(torch::zeros({4, 6}, torch::kDouble)));
       },
       "attn_mask must be bool or have the query's dtype Float, got Double"},
      {"mask on another device",
       [=] {
         sdpa(q, k, v, with_mask(on_meta({4, 6}, torch::kBool)));
       },
       "attn_mask must be on the query's device cpu, got meta"},
      {"dropout_p > 1", [=] { sdpa(q, k, v, SDPAOptions().dropout_p(1.5)); },
       "dropout_p must be in [0, 1], got 1.5"},
      {"dropout_p NaN", [=] { sdpa(q, k, v, SDPAOptions().dropout_p(kNaN)); },
       "dropout_p must be in [0, 1], got nan"},
      {"scale NaN", [=] { sdpa(q, k, v, SDPAOptions().scale(kNaN)); },
       "scale must be a finite number, got nan"},
      {"scale infinite", [=] { sdpa(q, k, v, SDPAOptions().scale(kInf)); },
       "scale must be a finite number, got inf"},
      {"window = 0", [=] { sdpa(q, k, v, SDPAOptions().window(0)); },
       "window must be a positive number of keys, got 0"},
      {"window < 0, causal", [=] { sdpa(q, k, v, SDPAOptions().is_causal(true).window(-4)); },
       "window must be a positive number of keys, got -4"},
      {"query_offset beyond ±2^60",
       [=] { sdpa(q, k, v, SDPAOptions().query_offset((int64_t{1} << 60) + 1)); },
       "query_offset must be within ±2^60, got 1152921504606846977"},
      {"alibi_slopes of the wrong length",
       [=] { sdpa(q, k, v, SDPAOptions().alibi_slopes(torch::ones({3}))); },
       "alibi_slopes must be [2] (one entry per query head), got [3]"},
      {"alibi_slopes not finite",
       [=] {
         sdpa(q, k, v, SDPAOptions().alibi_slopes(torch::tensor({0.5, kNaN})));
       },
       "alibi_slopes must be finite in Float, the dtype of the scores, got a value that is not"},
      {"alibi_slopes whose bias leaves float32",
       [=] { sdpa(q, k, v, SDPAOptions().alibi_slopes(torch::full({2}, 1e38))); },
       "alibi_slopes times the distances (up to 5 keys) and position_bias add a bias beyond the "
       "range of Float"},
      {"softcap = 0", [=] { sdpa(q, k, v, SDPAOptions().softcap(0.0)); },
       "softcap must be a positive finite number in Float, the dtype of the scores, got 0"},
      {"softcap infinite", [=] { sdpa(q, k, v, SDPAOptions().softcap(kInf)); },
       "softcap must be a positive finite number in Float, the dtype of the scores, got inf"},
      {"softcap beyond float32", [=] { sdpa(q, k, v, SDPAOptions().softcap(1e39)); },
       "softcap must be a positive finite number in Float, the dtype of the scores, got 1e+39"},
      {"position_bias of the wrong shape",
       [=] {
         sdpa(q, k, v, SDPAOptions().position_bias(torch::zeros({2, 31})));
       },
       "position_bias must be [2, 32] (one entry per query head), got [2, 31]"},
      {"integer position_bias",
       [=] {
         sdpa(q, k, v, SDPAOptions().position_bias(torch::zeros({2, 32}, torch::kLong)));
       },
       "position_bias must have a floating-point dtype, got Long"},
      {"position buckets: num_buckets = 0",
       [=] {
         sdpa(
             q, k, v,
             SDPAOptions()
                 .position_bias(torch::zeros({2, 0}))
                 .position_buckets(PositionBuckets().num_buckets(0)));
       },
       "position_buckets needs num_buckets > 0 and max_distance > 0, got num_buckets 0 and "
       "max_distance 128"},
      {"position buckets: max_distance < 0",
       [=] {
         sdpa(
             q, k, v,
             SDPAOptions()
                 .position_bias(torch::zeros({2, 1}))
                 .position_buckets(
                     PositionBuckets().bucketing(PositionBucketing::clipped).max_distance(-1)));
       },
       "position_buckets needs num_buckets > 0 and max_distance > 0, got num_buckets 32 and "
       "max_distance -1"},
      {"position buckets: too few for T5's",
       [=] {
         sdpa(
             q, k, v,
             SDPAOptions()
                 .position_bias(torch::zeros({2, 2}))
                 .position_buckets(PositionBuckets().num_buckets(2)));
       },
       "T5's bidirectional buckets need num_buckets >= 4 and max_distance above the exact "
       "buckets (0), got num_buckets 2 and max_distance 128"},
      {"sinks of the wrong length", [=] { sdpa(q, k, v, SDPAOptions().sinks(torch::zeros({4}))); },
       "sinks must be [2] (one entry per query head), got [4]"},
      {"sinks not finite",
       [=] {
         sdpa(q, k, v, SDPAOptions().sinks(torch::tensor({0.0, -kInf})));
       },
       "sinks must be finite in Float, the dtype of the scores, got a value that is not"},
      {"float64 sinks beyond float32",
       [=] { sdpa(q, k, v, SDPAOptions().sinks(torch::full({2}, 1e39, torch::kDouble))); },
       "sinks must be finite in Float, the dtype of the scores, got a value that is not"},
      {"sinks on another device", [=] { sdpa(q, k, v, SDPAOptions().sinks(on_meta({2}))); },
       "sinks must be on the query's device cpu, got meta"},
      {"score_function without its derivative",
       [=] {
         sdpa(
             q, k, v,
             SDPAOptions().score_function(std::make_shared<attn::ScoreFunction>(attn::ScoreFunction{
                 [](double s, int64_t, int64_t, int64_t, int64_t) { return s; }, nullptr})));
       },
       "score_function needs both its value and its derivative, got value set and derivative "
       "empty"},
      {"score_function that throws",
       [=] {
         const auto throws = [](double, int64_t, int64_t, int64_t, int64_t) -> double {
           throw std::runtime_error("no score here");
         };
         sdpa(
             q, k, v,
             SDPAOptions().score_function(
                 std::make_shared<attn::ScoreFunction>(attn::ScoreFunction{throws, throws})));
       },
       "score_function threw: no score here"},
      {"sinks with no keys (S = 0): zero output, the sink's weight 1",
       [=] {
         const auto [out, w] = sdpa(
             q, torch::randn({2, 0, 8}), torch::randn({2, 0, 5}),
             SDPAOptions().sinks(torch::zeros({2})).alibi_slopes(torch::ones({2})).softcap(5.0));
         EXPECT_TRUE(torch::equal(out, torch::zeros({2, 4, 5})));
       },
       ""},
      {"enable_gqa with a 2-d query",
       [=] {
         sdpa(torch::randn({4, 8}), torch::randn({6, 8}), torch::randn({6, 5}), gqa);
       },
       "enable_gqa needs a heads dim: query must be (..., Hq, L, E), got [4, 8]"},
      {"enable_gqa with Hkv not dividing Hq",
       [=] {
         sdpa(
             torch::randn({2, 6, 4, 8}), torch::randn({2, 4, 6, 8}), torch::randn({2, 4, 6, 5}),
             gqa);
       },
       "the key/value heads Hkv must divide the query heads Hq, got Hq=6 and Hkv=4"},
      {"enable_gqa with key and value heads that differ",
       [=] {
         sdpa(
             torch::randn({2, 6, 4, 8}), torch::randn({2, 2, 6, 8}), torch::randn({2, 3, 6, 5}),
             gqa);
       },
       "and key and value their heads, got query [2, 6, 4, 8], key [2, 2, 6, 8], value [2, 3, 6, 5]"},
      {"fewer key heads without enable_gqa",
       [=] {
         sdpa(torch::randn({2, 6, 4, 8}), torch::randn({2, 2, 6, 8}), torch::randn({2, 2, 6, 5}));
       },
       "(enable_gqa allows fewer key/value heads)"},
      {"zero-length queries (L = 0): empty output",
       [=] {
         const auto [out, w] = sdpa(torch::randn({2, 0, 8}), k, v, weights);
         EXPECT_EQ(out.sizes(), torch::IntArrayRef({2, 0, 5}));
         EXPECT_EQ(w.sizes(), torch::IntArrayRef({2, 0, 6}));
       },
       ""},
      {"zero-length keys (S = 0): zero output, (…, L, 0) weights",
       [=] {
         const auto [out, w] = sdpa(q, torch::randn({2, 0, 8}), torch::randn({2, 0, 5}), weights);
         EXPECT_TRUE(torch::equal(out, torch::zeros({2, 4, 5})));
         EXPECT_EQ(w.sizes(), torch::IntArrayRef({2, 4, 0}));
       },
       ""},
      {"empty batch (B = 0): empty output",
       [=] {
         const auto out = output(
             torch::randn({0, 4, 8}), torch::randn({0, 6, 8}), torch::randn({0, 6, 5}));
         EXPECT_EQ(out.sizes(), torch::IntArrayRef({0, 4, 5}));
       },
       ""},
      {"value width Ev = 0: (…, L, 0) output",
       [=] {
         EXPECT_EQ(output(q, k, torch::randn({2, 6, 0})).sizes(), torch::IntArrayRef({2, 4, 0}));
       },
       ""},
      {"2-d inputs (no batch dims)",
       [=] { EXPECT_CLOSE(output(q[1], k[1], v[1]), expected[1], Tolerance{1e-6}); }, ""},
      {"5-d inputs",
       [=] {
         const auto out = output(
             q.view({1, 2, 1, 4, 8}), k.view({1, 2, 1, 6, 8}), v.view({1, 2, 1, 6, 5}));
         EXPECT_CLOSE(out.view({2, 4, 5}), expected, Tolerance{1e-6});
       },
       ""},
      {"mask broadcast from (1, S)",
       [=] {
         const auto keys = torch::tensor({true, true, false, true, false, true}).view({1, 6});
         EXPECT_CLOSE(
             output_of(sdpa(q, k, v, with_mask(keys))),
             output_of(sdpa(q, k, v, with_mask(keys.expand({2, 4, 6}).contiguous()))),
             Tolerance{1e-6});
       },
       ""},
      {"float16 inputs on the CPU: a float16 result near float32's",
       [=] {
         const auto out = output(q.to(torch::kHalf), k.to(torch::kHalf), v.to(torch::kHalf));
         EXPECT_EQ(out.scalar_type(), torch::kHalf);
         EXPECT_CLOSE(out, expected, Tolerance{1e-2});
       },
       ""},
  };
  return joined(cases, layout_cases(output, q, k, v, 1, 2));
}

std::vector<BadInput> scaled_dot_product_attention_module_cases() {
  ScaledDotProductAttention sdpa;
  return {
      {"module dropout < 0",
       [] { ScaledDotProductAttention(ScaledDotProductAttentionOptions().dropout(-0.1)); },
       "ScaledDotProductAttention: dropout must be in [0, 1), got -0.1"},
      {"module dropout = 1",
       [] { ScaledDotProductAttention(ScaledDotProductAttentionOptions().dropout(1.0)); },
       "ScaledDotProductAttention: dropout must be in [0, 1), got 1"},
      {"module scale NaN",
       [] {
         ScaledDotProductAttention(ScaledDotProductAttentionOptions().scale(kNaN))
             ->forward(torch::randn({2, 4}), torch::randn({3, 4}), torch::randn({3, 4}));
       },
       "scaled_dot_product_attention: scale must be a finite number, got nan"},
      {"module forward: key feature size differs",
       [sdpa]() mutable {
         sdpa(torch::randn({2, 4, 8}), torch::randn({2, 6, 7}), torch::randn({2, 6, 5}));
       },
       "scaled_dot_product_attention: key must be (..., S, E) with E == 8 (the query's feature size), got [2, 6, 7]"},
      {"module forward: mask of a wrong shape",
       [sdpa]() mutable {
         sdpa(
             torch::randn({2, 4, 8}), torch::randn({2, 6, 8}), torch::randn({2, 6, 5}),
             torch::ones({6, 4}, torch::kBool));
       },
       "attn_mask must be broadcastable to the scores' shape (..., L, S) = [2, 4, 6], got [6, 4]"},
  };
}

std::vector<BadInput> block_mask_cases() {
  torch::manual_seed(31);
  const auto q = torch::randn({2, 4, 6, 8});
  const auto ids = torch::tensor({0, 0, 1, 1, 1, 2});
  const auto documents = attn::document_mask(ids);
  const auto sdpa = [=](const SDPAOptions& options) {
    return output_of(attn::scaled_dot_product_attention(q, q, q, options));
  };
  return {
      {"window ≤ 0", [] { attn::sliding_window_mask(0); },
       "sliding_window_mask: window must be positive, got 0"},
      {"document ids not integers", [] { attn::document_mask(torch::ones({6})); },
       "document_mask: document_ids must hold integers, got Float"},
      {"document ids of 3 dims",
       [] {
         attn::document_mask(torch::zeros({1, 2, 6}, torch::kLong));
       },
       "document_mask: document_ids must be (T) or (B, T), got [1, 2, 6]"},
      {"document ids not grouped",
       [] {
         attn::document_mask(torch::tensor({0, 1, 0}));
       },
       "document_ids must be nondecreasing along each row (each document's tokens together), got a "
       "decrease at row 0, position 2"},
      {"query and key document ids of different rows",
       [] {
         attn::document_mask(torch::zeros({2, 6}, torch::kLong), torch::zeros({6}, torch::kLong));
       },
       "document_mask: the query and key document ids must have as many rows, got 2 and 1"},
      {"document ids of another length than the mask's",
       [=] { attn::block_mask(documents, 1, 1, 5, 6); },
       "block_mask: the document ids hold 6 query and 6 key positions, but the mask is for 5 "
       "queries and 6 keys"},
      {"document ids of another batch than the mask's",
       [] {
         attn::block_mask(attn::document_mask(torch::zeros({2, 6}, torch::kLong)), 3, 1, 6, 6);
       },
       "block_mask: the document ids have 2 rows, expected 1 or batch = 3"},
      {"prefix length < 0",
       [] {
         attn::prefix_lm_mask(torch::tensor({3, -1}));
       },
       "prefix_lm_mask: prefix_lengths must be at least 0, got -1"},
      {"prefix lengths of 2 dims",
       [] {
         attn::prefix_lm_mask(torch::zeros({2, 2}, torch::kLong));
       },
       "prefix_lm_mask: prefix_lengths must be (B) or (1), got [2, 2]"},
      {"an empty user predicate", [] { attn::MaskPredicate{attn::MaskPredicate::Function()}; },
       "MaskPredicate: the function must not be empty"},
      {"a user predicate that throws",
       [] {
         attn::block_mask(
             attn::MaskPredicate([](int64_t, int64_t, int64_t i, int64_t) -> bool {
               if (i == 3) {
                 throw std::runtime_error("no query 3");
               }
               return true;
             }),
             1, 1, 6, 6);
       },
       "block_mask: the mask predicate threw: no query 3"},
      {"block mask of batch 0", [=] { attn::block_mask(documents, 0, 1, 6, 6); },
       "block_mask: batch and heads must be positive and the lengths at least 0, got (0, 1, 6, 6)"},
      {"block mask built for other sizes than the call's",
       [=] { sdpa(SDPAOptions().block_mask(attn::block_mask(documents, 1, 3, 6, 6))); },
       "scaled_dot_product_attention: block_mask was built for scores (batch, heads, L, S) = (1, 3, "
       "6, 6), but the call's are (2, 4, 6, 6) (a batch or heads of 1 serves any)"},
      {"a block mask's band and is_causal with a window",
       [=] {
         sdpa(SDPAOptions()
                  .block_mask(attn::block_mask(attn::causal_mask(), 1, 1, 6, 6))
                  .is_causal(true)
                  .window(2));
       },
       "block_mask holds a causal band (window 0, 0: none) and is_causal, window and query_offset "
       "set another: set it in one place"},
      {"a block mask of batch and heads 1 for any call: the dense mask's results",
       [=] {
         const auto mask = attn::block_mask(documents, 1, 1, 6, 6);
         EXPECT_CLOSE(
             sdpa(SDPAOptions().block_mask(mask)), sdpa(SDPAOptions().attn_mask(mask.to_dense())),
             Tolerance{1e-6});
       },
       ""},
      {"a block mask and is_causal alike",
       [=] {
         const auto mask = attn::block_mask(attn::causal_mask() & documents, 1, 1, 6, 6);
         EXPECT_CLOSE(
             sdpa(SDPAOptions().block_mask(mask).is_causal(true)),
             sdpa(SDPAOptions().block_mask(mask)), Tolerance{1e-6});
       },
       ""},
      {"a block mask of L = S = 0",
       [] {
         const auto empty = torch::randn({1, 0, 8});
         const auto mask = attn::block_mask(attn::causal_mask(), 1, 1, 0, 0);
         EXPECT_EQ(
             output_of(attn::scaled_dot_product_attention(
                           empty, empty, empty, SDPAOptions().block_mask(mask)))
                 .sizes(),
             torch::IntArrayRef({1, 0, 8}));
       },
       ""},
  };
}

std::vector<BadInput> varlen_attention_cases() {
  torch::manual_seed(32);
  const auto q = torch::randn({10, 4, 8});
  const auto kv = torch::randn({12, 2, 8});
  const auto starts = torch::tensor({0, 4, 10});
  const auto packed = [=](const attn::PackedSequences& sequences, const SDPAOptions& options = {}) {
    return attn::varlen_attention(q, q, q, sequences, options);
  };
  return {
      {"query of 2 dims",
       [=] { attn::varlen_attention(q[0], q, q, attn::PackedSequences(starts)); },
       "varlen_attention: query (total_q, H, E), key (total_k, Hkv, E) and value (total_k, Hkv, "
       "Ev) must have 3 dims, got query [4, 8], key [10, 4, 8], value [10, 4, 8]"},
      {"key heads not dividing the query's",
       [=] {
         attn::varlen_attention(
             q, torch::randn({10, 3, 8}), torch::randn({10, 3, 8}), attn::PackedSequences(starts));
       },
       "varlen_attention: key and value must have the same heads Hkv, dividing the query's H, got "
       "query [10, 4, 8], key [10, 3, 8], value [10, 3, 8]"},
      {"sequence starts not from 0",
       [=] {
         packed(attn::PackedSequences(torch::tensor({1, 10})));
       },
       "varlen_attention: cu_seqlens_q must start at 0, got 1"},
      {"sequence starts decreasing",
       [=] {
         packed(attn::PackedSequences(torch::tensor({0, 6, 4, 10})));
       },
       "varlen_attention: cu_seqlens_q must be nondecreasing, got 6 then 4 at index 2"},
      {"sequence starts ending elsewhere than the total",
       [=] {
         packed(attn::PackedSequences(torch::tensor({0, 4, 9})));
       },
       "varlen_attention: cu_seqlens_q must end at the total length 10, got 9"},
      {"sequence starts not integers",
       [=] {
         packed(attn::PackedSequences(torch::tensor({0.0, 10.0})));
       },
       "varlen_attention: cu_seqlens_q must hold integers, got Float"},
      {"sequence starts of 2 dims",
       [=] {
         packed(attn::PackedSequences(torch::zeros({2, 2}, torch::kLong)));
       },
       "varlen_attention: cu_seqlens_q must be (N + 1) for N sequences, got [2, 2]"},
      {"query and key starts of different counts",
       [=] {
         packed(attn::PackedSequences(starts, torch::tensor({0, 10})));
       },
       "varlen_attention: cu_seqlens_q and cu_seqlens_k must count as many sequences, got 2 and 1"},
      {"a sequence longer than the stated maximum",
       [=] { packed(attn::PackedSequences(starts).max_seqlen_k(5)); },
       "varlen_attention: sequence 1 is 6 long by cu_seqlens_k, longer than the stated maximum 5"},
      {"an attn_mask",
       [=] {
         packed(
             attn::PackedSequences(starts),
             SDPAOptions().attn_mask(torch::ones({10, 10}, torch::kBool)));
       },
       "varlen_attention: takes no attn_mask or block_mask: the sequences are the mask"},
      {"a query_offset",
       [=] { packed(attn::PackedSequences(starts), SDPAOptions().query_offset(1)); },
       "varlen_attention: takes no query_offset (each sequence is aligned at its bottom-right corner), got 1"},
      {"need_weights",
       [=] { packed(attn::PackedSequences(starts), SDPAOptions().need_weights(true)); },
       "varlen_attention: returns no weights: set need_weights(false)"},
      {"ALiBi where queries and keys start apart",
       [=] {
         attn::varlen_attention(
             q, kv, kv, attn::PackedSequences(starts, torch::tensor({0, 5, 12})),
             SDPAOptions().alibi_slopes(attn::alibi_slopes(4)));
       },
       "varlen_attention: alibi_slopes and position_bias need each sequence's queries and keys to "
       "start together (cu_seqlens_q equal to cu_seqlens_k)"},
      {"sequences of 0 queries or 0 keys: zero output for queries without keys",
       [=] {
         const auto out = attn::varlen_attention(
             q, kv, kv,
             attn::PackedSequences(torch::tensor({0, 0, 4, 10}), torch::tensor({0, 5, 5, 12})));
         EXPECT_TRUE(torch::equal(out.narrow(0, 0, 4), torch::zeros({4, 4, 8})));
         EXPECT_TRUE(out.narrow(0, 4, 6).abs().sum().item<double>() > 0);
       },
       ""},
  };
}

// attn::MultiHeadAttention (E = 16, H = 4) on packed input: x (2, 6, 16)
// with document ids, one row x1 (1, 6, 16) with sequence starts.
std::vector<BadInput> packed_multi_head_attention_cases() {
  torch::manual_seed(33);
  MultiHeadAttention mha(MultiHeadAttentionOptions(16, 4));
  MultiHeadAttention bias_kv(MultiHeadAttentionOptions(16, 4).add_bias_kv(true));
  const auto x = torch::randn({2, 6, 16});
  const auto x1 = torch::randn({1, 6, 16});
  const auto ids = torch::tensor({{0, 0, 1, 1, 1, 2}, {0, 0, 0, 0, 1, 1}});
  const auto starts = torch::tensor({0, 2, 6});
  using Options = MultiHeadAttentionForwardOptions;
  return {
      {"document_ids and cu_seqlens together",
       [=]() mutable { mha(x1, x1, x1, Options().document_ids(ids[0]).cu_seqlens(starts)); },
       "MultiHeadAttention: give the packing as document_ids or as cu_seqlens, not both"},
      {"document_ids with keys of another length",
       [=]() mutable { mha(x, x.narrow(1, 0, 5), x.narrow(1, 0, 5), Options().document_ids(ids)); },
       "MultiHeadAttention: document_ids pack self-attention: key and value must be as long as "
       "the query (6 tokens), got 5"},
      {"document_ids of another length",
       [=]() mutable { mha(x, x, x, Options().document_ids(ids.narrow(1, 0, 5))); },
       "MultiHeadAttention: document_ids must be (T) = (6) or (B, T) = (2, 6), got [2, 5]"},
      {"document_ids not integers",
       [=]() mutable { mha(x, x, x, Options().document_ids(ids.to(torch::kFloat))); },
       "MultiHeadAttention: document_ids must hold integers, got Float"},
      {"document_ids not grouped",
       [=]() mutable {
         mha(x, x, x, Options().document_ids(torch::tensor({0, 1, 0, 1, 2, 2})));
       },
       "document_mask: document_ids must be nondecreasing along each row (each document's tokens "
       "together), got a decrease at row 0, position 2"},
      {"document_ids with add_bias_kv",
       [=]() mutable { bias_kv(x, x, x, Options().document_ids(ids)); },
       "MultiHeadAttention: document_ids take no add_bias_kv or add_zero_attn (their extra keys "
       "belong to no document)"},
      {"document_ids with a kv_cache",
       [=]() mutable {
         torch::NoGradGuard no_grad;
         KVCache cache;
         mha(x, x, x, Options().document_ids(ids).kv_cache(&cache));
       },
       "MultiHeadAttention: document_ids take no kv_cache (a cache holds sequences: give their "
       "cu_seqlens)"},
      {"cu_seqlens for two rows", [=]() mutable { mha(x, x, x, Options().cu_seqlens(starts)); },
       "MultiHeadAttention: cu_seqlens pack sequences into one row: the query must be (1, total, "
       "E) ((total, 1, E) sequence-first), got 2 rows"},
      {"cu_seqlens ending elsewhere than the row",
       [=]() mutable {
         mha(x1, x1, x1, Options().cu_seqlens(torch::tensor({0, 2, 5})));
       },
       "MultiHeadAttention: cu_seqlens must end at the total length 6, got 5"},
      {"cu_seqlens with a kv_cache and a mask",
       [=]() mutable {
         torch::NoGradGuard no_grad;
         KVCache cache;
         mha(x1, x1, x1,
             Options().cu_seqlens(starts).kv_cache(&cache).key_padding_mask(
                 torch::zeros({1, 6}, torch::kBool)));
       },
       "MultiHeadAttention: cu_seqlens with a kv_cache take no attn_mask, key_padding_mask or "
       "need_weights (the sequences are the mask, and no padding is computed)"},
      {"cu_seqlens counting other sequences than the kv_cache",
       [=]() mutable {
         torch::NoGradGuard no_grad;
         KVCache cache;
         mha(x1, x1, x1, Options().cu_seqlens(starts).kv_cache(&cache));
         mha(x1, x1, x1, Options().cu_seqlens(torch::tensor({0, 1, 2, 6})).kv_cache(&cache));
       },
       "MultiHeadAttention: cu_seqlens must count the kv_cache's 2 sequences, got 3"},
      {"a ragged kv_cache decoding another batch",
       [=]() mutable {
         torch::NoGradGuard no_grad;
         KVCache cache;
         mha(x1, x1, x1, Options().cu_seqlens(starts).kv_cache(&cache));
         const auto token = torch::randn({3, 1, 16});
         mha(token, token, token, Options().kv_cache(&cache));
       },
       "MultiHeadAttention: the kv_cache holds 2 sequences, got a batch of 3"},
      {"packed documents, one of a single token, causal: each attends to its own",
       [=]() mutable {
         const auto causal = Options().is_causal(true);
         auto packed = causal;
         const auto [out, none] = mha(x1, x1, x1, packed.cu_seqlens(torch::tensor({0, 1, 6})));
         const auto first = x1.narrow(1, 0, 1), rest = x1.narrow(1, 1, 5);
         EXPECT_CLOSE(
             out.narrow(1, 0, 1), std::get<0>(mha(first, first, first)), kFloat32Tolerance);
         EXPECT_CLOSE(
             out.narrow(1, 1, 5), std::get<0>(mha(rest, rest, rest, causal)), kFloat32Tolerance);
       },
       ""},
      {"a ragged kv_cache with alibi",
       [=]() mutable {
         torch::NoGradGuard no_grad;
         MultiHeadAttention alibi(MultiHeadAttentionOptions(16, 4).alibi(true));
         KVCache cache;
         alibi(x1, x1, x1, Options().cu_seqlens(starts).kv_cache(&cache));
         const auto token = torch::randn({2, 1, 16});
         alibi(token, token, token, Options().kv_cache(&cache));
       },
       "MultiHeadAttention: alibi and a position table need every sequence's queries to stand "
       "where its keys start, but a kv_cache of sequences of different lengths, or packed "
       "sequences after cached tokens, places them apart (decode such sequences with caches of "
       "their own)"},
      {"cu_seqlens of no sequence with a kv_cache",
       [=]() mutable {
         torch::NoGradGuard no_grad;
         KVCache cache;
         const auto none = x1.narrow(1, 0, 0);
         mha(none, none, none, Options().cu_seqlens(torch::tensor({0})).kv_cache(&cache));
       },
       "MultiHeadAttention: cu_seqlens with a kv_cache must hold at least one sequence, got [0]"},
      {"empty batch with document ids",
       [=]() mutable {
         const auto empty = x.narrow(0, 0, 0);
         const auto [out, none] = mha(
             empty, empty, empty, Options().document_ids(ids.narrow(0, 0, 0)));
         EXPECT_EQ(out.sizes(), torch::IntArrayRef({0, 6, 16}));
       },
       ""},
  };
}

std::vector<BadInput> multi_head_attention_construction_cases() {
  const auto make = [](const MultiHeadAttentionOptions& options) {
    MultiHeadAttention mha(options);
  };
  return {
      {"embed_dim not divisible by num_heads", [=] { make(MultiHeadAttentionOptions(512, 7)); },
       "MultiHeadAttention: embed_dim must be divisible by num_heads, got embed_dim=512 and num_heads=7 (remainder 1)"},
      {"embed_dim = 0", [=] { make(MultiHeadAttentionOptions(0, 1)); },
       "MultiHeadAttention: embed_dim must be positive, got 0"},
      {"num_heads < 0", [=] { make(MultiHeadAttentionOptions(8, -2)); },
       "MultiHeadAttention: num_heads must be positive, got -2"},
      {"kdim = 0", [=] { make(MultiHeadAttentionOptions(8, 2).kdim(0)); },
       "MultiHeadAttention: kdim and vdim must be positive, got kdim=0 and vdim=8"},
      {"dropout = 1", [=] { make(MultiHeadAttentionOptions(8, 2).dropout(1.0)); },
       "MultiHeadAttention: dropout must be in [0, 1), got 1"},
      {"dropout NaN", [=] { make(MultiHeadAttentionOptions(8, 2).dropout(kNaN)); },
       "MultiHeadAttention: dropout must be in [0, 1), got nan"},
      {"num_kv_heads not dividing num_heads",
       [=] { make(MultiHeadAttentionOptions(64, 8).num_kv_heads(3)); },
       "MultiHeadAttention: num_kv_heads must be positive and divide num_heads, got num_heads=8 and num_kv_heads=3"},
      {"num_kv_heads = 0", [=] { make(MultiHeadAttentionOptions(64, 8).num_kv_heads(0)); },
       "num_kv_heads must be positive and divide num_heads"},
      {"rotary dim above the head width",
       [=] { make(MultiHeadAttentionOptions(64, 8).rotary(attn::RotaryEmbeddingOptions(16))); },
       "MultiHeadAttention: rotary dim must be at most the head width embed_dim / num_heads = 8, got 16"},
      {"odd rotary dim",
       [=] { make(MultiHeadAttentionOptions(64, 8).rotary(attn::RotaryEmbeddingOptions(5))); },
       "RotaryEmbedding: dim must be a positive even number of features (they rotate in pairs), got 5"},
      {"softcap = 0", [=] { make(MultiHeadAttentionOptions(8, 2).softcap(0.0)); },
       "MultiHeadAttention: softcap must be a positive finite number, got 0"},
      {"position buckets: max_distance = 0",
       [=] {
         make(MultiHeadAttentionOptions(8, 2).position_buckets(PositionBuckets().max_distance(0)));
       },
       "MultiHeadAttention: position_buckets needs num_buckets > 0 and max_distance > 0, got "
       "num_buckets 32 and max_distance 0"},
      {"a score modifier with add_bias_kv",
       [=] { make(MultiHeadAttentionOptions(8, 2).alibi(true).add_bias_kv(true)); },
       "MultiHeadAttention: the score modifiers (alibi, softcap, position_buckets, sinks) take no "
       "add_bias_kv or add_zero_attn, whose extra keys stand at no position"},
  };
}

// A module with kdim 12 and vdim 10; q (2, 3, 16), k (2, 5, 12), v (2, 5, 10).
std::vector<BadInput> multi_head_attention_forward_cases() {
  torch::manual_seed(31);
  MultiHeadAttention mha(MultiHeadAttentionOptions(16, 4).kdim(12).vdim(10));
  MultiHeadAttention self(MultiHeadAttentionOptions(16, 4));
  MultiHeadAttention seq_first(MultiHeadAttentionOptions(16, 4).batch_first(false));
  const auto q = torch::randn({2, 3, 16});
  const auto k = torch::randn({2, 5, 12});
  const auto v = torch::randn({2, 5, 10});
  const auto with = [](const torch::Tensor& pad, const torch::Tensor& mask) {
    return MultiHeadAttentionForwardOptions().key_padding_mask(pad).attn_mask(mask);
  };
  const Forward output = [mha](
                             const torch::Tensor& query, const torch::Tensor& key,
                             const torch::Tensor& value) mutable {
    return output_of(mha(query, key, value));
  };
  const std::vector<BadInput> cases = {
      {"undefined key", [=]() mutable { mha(q, torch::Tensor(), v); },
       "MultiHeadAttention: query, key and value must be defined tensors"},
      {"2-d query",
       [=]() mutable {
         mha(torch::randn({3, 16}), k, v);
       },
       "query must be (B, L, E) with E == 16, got [3, 16]"},
      {"query feature size differs",
       [=]() mutable {
         mha(torch::randn({2, 3, 8}), k, v);
       },
       "query must be (B, L, E) with E == 16, got [2, 3, 8]"},
      {"query feature size differs, sequence-first",
       [=]() mutable {
         seq_first(torch::randn({2, 3, 8}), q, q);
       },
       "query must be (L, B, E) with E == 16, got [2, 3, 8]"},
      {"key feature size differs from kdim",
       [=]() mutable {
         mha(q, torch::randn({2, 5, 16}), v);
       },
       "key must be (B, S, kdim) with kdim == 12, got [2, 5, 16]"},
      {"2-d value",
       [=]() mutable {
         mha(q, k, torch::randn({2, 5}));
       },
       "value must be (B, S, vdim) with vdim == 10, got [2, 5]"},
      {"batch sizes differ",
       [=]() mutable {
         mha(q, torch::randn({3, 5, 12}), torch::randn({3, 5, 10}));
       },
       "query, key and value must have the same batch size B, got query [2, 3, 16], key [3, 5, 12], value [3, 5, 10]"},
      {"key and value lengths differ",
       [=]() mutable {
         mha(q, k, torch::randn({2, 4, 10}));
       },
       "key and value must have the same length S, got key [2, 5, 12], value [2, 4, 10]"},
      {"inputs of another dtype than the module",
       [=]() mutable { mha(q.to(torch::kDouble), k, v); },
       "inputs must have the module's dtype Float, got query Double, key Float, value Float (convert one with .to())"},
      {"integer inputs",
       [=]() mutable { self(q.to(torch::kLong), q.to(torch::kLong), q.to(torch::kLong)); },
       "inputs must have the module's dtype Float, got query Long"},
      {"inputs on another device than the module",
       [=]() mutable {
         mha(on_meta({2, 3, 16}), k, v);
       },
       "inputs must be on the module's device cpu, got query on meta, key on cpu, value on cpu (move one with .to())"},
      {"key_padding_mask of a wrong shape",
       [=]() mutable {
         mha(q, k, v, with(torch::zeros({2, 4}, torch::kBool), {}));
       },
       "key_padding_mask must be (B, S) = [2, 5], got [2, 4]"},
      {"integer key_padding_mask",
       [=]() mutable {
         mha(q, k, v, with(torch::zeros({2, 5}, torch::kLong), {}));
       },
       "key_padding_mask must be bool or have the query's dtype Float, got Long"},
      {"key_padding_mask on another device",
       [=]() mutable {
         mha(q, k, v, with(on_meta({2, 5}, torch::kBool), {}));
       },
       "key_padding_mask must be on the query's device cpu, got meta"},
      {"attn_mask (S, L) instead of (L, S)",
       [=]() mutable {
         mha(q, k, v, with({}, torch::zeros({5, 3})));
       },
       "attn_mask must be (L, S) = [3, 5], (B·H, L, S) = [8, 3, 5] or (B, H, L, S) = [2, 4, 3, 5] (B and H may be 1), got [5, 3]"},
      {"attn_mask (H, L, S) instead of (B·H, L, S)",
       [=]() mutable {
         mha(q, k, v, with({}, torch::zeros({4, 3, 5})));
       },
       "attn_mask must be (L, S) = [3, 5], (B·H, L, S) = [8, 3, 5] or (B, H, L, S) = [2, 4, 3, 5] (B and H may be 1), got [4, 3, 5]"},
      {"float attn_mask of another dtype",
       [=]() mutable {
         mha(q, k, v, with({}, torch::zeros({3, 5}, torch::kDouble)));
       },
       "attn_mask must be bool or have the query's dtype Float, got Double"},
      {"zero-length queries (L = 0): empty output",
       [=]() mutable {
         EXPECT_EQ(output(torch::randn({2, 0, 16}), k, v).sizes(), torch::IntArrayRef({2, 0, 16}));
       },
       ""},
      {"zero-length keys (S = 0): output is out_proj's bias",
       [=]() mutable {
         const auto out = output(q, torch::randn({2, 0, 12}), torch::randn({2, 0, 10}));
         EXPECT_TRUE(torch::equal(out, mha->out_proj->bias.expand({2, 3, 16})));
       },
       ""},
      {"empty batch (B = 0): empty output",
       [=]() mutable {
         EXPECT_EQ(
             output_of(
                 self(torch::randn({0, 3, 16}), torch::randn({0, 3, 16}), torch::randn({0, 3, 16})))
                 .sizes(),
             torch::IntArrayRef({0, 3, 16}));
       },
       ""},
  };
  return joined(cases, layout_cases(output, q, k, v, 0, 1));
}

// attn::multi_head_attention_forward with a module's parameters (E = 16,
// H = 4, H_kv = 2, kdim 12, vdim 10), one of them changed per case;
// q (2, 3, 16), k (2, 5, 12), v (2, 5, 10).
std::vector<BadInput> multi_head_attention_function_cases() {
  torch::manual_seed(37);
  const auto options = MultiHeadAttentionOptions(16, 4).num_kv_heads(2).kdim(12).vdim(10);
  MultiHeadAttention mha(options);
  const auto parameters = mha->functional_parameters();
  const auto q = torch::randn({2, 3, 16});
  const auto k = torch::randn({2, 5, 12});
  const auto v = torch::randn({2, 5, 10});
  using Change = std::function<void(attn::MultiHeadAttentionParameters&)>;
  const auto call_with = [=](const Change& change) {
    auto changed = parameters;
    change(changed);
    return attn::multi_head_attention_forward(q, k, v, options, changed);
  };
  return {
      {"the module's parameters: the module's output",
       [=]() mutable {
         torch::NoGradGuard no_grad;
         EXPECT_TRUE(torch::equal(output_of(call_with([](auto&) {})), output_of(mha(q, k, v))));
       },
       ""},
      {"num_kv_heads not dividing num_heads",
       [=] { call_with([](auto& p) { p.num_kv_heads = 3; }); },
       "multi_head_attention_forward: parameters must have num_heads H > 0, num_kv_heads H_kv > 0 dividing H and head_dim D > 0, got H=4, H_kv=3, D=4"},
      {"head_dim 0", [=] { call_with([](auto& p) { p.head_dim = 0; }); }, "got H=4, H_kv=2, D=0"},
      {"q_weight of a wrong shape",
       [=] { call_with([](auto& p) {
               p.q_weight = torch::zeros({16, 12});
             }); },
       "parameters.q_weight must be (H·D, embed_dim) = [16, 16], got [16, 12]"},
      {"k_weight as wide as the queries, not kdim",
       [=] { call_with([](auto& p) {
               p.k_weight = torch::zeros({8, 16});
             }); },
       "parameters.k_weight must be (H_kv·D, kdim) = [8, 12], got [8, 16]"},
      {"undefined out_weight", [=] { call_with([](auto& p) { p.out_weight = torch::Tensor(); }); },
       "parameters.out_weight must be (embed_dim, H·D) = [16, 16], got an undefined tensor"},
      {"v_bias of a wrong size", [=] { call_with([](auto& p) { p.v_bias = torch::zeros({16}); }); },
       "parameters.v_bias must be undefined or (8), got [16]"},
      {"bias_k without add_bias_kv",
       [=] { call_with([](auto& p) {
               p.bias_k = torch::zeros({1, 1, 8});
             }); },
       "parameters.bias_k is read only with add_bias_kv: set it in the options, or leave bias_k undefined (got [1, 1, 8])"},
      {"add_bias_kv without bias_v",
       [=] {
         auto p = parameters;
         p.bias_k = torch::zeros({1, 1, 8});
         attn::multi_head_attention_forward(
             q, k, v, MultiHeadAttentionOptions(options).add_bias_kv(true), p);
       },
       "parameters.bias_v must be (1, 1, H_kv·D) = [1, 1, 8] with add_bias_kv, got an undefined tensor"},
      {"a parameter of another dtype",
       [=] { call_with([](auto& p) { p.out_bias = p.out_bias.to(torch::kDouble); }); },
       "parameters.out_bias must have q_weight's dtype Float and device cpu, got Double on cpu"},
      {"integer q_weight",
       [=] { call_with([](auto& p) { p.q_weight = p.q_weight.to(torch::kLong); }); },
       "parameters.q_weight must have a floating-point dtype, got Long"},
      {"inputs of another dtype than the parameters",
       [=] { attn::multi_head_attention_forward(q.to(torch::kDouble), k, v, options, parameters); },
       "multi_head_attention_forward: inputs must have the parameters' dtype Float, got query Double"},
      {"dropout 1",
       [=] {
         attn::multi_head_attention_forward(
             q, k, v, MultiHeadAttentionOptions(options).dropout(1.0), parameters);
       },
       "multi_head_attention_forward: options.dropout must be in [0, 1), got 1"},
  };
}

std::vector<BadInput> unknown_device_cases() {
  std::vector<BadInput> cases;
  for (const std::string request :
       {"tpu", "", "gpu", "CPU", "mps", "cuda:", "cuda:x", "cuda:-1", "cuda:1:2"}) {
    cases.push_back(
        {"device '" + request + "'", [request] { attn::select_device(request); },
         "unknown device '" + request + "': expected auto, cpu, cuda or cuda:N"});
  }
  return cases;
}

std::vector<BadInput> unavailable_cuda_cases() {
  std::vector<BadInput> cases;
  for (const std::string request : {"cuda", "cuda:0"}) {
    cases.push_back(
        {request + " without CUDA", [request] { attn::select_device(request); },
         "device '" + request + "' requested but CUDA is not available"});
  }
  return cases;
}

std::vector<BadInput> copy_weights_cases() {
  using Builtin = torch::nn::MultiheadAttention;
  using BuiltinOptions = torch::nn::MultiheadAttentionOptions;
  MultiHeadAttention ours(MultiHeadAttentionOptions(16, 2));
  Builtin wider(BuiltinOptions(32, 2));
  Builtin more_heads(BuiltinOptions(16, 4));
  Builtin no_bias(BuiltinOptions(16, 2).bias(false));
  Builtin bias_kv(BuiltinOptions(16, 2).add_bias_kv(true));
  MultiHeadAttention grouped(MultiHeadAttentionOptions(16, 2).num_kv_heads(1).bias(false));
  return {
      {"modules of different embed_dim", [=]() mutable { attn::copy_weights(*wider, *ours); },
       "copy_weights: modules differ; torch::nn::MultiheadAttention has embed_dim=32, num_heads=2"},
      {"modules of different num_heads", [=]() mutable { attn::copy_weights(*more_heads, *ours); },
       "copy_weights: modules differ; torch::nn::MultiheadAttention has embed_dim=16, num_heads=4"},
      {"only one module has biases", [=]() mutable { attn::copy_weights(*ours, *no_bias); },
       "bias=0, add_bias_kv=0, add_zero_attn=0 but attn::MultiHeadAttention has embed_dim=16, num_heads=2, kdim=16, vdim=16, bias=1"},
      {"a built-in with add_bias_kv into a module without",
       [=]() mutable { attn::copy_weights(*bias_kv, *ours); },
       "bias=1, add_bias_kv=1, add_zero_attn=0 but attn::MultiHeadAttention has embed_dim=16, num_heads=2, kdim=16, vdim=16, bias=1, add_bias_kv=0, add_zero_attn=0"},
      {"into a grouped-query module", [=]() mutable { attn::copy_weights(*no_bias, *grouped); },
       "copy_weights: torch.nn.MultiheadAttention has no grouped-query form; the attn::MultiHeadAttention must have num_kv_heads == num_heads, got num_kv_heads=1 and num_heads=2"},
  };
}

} // namespace attn::testing
