#pragma once

// The kernels' view of the masks: element access to the (B, H, L, S) mask
// through its (possibly zero, broadcast) strides, the blocks that the mask
// or a BlockMask leaves visible (MaskBlocks), and the band of keys that
// `causal` and `window` leave visible.

#include "kernels/attention_params.h"
#include "kernels/cpu/tile_product.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace attn::detail {

template <typename scalar_t>
constexpr scalar_t kNegativeInfinity = -std::numeric_limits<scalar_t>::infinity();

// MaskBlocks as the loops read them: each block's kind, and the elements of
// a partial one.
struct BlockView {
  static constexpr int64_t kRows = MaskBlocks::kRows, kCols = MaskBlocks::kCols;
  const uint8_t* kinds = nullptr; // null: no blocks
  // Whether the blocks hold their partial blocks' pairs (a BlockMask's:
  // the mask tensor then applies besides them); else those pairs are the
  // bool mask's the blocks were classified from.
  bool own_tiles = false;
  const int32_t* tile_of = nullptr;
  const bool* tiles = nullptr; // may be null where there are no partial blocks
  int64_t stride_b = 0, stride_h = 0, stride_q = 0;
  const int64_t* key_bounds = nullptr; // (Bm, L, 2), or null
  int64_t bounds_stride_b = 0;

  explicit BlockView(const MaskBlocks& blocks) {
    if (!blocks.defined()) {
      return;
    }
    const auto& k = blocks.kinds;
    const auto stride = [&](int64_t dim) { return k.size(dim) == 1 ? 0 : k.stride(dim); };
    stride_b = stride(0);
    stride_h = stride(1);
    stride_q = stride(2);
    kinds = k.data_ptr<uint8_t>();
    own_tiles = blocks.tiles.defined();
    if (own_tiles) {
      tile_of = blocks.tile_of.data_ptr<int32_t>();
      tiles = blocks.tiles.data_ptr<bool>();
    }
    if (blocks.key_bounds.defined()) {
      const auto& bounds = blocks.key_bounds;
      key_bounds = bounds.data_ptr<int64_t>();
      bounds_stride_b = bounds.size(0) == 1 ? 0 : bounds.stride(0);
    }
  }

  // The offset of query i's row of blocks of head (b, h) in kinds.
  int64_t row_of(int64_t b, int64_t h, int64_t i) const {
    return b * stride_b + h * stride_h + i / kRows * stride_q;
  }

  // Row (i % kRows) of the partial block at `block` (an offset in kinds).
  const bool* tile_row(int64_t block, int64_t i) const {
    return tiles + (static_cast<int64_t>(tile_of[block]) * kRows + i % kRows) * kCols;
  }
};

// scores[0 .. n) += n elements of a half-precision mask (their bits) from
// `from` on, `stride` apart, widened exactly by `widen` a run of keys at a
// time. Out of line (mask_view.cpp; not inlined in a unity batch either),
// so that MaskView's loops over bool and float masks stay as the compiler
// laid them out without it.
[[gnu::noinline]] void add_half_mask_row(
    float* scores,
    int64_t n,
    const uint16_t* from,
    int64_t stride,
    void (*widen)(const uint16_t* from, int64_t n, float* to));

template <typename scalar_t>
struct MaskView {
  const bool* allowed = nullptr;  // bool mask: true = may attend
  const scalar_t* bias = nullptr; // additive mask
  // An additive mask in bfloat16 or float16 (its bits) on float scores,
  // widened a run of keys at a time as it is added: no float copy of it.
  const uint16_t* half_bias = nullptr;
  void (*widen_half_bias)(const uint16_t* from, int64_t n, float* to) = nullptr;
  int64_t stride_b = 0, stride_h = 0, stride_l = 0, stride_s = 0;
  BlockView blocks;
  KeyBand band;

  // A half-precision mask widens on `loops`' instructions.
  MaskView(const AttentionParams& params, const CpuLoops& loops)
      : blocks(params.blocks), band(params.key_band()) {
    const auto& mask = params.mask;
    if (!mask.defined()) {
      return;
    }
    stride_b = mask.stride(0);
    stride_h = mask.stride(1);
    stride_l = mask.stride(2);
    stride_s = mask.stride(3);
    if (mask.scalar_type() == torch::kBool) {
      allowed = mask.data_ptr<bool>();
    } else if (is_half_precision(mask.scalar_type()) && std::is_same_v<scalar_t, float>) {
      half_bias = static_cast<const uint16_t*>(mask.data_ptr());
      widen_half_bias = half_rows(loops, mask.scalar_type()).widen;
    } else {
      bias = mask.data_ptr<scalar_t>();
    }
  }

  // Whether any pair is tested element by element (else the band alone hides keys).
  bool tests_elements() const {
    return allowed != nullptr || bias != nullptr || half_bias != nullptr || blocks.kinds != nullptr;
  }

