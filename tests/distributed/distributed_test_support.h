#pragma once

// What the distributed tests share: the group of the ranks that
// attn_launch_ranks started (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
// set), made once per process.

#include <attn/distributed/process_group.h>

#include <chrono>
#include <string>
#include <utility>
#include <vector>

namespace attn::testing {

// Long enough for four oversubscribed ranks on two cores, short enough
// that a broken test fails well inside ctest's timeout.
inline constexpr auto kDistributedTestTimeout = std::chrono::seconds(20);

inline const distributed::Group& group() {
  static const distributed::Group group = distributed::init_process_group(
      distributed::InitOptions().timeout(kDistributedTestTimeout));
  return group;
}

// A list of named test cases, each a default `Case` (which has a `name`)
// changed by a function: `cases.add("causal", [](Case& c) { c.is_causal = true; })`.
template <typename Case>
struct NamedCases {
  std::vector<Case> cases;

  template <typename Customise>
  void add(std::string name, Customise&& customise) {
    Case test_case;
    test_case.name = std::move(name);
    customise(test_case);
    cases.push_back(std::move(test_case));
  }
};

} // namespace attn::testing
