// The reference demo: self-attention over a batch of 4 sequences of 20
// tokens, d_model 512, 8 heads, with attn::MultiHeadAttention and with
// torch::nn::MultiheadAttention holding the same weights.
//
// Usage: attn_demo [--device auto|cpu|cuda|cuda:N]

#include <attn/attn.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include <string>

namespace {

constexpr int kUsageError = 2;

std::string shape(const torch::Tensor& tensor) {
  return fmt::format("[{}]", fmt::join(tensor.sizes(), ", "));
}

int run(const std::string& device_request) {
  const auto device = attn::select_device(device_request);
  constexpr int64_t B = 4, T = 20, E = 512, H = 8;

  torch::manual_seed(0);
  attn::MultiHeadAttention mha(attn::MultiHeadAttentionOptions(E, H));
  torch::nn::MultiheadAttention builtin(
      torch::nn::MultiheadAttentionOptions(E, H));
  attn::copy_weights(*mha, *builtin);
  mha->to(device);
  builtin->to(device);
  mha->eval();
  builtin->eval();

  torch::NoGradGuard no_grad;
  const auto x = torch::randn({B, T, E}, device); // (B, T, E)
  const auto [out, weights] = mha(x, x, x);       // self-attention: Q=K=V=x

  // The built-in takes and returns sequence-first (T, B, E) tensors.
  const auto x_seq_first = x.transpose(0, 1);
  const auto builtin_out =
      std::get<0>(builtin(x_seq_first, x_seq_first, x_seq_first))
          .transpose(0, 1);

  fmt::print("Device:          {}\n", device.str());
  fmt::print("Output:          {}\n", shape(out));
  fmt::print("Weights:         {}\n", shape(weights));
  fmt::print("Built-in output: {}\n", shape(builtin_out));
  fmt::print(
      "Max |output - built-in output|: {:.3g}\n",
      (out - builtin_out).abs().max().item<double>());
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  std::string device_request = "auto";
  if (argc == 3 && std::string(argv[1]) == "--device") {
    device_request = argv[2];
  } else if (argc != 1) {
    fmt::print(stderr, "usage: attn_demo [--device auto|cpu|cuda|cuda:N]\n");
    return kUsageError;
  }
  try {
    return run(device_request);
  } catch (const c10::Error& error) {
    fmt::print(stderr, "attn_demo: {}\n", error.what_without_backtrace());
    return kUsageError;
  }
}
