#include "precision.h"

#include <ATen/autocast_mode.h>
#include <torch/version.h>

namespace train {
namespace {

// LibTorch 2.4 named autocast's switches by device type; 1.13 had one
// pair for the CPU and one for CUDA.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
bool autocast_enabled(torch::DeviceType type) {
  return at::autocast::is_autocast_enabled(type);
}
torch::ScalarType autocast_dtype(torch::DeviceType type) {
  return at::autocast::get_autocast_dtype(type);
}
void set_autocast(torch::DeviceType type, bool enabled, torch::ScalarType dtype) {
  at::autocast::set_autocast_enabled(type, enabled);
  at::autocast::set_autocast_dtype(type, dtype);
}
#else
bool autocast_enabled(torch::DeviceType type) {
  return type == torch::kCPU ? at::autocast::is_cpu_enabled() : at::autocast::is_enabled();
}
torch::ScalarType autocast_dtype(torch::DeviceType type) {
  return type == torch::kCPU ? at::autocast::get_autocast_cpu_dtype()
                             : at::autocast::get_autocast_gpu_dtype();
}
void set_autocast(torch::DeviceType type, bool enabled, torch::ScalarType dtype) {
  if (type == torch::kCPU) {
    at::autocast::set_cpu_enabled(enabled);
    at::autocast::set_autocast_cpu_dtype(dtype);
  } else {
    at::autocast::set_enabled(enabled);
    at::autocast::set_autocast_gpu_dtype(dtype);
  }
}
#endif

} // namespace

const char* precision_name(Precision precision) {
  switch (precision) {
    case Precision::kFloat32: return "float32";
    case Precision::kBFloat16: return "bfloat16";
  }
  return "?";
}

ScopedPrecision::ScopedPrecision(Precision precision, const torch::Device& device)
    : active_(precision == Precision::kBFloat16), device_type_(device.type()) {
  if (!active_) {
    return;
  }
  was_enabled_ = autocast_enabled(device_type_);
  previous_dtype_ = autocast_dtype(device_type_);
  set_autocast(device_type_, true, torch::kBFloat16);
}

ScopedPrecision::~ScopedPrecision() {
  if (!active_) {
    return;
  }
  set_autocast(device_type_, was_enabled_, previous_dtype_);
  at::autocast::clear_cache();
}

} // namespace train
