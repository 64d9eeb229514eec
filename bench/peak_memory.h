#pragma once

// The peak of the bytes held by CPU tensors while a PeakTensorMemory is
// alive: it puts a counting allocator in front of LibTorch's CPU allocator,
// so every tensor allocated from any thread counts until it is freed. It
// must outlive the tensors it counted: a program makes one, for its whole
// run, and never destroys it.

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <torch/version.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>

namespace attn::bench {

class PeakTensorMemory final : public c10::Allocator {
 public:
  PeakTensorMemory() : inner_(c10::GetCPUAllocator()) { c10::SetCPUAllocator(this, kPriority); }
  ~PeakTensorMemory() override { c10::SetCPUAllocator(inner_, kPriority); }
  PeakTensorMemory(const PeakTensorMemory&) = delete;
  PeakTensorMemory& operator=(const PeakTensorMemory&) = delete;

  // Starts a new peak from the bytes held now.
  void reset_peak() { peak_ = live_.load(); }
  int64_t peak_bytes() const { return peak_.load(); }
  int64_t live_bytes() const { return live_.load(); }

  // From LibTorch 2.3 on, allocate is not const and copy_data must be given.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
  c10::DataPtr allocate(size_t bytes) override {
    return counted(bytes);
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
#else
  c10::DataPtr allocate(size_t bytes) const override {
    return counted(bytes);
  }
#endif

 private:
  // Above the default allocator's registration, which is priority 0.
  static constexpr uint8_t kPriority = 1;

  // What a counted allocation's deleter needs: the inner allocation (freed
  // with it) and how many bytes to uncount.
  struct Allocation {
    c10::DataPtr inner;
    int64_t bytes;
    const PeakTensorMemory* meter;
  };

  c10::DataPtr counted(size_t bytes) const {
    auto inner = inner_->allocate(bytes);
    const auto size = static_cast<int64_t>(bytes);
    const int64_t live = live_ += size;
    int64_t peak = peak_.load();
    while (live > peak && !peak_.compare_exchange_weak(peak, live)) {
    }
    void* data = inner.get();
    const auto device = inner.device();
    return {data, new Allocation{std::move(inner), size, this}, &release, device};
  }

  static void release(void* context) {
    auto* allocation = static_cast<Allocation*>(context);
    allocation->meter->live_ -= allocation->bytes;
    delete allocation;
  }

  c10::Allocator* inner_;
  mutable std::atomic<int64_t> live_{0};
  mutable std::atomic<int64_t> peak_{0};
};

} // namespace attn::bench
