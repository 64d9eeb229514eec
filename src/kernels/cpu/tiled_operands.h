#pragma once

// What the operand policies of the tiled loops (tiled_template.h) share:
// which direction they are made for, how a gradient's product adds, the
// request they read (its queries' heads, its keys and values through a
// source: key_value_source.h), what they make of each kv head once per
// call, and 16-bit heads packed as a product's right operand.

#include "kernels/attention_params.h"
#include "kernels/cpu/heads.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/key_value_source.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/tile_product.h"
#include "kernels/cpu/tiled_loops.h"
#include "kernels/cpu/workspace.h"

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

// Uninitialised PackedHeads for `source`'s kv heads: `rows` rows of at
// least `cols` 16-bit elements per head, spread_row_stride apart.
template <typename Source>
PackedHeads empty_packed_heads(
    const Source& source,
    int64_t rows,
    int64_t cols,
    WorkspaceSlot slot) {
  using Element = typename Source::Element;
  static_assert(sizeof(Element) == sizeof(uint16_t), "packs 16-bit elements");
  PackedHeads packed;
  packed.heads = source.kv_heads();
  packed.rows = rows;
  packed.ld = spread_row_stride(cols, static_cast<int64_t>(sizeof(uint16_t)));
  packed.memory = workspace_tensor(
      slot, {source.batch(), packed.heads, rows, packed.ld},
      torch::dtype(c10::CppTypeToScalarType<Element>::value));
  return packed;
}

// `make(first, run, to)` for every run of keys (KeyValueSource::
// for_each_run) of each kv head of `source`'s keys or values, in
// parallel over the heads, `grain` heads at least per task: `to` is the
// first element of the head's memory in `made` (B, Hkv, ·, ·).
template <typename To, typename Source, typename Make>
void make_each_head(
    const Source& source,
    KeyOrValue which,
    const torch::Tensor& made,
    int64_t grain,
    const Make& make) {
  using Element = typename Source::Element;
  if (made.numel() == 0 || source.length() == 0 || source.width(which) == 0) {
    return;
  }
  const int64_t H = source.kv_heads();
  To* to = static_cast<To*>(made.data_ptr());
  parallel_for(0, source.batch() * H, grain, [&](int64_t begin, int64_t end) {
    for (int64_t head = begin; head < end; ++head) {
      To* head_to = to + head / H * made.stride(0) + head % H * made.stride(1);
      source.for_each_run(
          which, head / H, head % H,
          [&](int64_t first, const MatrixRef<Element>& run) { make(first, run, head_to); });
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
// direction and loops, its queries' heads and its keys and values'
// source, in their own dtype.
template <typename Element, typename Source>
struct RequestHeads {
  RequestHeads(const AttentionParams& params, OperandDirection direction, const CpuLoops& loops)
      : loops(loops),
        D(params.D()),
        Dv(params.Dv()),
        group(params.group()),
        scale(params.scale),
        direction(direction),
        q(params.q),
        kv(params) {}

  CpuLoops loops; // the products' and conversions' (kernel_plan.h)
  int64_t D, Dv, group;
  double scale;
  OperandDirection direction;
  Heads<Element> q;
  Source kv;
};

} // namespace attn::detail
