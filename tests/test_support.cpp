#include "test_support.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <limits>
#include <sstream>

namespace attn::testing {
namespace {

// A detached, contiguous float64 copy on the CPU: what the references read.
torch::Tensor cpu64(const torch::Tensor& t) {
  return t.detach().to(torch::kCPU, torch::kDouble).contiguous();
}

} // namespace

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  EXPECT_EQ(a.sizes(), b.sizes());
  if (a.numel() == 0) {
    return 0.0;
  }
  const auto a64 = a.detach().to(torch::kCPU, torch::kDouble);
  const auto b64 = b.detach().to(torch::kCPU, torch::kDouble);
  return (a64 - b64).abs().max().item<double>();
}

double Tolerance::allowed(const torch::Tensor& expected) const {
  if (rtol == 0.0 || expected.numel() == 0) {
    return atol;
  }
  return std::max(atol, rtol * cpu64(expected).abs().max().item<double>());
}

Tolerance tolerance_for(torch::ScalarType dtype) {
  return dtype == torch::kDouble ? kFloat64Tolerance : kFloat32Tolerance;
}

::testing::AssertionResult AssertClose(
    const char* actual_text,
    const char* expected_text,
    const char* tolerance_text,
    const torch::Tensor& actual,
    const torch::Tensor& expected,
    const Tolerance& tolerance) {
  if (!actual.defined()) {
    return ::testing::AssertionFailure() << actual_text << " is undefined";
  }
  if (actual.sizes() != expected.sizes()) {
    return ::testing::AssertionFailure() << actual_text << " is " << actual.sizes() << " but "
                                         << expected_text << " is " << expected.sizes();
  }
  const double difference = max_abs_diff(actual, expected);
  const double allowed = tolerance.allowed(expected);
  if (difference <= allowed) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure()
      << actual_text << " differs from " << expected_text << " by up to " << difference
      << ", more than the " << allowed << " that " << tolerance_text << " (atol " << tolerance.atol
      << ", rtol " << tolerance.rtol << ") allows";
}

torch::Tensor composite_attention(
    const torch::Tensor& q,
    const torch::Tensor& k,
    const torch::Tensor& v,
    const torch::Tensor& bias,
    double scale) {
  auto scores = torch::matmul(q, k.transpose(-2, -1)) * scale;
  if (bias.defined()) {
    scores = scores + bias.to(scores.scalar_type());
  }
  const auto empty = (scores == -kInf).all(-1, /*keepdim=*/true);
  const auto weights = torch::softmax(scores.masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0);
  return torch::matmul(weights, v);
}

::testing::AssertionResult WithinLibTorchsError(
    const torch::Tensor& ours,
    const torch::Tensor& libtorch,
    const torch::Tensor& reference,
    double factor) {
  const double error = max_abs_diff(ours, reference);
  const double largest = reference.numel() > 0 ? reference.abs().max().item<double>() : 0.0;
  const int significant_bits = ours.scalar_type() == torch::kBFloat16 ? 8
      : ours.scalar_type() == torch::kHalf                            ? 11
      : ours.scalar_type() == torch::kFloat                           ? 24
                                                                      : 53;
  const double bound = factor * max_abs_diff(libtorch, reference) +
      std::ldexp(1.0, -significant_bits) * largest + 1e-6;
  if (error <= bound) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "the error is " << error << " from the reference, above "
                                       << factor << " times LibTorch's error (" << bound << ")";
}

::testing::AssertionResult WithinTwiceLibTorchsError(
    const char* ours_text,
    const char* /*libtorch_text*/,
    const char* /*reference_text*/,
    const torch::Tensor& ours,
    const torch::Tensor& libtorch,
    const torch::Tensor& reference) {
  auto result = WithinLibTorchsError(ours, libtorch, reference, 2.0);
  if (!result) {
    result << " for " << ours_text;
  }
  return result;
}

namespace {

// Whether `ours` is defined and shaped as `reference`.
::testing::AssertionResult shaped_as(const torch::Tensor& ours, const torch::Tensor& reference) {
  if (!ours.defined() || ours.sizes() != reference.sizes()) {
    return ::testing::AssertionFailure()
        << "the result is " << (ours.defined() ? "shaped " : "undefined")
        << (ours.defined() ? c10::str(ours.sizes()) : "") << ", the reference "
        << reference.sizes();
  }
  return ::testing::AssertionSuccess();
}

} // namespace

