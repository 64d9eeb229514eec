// Property tests: seeded random configurations of every public attention
// path — the function with and without weights and gradients, the
// ScaledDotProductAttention module, MultiHeadAttention for self- and
// cross-attention in both layouts — compared in output, weights and input
// gradients with the float64 loop references of test_support. Each
// configuration is drawn from its own seed alone, and a failure prints the
// seed and every parameter, so the description reproduces the case.

#include "test_support.h"

#include <attn/functional.h>
#include <attn/modules/multi_head_attention.h>
#include <attn/modules/scaled_dot_product_attention.h>

#include "kernels/cpu/short_heads.h"
#include "sdpa/backend.h" // the capabilities' loops and products

#include <cmath>
#include <cstdint>
#include <iostream>
#include <limits>
#include <random>
#include <sstream>

namespace {

using attn::testing::additive_bias;
using attn::testing::Tolerance;
using attn::testing::WithinFloat32RoundedOnce;
using attn::testing::WithinFloat32RoundedToFloat16;

using attn::testing::kInf;
constexpr uint64_t kBaseSeed = 1000;
constexpr int kFunctionCases = 300;
constexpr int kMultiHeadCases = 160;

// Uniform choice among `values`.
template <typename T>
T pick(std::mt19937_64& rng, std::initializer_list<T> values) {
  std::vector<T> v(values);
  return v[std::uniform_int_distribution<size_t>(0, v.size() - 1)(rng)];
}

bool coin(std::mt19937_64& rng) {
  return pick(rng, {false, true});
}

// Relative to the largest reference magnitude (at least 1): float32
// results differ from float64 by a few roundings per element after sums of
// up to ~500 terms in another order; gradients go through one more such
// sum. float64 differs by summation order only.
Tolerance tolerance(torch::ScalarType dtype, bool gradient) {
  if (dtype == torch::kFloat) {
    return gradient ? Tolerance{1e-4, 1e-4} : Tolerance{2e-5, 2e-5};
  }
  return gradient ? Tolerance{1e-10, 1e-10} : Tolerance{1e-12, 1e-12};
}

// How an input is laid out in memory; every layout must give the same result.
enum class Layout { contiguous, transposed, expanded };
const char* const kLayoutNames[] = {"contiguous", "transposed", "expanded"};
const char* name(Layout layout) {
  return kLayoutNames[static_cast<int>(layout)];
}

// A random tensor of `shape` in `layout`: transposed stores the last two
// dims swapped (no unit stride); expanded repeats one slice of dim 0
// (stride 0) when there is a dim to spare.
torch::Tensor random_tensor(
    const std::vector<int64_t>& shape,
    torch::ScalarType dtype,
    Layout layout) {
  const auto opts = torch::TensorOptions(dtype);
  const auto n = static_cast<int64_t>(shape.size());
  if (layout == Layout::transposed) {
    auto swapped = shape;
    std::swap(swapped[n - 1], swapped[n - 2]);
    return torch::randn(swapped, opts).transpose(-1, -2);
  }
  if (layout == Layout::expanded && n > 2) {
    auto one = shape;
    one[0] = 1;
    return torch::randn(one, opts).expand(shape);
  }
  return torch::randn(shape, opts);
}

// ---------------------------------------------------------------------------
// The function and the ScaledDotProductAttention module.

enum class SdpaMask { none, bool_pairs, bool_keys, float_full, float_pairs };
const char* const kSdpaMaskNames[] = {
    "none", "bool (L, S)", "bool (..., 1, S)", "float (..., L, S)", "float (L, S)"};
const char* name(SdpaMask mask) {
  return kSdpaMaskNames[static_cast<int>(mask)];
}

struct SdpaCase {
  uint64_t seed;
  bool module;                // through attn::ScaledDotProductAttention
  std::vector<int64_t> batch; // leading dims, possibly none
  int64_t L, S, E, Ev;
  SdpaMask mask;
  bool masked_row;         // one query row with every key masked
  bool mask_requires_grad; // a float mask that is itself learned
  bool causal;
  int64_t window = 0; // 0: none
  bool need_weights;
  bool requires_grad;
  c10::optional<double> scale;
  torch::ScalarType dtype;
  Layout layout;
  // The function's CPU capability (attn's loops or the BLAS's products);
  // a module runs at the widest.
  attn::CpuCapability capability = attn::cpu_capabilities().back();

