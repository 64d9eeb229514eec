#include "kernels/cpu/workspace.h"

#include <c10/core/InferenceMode.h>
#include <torch/torch.h>

#include <array>

namespace attn::detail {

torch::Tensor workspace_tensor(
    WorkspaceSlot slot,
    at::IntArrayRef sizes,
    const torch::TensorOptions& options) {
  const int64_t numel = c10::multiply_integers(sizes);
  const size_t bytes = static_cast<size_t>(numel) * options.dtype().itemsize();
  if (bytes > kMaxWorkspaceBytes || !options.device().is_cpu()) {
    return torch::empty(sizes, options);
  }
  thread_local std::array<torch::Tensor, kWorkspaceSlots> buffers;
  auto& buffer = buffers.at(static_cast<size_t>(slot));
  if (!buffer.defined() || buffer.numel() < numel || buffer.dtype() != options.dtype()) {
    // A normal tensor even when the first call runs in InferenceMode: an
    // inference tensor could not be written by a later call outside it.
    const c10::InferenceMode normal_tensor(false);
    buffer = torch::empty({numel}, options);
  }
  return buffer.narrow(0, 0, numel).view(sizes);
}

} // namespace attn::detail
