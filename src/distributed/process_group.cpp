#include <attn/distributed/process_group.h>

#include "distributed/compat.h"

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cstdlib>
#include <limits>
#include <string>

namespace attn::distributed {

Group::Group(
    c10::intrusive_ptr<c10d::ProcessGroup> process_group,
    std::chrono::milliseconds timeout)
    : process_group_(std::move(process_group)), timeout_(timeout) {
  TORCH_CHECK(process_group_, "attn::distributed::Group: the process group is null");
  TORCH_CHECK(
      timeout_.count() > 0, "attn::distributed::Group: the timeout must be positive, got ",
      timeout_.count(), " ms");
}

int64_t Group::rank() const {
  return process_group_->getRank();
}

int64_t Group::size() const {
  return process_group_->getSize();
}

namespace {

constexpr const char* kLaunchVariables =
    "(torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)";

std::string environment_variable(const char* name) {
  const char* value = std::getenv(name);
  TORCH_CHECK(
      value != nullptr && *value != '\0',
      "attn::distributed::init_process_group: ", "environment variable ", name, " is not set ",
      kLaunchVariables);
  return value;
}

// The variable `name` as an integer in [low, high].
int64_t integer_variable(const char* name, int64_t low, int64_t high) {
  const auto text = environment_variable(name);
  size_t parsed = 0;
  int64_t value = -1;
  try {
    value = std::stoll(text, &parsed);
  } catch (const std::exception&) {
    parsed = 0;
  }
  TORCH_CHECK(
      parsed == text.size() && value >= low && value <= high,
      "attn::distributed::init_process_group: environment variable ", name,
      " must be an integer in [", low, ", ", high, "], got '", text, "'");
  return value;
}

bool is_loopback(const std::string& address) {
  return address == "localhost" || address.rfind("127.", 0) == 0 || address == "::1";
}

// Gloo's transport binds to one address. Its default, the address this
// host's name resolves to, is right across machines; on one machine
// (MASTER_ADDR a loopback address) the loopback itself is, which works
// without a network and whatever the host's name resolves to.
std::shared_ptr<::gloo::transport::Device> gloo_device(const std::string& master_address) {
  return is_loopback(master_address)
      ? c10d::ProcessGroupGloo::createDeviceForHostname(master_address)
      : c10d::ProcessGroupGloo::createDefaultDevice();
}

c10::intrusive_ptr<c10d::ProcessGroup> make_group(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int size,
    const std::string& master_address,
    const InitOptions& options) {
  if (options.backend() == "gloo") {
    return detail::make_gloo_group(
        store, rank, size, gloo_device(master_address), options.timeout());
  }
  TORCH_CHECK(
      options.backend() == "nccl",
      "attn::distributed::init_process_group: backend "
      "must be \"gloo\" or \"nccl\", got \"",
      options.backend(), "\"");
#ifdef USE_C10D_NCCL
  const auto local_rank = std::getenv("LOCAL_RANK") == nullptr
      ? 0
      : integer_variable("LOCAL_RANK", 0, std::numeric_limits<int16_t>::max());
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(local_rank));
  return detail::make_nccl_group(store, rank, size, options.timeout());
#else
  TORCH_CHECK(
      false,
      "attn::distributed::init_process_group: the backend \"nccl\" needs a "
      "LibTorch built with NCCL; this one has Gloo only");
  return {};
#endif
}

} // namespace

Group init_process_group(const InitOptions& options) {
  const auto world_size = integer_variable("WORLD_SIZE", 1, std::numeric_limits<int32_t>::max());
  const auto rank = integer_variable("RANK", 0, world_size - 1);
  const auto master_address = environment_variable("MASTER_ADDR");
  const auto port = integer_variable("MASTER_PORT", 1, std::numeric_limits<uint16_t>::max());
  TORCH_CHECK(
      options.timeout().count() > 0,
      "attn::distributed::init_process_group: "
      "the timeout must be positive, got ",
      options.timeout().count(), " ms");

  c10d::TCPStoreOptions store_options;
  store_options.port = static_cast<uint16_t>(port);
  store_options.isServer = rank == 0;
  store_options.numWorkers = static_cast<size_t>(world_size);
  store_options.timeout = options.timeout();
  auto store = c10::make_intrusive<c10d::TCPStore>(master_address, store_options);
  return Group(
      make_group(
          store, static_cast<int>(rank), static_cast<int>(world_size), master_address, options),
      options.timeout());
}

} // namespace attn::distributed