  std::string describe() const {
    std::ostringstream s;
    s << "seed=" << seed << (module ? " module" : " function")
      << " batch=" << torch::IntArrayRef(batch) << " L=" << L << " S=" << S << " E=" << E
      << " Ev=" << Ev << " mask=" << name(mask) << " masked_row=" << masked_row
      << " mask_requires_grad=" << mask_requires_grad << " causal=" << causal
      << " window=" << window << " need_weights=" << need_weights
      << " requires_grad=" << requires_grad
      << " scale=" << (scale ? std::to_string(*scale) : "default") << " dtype=" << dtype
      << " layout=" << name(layout) << " capability=" << capability;
    return s.str();
  }
};

// Lengths around the fused kernel's tiles (128 queries, 512 keys) and
// small ones, with small widths so that hundreds of cases run in seconds.
SdpaCase draw_sdpa_case(uint64_t seed) {
  std::mt19937_64 rng(seed);
  SdpaCase c;
  c.seed = seed;
  c.module = pick(rng, {0, 0, 0, 1}) == 1;
  c.batch = pick<std::vector<int64_t>>(rng, {{}, {2}, {1, 3}, {2, 2}, {2, 1, 2}});
  const bool long_queries = pick(rng, {0, 0, 0, 1}) == 1;
  const bool long_keys = pick(rng, {0, 0, 0, 1}) == 1;
  c.L = long_queries ? pick<int64_t>(rng, {127, 128, 129, 200}) : pick<int64_t>(rng, {1, 2, 5, 17});
  c.S = long_keys ? pick<int64_t>(rng, {511, 512, 513}) : pick<int64_t>(rng, {1, 2, 6, 31});
  c.E = pick<int64_t>(rng, {1, 3, 8});
  c.Ev = pick<int64_t>(rng, {c.E, 5});
  c.mask = pick(
      rng,
      {SdpaMask::none, SdpaMask::bool_pairs, SdpaMask::bool_keys, SdpaMask::float_full,
       SdpaMask::float_pairs});
  c.masked_row = c.mask != SdpaMask::none && c.mask != SdpaMask::bool_keys && coin(rng);
  c.causal = coin(rng);
  c.need_weights = c.module || coin(rng);
  c.requires_grad = coin(rng);
  const bool float_mask = c.mask == SdpaMask::float_full || c.mask == SdpaMask::float_pairs;
  c.mask_requires_grad = float_mask && c.requires_grad && coin(rng);
  c.scale = coin(rng) ? c10::optional<double>(pick(rng, {0.05, 0.7, 1.3})) : c10::nullopt;
  c.dtype = coin(rng) ? torch::kDouble : torch::kFloat;
  c.layout = pick(rng, {Layout::contiguous, Layout::transposed, Layout::expanded});
  // Any of the capabilities this CPU runs (drawn last, so that the other
  // draws are the same on every CPU).
  const auto capabilities = attn::cpu_capabilities();
  const auto drawn =
      capabilities[std::uniform_int_distribution<size_t>(0, capabilities.size() - 1)(rng)];
  c.capability = c.module ? capabilities.back() : drawn;
  return c;
}

// The case's mask in SDPA's convention, or undefined.
torch::Tensor make_sdpa_mask(const SdpaCase& c) {
  auto full = c.batch;
  full.insert(full.end(), {c.L, c.S});
  auto keys = c.batch;
  keys.insert(keys.end(), {1, c.S});
  torch::Tensor mask;
  switch (c.mask) {
    case SdpaMask::none: return {};
    case SdpaMask::bool_pairs: mask = torch::rand({c.L, c.S}) > 0.3; break;
    case SdpaMask::bool_keys: mask = torch::rand(keys) > 0.3; break;
    case SdpaMask::float_full:
    case SdpaMask::float_pairs: {
      const auto shape = c.mask == SdpaMask::float_full ? full : std::vector<int64_t>{c.L, c.S};
      mask = torch::randn(shape, c.dtype).masked_fill(torch::rand(shape) > 0.8, -kInf);
      break;
    }
  }
  if (c.masked_row) {
    mask.select(-2, c.L / 2).fill_(mask.scalar_type() == torch::kBool ? 0.0 : -kInf);
  }
  return c.mask_requires_grad ? mask.requires_grad_() : mask;
}

// `mask` (SDPA's convention, broadcastable) and the causal rule as the
// additive float64 bias (N, L, S) of the loop reference.
torch::Tensor reference_bias(const SdpaCase& c, const torch::Tensor& mask) {
  auto full = c.batch;
  full.insert(full.end(), {c.L, c.S});
  auto bias = torch::zeros(full, torch::kDouble);
  if (mask.defined()) {
    bias = bias + additive_bias(mask.expand(full));
  }
  if (c.causal || c.window > 0) {
    bias = bias + additive_bias(attn::testing::band_mask(c.L, c.S, 0, c.causal, c.window));
  }
  return bias.reshape({-1, c.L, c.S}); // (N, L, S)
}

// The function's options for the case.
attn::SDPAOptions sdpa_options(const SdpaCase& c, const torch::Tensor& mask) {
  return attn::SDPAOptions()
      .attn_mask(mask)
      .is_causal(c.causal)
      .scale(c.scale)
      .need_weights(c.need_weights)
      .cpu_capability(c.capability);
}

// The backend the plan chooses for the case, and whether the fused kernel
// runs its short loops (short_heads.h) on it.
std::string route_of(
    const torch::Tensor& q,
    const torch::Tensor& k,
    const torch::Tensor& v,
    const torch::Tensor& mask,
    const SdpaCase& c) {
  const auto plan = attn::testing::plan_of(q, k, v, sdpa_options(c, mask));
  std::ostringstream route;
  route << plan.backend;
  if (plan.backend == attn::AttentionBackend::fused_cpu &&
      plan.kernel.fused_loops == attn::detail::FusedLoops::short_heads) {
    route << " (short heads)";
  }
  return route.str();
}

// The case's query, key and value, drawn from its seed in its dtype and
// layout. Gradients are taken with respect to these tensors, views or not.
attn::testing::QueryKeyValue case_inputs(const SdpaCase& c) {
  torch::manual_seed(c.seed);
  const auto shape = [&](int64_t T, int64_t F) {
    auto s = c.batch;
    s.insert(s.end(), {T, F});
    return s;
  };
  return {
      random_tensor(shape(c.L, c.E), c.dtype, c.layout).requires_grad_(c.requires_grad),
      random_tensor(shape(c.S, c.E), c.dtype, c.layout).requires_grad_(c.requires_grad),
      random_tensor(shape(c.S, c.Ev), c.dtype, c.layout).requires_grad_(c.requires_grad)};
}

void check_sdpa_case(const SdpaCase& c) {
  const auto [q, k, v] = case_inputs(c);
  const auto mask = make_sdpa_mask(c);
  SCOPED_TRACE("route: " + route_of(q, k, v, mask, c));

  torch::Tensor out, weights;
  if (c.module) {
    attn::ScaledDotProductAttention sdpa(
        attn::ScaledDotProductAttentionOptions().scale(c.scale).dropout(0.3));
    sdpa->eval(); // dropout off
    std::tie(out, weights) = sdpa(q, k, v, mask, c.causal, c.need_weights);
  } else {
    std::tie(out, weights) = attn::scaled_dot_product_attention(q, k, v, sdpa_options(c, mask));
  }

  const double scale = c.scale.value_or(1.0 / std::sqrt(static_cast<double>(c.E)));
  const auto flat = [](const torch::Tensor& t) { // (N, T, F)
    return t.reshape({-1, t.size(-2), t.size(-1)});
  };
  const auto bias = reference_bias(c, mask);
  const auto [ref_out, ref_weights] = attn::testing::reference_attention(
      flat(q), flat(k), flat(v), bias, scale);
  EXPECT_CLOSE(flat(out), ref_out, tolerance(c.dtype, false)) << "output";
  if (c.need_weights) {
    EXPECT_CLOSE(flat(weights), ref_weights, tolerance(c.dtype, false)) << "weights";
  } else {
    EXPECT_FALSE(weights.defined()) << "weights without need_weights";
  }
  if (!c.requires_grad) {
    return;
  }
  const auto upstream = torch::randn(out.sizes(), c.dtype);
  const auto grads = torch::autograd::grad({out}, {q, k, v}, {upstream});
  const auto ref_grads = attn::testing::reference_attention_gradients(
      flat(q), flat(k), flat(v), bias, scale, flat(upstream));
  const char* names[] = {"d query", "d key", "d value"};
  for (int i = 0; i < 3; ++i) {
    EXPECT_CLOSE(flat(grads[i]), ref_grads[i], tolerance(c.dtype, true)) << names[i];
  }
}

TEST(PropertySweep, FunctionAndModuleMatchTheFloat64Reference) {
  for (int i = 0; i < kFunctionCases; ++i) {
    const auto c = draw_sdpa_case(kBaseSeed + i);
    SCOPED_TRACE(c.describe());
    check_sdpa_case(c);
    if (HasFailure()) {
      break; // one reproducible configuration is enough to report
    }
  }
}

// ---------------------------------------------------------------------------
// Half precision. bfloat16 by FlashAttention's rule (test_support.h):
// against the float64 oracle of the same bfloat16 inputs, attn's error is
// at most twice the error of LibTorch's own bfloat16 computation,
// softmax(Q Kᵀ·scale + bias) V op by op in bfloat16, for the output and
// each gradient. float16, whose loops multiply its exact values in float:
// by WithinFloat32RoundedToFloat16 (test_support.h), with the sweep's
// float32 tolerance.

constexpr int kHalfPrecisionCases = 40;

// Where the fused kernel's tiled loops compute in half precision (a
// request the short heads' loops would not take in float32), where its
// short heads' loops do, and elsewhere; some of those that need no
// gradient ask for the weights (the weights kernel, or the batched
// kernel at short lengths).
SdpaCase draw_half_precision_case(
    uint64_t seed,
    torch::ScalarType dtype,
    attn::CpuCapability capability) {
  std::mt19937_64 rng(seed);
  SdpaCase c;
  c.seed = seed;
  c.module = false;
  c.batch = pick<std::vector<int64_t>>(rng, {{2}, {1, 3}, {2, 2}});
  c.L = pick<int64_t>(rng, {1, 17, 128, 129, 300});
  c.S = pick<int64_t>(rng, {1, 6, 40, 64, 65, 511, 512, 513, 700});
  c.E = pick<int64_t>(rng, {8, 16, 64});
  c.Ev = pick<int64_t>(rng, {c.E, 5});
  c.mask = pick(rng, {SdpaMask::none, SdpaMask::bool_pairs, SdpaMask::float_full});
  c.masked_row = false;
  c.causal = coin(rng);
  c.window = c.L <= c.S ? pick<int64_t>(rng, {0, 0, 38, 200}) : 0; // 38: odd first keys
  c.requires_grad = coin(rng);
  c.mask_requires_grad = false;
  c.scale = coin(rng) ? c10::optional<double>(pick(rng, {0.05, 0.7})) : c10::nullopt;
  c.dtype = dtype;
  c.layout = pick(rng, {Layout::contiguous, Layout::transposed});
  c.capability = capability;
  c.need_weights = !c.requires_grad && coin(rng); // drawn last: the draws above stay
  return c;
}

// Whether the tiled loops compute `dtype` in its own dtype at
// `capability`: bfloat16 where its products outrun float ones, float16
// wherever attn's loops widen it (backend.h, half_products_pay).
bool half_precision_loops_run(torch::ScalarType dtype, attn::CpuCapability capability) {
  return attn::detail::half_products_pay(
      attn::detail::cpu_loops(attn::detail::cpu_level_of(capability)), dtype);
}

// Which of the fused kernels' loops a case took: the tiled loops, the
// short heads' (each in its half precision where they compute it), the
// weights kernel (on the tiled loops' half-precision products where they
// run) or none.
enum class FusedRoute { tiled, short_heads, weights, none };

// Checks the case; returns which of the fused kernel's loops took it.
FusedRoute check_half_precision_case(const SdpaCase& c) {
  const auto [q, k, v] = case_inputs(c);
  // Every row sees a key, so that LibTorch's rows are defined: key 0
  // without a window, key i (in every band: windows come with L <= S).
  auto mask = make_sdpa_mask(c);
  if (mask.defined()) {
    const double visible = mask.scalar_type() == torch::kBool ? 1.0 : 0.0;
    mask.select(-1, 0).fill_(visible);
    mask.diagonal(0, -2, -1).fill_(visible);
  }
  auto options = sdpa_options(c, mask);
  if (c.window > 0) {
    options.window(c.window);
  }
  const auto plan = attn::testing::plan_of(q, k, v, options);
  const bool short_heads = plan.kernel.fused_loops == attn::detail::FusedLoops::short_heads;
  const auto route = plan.backend == attn::AttentionBackend::fused_cpu_weights ? FusedRoute::weights
      : plan.backend != attn::AttentionBackend::fused_cpu                      ? FusedRoute::none
      : short_heads ? FusedRoute::short_heads
                    : FusedRoute::tiled;
  const auto [out, weights] = attn::scaled_dot_product_attention(q, k, v, options);
  EXPECT_EQ(out.scalar_type(), c.dtype);
  if ((route == FusedRoute::tiled || route == FusedRoute::weights) &&
      half_precision_loops_run(c.dtype, c.capability)) {
    EXPECT_EQ(plan.compute_dtype, c.dtype) << "the half-precision loops do not run";
  }
  if (route == FusedRoute::short_heads) {
    EXPECT_EQ(plan.compute_dtype, c.dtype)
        << "the short heads' loops do not compute the half precision";
  }

  const double scale = c.scale.value_or(1.0 / std::sqrt(static_cast<double>(c.E)));
  const auto flat = [](const torch::Tensor& t) { return t.reshape({-1, t.size(-2), t.size(-1)}); };
  const auto as_leaf = [&](const torch::Tensor& t, torch::ScalarType dtype) {
    return flat(t).detach().to(dtype).requires_grad_(c.requires_grad);
  };
  const auto bias = reference_bias(c, mask);
  const auto q64 = as_leaf(q, torch::kDouble), k64 = as_leaf(k, torch::kDouble);
  const auto v64 = as_leaf(v, torch::kDouble);
  const auto [ref_out, ref_weights] = attn::testing::reference_attention(
      q64, k64, v64, bias, scale);
  const bool bfloat16 = c.dtype == torch::kBFloat16;
  const auto q16 = as_leaf(q, c.dtype), k16 = as_leaf(k, c.dtype), v16 = as_leaf(v, c.dtype);
  const auto libtorch_out = bfloat16
      ? attn::testing::composite_attention(q16, k16, v16, bias, scale)
      : torch::Tensor();
  if (bfloat16) {
    EXPECT_WITHIN_TWICE_LIBTORCHS_ERROR(flat(out), libtorch_out, ref_out);
  } else {
    EXPECT_TRUE(WithinFloat32RoundedToFloat16(flat(out), ref_out, tolerance(torch::kFloat, false)));
  }
  if (c.need_weights) {
    EXPECT_EQ(weights.scalar_type(), c.dtype);
    EXPECT_TRUE(WithinFloat32RoundedOnce(flat(weights), ref_weights)) << "weights";
  }
  if (!c.requires_grad) {
    return route;
  }
  const auto upstream = torch::randn(out.sizes()).to(c.dtype);
  const auto grads = torch::autograd::grad({out}, {q, k, v}, {upstream});
  const auto ref_grads = attn::testing::reference_attention_gradients(
      q64, k64, v64, bias, scale, flat(upstream).to(torch::kDouble));
  const auto libtorch_grads = bfloat16
      ? torch::autograd::grad({libtorch_out}, {q16, k16, v16}, {flat(upstream)})
      : std::vector<torch::Tensor>{};
  const auto carried = attn::testing::float16_delta_error(
      q64, k64, ref_out, ref_weights, flat(upstream), scale);
  const torch::Tensor carried_into[] = {carried.dq, carried.dk, torch::Tensor()};
  const char* names[] = {"d query", "d key", "d value"};
  for (size_t i = 0; i < 3; ++i) {
    if (bfloat16) {
      EXPECT_WITHIN_TWICE_LIBTORCHS_ERROR(flat(grads[i]), libtorch_grads[i], ref_grads[i])
          << names[i];
    } else {
      EXPECT_TRUE(WithinFloat32RoundedToFloat16(
          flat(grads[i]), ref_grads[i], tolerance(torch::kFloat, true), carried_into[i]))
          << names[i];
    }
  }
  return route;
}

// Cases whose tiles' products run in bands of keys (TileBands) from the
// edges that the draws reach rarely: a window of even width, whose key
// blocks begin at an odd key, so that a band starting 32 keys on begins
// with a lone key; a causal window over more keys than queries; a causal
// mask over more keys than queries, whose last query tile is one row.
std::vector<SdpaCase> banded_half_precision_cases(
    torch::ScalarType dtype,
    attn::CpuCapability capability) {
  const auto banded = [&](int64_t L, int64_t S, bool causal, int64_t window) {
    SdpaCase c = draw_half_precision_case(kBaseSeed, dtype, capability);
    c.seed = kBaseSeed + 100 + static_cast<uint64_t>(L + S + window);
    c.batch = {1, 2};
    c.L = L;
    c.S = S;
    c.E = c.Ev = 64;
    c.mask = SdpaMask::none;
    c.causal = causal;
    c.window = window;
    c.requires_grad = true;
    c.need_weights = false;
    return c;
  };
  return {banded(300, 300, false, 38), banded(300, 513, true, 200), banded(129, 700, true, 0)};
}

// The sweep of `dtype`'s cases, at least a quarter of them on the tiled
// loops, an eighth on the weights kernel, and some on the short heads'
// where they run, after the banded cases; at `capability`.
void sweep_half_precision(torch::ScalarType dtype, attn::CpuCapability capability) {
  for (const auto& c : banded_half_precision_cases(dtype, capability)) {
    SCOPED_TRACE(c.describe());
    EXPECT_EQ(check_half_precision_case(c), FusedRoute::tiled);
  }
  int tiled = 0, short_heads = 0, weights = 0;
  for (int i = 0; i < kHalfPrecisionCases && !::testing::Test::HasFailure(); ++i) {
    const auto c = draw_half_precision_case(kBaseSeed + i, dtype, capability);
    SCOPED_TRACE(c.describe());
    const auto route = check_half_precision_case(c);
    tiled += route == FusedRoute::tiled ? 1 : 0;
    short_heads += route == FusedRoute::short_heads ? 1 : 0;
    weights += route == FusedRoute::weights ? 1 : 0;
  }
  if (!::testing::Test::HasFailure()) {
    EXPECT_GE(tiled, kHalfPrecisionCases / 4) << "cases on the tiled loops";
    EXPECT_GE(weights, kHalfPrecisionCases / 8) << "cases on the weights kernel";
    const auto loops = attn::detail::cpu_loops(attn::detail::cpu_level_of(capability));
    if (attn::detail::short_heads_run(loops, torch::kFloat, 1, 1)) {
      EXPECT_GE(short_heads, kHalfPrecisionCases / 8) << "cases on the short heads' loops";
    }
  }
}

// The capabilities this CPU runs, of those `wanted` names.
std::vector<attn::CpuCapability> capabilities_among(
    std::initializer_list<attn::CpuCapability> wanted) {
  std::vector<attn::CpuCapability> runs;
  for (const auto capability : attn::cpu_capabilities()) {
    if (std::find(wanted.begin(), wanted.end(), capability) != wanted.end()) {
      runs.push_back(capability);
    }
  }
  return runs;
}

// At each capability with bfloat16 products this CPU runs (the bfloat16
// loops run where they outrun float ones: backend.h, half_products_pay),
// and at the widest (the request computed in float32) where it runs none.
TEST(PropertySweep, Bfloat16IsWithinTwiceLibTorchsBfloat16Error) {
  const auto products = capabilities_among(
      {attn::CpuCapability::avx512_bf16, attn::CpuCapability::amx});
  if (products.empty()) {
    std::cout << "[  NOTE    ] this CPU has no bfloat16 products (AVX512-BF16, AMX): the sweep "
                 "checks bfloat16 requests computed in float32 on the tiled route\n";
    sweep_half_precision(torch::kBFloat16, attn::cpu_capabilities().back());
  }
  for (const auto capability : products) {
    SCOPED_TRACE(std::string("capability: ") + attn::cpu_capability_name(capability));
    sweep_half_precision(torch::kBFloat16, capability);
  }
}

// At each of attn's float loops this CPU runs, whose micro-tiles widen
// float16 (backend.h, half_products_pay), and at portable, the BLAS's
// products, where the request is computed in float32.
TEST(PropertySweep, Float16IsWithinFloat32RoundedToFloat16) {
  for (const auto capability : capabilities_among(
           {attn::CpuCapability::portable, attn::CpuCapability::avx2,
            attn::CpuCapability::avx512})) {
    SCOPED_TRACE(std::string("capability: ") + attn::cpu_capability_name(capability));
    sweep_half_precision(torch::kHalf, capability);
  }
}

// A floating mask in half precision stays in its dtype where the fused
// kernel computes one (its loops widen it as they add it): transposed,
// strided over the keys and per batch entry, on the short heads' loops
// and on the tiled ones (where they compute the half precision: checked
// on the call's plan), against the float64 oracle of the same
// values. The output is rounded once into the half precision.
TEST(PropertySweep, HalfPrecisionMasksAtAnyStrideGiveTheOraclesResults) {
  torch::manual_seed(31);
  for (const auto dtype : {torch::kBFloat16, torch::kHalf}) {
    const double half_ulp = std::ldexp(1.0, dtype == torch::kBFloat16 ? -8 : -11);
    for (const auto& [L, S] : {std::pair<int64_t, int64_t>{20, 30}, {150, 600}}) {
      const auto input = [&](int64_t T) { return torch::randn({2, 3, T, 16}).to(dtype); };
      const auto q = input(L), k = input(S), v = input(S);
      const std::pair<const char*, torch::Tensor> masks[] = {
          {"transposed", torch::randn({S, L}).to(dtype).t()},
          {"every other key", torch::randn({L, 2 * S}).to(dtype).slice(1, 0, 2 * S, 2)},
          {"per batch entry", torch::randn({2, 1, 1, S}).to(dtype)}};
      for (const auto& [name, mask] : masks) {
        SCOPED_TRACE(
            ::testing::Message() << c10::toString(dtype) << " L=" << L << " S=" << S << " mask "
                                 << name);
        const auto options = attn::SDPAOptions().attn_mask(mask);
        const auto plan = attn::testing::plan_of(q, k, v, options);
        EXPECT_EQ(plan.backend, attn::AttentionBackend::fused_cpu);
        const bool short_heads = plan.kernel.fused_loops == attn::detail::FusedLoops::short_heads;
        if (short_heads || half_precision_loops_run(dtype, attn::cpu_capabilities().back())) {
          EXPECT_EQ(plan.compute_dtype, dtype);
          EXPECT_EQ(plan.mask_dtype, dtype);
        }
        const auto out = std::get<0>(attn::scaled_dot_product_attention(q, k, v, options));
        const auto flat = [&](const torch::Tensor& t) {
          return t.to(torch::kDouble).reshape({-1, t.size(-2), t.size(-1)});
        };
        const auto bias = mask.to(torch::kDouble).expand({2, 3, L, S}).reshape({-1, L, S});
        const auto reference = std::get<0>(
            attn::testing::reference_attention(flat(q), flat(k), flat(v), bias, 0.25));
        EXPECT_CLOSE(flat(out), reference, (Tolerance{1e-4, half_ulp}));
      }
    }
  }
}

// The batched kernel computes half precision in float, query chunks of
// 64 rows of one matrix of the batch at a time (the last one partial),
// its results rounded once (its plan's compute dtype): here weights with
// gradients (cpu-short-sequences, or cpu-weights-with-gradients where
// bfloat16 leaves the former). The output, the weights and the
// gradients of q, k and v through both, against the float64 oracle
// (softmax(Q Kᵀ·scale + bias), op by op in float64) of the same inputs:
// bfloat16 by FlashAttention's rule against the same ops in bfloat16,
// float16 within float32's tolerance rounded once, the weights each
// within half an ulp of float32's (WithinFloat32RoundedOnce). At each
// of the float products this CPU runs (attn's loops, the BLAS's).
TEST(PropertySweep, HalfPrecisionOnTheBatchedKernelMatchesTheOracleThroughTheWeights) {
  enum class Mask { none, shared, per_head }; // a float mask (L, S) or (B, H, L, S)
  struct Shape {
    int64_t B, H, L, S, Hkv;
    bool causal;
    int64_t window;
    Mask mask;
    bool output_in_loss; // else the loss reads only the weights
  };
  // The second, one matrix (B·Hkv = 1) on two threads, splits its query
  // chunks between two backward tasks, whose dK and dV are summed after.
  // The third's mask tells every query head of every matrix apart.
  const Shape shapes[] = {
      {2, 2, 20, 30, 2, false, 0, Mask::shared, true},
      {1, 2, 150, 300, 1, true, 0, Mask::none, true},
      {2, 4, 129, 129, 2, false, 38, Mask::per_head, true},
      {2, 2, 40, 40, 1, false, 0, Mask::none, false}};
  const attn::testing::ThreadCount two_threads(2);
  torch::manual_seed(41);
  for (const auto dtype : {torch::kBFloat16, torch::kHalf}) {
    for (const auto& c : shapes) {
      for (const auto capability : capabilities_among(
               {attn::CpuCapability::portable, attn::CpuCapability::avx2,
                attn::CpuCapability::avx512})) {
        SCOPED_TRACE(
            ::testing::Message() << c10::toString(dtype) << " capability " << capability
                                 << " B=" << c.B << " L=" << c.L << " S=" << c.S << " Hkv=" << c.Hkv
                                 << " causal=" << c.causal << " window=" << c.window
                                 << " mask=" << static_cast<int>(c.mask)
                                 << " output in the loss=" << c.output_in_loss);
        const int64_t B = c.B, H = c.H, E = 16, Ev = 8;
        const auto leaf = [&](at::IntArrayRef shape) {
          return torch::randn(shape).to(dtype).requires_grad_(true);
        };
        const auto q = leaf({B, H, c.L, E}), k = leaf({B, c.Hkv, c.S, E});
        const auto v = leaf({B, c.Hkv, c.S, Ev});
        const auto mask = c.mask == Mask::none ? torch::Tensor()
            : c.mask == Mask::shared           ? torch::randn({c.L, c.S}).to(dtype)
                                               : torch::randn({B, H, c.L, c.S}).to(dtype);
        auto options = attn::SDPAOptions()
                           .attn_mask(mask)
                           .is_causal(c.causal)
                           .need_weights(true)
                           .enable_gqa(c.Hkv < H)
                           .cpu_capability(capability);
        if (c.window > 0) {
          options.window(c.window);
        }
        const auto plan = attn::testing::plan_of(q, k, v, options);
        ASSERT_EQ(plan.backend, attn::AttentionBackend::batched_cpu);
        EXPECT_EQ(plan.compute_dtype, dtype) << "a chunk of one matrix at a time in float";
        const auto [out, weights] = attn::scaled_dot_product_attention(q, k, v, options);
        const auto upstream = torch::randn(out.sizes()).to(dtype);
        const auto weights_upstream = torch::randn(weights.sizes()).to(dtype);
        const auto loss = [&](const torch::Tensor& o, const torch::Tensor& p) {
          const auto from_weights =
              (p.to(torch::kDouble) * weights_upstream.to(torch::kDouble)).sum();
          return c.output_in_loss
              ? (o.to(torch::kDouble) * upstream.to(torch::kDouble)).sum() + from_weights
              : from_weights;
        };
        const auto grads = torch::autograd::grad({loss(out, weights)}, {q, k, v});
        EXPECT_EQ(weights.scalar_type(), dtype);

        auto bias = attn::testing::additive_bias(
            attn::testing::band_mask(c.L, c.S, 0, c.causal, c.window));
        if (mask.defined()) {
          bias = bias + mask.to(torch::kDouble);
        }
        // The oracle's ops in `in` (float64, or the dtype for LibTorch's error).
        const auto composite = [&](torch::ScalarType in) {
          const auto own = [&](const torch::Tensor& t) {
            return t.detach().to(in).requires_grad_(true);
          };
          std::vector<torch::Tensor> inputs{own(q), own(k), own(v)};
          const int64_t group = H / c.Hkv;
          const auto scores = torch::matmul(
                                  inputs[0],
                                  inputs[1].repeat_interleave(group, 1).transpose(-2, -1)) /
                  std::sqrt(static_cast<double>(E)) +
              bias.to(in);
          const auto p = torch::softmax(scores, -1);
          const auto o = torch::matmul(p, inputs[2].repeat_interleave(group, 1));
          auto g = torch::autograd::grad(
              {loss(o, p)}, inputs, /*grad_outputs=*/{}, /*retain_graph=*/c10::nullopt,
              /*create_graph=*/false, /*allow_unused=*/true);
          for (size_t i = 0; i < g.size(); ++i) { // V, where only the weights are in the loss
            g[i] = g[i].defined() ? g[i] : torch::zeros_like(inputs[i]);
          }
          g.insert(g.begin(), {o.detach(), p.detach()});
          return g; // out, weights, dq, dk, dv
        };
        const auto oracle = composite(torch::kDouble);
        const torch::Tensor ours[] = {out, weights, grads[0], grads[1], grads[2]};
        const char* names[] = {"output", "weights", "d query", "d key", "d value"};
        EXPECT_TRUE(WithinFloat32RoundedOnce(weights, oracle[1])) << "weights";
        if (dtype == torch::kBFloat16) {
          const auto libtorch = composite(dtype);
          for (size_t i = 0; i < 5; ++i) {
            EXPECT_WITHIN_TWICE_LIBTORCHS_ERROR(ours[i], libtorch[i], oracle[i]) << names[i];
          }
          continue;
        }
        for (size_t i = 0; i < 5; ++i) {
          EXPECT_TRUE(WithinFloat32RoundedToFloat16(
              ours[i], oracle[i], tolerance(torch::kFloat, /*gradient=*/i >= 2)))
              << names[i];
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------
// MultiHeadAttention.

enum class MhaMask {
  none,
  bool_pairs,
  float_pairs,
  bool_per_head_3d,
  float_full_4d,
  bool_heads_4d,
  float_batch_4d
};
const char* const kMhaMaskNames[] = {
    "none",
    "bool (L, S)",
    "float (L, S)",
    "bool (B*H, L, S)",
    "float (B, H, L, S)",
    "bool (1, H, L, S)",
    "float (B, 1, L, S)"};
const char* name(MhaMask mask) {
  return kMhaMaskNames[static_cast<int>(mask)];
}
enum class Padding { none, bool_keys, float_keys };
const char* const kPaddingNames[] = {"none", "bool", "float"};
const char* name(Padding padding) {
  return kPaddingNames[static_cast<int>(padding)];
}

struct MhaCase {
  uint64_t seed;
  int64_t B, L, S, E, H, kdim, vdim;
  bool self_attention; // one tensor as query, key and value (S == L)
  bool batch_first;
  bool bias;
  MhaMask mask;
  Padding padding;
  bool padded_batch; // one batch entry with every key padded
  bool causal;
  bool need_weights;
  bool average_weights;
  bool requires_grad;
  bool transposed_inputs;
  torch::ScalarType dtype;

  std::string describe() const {
    std::ostringstream s;
    s << "seed=" << seed << " B=" << B << " L=" << L << " S=" << S << " E=" << E << " H=" << H
      << " kdim=" << kdim << " vdim=" << vdim << (self_attention ? " self" : " cross")
      << " batch_first=" << batch_first << " bias=" << bias << " attn_mask=" << name(mask)
      << " key_padding_mask=" << name(padding) << " padded_batch=" << padded_batch
      << " causal=" << causal << " need_weights=" << need_weights
      << " average_weights=" << average_weights << " requires_grad=" << requires_grad
      << " transposed_inputs=" << transposed_inputs << " dtype=" << dtype;
    return s.str();
  }
};

MhaCase draw_mha_case(uint64_t seed) {
  std::mt19937_64 rng(seed);
  MhaCase c;
  c.seed = seed;
  c.B = pick<int64_t>(rng, {1, 2, 3});
  c.E = pick<int64_t>(rng, {4, 6, 12});
  c.H = c.E == 6 ? pick<int64_t>(rng, {1, 2, 3}) : pick<int64_t>(rng, {1, 2, 4});
  c.L = pick(rng, {0, 0, 0, 1}) == 1 ? pick<int64_t>(rng, {128, 129})
                                     : pick<int64_t>(rng, {1, 2, 5, 9});
  c.self_attention = coin(rng);
  c.S = c.self_attention ? c.L
                         : (pick(rng, {0, 0, 0, 1}) == 1 ? pick<int64_t>(rng, {512, 513})
                                                         : pick<int64_t>(rng, {1, 3, 7}));
  c.kdim = c.self_attention ? c.E : pick<int64_t>(rng, {c.E, 3});
  c.vdim = c.self_attention ? c.E : pick<int64_t>(rng, {c.E, 5});
  c.batch_first = coin(rng);
  c.bias = pick(rng, {0, 1, 1}) == 1;
  c.mask = pick(
      rng,
      {MhaMask::none, MhaMask::bool_pairs, MhaMask::float_pairs, MhaMask::bool_per_head_3d,
       MhaMask::float_full_4d, MhaMask::bool_heads_4d, MhaMask::float_batch_4d});
  c.padding = pick(rng, {Padding::none, Padding::bool_keys, Padding::float_keys});
  c.padded_batch = c.padding != Padding::none && pick(rng, {0, 0, 1}) == 1;
  c.causal = coin(rng);
  c.need_weights = coin(rng);
  c.average_weights = c.need_weights && coin(rng);
  c.requires_grad = coin(rng);
  c.transposed_inputs = coin(rng);
  c.dtype = coin(rng) ? torch::kDouble : torch::kFloat;
  return c;
}

torch::Tensor make_mha_mask(const MhaCase& c) {
  const auto random_mask = [&](std::vector<int64_t> shape, bool is_bool) {
    return is_bool ? torch::rand(shape) > 0.3
                   : torch::randn(shape, c.dtype).masked_fill(torch::rand(shape) > 0.8, -kInf);
  };
  switch (c.mask) {
    case MhaMask::none: return {};
    case MhaMask::bool_pairs: return random_mask({c.L, c.S}, true);
    case MhaMask::float_pairs: return random_mask({c.L, c.S}, false);
    case MhaMask::bool_per_head_3d: return random_mask({c.B * c.H, c.L, c.S}, true);
    case MhaMask::float_full_4d: return random_mask({c.B, c.H, c.L, c.S}, false);
    case MhaMask::bool_heads_4d: return random_mask({1, c.H, c.L, c.S}, true);
    case MhaMask::float_batch_4d: return random_mask({c.B, 1, c.L, c.S}, false);
  }
  return {};
}

torch::Tensor make_padding(const MhaCase& c) {
  torch::Tensor padding;
  switch (c.padding) {
    case Padding::none: return {};
    case Padding::bool_keys: padding = torch::rand({c.B, c.S}) > 0.7; break;
    case Padding::float_keys:
      padding = torch::randn({c.B, c.S}, c.dtype).masked_fill(torch::rand({c.B, c.S}) > 0.7, -kInf);
      break;
  }
  if (c.padded_batch) {
    padding.select(0, c.B - 1).fill_(padding.scalar_type() == torch::kBool ? 1.0 : -kInf);
  }
  return padding;
}

void check_mha_case(const MhaCase& c) {
  torch::manual_seed(c.seed);
  attn::MultiHeadAttention mha(attn::MultiHeadAttentionOptions(c.E, c.H)
                                   .kdim(c.kdim)
                                   .vdim(c.vdim)
                                   .bias(c.bias)
                                   .batch_first(c.batch_first)
                                   .dropout(0.2));
  mha->to(c.dtype);
  mha->eval(); // dropout off
  {
    torch::NoGradGuard no_grad;
    for (auto& p : mha->parameters()) {
      p.normal_(0.0, 0.5); // non-zero biases too
    }
  }
  const auto input = [&](int64_t T, int64_t F) {
    std::vector<int64_t> shape = c.batch_first ? std::vector<int64_t>{c.B, T, F}
                                               : std::vector<int64_t>{T, c.B, F};
    return random_tensor(
               shape, c.dtype, c.transposed_inputs ? Layout::transposed : Layout::contiguous)
        .requires_grad_(c.requires_grad);
  };
  const auto query = input(c.L, c.E);
  const auto key = c.self_attention ? query : input(c.S, c.kdim);
  const auto value = c.self_attention ? query : input(c.S, c.vdim);
  const auto options = attn::MultiHeadAttentionForwardOptions()
                           .attn_mask(make_mha_mask(c))
                           .key_padding_mask(make_padding(c))
                           .is_causal(c.causal)
                           .need_weights(c.need_weights)
                           .average_attn_weights(c.average_weights);
  const auto [out, weights] = mha(query, key, value, options);

  const auto upstream = c.requires_grad ? torch::randn(out.sizes(), c.dtype) : torch::Tensor();
  const auto ref = attn::testing::reference_multi_head_attention(
      *mha, query, key, value, options, upstream);
  EXPECT_CLOSE(out, ref.output, tolerance(c.dtype, false)) << "output";
  if (c.need_weights) {
    EXPECT_CLOSE(
        weights, c.average_weights ? ref.weights.mean(1) : ref.weights, tolerance(c.dtype, false))
        << "weights";
  } else {
    EXPECT_FALSE(weights.defined()) << "weights without need_weights";
  }
  if (!c.requires_grad) {
    return;
  }
  const auto& ref_grads = ref.input_gradients;
  if (c.self_attention) {
    const auto grad = torch::autograd::grad({out}, {query}, {upstream})[0];
    EXPECT_CLOSE(grad, ref_grads[0] + ref_grads[1] + ref_grads[2], tolerance(c.dtype, true))
        << "d x";
    return;
  }
  const auto grads = torch::autograd::grad({out}, {query, key, value}, {upstream});
  const char* names[] = {"d query", "d key", "d value"};
  for (int i = 0; i < 3; ++i) {
    EXPECT_CLOSE(grads[i], ref_grads[i], tolerance(c.dtype, true)) << names[i];
  }
}

TEST(PropertySweep, MultiHeadAttentionMatchesTheFloat64Reference) {
  for (int i = 0; i < kMultiHeadCases; ++i) {
    const auto c = draw_mha_case(kBaseSeed + kFunctionCases + i);
    SCOPED_TRACE(c.describe());
    check_mha_case(c);
    if (HasFailure()) {
      break; // one reproducible configuration is enough to report
    }
  }
}

} // namespace
