#include "kernels/cpu/short_heads.h"

#include "kernels/cpu/isa.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/short_heads_loops.h"
#include "kernels/cpu/tile_product.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/torch.h>

#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

namespace attn::detail {
namespace {

// The short heads' loops of `loops`, which short_heads_run admitted.
const ShortHeadsLoops& admitted_loops(const CpuLoops& loops) {
  TORCH_INTERNAL_ASSERT(
      loops.isa != nullptr && loops.isa->short_heads != nullptr, "no short-heads loops at ",
      cpu_level_name(loops.level));
  return *loops.isa->short_heads;
}

// `run(begin, end)` over the (B, H) grid's heads [begin, end), in
// parallel where the work pays for it.
template <typename Run>
void parallel_heads(int64_t heads, double flops_per_head, const Run& run) {
  const int64_t grain = parallel_grain(flops_per_head, kMinShortHeadsTaskFlops);
  parallel_for(0, heads, grain, run);
}

// The call of params' sizes, scale and mask; its heads those of params
// and `out` where they are float, else none (HalfHeadCopies names them).
ShortHeadsCall call_of(
    const CpuLoops& loops,
    const AttentionParams& params,
    const torch::Tensor& out) {
  TORCH_INTERNAL_ASSERT(!params.dropout.active(), "the short-head loops drop no weights");
  const bool in_float = params.q.scalar_type() == torch::kFloat;
  const auto heads = [&](const torch::Tensor& t) {
    return in_float ? Heads<float>(t) : Heads<float>();
  };
  return {
      heads(params.q),
      heads(params.k),
      heads(params.v),
      heads(out),
      MaskView<float>(params, loops),
      static_cast<float>(params.scale),
      params.H(),
      params.group(),
      params.L(),
      params.S(),
      params.D(),
      params.Dv(),
      loops};
}

// A task's float copies of one head of a half-precision call's tensors
// (Element: c10::BFloat16 or c10::Half), for the loops' float heads
// (ShortHeadsConversion): those it reads widened before each head, those
// it writes rounded after: a head of each tensor the loops read and
// write (Q, K, V and the output; the backward's output gradient and
// gradients too), no copy of a whole tensor.
template <typename Element>
class HalfHeadCopies final : public ShortHeadsConversion {
 public:
  HalfHeadCopies(const CpuLoops& loops, int64_t group)
      : group_(group), rows_(half_rows(loops, c10::CppTypeToScalarType<Element>::value)) {}
  HalfHeadCopies(const HalfHeadCopies&) = delete;
  HalfHeadCopies& operator=(const HalfHeadCopies&) = delete;

  // Heads naming a float copy of t's head, widened before each head's
  // loops: per key/value head (h / group) for K and V.
  Heads<float> read(const torch::Tensor& t, bool per_kv_head = false) {
    reads_.push_back(copy_of(t, per_kv_head));
    return reads_.back().floats();
  }

  // Heads whose writes reach t: t itself where it is float (grouped
  // heads' key and value gradients, summed after in float), else a float
  // copy rounded into t after each head.
  Heads<float> write(const torch::Tensor& t) {
    if (t.scalar_type() == torch::kFloat) {
      return Heads<float>(t);
    }
    writes_.push_back(copy_of(t, false));
    return writes_.back().floats();
  }

  void widen_head(int64_t b, int64_t h) override {
    for (auto& copy : reads_) {
      const int64_t head = copy.per_kv_head ? h / group_ : h;
      if (copy.held_b != b || copy.held_head != head) { // K, V: once per group
        copy.held_b = b;
        copy.held_head = head;
        const auto from = copy.half.head(b, head);
        for (int64_t r = 0; r < from.rows; ++r) {
          rows_.widen(half_bits(from.row(r)), from.cols, copy.row(r));
        }
      }
    }
  }

  void round_head(int64_t b, int64_t h) override {
    for (auto& copy : writes_) {
      const auto to = copy.half.head(b, h);
      for (int64_t r = 0; r < to.rows; ++r) {
        rows_.round(copy.row(r), to.cols, half_bits(to.row(r)));
      }
    }
  }

 private:
  struct Copy {
    Heads<Element> half;
    std::vector<float> memory; // rows × cols
    bool per_kv_head = false;
    int64_t held_b = -1, held_head = -1; // the head `memory` holds (reads)

    float* row(int64_t r) { return memory.data() + r * half.cols; }
    Heads<float> floats() {
      return Heads<float>::every_head_at(memory.data(), half.rows, half.cols, half.cols);
    }
  };