  // The keys [tile_key_begin, tile_key_end) that some query of rows
  // [i0, i0 + rows) sees.
  int64_t tile_key_begin(int64_t i0) const { return band.begin(i0); }
  int64_t tile_key_end(int64_t i0, int64_t rows) const {
    return std::max(tile_key_begin(i0), band.end(i0 + rows - 1));
  }

  // Keys [begin, end) that some query of rows [first, last] of batch row b
  // may see: the band's, narrowed by the block mask's key bounds.
  IndexRange rows_keys(int64_t b, int64_t first, int64_t last) const {
    int64_t begin = band.begin(first), end = band.end(last);
    if (blocks.key_bounds != nullptr) {
      const int64_t* bounds = blocks.key_bounds + b * blocks.bounds_stride_b;
      begin = std::max(begin, bounds[2 * first]);
      end = std::min(end, bounds[2 * last + 1]);
    }
    return {begin, end};
  }

  // Whether rows_keys narrows the band by key bounds.
  bool bounds_keys() const { return blocks.key_bounds != nullptr; }

  // The next keys that the query tile of head (b, h) from row i0 scores,
  // from `from` on and before `end`: at most `most` consecutive keys from
  // the first block that is not empty, up to the next empty one. {end, end}
  // when no such key remains.
  IndexRange next_keys(int64_t b, int64_t h, int64_t i0, int64_t from, int64_t end, int64_t most)
      const {
    if (blocks.kinds == nullptr) {
      return {std::min(from, end), std::min(end, from + most)};
    }
    const uint8_t* row = blocks.kinds + blocks.row_of(b, h, i0);
    constexpr int64_t cols = BlockView::kCols;
    int64_t begin = from;
    while (begin < end && row[begin / cols] == kEmptyBlock) {
      begin = (begin / cols + 1) * cols;
    }
    if (begin >= end) {
      return {end, end};
    }
    const int64_t limit = std::min(end, begin + most);
    int64_t stop = begin;
    while (stop < limit && row[stop / cols] != kEmptyBlock) {
      stop = std::min(limit, (stop / cols + 1) * cols);
    }
    return {begin, stop};
  }

  // Applies the masks to the scores of query i against keys j0 .. j0+n-1.
  void apply(scalar_t* scores, int64_t n, int64_t b, int64_t h, int64_t i, int64_t j0) const {
    if (blocks.kinds != nullptr) {
      apply_blocks(scores, n, b, h, i, j0);
    }
    if (blocks.kinds == nullptr || blocks.own_tiles) {
      apply_elements(scores, n, b, h, i, j0);
    }
    const int64_t visible_begin = std::clamp<int64_t>(band.begin(i) - j0, 0, n);
    const int64_t visible_end = std::clamp<int64_t>(band.end(i) - j0, visible_begin, n);
    std::fill(scores, scores + visible_begin, kNegativeInfinity<scalar_t>);
    std::fill(scores + visible_end, scores + n, kNegativeInfinity<scalar_t>);
  }

 private:
  // The mask tensor's elements, bool or additive.
  void apply_elements(scalar_t* scores, int64_t n, int64_t b, int64_t h, int64_t i, int64_t j0)
      const {
    const int64_t base = b * stride_b + h * stride_h + i * stride_l + j0 * stride_s;
    if (allowed != nullptr) {
      for (int64_t j = 0; j < n; ++j) {
        if (!allowed[base + j * stride_s]) {
          scores[j] = kNegativeInfinity<scalar_t>;
        }
      }
    } else if (bias != nullptr) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        scores[j] += bias[base + j * stride_s];
      }
    } else if constexpr (std::is_same_v<scalar_t, float>) {
      if (half_bias != nullptr) {
        add_half_mask_row(scores, n, half_bias + base, stride_s, widen_half_bias);
      }
    }
  }

  // Block by block: an empty block hides its keys, a full one none, a
  // partial one those its elements forbid (a BlockMask's tile, else the
  // bool mask's elements).
  void apply_blocks(scalar_t* scores, int64_t n, int64_t b, int64_t h, int64_t i, int64_t j0)
      const {
    constexpr int64_t cols = BlockView::kCols;
    const int64_t row = blocks.row_of(b, h, i);
    for (int64_t j = j0; j < j0 + n;) {
      const int64_t block = j / cols;
      const int64_t stop = std::min(j0 + n, (block + 1) * cols);
      const uint8_t kind = blocks.kinds[row + block];
      if (kind == kEmptyBlock) {
        std::fill(scores + (j - j0), scores + (stop - j0), kNegativeInfinity<scalar_t>);
      } else if (kind == kPartialBlock && blocks.own_tiles) {
        const bool* tile = blocks.tile_row(row + block, i);
        for (int64_t k = j; k < stop; ++k) {
          if (!tile[k - block * cols]) {
            scores[k - j0] = kNegativeInfinity<scalar_t>;
          }
        }
      } else if (kind == kPartialBlock) {
        apply_elements(scores + (j - j0), stop - j, b, h, i, j);
      }
      j = stop;
    }
  }
};

} // namespace attn::detail
