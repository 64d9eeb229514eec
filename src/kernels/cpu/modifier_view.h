#pragma once

// The kernels' view of the score modifiers (ScoreModifiers,
// attention_params.h): soft-capping and the per-distance bias applied to a
// row of scaled scores before the mask (mask_view.h), the sinks' logits
// that start each row's softmax, and, in the backward, where the gradient
// of what they add goes.

#include "kernels/attention_params.h"
#include "kernels/cpu/mask_view.h"
#include "kernels/cpu/row_ops.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace attn::detail {

// t's data, or null where t is undefined.
template <typename scalar_t>
scalar_t* data_or_null(const torch::Tensor& t) {
  return t.defined() ? t.data_ptr<scalar_t>() : nullptr;
}

template <typename scalar_t>
struct ModifierView {
  // The soft cap runs on `loops`' row operations.
  ModifierView(const AttentionParams& params, const CpuLoops& loops)
      : loops(loops),
        softcap(static_cast<scalar_t>(params.modifiers.softcap)),
        offset_bias_memory(contiguous_or_undefined(params.modifiers.offset_bias)),
        sinks_memory(contiguous_or_undefined(params.modifiers.sinks)),
        offset_bias(data_or_null<scalar_t>(offset_bias_memory)),
        sinks(data_or_null<scalar_t>(sinks_memory)),
        user(params.modifiers.user.get()),
        offsets(std::max<int64_t>(params.L() + params.S() - 1, 0)),
        L(params.L()) {}

  bool changes_scores() const { return bends_scores() || offset_bias != nullptr; }

  // Whether the scores pass through a function other than a shift, whose
  // derivative the backward multiplies in (the soft cap, a user's).
  bool bends_scores() const { return softcap > 0 || user != nullptr; }

  // The scaled scores of query i of head (b, h) against keys j0 .. j0+n-1,
  // capped, passed through the user's function (`slopes`, where not null,
  // receiving the derivative of both), then with the per-distance bias
  // added.
  void apply(
      scalar_t* scores,
      int64_t n,
      int64_t b,
      int64_t h,
      int64_t i,
      int64_t j0,
      scalar_t* slopes) const {
    if (softcap > 0) {
      softcap_row(loops, scores, n, softcap, slopes);
    }
    if (user != nullptr) {
      apply_user_function(scores, n, b, h, i, j0, slopes);
    }
    if (offset_bias != nullptr) {
      const scalar_t* bias = offset_bias + offset_index(h, i, j0);
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        scores[j] += bias[j];
      }
    }
  }

  // Where the bias of query i and key j0 of head h lies in an (H, offsets)
  // table: the bias's own, or a gradient's.
  int64_t offset_index(int64_t h, int64_t i, int64_t j0) const {
    return h * offsets + j0 - i + L - 1;
  }

  // Head h's sink logit, which starts each row's softmax; -inf without.
  scalar_t sink(int64_t h) const {
    return sinks == nullptr ? kNegativeInfinity<scalar_t> : sinks[h];
  }

  CpuLoops loops;
  scalar_t softcap;
  torch::Tensor offset_bias_memory, sinks_memory;
  const scalar_t* offset_bias;
  const scalar_t* sinks;
  const UserScoreFunction* user;
  int64_t offsets; // L + S - 1: the distances j - i
  int64_t L;

 private:
  // scores[j] = value(scores[j], ...), and slopes[j] (where not null) times
  // (or, without a cap, set to) the derivative there.
  void apply_user_function(
      scalar_t* scores,
      int64_t n,
      int64_t b,
      int64_t h,
      int64_t i,
      int64_t j0,
      scalar_t* slopes) const {
    calling_score_function([&] {
      for (int64_t j = 0; j < n; ++j) {
        const double score = scores[j];
        scores[j] = static_cast<scalar_t>(user->value(score, b, h, i, j0 + j));
        if (slopes != nullptr) {
          const auto slope = static_cast<scalar_t>(user->derivative(score, b, h, i, j0 + j));
          slopes[j] = softcap > 0 ? slopes[j] * slope : slope;
        }
      }
    });
  }

  static torch::Tensor contiguous_or_undefined(const torch::Tensor& t) {
    return t.defined() ? t.contiguous() : t;
  }
};

// Where the backward writes the gradients of what the modifiers and a
// floating mask add to the scores (InputGradients' d_offset_bias and
// d_mask): the gradient g of a modified score is the gradient of each
// bias added to it. Per task, so that tasks never add into the same
// memory: the offset bias's gradient in a row of its own (summed after),
// the mask's in its elements, each of which one task computes.
// (offset_index(task, ·, ·) finds a task's row as it finds a head's.)
template <typename scalar_t>
struct ModifierGradients {
  scalar_t* offset_bias = nullptr; // (tasks, offsets), zeroed: a row per task
  scalar_t* mask = nullptr;        // (B, H, L, S), contiguous, zeroed
  int64_t H = 0, L = 0, S = 0;
  // Or the mask's gradient in half precision (bfloat16 or float16 bits,
  // laid out as `mask`; scalar_t float): each row of g rounded once by
  // `round_row`.
  uint16_t* half_mask = nullptr;
  void (*round_row)(const float* from, int64_t n, uint16_t* to) = nullptr;

  bool any() const { return offset_bias != nullptr || mask != nullptr || half_mask != nullptr; }

  // Adds g = ds[0 .. n) of query i of head (b, h), keys from j0 on, as
  // task `task` computed it.
  void add_row(
      const ModifierView<scalar_t>& view,
      const scalar_t* ds,
      int64_t n,
      int64_t task,
      int64_t b,
      int64_t h,
      int64_t i,
      int64_t j0) const {
    if (offset_bias != nullptr) {
      scalar_t* to = offset_bias + view.offset_index(task, i, j0);
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        to[j] += ds[j];
      }
    }
    const int64_t first = ((b * H + h) * L + i) * S + j0;
    if (mask != nullptr) {
      std::copy(ds, ds + n, mask + first);
    }
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (half_mask != nullptr) {
        round_row(ds, n, half_mask + first);
      }
    }
  }
};

} // namespace attn::detail
