#pragma once

// What the distributed tests share: the group of the ranks that
// attn_launch_ranks started (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
// set), made once per process.

#include <attn/distributed/process_group.h>

#include <chrono>

namespace attn::testing {

// Long enough for four oversubscribed ranks on two cores, short enough
// that a broken test fails well inside ctest's timeout.
inline constexpr auto kDistributedTestTimeout = std::chrono::seconds(20);

inline const distributed::Group& group() {
  static const distributed::Group group = distributed::init_process_group(
      distributed::InitOptions().timeout(kDistributedTestTimeout));
  return group;
}

} // namespace attn::testing