::testing::AssertionResult WithinFloat32RoundedToFloat16(
    const torch::Tensor& ours,
    const torch::Tensor& reference,
    const Tolerance& float32,
    const torch::Tensor& carried) {
  if (auto shaped = shaped_as(ours, reference); !shaped) {
    return shaped;
  }
  const auto error = (cpu64(ours) - reference).abs();
  // Half an ulp of the element, plus half the spacing of float16's
  // subnormals (2^-25), which the first term misses below the normal range.
  auto bound = std::ldexp(1.0, -11) * reference.abs() + std::ldexp(1.0, -25) +
      float32.allowed(reference);
  if (carried.defined()) {
    bound = bound + carried;
  }
  const auto excess = error - bound;
  if (excess.numel() == 0 || (excess <= 0).all().item<bool>()) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure()
      << "the largest error is " << error.max().item<double>()
      << "; an element exceeds float32's tolerance plus half a float16 ulp"
      << (carried.defined() ? " plus the output's rounding carried" : "") << " by "
      << excess.max().item<double>();
}

::testing::AssertionResult WithinFloat32RoundedOnce(
    const torch::Tensor& ours,
    const torch::Tensor& reference) {
  if (auto shaped = shaped_as(ours, reference); !shaped) {
    return shaped;
  }
  const bool bfloat16 = ours.scalar_type() == torch::kBFloat16;
  const double half_ulp = std::ldexp(1.0, bfloat16 ? -8 : -11);
  // Below the normal range: float16's subnormals are 2^-24 apart; bfloat16's
  // rounding on AVX512-BF16 flushes values below 2^-126 to zero.
  const double floor = std::ldexp(1.0, bfloat16 ? -126 : -25);
  const auto error = (cpu64(ours) - reference).abs();
  const auto bound = (half_ulp + kFloat32RelativeError) * reference.abs() + floor;
  const auto excess = error - bound;
  if (excess.numel() == 0 || (excess <= 0).all().item<bool>()) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure()
      << "an element exceeds half " << (bfloat16 ? "a bfloat16" : "a float16")
      << " ulp plus float32's error of itself by " << excess.max().item<double>()
      << " (the largest error is " << error.max().item<double>() << ")";
}

Float16DeltaError float16_delta_error(
    const torch::Tensor& q,
    const torch::Tensor& k,
    const torch::Tensor& out,
    const torch::Tensor& weights,
    const torch::Tensor& upstream,
    double scale) {
  const auto delta_error = std::ldexp(1.0, -11) *
      (cpu64(upstream) * cpu64(out)).abs().sum(-1, /*keepdim=*/true); // (…, L, 1)
  const auto p = cpu64(weights);
  return {
      scale * delta_error * p.matmul(cpu64(k).abs()),
      scale * p.transpose(-2, -1).matmul(delta_error * cpu64(q).abs())};
}

torch::Tensor additive_bias(const torch::Tensor& mask) {
  if (mask.scalar_type() != torch::kBool) {
    return cpu64(mask);
  }
  return torch::zeros(mask.sizes(), torch::kDouble)
      .masked_fill(mask.detach().cpu().logical_not(), -std::numeric_limits<double>::infinity());
}

std::pair<torch::Tensor, torch::Tensor> reference_attention(
    const torch::Tensor& q,
    const torch::Tensor& k,
    const torch::Tensor& v,
    const torch::Tensor& bias,
    double scale) {
  const auto Q = cpu64(q), K = cpu64(k), V = cpu64(v);
  const int64_t N = Q.size(0), L = Q.size(1), E = Q.size(2);
  const int64_t S = K.size(1), Ev = V.size(2);
  const auto B = bias.defined() ? cpu64(bias.expand({N, L, S}))
                                : torch::zeros({N, L, S}, torch::kDouble);
  auto out = torch::zeros({N, L, Ev}, torch::kDouble);
  auto weights = torch::zeros({N, L, S}, torch::kDouble);
  const auto q_ = Q.accessor<double, 3>(), k_ = K.accessor<double, 3>();
  const auto v_ = V.accessor<double, 3>(), b_ = B.accessor<double, 3>();
  auto out_ = out.accessor<double, 3>();
  auto w_ = weights.accessor<double, 3>();
  std::vector<double> scores(S);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t i = 0; i < L; ++i) {
      double row_max = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < S; ++j) {
        double dot = 0.0;
        for (int64_t e = 0; e < E; ++e) {
          dot += q_[n][i][e] * k_[n][j][e];
        }
        scores[j] = dot * scale + b_[n][i][j];
        row_max = std::max(row_max, scores[j]);
      }
      if (std::isinf(row_max) && row_max < 0) {
        continue; // every key forbidden: zero weights, zero output
      }
      double total = 0.0;
      for (int64_t j = 0; j < S; ++j) {
        total += std::exp(scores[j] - row_max);
      }
      for (int64_t j = 0; j < S; ++j) {
        w_[n][i][j] = std::exp(scores[j] - row_max) / total;
        for (int64_t e = 0; e < Ev; ++e) {
          out_[n][i][e] += w_[n][i][j] * v_[n][j][e];
        }
      }
    }
  }
  return {out, weights};
}

