#pragma once

// Helpers shared by the tests: an independent float64 attention reference,
// finite-difference gradients, and assertions on tensors (within a
// Tolerance) and errors.

#include <attn/modules/multi_head_attention.h>

#include "sdpa/plan.h"

#include <ATen/Parallel.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <limits>
#include <set>
#include <string>
#include <vector>

namespace attn::testing {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Queries, keys and values of one call.
struct QueryKeyValue {
  torch::Tensor q, k, v;
};

// Asserts that `statement` throws a c10::Error whose message contains
// `needle`.
#define EXPECT_ATTN_ERROR(statement, needle) \
  EXPECT_THAT(                               \
      [&] { (void)(statement); },            \
      ::testing::ThrowsMessage<c10::Error>(::testing::HasSubstr(needle)))

// Largest |a - b| over all elements (both moved to CPU float64).
double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b);

// How far a result may lie from the value it is checked against: its
// largest elementwise difference may reach `atol`, or `rtol` times the
// largest magnitude of the expected tensor where that is more. Every
// tolerance in the tests is one of these.
struct Tolerance {
  double atol = 0.0;
  double rtol = 0.0;
  // The largest difference allowed from `expected`.
  double allowed(const torch::Tensor& expected) const;
};

// Results of O(1) magnitude: float32 after a handful of roundings per
// element, float64 limited by summation order only.
inline constexpr Tolerance kFloat32Tolerance{1e-5};
inline constexpr Tolerance kFloat64Tolerance{1e-12};
// kFloat32Tolerance or kFloat64Tolerance.
Tolerance tolerance_for(torch::ScalarType dtype);

// Whether `actual` is defined, shaped like `expected` and within
// `tolerance` of it; for EXPECT_CLOSE.
::testing::AssertionResult AssertClose(
    const char* actual_text,
    const char* expected_text,
    const char* tolerance_text,
    const torch::Tensor& actual,
    const torch::Tensor& expected,
    const Tolerance& tolerance);

// Expects `actual` within `tolerance` (a Tolerance) of `expected`.
#define EXPECT_CLOSE(actual, expected, tolerance) \
  EXPECT_PRED_FORMAT3(::attn::testing::AssertClose, actual, expected, tolerance)

// FlashAttention's rule for half precision (Dao, FlashAttention-2, 2023;
// its tests/test_flash_attn.py): `ours` is at most twice as far from the
// float64 `reference` of the same rounded inputs as `libtorch`, LibTorch's
// own computation in that precision, op by op; plus the rounding of a
// result into `ours`'s dtype, which no computation avoids: half an ulp
// of the largest reference magnitude; and 1e-6, float32's rounding of
// terms near 1, for results that are 0 (a softmax over one key has no
// gradient).
::testing::AssertionResult WithinTwiceLibTorchsError(
    const char* ours_text,
    const char* libtorch_text,
    const char* reference_text,
    const torch::Tensor& ours,
    const torch::Tensor& libtorch,
    const torch::Tensor& reference);

// The same bound with `factor` in place of 2.
::testing::AssertionResult WithinLibTorchsError(
    const torch::Tensor& ours,
    const torch::Tensor& libtorch,
    const torch::Tensor& reference,
    double factor);

#define EXPECT_WITHIN_TWICE_LIBTORCHS_ERROR(ours, libtorch, reference) \
  EXPECT_PRED_FORMAT3(::attn::testing::WithinTwiceLibTorchsError, ours, libtorch, reference)

// The rule for float16 where attn multiplies float16's exact values in
// float (its tiled loops), and LibTorch 1.13 has no float16 product on the
// CPU to compare with: each element of `ours` within `float32` (a float32
// computation's tolerance, relative to the largest magnitude of the
// float64 `reference`) plus half an ulp of float16 (2^-11) of the element
// itself, plus half the spacing of float16's subnormals (2^-25, what
// rounding loses below the normal range), plus `carried` where defined
// (Float16DeltaError).
::testing::AssertionResult WithinFloat32RoundedToFloat16(
    const torch::Tensor& ours,
    const torch::Tensor& reference,
    const Tolerance& float32,
    const torch::Tensor& carried = {});

