#pragma once

#include <torch/arg.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <cstdint>
#include <string>

namespace attn::distributed {

/// How long a collective may wait for the other ranks before it fails,
/// unless the group is made with another: a minute rather than c10d's
/// half hour, so that a rank that died is reported while someone watches.
inline constexpr std::chrono::milliseconds kDefaultTimeout = std::chrono::seconds(60);

/// A c10d process group and the timeout its collectives wait with. Every
/// rank of the group must make the same calls in the same order.
///
/// Example:
/// ```
/// // A group made elsewhere (any c10d::ProcessGroup of this LibTorch):
/// attn::distributed::Group group(process_group, std::chrono::seconds(30));
/// auto sum = attn::distributed::reduce_from_parallel(x, group);
/// ```
class Group {
 public:
  explicit Group(
      c10::intrusive_ptr<c10d::ProcessGroup> process_group,
      std::chrono::milliseconds timeout = kDefaultTimeout);

  /// This process's rank in [0, size()).
  int64_t rank() const;
  /// The number of ranks W.
  int64_t size() const;
  const c10::intrusive_ptr<c10d::ProcessGroup>& process_group() const { return process_group_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> process_group_;
  std::chrono::milliseconds timeout_;
};

/// Options of `init_process_group`.
struct InitOptions {
  /// How long the rendezvous and every collective may wait for the other
  /// ranks.
  TORCH_ARG(std::chrono::milliseconds, timeout) = kDefaultTimeout;
  /// `"gloo"` (CPU tensors) or `"nccl"` (CUDA tensors; only where LibTorch
  /// was built with NCCL).
  TORCH_ARG(std::string, backend) = "gloo";
};

/// A group of the processes that torchrun (or any launcher that sets the
/// same variables) started: `RANK`, `WORLD_SIZE`, `MASTER_ADDR` and
/// `MASTER_PORT` name this process and the rendezvous, a c10d TCPStore
/// served by rank 0. With NCCL, `LOCAL_RANK` (default 0) picks the GPU. A
/// variable that is missing or malformed is a c10::Error naming it.
///
/// Example:
/// ```
/// // torchrun --no-python --nproc-per-node 2 ./train
/// auto group = attn::distributed::init_process_group(
///     attn::distributed::InitOptions().timeout(std::chrono::seconds(30)));
/// ```
Group init_process_group(const InitOptions& options = {});

} // namespace attn::distributed
