#pragma once

// Layers that a distributed module registers only to overwrite their
// initial values (with a whole module's parameters, or their part) draw
// those values from the default CPU generator. Putting its state back
// afterwards lets every rank draw next what a single process that made
// only the whole module would.

#include <ATen/CPUGeneratorImpl.h>

#include <mutex>

namespace attn::distributed::detail {

// Calls `make()` and restores the default CPU generator's state, also when
// `make` throws. Another thread drawing meanwhile would lose its draws to
// this, as it would race with torch::manual_seed.
template <typename Make>
void keeping_random_state(Make&& make) {
  auto generator = at::detail::getDefaultCPUGenerator();
  at::Tensor state;
  {
    std::lock_guard<std::mutex> lock(generator.mutex());
    state = generator.get_state();
  }
  const auto restore = [&] {
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(state);
  };
  try {
    make();
  } catch (...) {
    restore();
    throw;
  }
  restore();
}

} // namespace attn::distributed::detail
