#include <attn/device.h>

#include <torch/cuda.h>
#include <torch/torch.h>

#include <algorithm>
#include <cctype>

namespace attn {
namespace {

constexpr const char* kAccepted = "auto, cpu, cuda or cuda:N";

bool is_index(const std::string& text) {
  return !text.empty() && text.size() <= 9 &&
      std::all_of(text.begin(), text.end(), [](unsigned char c) { return std::isdigit(c) != 0; });
}

} // namespace

torch::Device select_device(const std::string& request) {
  if (request == "cpu") {
    return torch::kCPU;
  }
  if (request == "auto") {
    return torch::cuda::is_available() ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);
  }
  const std::string cuda_prefix = "cuda:";
  const bool indexed = request.rfind(cuda_prefix, 0) == 0 &&
      is_index(request.substr(cuda_prefix.size()));
  TORCH_CHECK(request == "cuda" || indexed, "unknown device '", request, "': expected ", kAccepted);
  TORCH_CHECK(
      torch::cuda::is_available(), "device '", request,
      "' requested but CUDA is not available (this LibTorch has no CUDA ",
      "support or no GPU is visible); use cpu or auto");
  if (!indexed) {
    return torch::kCUDA;
  }
  const auto index = std::stoll(request.substr(cuda_prefix.size()));
  const auto count = static_cast<long long>(torch::cuda::device_count());
  TORCH_CHECK(
      index < count, "device '", request, "' requested but only ", count,
      " CUDA device(s) are visible: expected cuda:0 to cuda:", count - 1);
  return {torch::kCUDA, static_cast<c10::DeviceIndex>(index)};
}

} // namespace attn
