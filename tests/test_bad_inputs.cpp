// The catalogue of bad and unusual inputs to every public function and
// module, case for case as in docs/BAD_INPUTS.md: each call either works
// (and its result is checked) or raises a c10::Error whose message names
// what was expected and what arrived.

#include "test_support.h"

#include <attn/device.h>
#include <attn/functional.h>
#include <attn/interop.h>
#include <attn/modules/multi_head_attention.h>
#include <attn/modules/scaled_dot_product_attention.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

namespace {

using attn::MultiHeadAttention;
using attn::MultiHeadAttentionForwardOptions;
using attn::MultiHeadAttentionOptions;
using attn::SDPAOptions;
using attn::testing::max_abs_diff;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

struct Entry {
  std::string input;          // the case, as named in docs/BAD_INPUTS.md
  std::function<void()> call; // checks its own result when it works
  std::string error;          // part of the c10::Error message; empty: works
};

void check_catalogue(const std::vector<Entry>& catalogue) {
  for (const auto& entry : catalogue) {
    SCOPED_TRACE(entry.input);
    if (entry.error.empty()) {
      EXPECT_NO_THROW(entry.call());
    } else {
      EXPECT_ATTN_ERROR(entry.call(), entry.error);
    }
  }
}

// A tensor on the meta device: another device than the CPU, available
// without a GPU, so that device checks are exercised everywhere.
torch::Tensor on_meta(torch::IntArrayRef shape, torch::ScalarType dtype = torch::kFloat) {
  return torch::empty(shape, torch::TensorOptions(dtype).device(torch::kMeta));
}

torch::Tensor output_of(const std::tuple<torch::Tensor, torch::Tensor>& result) {
  return std::get<0>(result);
}

TEST(BadInputs, ScaledDotProductAttentionFunction) {
  torch::manual_seed(30);
  const auto q = torch::randn({2, 4, 8});
  const auto k = torch::randn({2, 6, 8});
  const auto v = torch::randn({2, 6, 5});
  const auto sdpa = [](const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                       const SDPAOptions& options = {}) {
    return attn::scaled_dot_product_attention(query, key, value, options);
  };
  const auto expected = output_of(sdpa(q, k, v));
  const auto with_mask = [](const torch::Tensor& mask) { return SDPAOptions().attn_mask(mask); };
  const std::vector<Entry> catalogue = {
      {"undefined key", [&] { sdpa(q, torch::Tensor(), v); },
       "scaled_dot_product_attention: query, key and value must be defined tensors"},
      {"0-d query", [&] { sdpa(torch::tensor(1.0f), k, v); },
       "query must be (..., L, E) with at least 2 dims, got []"},
      {"1-d query", [&] { sdpa(torch::randn({8}), k, v); },
       "query must be (..., L, E) with at least 2 dims, got [8]"},
      {"ranks differ", [&] { sdpa(q, torch::randn({6, 8}), v); },
       "query, key and value must have the same number of dims, got query [2, 4, 8], key [6, 8], value [2, 6, 5]"},
      {"batch sizes differ", [&] { sdpa(q, torch::randn({3, 6, 8}), torch::randn({3, 6, 5})); },
       "query, key and value must have the same leading dims, got query [2, 4, 8], key [3, 6, 8], value [3, 6, 5]"},
      {"key feature size differs", [&] { sdpa(q, torch::randn({2, 6, 7}), v); },
       "key must be (..., S, E) with E == 8 (the query's feature size), got [2, 6, 7]"},
      {"key and value lengths differ", [&] { sdpa(q, k, torch::randn({2, 5, 5})); },
       "value must be (..., S, Ev) with S == 6 (the key's length), got [2, 5, 5]"},
      {"feature size E = 0", [&] { sdpa(torch::zeros({2, 4, 0}), torch::zeros({2, 6, 0}), v); },
       "query must have a feature size E > 0, got [2, 4, 0]"},
      {"integer inputs", [&] { sdpa(q.to(torch::kLong), k.to(torch::kLong), v.to(torch::kLong)); },
       "query must have a floating-point dtype, got Long"},
      {"bool inputs", [&] { sdpa(q > 0, k > 0, v > 0); },
       "query must have a floating-point dtype, got Bool"},
      {"dtypes differ", [&] { sdpa(q, k.to(torch::kDouble), v); },
       "key and value must have the query's dtype Float, got key Double and value Float"},
      {"devices differ", [&] { sdpa(q, on_meta({2, 6, 8}), v); },
       "key and value must be on the query's device cpu, got key on meta and value on cpu"},
      {"mask of a wrong shape", [&] { sdpa(q, k, v, with_mask(torch::zeros({4, 5}))); },
       "attn_mask must be broadcastable to the scores' shape (..., L, S) = [2, 4, 6], got [4, 5]"},
      {"mask with more dims than the scores", [&] { sdpa(q, k, v, with_mask(torch::zeros({3, 2, 4, 6}))); },
       "attn_mask must be broadcastable to the scores' shape (..., L, S) = [2, 4, 6], got [3, 2, 4, 6]"},
      {"integer mask", [&] { sdpa(q, k, v, with_mask(torch::zeros({4, 6}, torch::kInt))); },
       "attn_mask must be bool or have the query's dtype Float, got Int"},
      {"float mask of another dtype", [&] { sdpa(q, k, v, with_mask(torch::zeros({4, 6}, torch::kDouble))); },
       "attn_mask must be bool or have the query's dtype Float, got Double"},
      {"mask on another device", [&] { sdpa(q, k, v, with_mask(on_meta({4, 6}, torch::kBool))); },
       "attn_mask must be on the query's device cpu, got meta"},
      {"dropout_p > 1", [&] { sdpa(q, k, v, SDPAOptions().dropout_p(1.5)); },
       "dropout_p must be in [0, 1], got 1.5"},
      {"dropout_p NaN", [&] { sdpa(q, k, v, SDPAOptions().dropout_p(kNaN)); },
       "dropout_p must be in [0, 1], got nan"},
      {"scale NaN", [&] { sdpa(q, k, v, SDPAOptions().scale(kNaN)); },
       "scale must be a finite number, got nan"},
      {"scale infinite", [&] { sdpa(q, k, v, SDPAOptions().scale(kInf)); },
       "scale must be a finite number, got inf"},
      {"zero-length queries (L = 0): empty output", [&] {
         const auto [out, w] = sdpa(torch::randn({2, 0, 8}), k, v);
         EXPECT_EQ(out.sizes(), torch::IntArrayRef({2, 0, 5}));
         EXPECT_EQ(w.sizes(), torch::IntArrayRef({2, 0, 6}));
       }, ""},
      {"zero-length keys (S = 0): zero output, (…, L, 0) weights", [&] {
         const auto [out, w] = sdpa(q, torch::randn({2, 0, 8}), torch::randn({2, 0, 5}));
         EXPECT_TRUE(torch::equal(out, torch::zeros({2, 4, 5})));
         EXPECT_EQ(w.sizes(), torch::IntArrayRef({2, 4, 0}));
       }, ""},
      {"empty batch (B = 0): empty output", [&] {
         const auto out = output_of(sdpa(torch::randn({0, 4, 8}), torch::randn({0, 6, 8}), torch::randn({0, 6, 5})));
         EXPECT_EQ(out.sizes(), torch::IntArrayRef({0, 4, 5}));
       }, ""},
      {"value width Ev = 0: (…, L, 0) output", [&] {
         EXPECT_EQ(output_of(sdpa(q, k, torch::randn({2, 6, 0}))).sizes(), torch::IntArrayRef({2, 4, 0}));
       }, ""},
      {"transposed (non-contiguous) inputs", [&] {
         const auto t = [](const torch::Tensor& x) { return x.transpose(1, 2).contiguous().transpose(1, 2); };
         EXPECT_LE(max_abs_diff(output_of(sdpa(t(q), t(k), t(v))), expected), 1e-6);
       }, ""},
      {"expanded (stride 0) inputs", [&] {
         const auto out = output_of(sdpa(q, k[0].expand({2, 6, 8}), v[0].expand({2, 6, 5})));
         EXPECT_LE(max_abs_diff(out, output_of(sdpa(q, k[0].repeat({2, 1, 1}), v[0].repeat({2, 1, 1})))), 1e-6);
       }, ""},
      {"2-d inputs (no batch dims)", [&] {
         EXPECT_LE(max_abs_diff(output_of(sdpa(q[1], k[1], v[1])), expected[1]), 1e-6);
       }, ""},
      {"5-d inputs", [&] {
         const auto out = output_of(sdpa(q.view({1, 2, 1, 4, 8}), k.view({1, 2, 1, 6, 8}), v.view({1, 2, 1, 6, 5})));
         EXPECT_LE(max_abs_diff(out.view({2, 4, 5}), expected), 1e-6);
       }, ""},
      {"mask broadcast from (1, S)", [&] {
         const auto keys = torch::tensor({true, true, false, true, false, true}).view({1, 6});
         EXPECT_LE(max_abs_diff(output_of(sdpa(q, k, v, with_mask(keys))),
                                output_of(sdpa(q, k, v, with_mask(keys.expand({2, 4, 6}).contiguous())))), 1e-6);
       }, ""},
      {"float16 inputs on the CPU: computed in float32", [&] {
         const auto out = output_of(sdpa(q.to(torch::kHalf), k.to(torch::kHalf), v.to(torch::kHalf)));
         EXPECT_EQ(out.scalar_type(), torch::kHalf);
         EXPECT_LE(max_abs_diff(out, expected), 1e-2);
       }, ""},
  };
  check_catalogue(catalogue);
}

TEST(BadInputs, ScaledDotProductAttentionModule) {
  attn::ScaledDotProductAttention sdpa;
  const std::vector<Entry> catalogue = {
      {"module dropout < 0", [] { attn::ScaledDotProductAttention(attn::ScaledDotProductAttentionOptions().dropout(-0.1)); },
       "ScaledDotProductAttention: dropout must be in [0, 1), got -0.1"},
      {"module dropout = 1", [] { attn::ScaledDotProductAttention(attn::ScaledDotProductAttentionOptions().dropout(1.0)); },
       "ScaledDotProductAttention: dropout must be in [0, 1), got 1"},
      {"module scale NaN", [] {
         attn::ScaledDotProductAttention(attn::ScaledDotProductAttentionOptions().scale(kNaN))
             ->forward(torch::randn({2, 4}), torch::randn({3, 4}), torch::randn({3, 4}));
       }, "scaled_dot_product_attention: scale must be a finite number, got nan"},
      {"module forward: key feature size differs", [&] {
         sdpa(torch::randn({2, 4, 8}), torch::randn({2, 6, 7}), torch::randn({2, 6, 5}));
       }, "scaled_dot_product_attention: key must be (..., S, E) with E == 8 (the query's feature size), got [2, 6, 7]"},
      {"module forward: mask of a wrong shape", [&] {
         sdpa(torch::randn({2, 4, 8}), torch::randn({2, 6, 8}), torch::randn({2, 6, 5}), torch::ones({6, 4}, torch::kBool));
       }, "attn_mask must be broadcastable to the scores' shape (..., L, S) = [2, 4, 6], got [6, 4]"},
  };
  check_catalogue(catalogue);
}

TEST(BadInputs, MultiHeadAttentionConstruction) {
  const auto make = [](const MultiHeadAttentionOptions& options) { MultiHeadAttention mha(options); };
  const std::vector<Entry> catalogue = {
      {"embed_dim not divisible by num_heads", [&] { make(MultiHeadAttentionOptions(512, 7)); },
       "MultiHeadAttention: embed_dim must be divisible by num_heads, got embed_dim=512 and num_heads=7 (remainder 1)"},
      {"embed_dim = 0", [&] { make(MultiHeadAttentionOptions(0, 1)); },
       "MultiHeadAttention: embed_dim must be positive, got 0"},
      {"num_heads < 0", [&] { make(MultiHeadAttentionOptions(8, -2)); },
       "MultiHeadAttention: num_heads must be positive, got -2"},
      {"kdim = 0", [&] { make(MultiHeadAttentionOptions(8, 2).kdim(0)); },
       "MultiHeadAttention: kdim and vdim must be positive, got kdim=0 and vdim=8"},
      {"dropout = 1", [&] { make(MultiHeadAttentionOptions(8, 2).dropout(1.0)); },
       "MultiHeadAttention: dropout must be in [0, 1), got 1"},
      {"dropout NaN", [&] { make(MultiHeadAttentionOptions(8, 2).dropout(kNaN)); },
       "MultiHeadAttention: dropout must be in [0, 1), got nan"},
  };
  check_catalogue(catalogue);
}

TEST(BadInputs, MultiHeadAttentionForward) {
  torch::manual_seed(31);
  MultiHeadAttention mha(MultiHeadAttentionOptions(16, 4).kdim(12).vdim(10));
  MultiHeadAttention self(MultiHeadAttentionOptions(16, 4));
  MultiHeadAttention seq_first(MultiHeadAttentionOptions(16, 4).batch_first(false));
  const auto q = torch::randn({2, 3, 16});
  const auto k = torch::randn({2, 5, 12});
  const auto v = torch::randn({2, 5, 10});
  const auto expected = output_of(mha(q, k, v));
  const auto with = [](const torch::Tensor& pad, const torch::Tensor& mask) {
    return MultiHeadAttentionForwardOptions().key_padding_mask(pad).attn_mask(mask);
  };
  const std::vector<Entry> catalogue = {
      {"undefined key", [&] { mha(q, torch::Tensor(), v); },
       "MultiHeadAttention: query, key and value must be defined tensors"},
      {"2-d query", [&] { mha(torch::randn({3, 16}), k, v); },
       "query must be (B, L, E) with E == 16, got [3, 16]"},
      {"query feature size differs", [&] { mha(torch::randn({2, 3, 8}), k, v); },
       "query must be (B, L, E) with E == 16, got [2, 3, 8]"},
      {"query feature size differs, sequence-first", [&] { seq_first(torch::randn({2, 3, 8}), q, q); },
       "query must be (L, B, E) with E == 16, got [2, 3, 8]"},
      {"key feature size differs from kdim", [&] { mha(q, torch::randn({2, 5, 16}), v); },
       "key must be (B, S, kdim) with kdim == 12, got [2, 5, 16]"},
      {"2-d value", [&] { mha(q, k, torch::randn({2, 5})); },
       "value must be (B, S, vdim) with vdim == 10, got [2, 5]"},
      {"batch sizes differ", [&] { mha(q, torch::randn({3, 5, 12}), torch::randn({3, 5, 10})); },
       "query, key and value must have the same batch size B, got query [2, 3, 16], key [3, 5, 12], value [3, 5, 10]"},
      {"key and value lengths differ", [&] { mha(q, k, torch::randn({2, 4, 10})); },
       "key and value must have the same length S, got key [2, 5, 12], value [2, 4, 10]"},
      {"inputs of another dtype than the module", [&] { mha(q.to(torch::kDouble), k, v); },
       "inputs must have the module's dtype Float, got query Double, key Float, value Float (convert one with .to())"},
      {"integer inputs", [&] { self(q.to(torch::kLong), q.to(torch::kLong), q.to(torch::kLong)); },
       "inputs must have the module's dtype Float, got query Long"},
      {"inputs on another device than the module", [&] { mha(on_meta({2, 3, 16}), k, v); },
       "inputs must be on the module's device cpu, got query on meta, key on cpu, value on cpu (move one with .to())"},
      {"key_padding_mask of a wrong shape", [&] { mha(q, k, v, with(torch::zeros({2, 4}, torch::kBool), {})); },
       "key_padding_mask must be (B, S) = [2, 5], got [2, 4]"},
      {"integer key_padding_mask", [&] { mha(q, k, v, with(torch::zeros({2, 5}, torch::kLong), {})); },
       "key_padding_mask must be bool or have the query's dtype Float, got Long"},
      {"key_padding_mask on another device", [&] { mha(q, k, v, with(on_meta({2, 5}, torch::kBool), {})); },
       "key_padding_mask must be on the query's device cpu, got meta"},
      {"attn_mask (S, L) instead of (L, S)", [&] { mha(q, k, v, with({}, torch::zeros({5, 3}))); },
       "attn_mask must be (L, S) = [3, 5], (B·H, L, S) = [8, 3, 5] or (B, H, L, S) = [2, 4, 3, 5] (B and H may be 1), got [5, 3]"},
      {"attn_mask (H, L, S) instead of (B·H, L, S)", [&] { mha(q, k, v, with({}, torch::zeros({4, 3, 5}))); },
       "attn_mask must be (L, S) = [3, 5], (B·H, L, S) = [8, 3, 5] or (B, H, L, S) = [2, 4, 3, 5] (B and H may be 1), got [4, 3, 5]"},
      {"float attn_mask of another dtype", [&] { mha(q, k, v, with({}, torch::zeros({3, 5}, torch::kDouble))); },
       "attn_mask must be bool or have the query's dtype Float, got Double"},
      {"zero-length queries (L = 0): empty output", [&] {
         EXPECT_EQ(output_of(mha(torch::randn({2, 0, 16}), k, v)).sizes(), torch::IntArrayRef({2, 0, 16}));
       }, ""},
      {"zero-length keys (S = 0): output is out_proj's bias", [&] {
         const auto out = output_of(mha(q, torch::randn({2, 0, 12}), torch::randn({2, 0, 10})));
         EXPECT_LE(max_abs_diff(out, mha->out_proj->bias.expand({2, 3, 16})), 0.0);
       }, ""},
      {"empty batch (B = 0): empty output", [&] {
         EXPECT_EQ(output_of(self(torch::randn({0, 3, 16}), torch::randn({0, 3, 16}), torch::randn({0, 3, 16}))).sizes(),
                   torch::IntArrayRef({0, 3, 16}));
       }, ""},
      {"transposed (non-contiguous) inputs", [&] {
         const auto t = [](const torch::Tensor& x) { return x.transpose(0, 1).contiguous().transpose(0, 1); };
         EXPECT_LE(max_abs_diff(output_of(mha(t(q), t(k), t(v))), expected), 1e-6);
       }, ""},
      {"expanded (stride 0) inputs", [&] {
         const auto out = output_of(mha(q, k[0].expand({2, 5, 12}), v[0].expand({2, 5, 10})));
         EXPECT_LE(max_abs_diff(out, output_of(mha(q, k[0].repeat({2, 1, 1}), v[0].repeat({2, 1, 1})))), 1e-6);
       }, ""},
  };
  check_catalogue(catalogue);
}

TEST(BadInputs, SelectDeviceAndCopyWeights) {
  MultiHeadAttention ours(MultiHeadAttentionOptions(16, 2));
  torch::nn::MultiheadAttention wider(torch::nn::MultiheadAttentionOptions(32, 2));
  torch::nn::MultiheadAttention no_bias(torch::nn::MultiheadAttentionOptions(16, 2).bias(false));
  torch::nn::MultiheadAttention bias_kv(torch::nn::MultiheadAttentionOptions(16, 2).add_bias_kv(true));
  MultiHeadAttention grouped(MultiHeadAttentionOptions(16, 2).num_kv_heads(1).bias(false));
  std::vector<Entry> catalogue = {
      {"unknown device name", [] { attn::select_device("tpu"); },
       "unknown device 'tpu': expected auto, cpu, cuda or cuda:N"},
      {"empty device name", [] { attn::select_device(""); }, "unknown device '': expected auto, cpu, cuda or cuda:N"},
      {"negative CUDA index", [] { attn::select_device("cuda:-1"); },
       "unknown device 'cuda:-1': expected auto, cpu, cuda or cuda:N"},
      {"CUDA index that is not a number", [] { attn::select_device("cuda:x"); },
       "unknown device 'cuda:x': expected auto, cpu, cuda or cuda:N"},
      {"copy_weights between modules of different embed_dim", [&] { attn::copy_weights(*wider, *ours); },
       "copy_weights: modules differ; torch::nn::MultiheadAttention has embed_dim=32, num_heads=2"},
      {"copy_weights where only one module has biases", [&] { attn::copy_weights(*ours, *no_bias); },
       "bias=0, add_bias_kv=0, add_zero_attn=0 but attn::MultiHeadAttention has embed_dim=16, num_heads=2, kdim=16, vdim=16, bias=1"},
      {"copy_weights from a built-in with add_bias_kv into a module without", [&] { attn::copy_weights(*bias_kv, *ours); },
       "bias=1, add_bias_kv=1, add_zero_attn=0 but attn::MultiHeadAttention has embed_dim=16, num_heads=2, kdim=16, vdim=16, bias=1, add_bias_kv=0, add_zero_attn=0"},
      {"copy_weights into a grouped-query module", [&] { attn::copy_weights(*no_bias, *grouped); },
       "copy_weights: torch.nn.MultiheadAttention has no grouped-query form; the attn::MultiHeadAttention must have num_kv_heads == num_heads, got num_kv_heads=1 and num_heads=2"},
  };
  if (!torch::cuda::is_available()) {
    catalogue.push_back({"cuda requested without CUDA", [] { attn::select_device("cuda"); },
                         "device 'cuda' requested but CUDA is not available"});
  }
  check_catalogue(catalogue);
}

} // namespace
