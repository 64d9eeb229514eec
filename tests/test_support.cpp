#include "test_support.h"

#include <cmath>
#include <limits>

namespace attn::testing {

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  EXPECT_EQ(a.sizes(), b.sizes());
  if (a.numel() == 0) {
    return 0.0;
  }
  const auto a64 = a.detach().to(torch::kCPU, torch::kDouble);
  const auto b64 = b.detach().to(torch::kCPU, torch::kDouble);
  return (a64 - b64).abs().max().item<double>();
}

std::pair<torch::Tensor, torch::Tensor> reference_attention(
    const torch::Tensor& q,
    const torch::Tensor& k,
    const torch::Tensor& v,
    const torch::Tensor& bias,
    double scale) {
  const auto cpu64 = [](const torch::Tensor& t) {
    return t.detach().to(torch::kCPU, torch::kDouble).contiguous();
  };
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

torch::Tensor numerical_gradient(
    const std::function<torch::Tensor()>& loss, torch::Tensor x) {
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

std::vector<torch::Device> test_devices() {
  return {torch::kCPU, torch::kCUDA};
}

} // namespace attn::testing