std::vector<torch::Tensor> reference_attention_gradients(
    const torch::Tensor& q,
    const torch::Tensor& k,
    const torch::Tensor& v,
    const torch::Tensor& bias,
    double scale,
    const torch::Tensor& upstream) {
  const auto Q = cpu64(q), K = cpu64(k), V = cpu64(v), dO = cpu64(upstream);
  const auto P = reference_attention(q, k, v, bias, scale).second; // (N, L, S)
  const auto dV = torch::matmul(P.transpose(1, 2), dO);
  const auto dP = torch::matmul(dO, V.transpose(1, 2));
  const auto dS = P * (dP - (P * dP).sum(-1, /*keepdim=*/true));
  return {scale * torch::matmul(dS, K), scale * torch::matmul(dS.transpose(1, 2), Q), dV};
}

MultiHeadReference reference_multi_head_attention(
    const attn::MultiHeadAttentionImpl& mha,
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const attn::MultiHeadAttentionForwardOptions& options,
    const torch::Tensor& upstream) {
  const bool batch_first = mha.options.batch_first();
  const auto layout = [&](const torch::Tensor& t) { // to and from (B, T, ·)
    return batch_first ? cpu64(t) : cpu64(t).transpose(0, 1);
  };
  const auto x_q = layout(query), x_k = layout(key), x_v = layout(value);
  const int64_t B = x_q.size(0), L = x_q.size(1), S = x_k.size(1);
  const int64_t E = mha.options.embed_dim(), H = mha.options.num_heads(), D = E / H;
  const auto weight = [&](const torch::nn::Linear& p) { return cpu64(p->weight); };
  const auto project = [&](const torch::Tensor& x, const torch::nn::Linear& p) {
    auto y = torch::matmul(x, weight(p).t());
    return p->bias.defined() ? y + cpu64(p->bias) : y;
  };
  const auto split = [&](const torch::Tensor& x, int64_t T) { // (B·H, T, D)
    return x.reshape({B, T, H, D}).transpose(1, 2).reshape({B * H, T, D});
  };
  const auto merge = [&](const torch::Tensor& x, int64_t T) { // (B, T, H·D)
    return x.reshape({B, H, T, -1}).transpose(1, 2).reshape({B, T, -1});
  };

  auto bias = torch::zeros({B, H, L, S}, torch::kDouble);
  const auto& attn_mask = options.attn_mask();
  if (attn_mask.defined()) {
    const auto m = attn_mask.dim() == 3 ? attn_mask.reshape({B, H, L, S})
                                        : attn_mask; // from (B·H, L, S)
    bias = bias + additive_bias(m);
  }
  const auto& padding = options.key_padding_mask();
  if (padding.defined()) {
    const auto m = padding.reshape({B, 1, 1, S}); // a bool one is true at padding keys
    bias = bias + additive_bias(m.scalar_type() == torch::kBool ? m.logical_not() : m);
  }
  if (options.is_causal()) {
    bias = bias + additive_bias(band_mask(L, S, 0, /*causal=*/true, 0));
  }
  bias = bias.reshape({B * H, L, S});

  const auto Q = split(project(x_q, mha.q_proj), L);
  const auto K = split(project(x_k, mha.k_proj), S);
  const auto V = split(project(x_v, mha.v_proj), S);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const auto [heads, weights] = reference_attention(Q, K, V, bias, scale);
  const auto output = project(merge(heads, L), mha.out_proj); // (B, L, E)

  MultiHeadReference result{
      batch_first ? output : output.transpose(0, 1), weights.reshape({B, H, L, S}), {}};
  if (upstream.defined()) {
    const auto d_heads = split(torch::matmul(layout(upstream), weight(mha.out_proj)), L);
    const auto grads = reference_attention_gradients(Q, K, V, bias, scale, d_heads);
    const std::pair<const torch::nn::Linear*, int64_t> projections[] = {
        {&mha.q_proj, L}, {&mha.k_proj, S}, {&mha.v_proj, S}};
    for (int i = 0; i < 3; ++i) {
      const auto& [projection, T] = projections[i];
      const auto d_input = torch::matmul(merge(grads[i], T), weight(*projection));
      result.input_gradients.push_back(batch_first ? d_input : d_input.transpose(0, 1));
    }
  }
  return result;
}