// Results of either half precision that are a float32 computation
// rounded once, element by element (the weights kernel's weights, whose
// small values a bound relative to the largest would not check): each
// element of `ours` within half an ulp of its dtype (2^-8 for bfloat16,
// 2^-11 for float16) plus kFloat32RelativeError of the float64
// `reference` element itself, plus what rounding loses below the normal
// range (2^-25 for float16; 2^-126 for bfloat16, which AVX512-BF16's
// rounding flushes there).
inline constexpr double kFloat32RelativeError = 1.0 / 8192; // 2^-13
::testing::AssertionResult WithinFloat32RoundedOnce(
    const torch::Tensor& ours,
    const torch::Tensor& reference);

// What a FlashAttention backward carries into dQ and dK from the output it
// reads as the forward stored it, in float16: it takes each row's delta_i
// = Σ_d dO_id·O_id (Dao 2022, FlashAttention, Algorithm 4), which the
// rounding of O moves by up to 2^-11·Σ_d |dO_id·O_id|, and dS_ij =
// P_ij·(dP_ij − delta_i) carries that into dQ_i = scale·Σ_j dS_ij·K_j and
// dK_j = scale·Σ_i dS_ij·Q_i. From float64 q (…, L, D), k (…, S, D) per
// query head, the oracle's output (…, L, Dv) and weights P (…, L, S), and
// upstream dO: bounds on the elements of dQ (…, L, D) and of dK per query
// head (…, S, D; summed over a group by its caller).
struct Float16DeltaError {
  torch::Tensor dq, dk;
};
Float16DeltaError float16_delta_error(
    const torch::Tensor& q,
    const torch::Tensor& k,
    const torch::Tensor& out,
    const torch::Tensor& weights,
    const torch::Tensor& upstream,
    double scale);

// `mask` as the additive float64 bias that reference_attention takes, on
// the CPU: a bool mask (true: may attend) becomes 0 where true and -inf
// where false; a float mask is additive already.
torch::Tensor additive_bias(const torch::Tensor& mask);

// Plain attention in float64 with explicit loops, sharing no code with the
// library. q (N, L, E), k (N, S, E), v (N, S, Ev) and `bias` (N, L, S), an
// additive mask where -inf forbids a pair (undefined: no mask). A query with
// every key forbidden gets zero weights and a zero output. Returns
// (output (N, L, Ev), weights (N, L, S)) in float64 on the CPU.
std::pair<torch::Tensor, torch::Tensor> reference_attention(
    const torch::Tensor& q,
    const torch::Tensor& k,
    const torch::Tensor& v,
    const torch::Tensor& bias,
    double scale);

// softmax(q·kᵀ·scale + bias)·v by LibTorch's operations in the inputs'
// dtype: LibTorch's own computation in that precision, for
// WithinTwiceLibTorchsError. Shapes as reference_attention, `bias` cast to
// the inputs' dtype; rows that see no key give zeros (and zero gradients).
torch::Tensor composite_attention(
    const torch::Tensor& q,
    const torch::Tensor& k,
    const torch::Tensor& v,
    const torch::Tensor& bias,
    double scale);

// Gradients of sum(upstream · output) of reference_attention's output with
// respect to q, k and v, in float64 by the textbook formulas: dV = Pᵀ·dO,
// dP = dO·Vᵀ, dS = P ∘ (dP − rowsum(P ∘ dP)), dQ = s·dS·K, dK = s·dSᵀ·Q.
// Shapes and conventions as reference_attention; upstream is (N, L, Ev).
std::vector<torch::Tensor> reference_attention_gradients(
    const torch::Tensor& q,
    const torch::Tensor& k,
    const torch::Tensor& v,
    const torch::Tensor& bias,
    double scale,
    const torch::Tensor& upstream);

