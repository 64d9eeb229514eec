#pragma once

// The c10d calls that differ between LibTorch versions. Up to 1.13 a
// ProcessGroupGloo is a c10d::ProcessGroup; from 2.0 on it is a
// c10d::Backend, which a dispatching c10d::ProcessGroup holds per device.

#include <torch/version.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#ifdef USE_C10D_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <chrono>
#include <memory>
#include <type_traits>
#include <vector>

namespace attn::distributed::detail {

// Whether this LibTorch can make NCCL groups.
#ifdef USE_C10D_NCCL
constexpr bool kHasNccl = true;
#else
constexpr bool kHasNccl = false;
#endif

#if TORCH_VERSION_MAJOR >= 2
// The dispatching group that runs `backend` for tensors on `device_type`.
inline c10::intrusive_ptr<c10d::ProcessGroup> group_of(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    const c10::intrusive_ptr<c10d::Backend>& backend,
    c10::DeviceType device_type,
    c10d::ProcessGroup::BackendType backend_type) {
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size);
  group->setBackend(device_type, backend_type, backend);
  group->setDefaultBackend(backend_type);
  return group;
}
#endif

// A Gloo group of `size` ranks over `store`, its transport bound to
// `device`, failing any collective that waits longer than `timeout`.
inline c10::intrusive_ptr<c10d::ProcessGroup> make_gloo_group(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    const std::shared_ptr<::gloo::transport::Device>& device,
    std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices = {device};
  // Two threads per device, as torch.distributed's Python front end uses.
  options->threads = 2;
  auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
#if TORCH_VERSION_MAJOR >= 2
  return group_of(
      store, rank, size, gloo, c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO);
#else
  return gloo;
#endif
}

// Whether `ProcessGroup` names its single-tensor all-to-all
// `all_to_all_single` (recent 2.x, which keeps `alltoall_base` as a
// deprecated alias) rather than `alltoall_base` (1.13 and early 2.x).
template <typename ProcessGroup, typename = void>
struct HasAllToAllSingle : std::false_type {};
template <typename ProcessGroup>
struct HasAllToAllSingle<ProcessGroup, std::void_t<decltype(&ProcessGroup::all_to_all_single)>>
    : std::true_type {};

// Starts c10d's all-to-all of `input` into `output`, both split into equal
// chunks along dim 0 (empty split lists). A template so that only the call
// this LibTorch has is compiled.
template <typename ProcessGroup>
c10::intrusive_ptr<c10d::Work> start_all_to_all(
    ProcessGroup& group,
    at::Tensor& output,
    at::Tensor& input) {
  std::vector<int64_t> equal_splits;
  if constexpr (HasAllToAllSingle<ProcessGroup>::value) {
    return group.all_to_all_single(output, input, equal_splits, equal_splits);
  } else {
    return group.alltoall_base(output, input, equal_splits, equal_splits);
  }
}

#ifdef USE_C10D_NCCL
// An NCCL group of `size` ranks over `store`, for CUDA tensors.
inline c10::intrusive_ptr<c10d::ProcessGroup> make_nccl_group(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
#if TORCH_VERSION_MAJOR >= 2
  return group_of(
      store, rank, size, nccl, c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL);
#else
  return nccl;
#endif
}
#endif

} // namespace attn::distributed::detail