torch::Tensor band_mask(int64_t L, int64_t S, int64_t offset, bool causal, int64_t window) {
  auto allowed = torch::ones({L, S}, torch::kBool);
  auto a = allowed.accessor<bool, 2>();
  for (int64_t i = 0; i < L; ++i) {
    for (int64_t j = 0; j < S; ++j) {
      const int64_t distance = i + offset - j;
      if ((causal && distance < 0) || (window > 0 && std::abs(distance) >= window)) {
        a[i][j] = false;
      }
    }
  }
  return allowed;
}

torch::Tensor numerical_gradient(const std::function<torch::Tensor()>& loss, torch::Tensor x) {
  torch::NoGradGuard no_grad;
  constexpr double kStep = 1e-6;
  auto flat = x.view(-1);
  auto gradient = torch::zeros_like(flat);
  for (int64_t i = 0; i < flat.numel(); ++i) {
    const double original = flat[i].item<double>();
    flat[i] = original + kStep;
    const double up = loss().item<double>();
    flat[i] = original - kStep;
    const double down = loss().item<double>();
    flat[i] = original;
    gradient[i] = (up - down) / (2 * kStep);
  }
  return gradient.view_as(x);
}

void copy_parameters(const torch::nn::Module& source, torch::nn::Module& target) {
  torch::NoGradGuard no_grad;
  const auto from = source.named_parameters();
  for (auto& parameter : target.named_parameters()) {
    parameter.value().copy_(from[parameter.key()]);
  }
}

void expect_same_parameters_in_own_tensors(
    const torch::nn::Module& copy,
    const torch::nn::Module& original) {
  const auto expected = original.named_parameters();
  ASSERT_EQ(copy.named_parameters().size(), expected.size());
  for (const auto& parameter : copy.named_parameters()) {
    SCOPED_TRACE(parameter.key());
    EXPECT_TRUE(torch::equal(parameter.value(), expected[parameter.key()]));
    EXPECT_FALSE(parameter.value().is_same(expected[parameter.key()]));
  }
}

attn::detail::CallPlan plan_of(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const attn::SDPAOptions& options) {
  return attn::detail::plan_call(query, key, value, options);
}

attn::detail::CpuLoops widest_loops() {
  return attn::detail::cpu_loops(attn::detail::widest_cpu_level());
}

attn::detail::KernelPlan kernel_plan(attn::detail::FusedLoops loops) {
  return {widest_loops(), loops};
}

std::string linux_cpuinfo_field(const std::string& name) {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    const auto colon = line.find(':');
    if (line.rfind(name, 0) == 0 && colon != std::string::npos &&
        line.find_first_not_of(" \t", name.size()) == colon) {
      const auto value = line.find_first_not_of(' ', colon + 1);
      return value == std::string::npos ? "" : line.substr(value);
    }
  }
  return "";
}

std::set<std::string> linux_cpu_flags() {
  std::istringstream words(linux_cpuinfo_field("flags"));
  return {std::istream_iterator<std::string>(words), std::istream_iterator<std::string>()};
}

std::vector<torch::Device> test_devices() {
  return {torch::kCPU, torch::kCUDA};
}

bool cuda_required() {
  const char* value = std::getenv("ATTN_REQUIRE_CUDA");
  return value != nullptr && std::string(value) == "1";
}

} // namespace attn::testing