// attn::MultiHeadAttention written out in float64 from `mha`'s parameters
// (no dropout): projections, reference_attention per head under one
// additive bias built from the options' masks, merged heads, out_proj.
struct MultiHeadReference {
  torch::Tensor output;  // in the module's layout, float64
  torch::Tensor weights; // (B, H, L, S) per head
  // d sum(upstream · output) / d query, key, value (each input on its own).
  std::vector<torch::Tensor> input_gradients;
};
// Inputs in the module's layout; `upstream` is shaped like the output.
MultiHeadReference reference_multi_head_attention(
    const attn::MultiHeadAttentionImpl& mha,
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const attn::MultiHeadAttentionForwardOptions& options,
    const torch::Tensor& upstream);

// (L, S) bool, true where query i (standing at key position i + offset) may
// see key j: j <= i + offset when causal, |i + offset - j| < window when
// window > 0. Written element by element, sharing no code with the library.
torch::Tensor band_mask(int64_t L, int64_t S, int64_t offset, bool causal, int64_t window);

// d loss / d x by central differences; `x` must be a float64 CPU tensor
// that `loss` reads. Entries are perturbed in place and restored.
torch::Tensor numerical_gradient(const std::function<torch::Tensor()>& loss, torch::Tensor x);

// Sets ATen's intra-op thread count while alive (for the calling thread:
// with OpenMP the setting is per thread), then restores it.
class ThreadCount {
 public:
  explicit ThreadCount(int threads) : previous_(at::get_num_threads()) {
    at::set_num_threads(threads);
  }
  ~ThreadCount() { at::set_num_threads(previous_); }
  ThreadCount(const ThreadCount&) = delete;
  ThreadCount& operator=(const ThreadCount&) = delete;

 private:
  int previous_;
};

// Copies every parameter of `source` into the same-named one of `target`.
void copy_parameters(const torch::nn::Module& source, torch::nn::Module& target);

// Expects `copy` (a clone of `original`) to hold the same parameters, by
// name and value, each in a tensor of its own.
void expect_same_parameters_in_own_tensors(
    const torch::nn::Module& copy,
    const torch::nn::Module& original);

// The plan of a valid call of attn::scaled_dot_product_attention
// (sdpa/plan.h): which backend, dtype, loops and policies it runs, for
// tests that check which path a request takes.
attn::detail::CallPlan plan_of(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const attn::SDPAOptions& options = {});

// The loops of the widest CPU capability this CPU runs (isa.h).
attn::detail::CpuLoops widest_loops();

// A kernel plan on widest_loops() whose fused kernel runs `loops`, for
// tests that call the kernels themselves.
attn::detail::KernelPlan kernel_plan(attn::detail::FusedLoops loops);

// The value of the first processor's field `name` in /proc/cpuinfo
// ("vendor_id": "AuthenticAMD"). Empty where there is no such file or field.
std::string linux_cpuinfo_field(const std::string& name);

// The "flags" of the first processor in /proc/cpuinfo: Linux's reading of
// CPUID, less what it cannot save across a context switch, whichever
// compiler built the test. Empty where there is no such file.
std::set<std::string> linux_cpu_flags();

// The devices a device-parameterised test runs on.
std::vector<torch::Device> test_devices();

// Whether the environment sets ATTN_REQUIRE_CUDA=1 (scripts/gpu-check.sh
// does on a GPU machine): then a CUDA variant that cannot run fails.
bool cuda_required();

// Skips the current test, with the reason, when `device` is CUDA and no
// CUDA device is available (fails instead under ATTN_REQUIRE_CUDA=1).
// Use as: ATTN_SKIP_IF_UNAVAILABLE(device);
#define ATTN_SKIP_IF_UNAVAILABLE(device)                                   \
  do {                                                                     \
    if ((device).is_cuda() && !torch::cuda::is_available()) {              \
      if (::attn::testing::cuda_required()) {                              \
        FAIL() << "ATTN_REQUIRE_CUDA=1 but CUDA is not available to this " \
                  "LibTorch build or no GPU is visible";                   \
      }                                                                    \
      GTEST_SKIP() << "CUDA is not available to this LibTorch build or "   \
                      "no GPU is visible; the CUDA variant needs one";     \
    }                                                                      \
  } while (false)

} // namespace attn::testing
