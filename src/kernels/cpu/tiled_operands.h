#pragma once

// What the operand policies of the tiled loops (tiled_template.h) share:
// which direction they are made for, how a gradient's product adds, the
// heads they read, and 16-bit heads packed once per call as a product's
// right operand.

#include "kernels/attention_params.h"
#include "kernels/cpu/heads.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/tile_product.h"
#include "kernels/cpu/tiled_loops.h"
#include "kernels/cpu/workspace.h"

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <cstdint>
#include <vector>

namespace attn::detail {

// Which of the loops' calls operands are made for: the forward reads Kᵀ
// and V, the backward Kᵀ, K and Vᵀ.
enum class OperandDirection { forward, backward };

// How a gradient's product adds into its accumulator: c = beta·c +
// alpha·(the product). Policies that accumulate in memory of their own
// (kAccumulatesInPlace false) take alpha 1 and beta 1 alone: their
// accumulators start at zero and their writes scale.
struct Accumulate {
  double alpha = 1.0, beta = 1.0;
};

// Checks that a policy accumulating in memory of its own got Accumulate's
// defaults.
inline void expect_plain_accumulation(const Accumulate& how) {
  TORCH_INTERNAL_ASSERT(how.alpha == 1.0 && how.beta == 1.0, "a scaled or overwriting product");
}

// Per (b, kv head), a (B, Hkv, ·, ·) tensor of 16-bit elements laid out as
// the right operand of a product: `rows` rows per head, ld elements apart.
struct PackedHeads {
  torch::Tensor memory; // (B, Hkv, rows, ld)
  int64_t heads = 0, rows = 0, ld = 0;

  const uint16_t* head(int64_t b, int64_t kv_head) const {
    return static_cast<const uint16_t*>(memory.data_ptr()) + (b * heads + kv_head) * rows * ld;
  }
};

// Uninitialised PackedHeads for t (B, Hkv, ·, ·): `rows` rows of at least
// `cols` elements per head, spread_row_stride apart.
inline PackedHeads empty_packed_heads(
    const torch::Tensor& t,
    int64_t rows,
    int64_t cols,
    WorkspaceSlot slot) {
  PackedHeads packed;
  packed.heads = t.size(1);
  packed.rows = rows;
  packed.ld = spread_row_stride(cols, static_cast<int64_t>(sizeof(uint16_t)));
  packed.memory = workspace_tensor(slot, {t.size(0), t.size(1), rows, packed.ld}, t.options());
  return packed;
}

// `pack(from, to)` for every head of t, in parallel: from its first
// element, to the head's packed rows.
template <typename T, typename Pack>
void pack_each_head(const torch::Tensor& t, const PackedHeads& packed, const Pack& pack) {
  if (t.numel() == 0) {
    return;
  }
  const int64_t H = t.size(1);
  const T* data = t.data_ptr<T>();
  T* to = static_cast<T*>(packed.memory.data_ptr());
  at::parallel_for(0, t.size(0) * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t head = begin; head < end; ++head) {
      pack(
          data + head / H * t.stride(0) + head % H * t.stride(1),
          to + head * packed.rows * packed.ld);
    }
  });
}

// for_each_band_run (tile_product.h) over the runs of blocks of rows of
// a tile, or keys of a block, whose `bands` (TileBands) are not empty: a
// banded product as whole products, one per run. A causal tile's row
// blocks run in up to fours, the blocks that end in one column panel.
template <typename Product>
void for_each_band(const std::vector<IndexRange>& bands, int64_t extent, const Product& product) {
  for_each_band_run(bands, extent, [&](int64_t first, int64_t count, const IndexRange& band) {
    if (band.begin < band.end) {
      product(first, count, band);
    }
  });
}

// What the operands of any type read of a request: its sizes, scale,
// direction and loops, and its heads in their own dtype.
template <typename Element>
struct RequestHeads {
  RequestHeads(const AttentionParams& params, OperandDirection direction, const CpuLoops& loops)
      : loops(loops),
        D(params.D()),
        Dv(params.Dv()),
        group(params.group()),
        scale(params.scale),
        direction(direction),
        q(params.q),
        k(params.k),
        v(params.v) {}

  CpuLoops loops; // the products' and conversions' (kernel_plan.h)
  int64_t D, Dv, group;
  double scale;
  OperandDirection direction;
  Heads<Element> q, k, v;
};

} // namespace attn::detail
