#pragma once

// The collectives attn::distributed makes, on a Group: each waits for its
// work with the group's timeout and turns any failure into a c10::Error
// that names the collective, the rank and the timeout.

#include <attn/distributed/process_group.h>

#include <torch/csrc/autograd/custom_function.h>
#include <torch/types.h>

#include <vector>

namespace attn::distributed::detail {

// The elementwise sum of `input` over the ranks, in a new tensor.
torch::Tensor all_reduce_sum(const torch::Tensor& input, const Group& group);

// Every rank's `input`, in rank order (all shaped alike).
std::vector<torch::Tensor> all_gather(const torch::Tensor& input, const Group& group);

// The exchange of equal chunks along dim 0: chunk r of `input` (W chunks)
// goes to rank r, and chunk r of the result is the one rank r sent here.
// Every rank passes the same sizes.
torch::Tensor all_to_all(const torch::Tensor& input, const Group& group);

// A point-to-point message in flight: `wait()` returns once it has been
// sent or received, or throws a c10::Error naming it, the peer and the
// timeout. Holds the message's tensors until then.
class PendingMessage {
 public:
  PendingMessage(
      c10::intrusive_ptr<c10d::Work> work,
      std::vector<torch::Tensor> tensors,
      const char* what,
      int64_t peer,
      const Group& group);
  void wait();

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::vector<torch::Tensor> tensors_;
  const char* what_;
  int64_t peer_;
  Group group_;
};

// Starts sending `tensor` (contiguous) to rank `peer` under `tag`.
PendingMessage start_send(const torch::Tensor& tensor, int64_t peer, int tag, const Group& group);
// Starts receiving into `tensor` (contiguous, shaped as the sender's) from
// rank `peer` under `tag`.
PendingMessage start_recv(const torch::Tensor& tensor, int64_t peer, int tag, const Group& group);

// Fails on every rank, naming `what` and each rank's sizes, unless every
// rank passes a tensor of the same sizes: a collective on tensors of
// different sizes would fail far from the cause, or not at all.
void check_same_sizes(const torch::Tensor& tensor, const char* what, const Group& group);
// The same for a list of up to 24 numbers (several tensors' sizes and
// options at once).
void check_same_sizes(c10::IntArrayRef sizes, const char* what, const Group& group);

// A Group kept in an autograd context for the backward: the process group
// as a capsule (its class is not registered with TorchScript), the timeout
// in milliseconds.
void save_group(torch::autograd::AutogradContext* ctx, const Group& group);
Group saved_group(torch::autograd::AutogradContext* ctx);

} // namespace attn::distributed::detail
