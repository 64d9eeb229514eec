#include "kernels/cpu/dropout.h"

#include "kernels/cpu/isa.h"
#include "kernels/cpu/philox.h"

#include <cmath>

namespace attn::detail {
namespace {

// philox.h's portable group, as the loops take it.
struct PortableGroup {
  void operator()(uint16_t* draws, uint64_t group, uint64_t seed, uint64_t subsequence) const {
    philox_group(draws, group, seed, subsequence);
  }
};

template <typename T>
void drop_row_portable(T* x, int64_t n, const DropoutRow& row) {
  drop_row_loop(x, n, row, PortableGroup{});
}

template <typename T>
void dropout_softmax_backward_row_portable(
    T* p,
    T* ds,
    int64_t n,
    T delta,
    T keep_scale,
    const DropoutRow& row) {
  dropout_softmax_backward_loop(p, ds, n, delta, keep_scale, row, PortableGroup{});
}

// The float loops of `loops` where they have vector loops (isa.h), else
// portable C++.
DropoutLoops float_dropout_loops(const CpuLoops& loops) {
  return loops.isa != nullptr && loops.isa->dropout != nullptr
      ? *loops.isa->dropout
      : DropoutLoops{drop_row_portable<float>, dropout_softmax_backward_row_portable<float>};
}

} // namespace

uint32_t dropout_threshold(double p) {
  constexpr double kDraws = 65536.0; // 2^16
  return static_cast<uint32_t>(std::clamp(std::floor(p * kDraws), 0.0, kDraws));
}

double dropout_keep_scale(double p) {
  constexpr uint32_t kDraws = 65536;
  const uint32_t threshold = dropout_threshold(p);
  return threshold < kDraws ? static_cast<double>(kDraws) / (kDraws - threshold) : 0.0;
}

DropoutRow dropout_stream(const DropoutDraw& draw) {
  return {draw.seed, 0, 0, dropout_threshold(draw.p)};
}

DropoutRow dropout_row(const DropoutRow& stream, int64_t bh, int64_t i, int64_t S, int64_t j) {
  const auto first = static_cast<uint64_t>(i) * static_cast<uint64_t>(S) + static_cast<uint64_t>(j);
  return {stream.seed, static_cast<uint64_t>(bh), first, stream.threshold};
}

void dropout_draws(uint16_t* draws, int64_t n, const DropoutRow& row) {
  for_each_draw_group(
      row, n, PortableGroup{}, [&](int64_t at, const uint16_t* group, int64_t count) {
        std::copy(group, group + count, draws + at);
      });
}

void drop_row(const CpuLoops& loops, float* x, int64_t n, const DropoutRow& row) {
  float_dropout_loops(loops).drop_row(x, n, row);
}

void drop_row(const CpuLoops& /*loops*/, double* x, int64_t n, const DropoutRow& row) {
  drop_row_portable(x, n, row);
}

void dropout_softmax_backward_row(
    const CpuLoops& loops,
    float* p,
    float* ds,
    int64_t n,
    float delta,
    float keep_scale,
    const DropoutRow& row) {
  float_dropout_loops(loops).softmax_backward_row(p, ds, n, delta, keep_scale, row);
}

void dropout_softmax_backward_row(
    const CpuLoops& /*loops*/,
    double* p,
    double* ds,
    int64_t n,
    double delta,
    double keep_scale,
    const DropoutRow& row) {
  dropout_softmax_backward_row_portable(p, ds, n, delta, keep_scale, row);
}

} // namespace attn::detail