  static Copy copy_of(const torch::Tensor& t, bool per_kv_head) {
    TORCH_INTERNAL_ASSERT(t.scalar_type() == c10::CppTypeToScalarType<Element>::value);
    TORCH_INTERNAL_ASSERT(t.size(3) <= 1 || t.stride(3) == 1, "rows of unit stride");
    Heads<Element> half(t);
    std::vector<float> memory(static_cast<size_t>(half.rows * half.cols));
    return {half, std::move(memory), per_kv_head};
  }

  // The loops' heads point into each Copy's memory, which a Copy keeps
  // where it is when the vectors below move it.
  static_assert(std::is_nothrow_move_constructible_v<Copy>);

  int64_t group_;
  HalfRows rows_;
  std::vector<Copy> reads_, writes_;
};

// `run(element)` with a value of the half-precision type of `dtype`.
template <typename Run>
void with_half_type(torch::ScalarType dtype, const Run& run) {
  if (dtype == torch::kBFloat16) {
    run(c10::BFloat16());
  } else {
    run(c10::Half());
  }
}

// `loops` over the call's heads, each task's call naming a HalfHeadCopies
// of its own: Q, K and V's, and those that name(copies, task_call,
// task_gradients) sets.
template <typename Name>
void run_in_half(
    const CpuLoops& cpu,
    const AttentionParams& params,
    const ShortHeadsCall& base,
    double flops_per_head,
    ShortHeadsFn loops,
    const Name& name) {
  with_half_type(params.q.scalar_type(), [&](auto element) {
    using Element = decltype(element);
    parallel_heads(params.B() * base.H, flops_per_head, [&](int64_t begin, int64_t end) {
      HalfHeadCopies<Element> copies(cpu, base.group);
      auto call = base;
      call.q = copies.read(params.q);
      call.k = copies.read(params.k, /*per_kv_head=*/true);
      call.v = copies.read(params.v, /*per_kv_head=*/true);
      ShortHeadsGradients gradients;
      name(copies, call, gradients);
      call.conversion = &copies;
      loops(call, begin, end);
    });
  });
}

} // namespace

bool short_heads_run(const CpuLoops& loops, torch::ScalarType dtype, int64_t L, int64_t S) {
  const bool computed = dtype == torch::kFloat || is_half_precision(dtype);
  return computed && L <= kMaxShortQueries && S <= kMaxShortKeys && loops.isa != nullptr &&
      loops.isa->short_heads != nullptr;
}

void short_heads_forward(
    const CpuLoops& cpu,
    const AttentionParams& params,
    const ForwardResult& result) {
  if (result.lse.numel() == 0) { // no query: nothing to write, however many heads
    return;
  }
  auto call = call_of(cpu, params, result.out);
  call.lse_out = result.lse.data_ptr<float>();
  const double flops_per_head = 2.0 * call.L * call.S * (call.D + call.Dv);
  const auto loops = admitted_loops(cpu).forward;
  if (params.q.scalar_type() == torch::kFloat) {
    parallel_heads(params.B() * call.H, flops_per_head, [&](int64_t begin, int64_t end) {
      loops(call, begin, end);
    });
    return;
  }
  run_in_half(cpu, params, call, flops_per_head, loops, [&](auto& copies, auto& task, auto&) {
    task.out = copies.write(result.out);
  });
}

void short_heads_backward(
    const CpuLoops& cpu,
    const AttentionParams& params,
    const ForwardResult& forward,
    const torch::Tensor& grad_out,
    const InputGradients& grads) {
  if (grads.dq.numel() == 0 && grads.dk.numel() == 0 && grads.dv.numel() == 0) {
    return;
  }
  auto call = call_of(cpu, params, forward.out);
  call.lse = forward.lse.data_ptr<float>();
  const double flops_per_head = 2.0 * call.L * call.S * (3 * call.D + 2 * call.Dv);
  const auto loops = admitted_loops(cpu).backward;
  if (params.q.scalar_type() == torch::kFloat) {
    const ShortHeadsGradients gradients{
        Heads<float>(grad_out), Heads<float>(grads.dq), Heads<float>(grads.dk),
        Heads<float>(grads.dv)};
    call.gradients = &gradients;
    parallel_heads(params.B() * call.H, flops_per_head, [&](int64_t begin, int64_t end) {
      loops(call, begin, end);
    });
    return;
  }
  run_in_half(
      cpu, params, call, flops_per_head, loops, [&](auto& copies, auto& task, auto& gradients) {
        task.out = copies.read(forward.out);
        gradients = {
            copies.read(grad_out), copies.write(grads.dq), copies.write(grads.dk),
            copies.write(grads.dv)};
        task.gradients = &gradients;
      });
}

} // namespace attn::detail
