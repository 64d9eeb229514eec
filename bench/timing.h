#pragma once

// What attn's timing programs share: interleaved timing of several steps
// (medians over rounds whose order rotates), the peak tensor memory of one
// step (peak_memory.h), and number formatting.

#include "peak_memory.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace attn::bench {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

inline double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

// One implementation's call, forward or forward+backward.
using Step = std::function<void()>;

// Median seconds per call of each step, interleaved in rounds of a few
// calls each whose order rotates, after a warm-up.
inline std::vector<double> time_interleaved(const std::vector<Step>& steps, double budget_seconds) {
  for (int i = 0; i < 2; ++i) {
    for (const auto& step : steps) {
      step();
    }
  }
  const auto start = Clock::now();
  for (const auto& step : steps) {
    step();
  }
  const double all_seconds = std::max(seconds_since(start), 1e-6);
  constexpr int kRounds = 9;
  const int calls = std::max(1, static_cast<int>(budget_seconds / kRounds / all_seconds));
  const size_t n = steps.size();
  std::vector<std::vector<double>> times(n);
  for (int round = 0; round < kRounds; ++round) {
    for (size_t position = 0; position < n; ++position) {
      const size_t which = (position + static_cast<size_t>(round)) % n;
      const auto begin = Clock::now();
      for (int i = 0; i < calls; ++i) {
        steps[which]();
      }
      times[which].push_back(seconds_since(begin) / calls);
    }
  }
  std::vector<double> medians;
  for (const auto& samples : times) {
    medians.push_back(median(samples));
  }
  return medians;
}

// The peak of tensor memory of one call of `step`, in MiB, over what was
// held before it (PeakTensorMemory, installed on first use).
inline double peak_mib(const Step& step) {
  static auto* const meter = new PeakTensorMemory(); // outlives every tensor
  const int64_t before = meter->live_bytes();
  meter->reset_peak();
  step();
  return static_cast<double>(meter->peak_bytes() - before) / (1 << 20);
}

inline std::string fixed(double value, const char* format) {
  char text[32];
  std::snprintf(text, sizeof text, format, value);
  return text;
}

} // namespace attn::bench
