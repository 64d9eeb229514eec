#include "distributed/collectives.h"
#include "distributed/compat.h"

#include <torch/torch.h>

#include <attn/distributed/mappings.h>

#include <atomic>
#include <exception>
#include <sstream>

namespace attn::distributed::detail {

namespace {

std::atomic<int64_t> collectives_made{0};
std::atomic<int64_t> bytes_contributed{0};

// Runs `collective` (which starts a c10d collective and returns its work)
// and waits for the work; a failure of either becomes a c10::Error naming
// `name`. c10d's own messages ("Connection closed by peer", "Operation
// timed out!") say what broke but not during which call.
template <typename Start>
void run_collective(
    const char* name,
    const Group& group,
    const torch::Tensor& contribution,
    Start&& collective) {
  ++collectives_made;
  bytes_contributed += static_cast<int64_t>(contribution.nbytes());
  try {
    auto work = collective();
    work->wait(group.timeout());
  } catch (const std::exception& error) {
    TORCH_CHECK(
        false, "attn::distributed: ", name, " failed on rank ", group.rank(), " of ", group.size(),
        " (timeout ", group.timeout().count(), " ms): ", error.what());
  }
}

} // namespace

PendingMessage::PendingMessage(
    c10::intrusive_ptr<c10d::Work> work,
    std::vector<torch::Tensor> tensors,
    const char* what,
    int64_t peer,
    const Group& group)
    : work_(std::move(work)),
      tensors_(std::move(tensors)),
      what_(what),
      peer_(peer),
      group_(group) {}

namespace {

// A c10::Error naming the message that failed, whether it failed to start
// or while under way.
[[noreturn]] void message_failed(
    const char* what,
    int64_t peer,
    const Group& group,
    const std::exception& error) {
  C10_THROW_ERROR(
      Error,
      c10::str(
          "attn::distributed: ", what, " rank ", peer, " failed on rank ", group.rank(), " of ",
          group.size(), " (timeout ", group.timeout().count(), " ms): ", error.what()));
}

template <typename Start>
PendingMessage start_message(
    const char* what,
    const torch::Tensor& tensor,
    int64_t peer,
    const Group& group,
    Start&& start) {
  TORCH_INTERNAL_ASSERT(tensor.is_contiguous());
  std::vector<torch::Tensor> tensors{tensor};
  try {
    auto work = start(tensors);
    return {std::move(work), std::move(tensors), what, peer, group};
  } catch (const std::exception& error) {
    message_failed(what, peer, group, error);
  }
}

} // namespace

void PendingMessage::wait() {
  try {
    work_->wait(group_.timeout());
  } catch (const std::exception& error) {
    message_failed(what_, peer_, group_, error);
  }
}

PendingMessage start_send(const torch::Tensor& tensor, int64_t peer, int tag, const Group& group) {
  ++collectives_made;
  bytes_contributed += static_cast<int64_t>(tensor.nbytes());
  return start_message("send to", tensor, peer, group, [&](std::vector<torch::Tensor>& tensors) {
    return group.process_group()->send(tensors, static_cast<int>(peer), tag);
  });
}

PendingMessage start_recv(const torch::Tensor& tensor, int64_t peer, int tag, const Group& group) {
  return start_message(
      "receive from", tensor, peer, group, [&](std::vector<torch::Tensor>& tensors) {
        return group.process_group()->recv(tensors, static_cast<int>(peer), tag);
      });
}

torch::Tensor all_reduce_sum(const torch::Tensor& input, const Group& group) {
  // Gloo reduces dense tensors in place: into a copy, so that the caller's
  // input (perhaps saved for backward) is left alone.
  std::vector<torch::Tensor> tensors{input.contiguous().clone()};
  run_collective(
      "all_reduce", group, tensors[0], [&] { return group.process_group()->allreduce(tensors); });
  return tensors[0];
}

std::vector<torch::Tensor> all_gather(const torch::Tensor& input, const Group& group) {
  // The list form: Gloo in LibTorch 1.13 has no single-tensor all-gather.
  std::vector<torch::Tensor> inputs{input.contiguous()};
  std::vector<std::vector<torch::Tensor>> outputs(1);
  for (int64_t rank = 0; rank < group.size(); ++rank) {
    outputs[0].push_back(torch::empty_like(inputs[0]));
  }
  run_collective("all_gather", group, inputs[0], [&] {
    return group.process_group()->allgather(outputs, inputs);
  });
  return outputs[0];
}

torch::Tensor all_to_all(const torch::Tensor& input, const Group& group) {
  TORCH_INTERNAL_ASSERT(input.dim() > 0 && input.size(0) % group.size() == 0);
  auto in = input.contiguous();
  auto out = torch::empty_like(in);
  run_collective(
      "all_to_all", group, in, [&] { return start_all_to_all(*group.process_group(), out, in); });
  return out;
}

namespace {

// Fails unless every rank passes the same `sizes`, at most `capacity` of
// them: they travel with their count in a message of a fixed size, so that
// every rank can gather every other's whatever they hold.
void check_same_sizes_in(
    c10::IntArrayRef sizes,
    int64_t capacity,
    const char* what,
    const Group& group) {
  const auto count = static_cast<int64_t>(sizes.size());
  TORCH_CHECK(
      count <= capacity, "attn::distributed: ", what, " has more than ", capacity, " sizes");
  auto message = torch::full({capacity + 1}, -1, torch::kInt64);
  message[0] = count;
  for (int64_t d = 0; d < count; ++d) {
    message[d + 1] = sizes[d];
  }
  const auto all = all_gather(message, group);
  bool same = true;
  std::ostringstream described;
  for (int64_t rank = 0; rank < group.size(); ++rank) {
    same = same && torch::equal(all[rank], all[0]);
    const auto counted = all[rank][0].item<int64_t>();
    described << (rank > 0 ? ", " : "") << "rank " << rank << " has "
              << c10::IntArrayRef(all[rank].data_ptr<int64_t>() + 1, counted);
  }
  TORCH_CHECK(
      same, "attn::distributed: the ranks disagree on the sizes of ", what, ": ", described.str());
}

} // namespace

void check_same_sizes(const torch::Tensor& tensor, const char* what, const Group& group) {
  constexpr int64_t kMaxDims = 8; // a message of 72 bytes
  check_same_sizes_in(tensor.sizes(), kMaxDims, what, group);
}

void check_same_sizes(c10::IntArrayRef sizes, const char* what, const Group& group) {
  constexpr int64_t kMaxSizes = 24; // a message of 200 bytes
  check_same_sizes_in(sizes, kMaxSizes, what, group);
}

void save_group(torch::autograd::AutogradContext* ctx, const Group& group) {
  ctx->saved_data["process_group"] = c10::IValue::make_capsule(group.process_group());
  ctx->saved_data["timeout_ms"] = static_cast<int64_t>(group.timeout().count());
}

Group saved_group(torch::autograd::AutogradContext* ctx) {
  return Group(
      c10::static_intrusive_pointer_cast<c10d::ProcessGroup>(
          ctx->saved_data["process_group"].toCapsule()),
      std::chrono::milliseconds(ctx->saved_data["timeout_ms"].toInt()));
}

} // namespace attn::distributed::detail

namespace attn::distributed {

CommunicationCount communication_count() {
  return {detail::collectives_made.load(), detail::bytes_contributed.load()};
}

void reset_communication_count() {
  detail::collectives_made = 0;
  detail::bytes_contributed = 0;
}

} // namespace attn::distributed
