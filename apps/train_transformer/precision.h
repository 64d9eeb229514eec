#pragma once

// The precision the trainer computes in. The weights, the optimizer's
// state and the gradients it steps with stay float32 (master weights);
// in bfloat16, LibTorch's autocast runs the matrix products (the
// projections, the feed-forward layers, the logits) in bfloat16, which
// hands the attention modules bfloat16 heads, and keeps layer norm, the
// softmax of the loss and the residual sums in float32.

#include <torch/types.h>

namespace train {

enum class Precision { kFloat32, kBFloat16 };

/// "float32", "bfloat16".
const char* precision_name(Precision precision);

/// While alive, computes in `precision` on `device`'s type: LibTorch's
/// autocast to bfloat16 there, or nothing for float32. Restores what was
/// set before.
class ScopedPrecision {
 public:
  ScopedPrecision(Precision precision, const torch::Device& device);
  ~ScopedPrecision();
  ScopedPrecision(const ScopedPrecision&) = delete;
  ScopedPrecision& operator=(const ScopedPrecision&) = delete;

 private:
  bool active_;
  torch::DeviceType device_type_;
  bool was_enabled_ = false;
  torch::ScalarType previous_dtype_ = torch::kFloat;
};

} // namespace train
