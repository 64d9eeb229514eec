#pragma once

// The float16 operand policy of the tiled loops (tiled_template.h): the
// float loops' products (tile_addmm_banded, in a causal or windowed tile's
// bands as the float kernel computes them) on operands widened to float
// per tile: Q and dO per query tile, K, Kᵀ, V and Vᵀ per block of keys
// (Kᵀ and Vᵀ transposed once per call in float16); P and dS stay float.

#include "kernels/cpu/tiled_operands.h"

#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace attn::detail {

// Rows and columns per block of transposed_heads' copy.
inline constexpr int64_t kHalfTransposeBlock = 16;

// `source`'s keys or values transposed per kv head into (features, keys)
// matrices of 16-bit elements: Kᵀ for the scores, Vᵀ for dP.
template <typename Source>
PackedHeads transposed_heads(const Source& source, KeyOrValue which, WorkspaceSlot slot) {
  const int64_t cols = source.width(which);
  auto packed = empty_packed_heads(source, cols, source.length(), slot);
  make_each_head<c10::Half>(
      source, which, packed.memory, 1,
      [&](int64_t first, const MatrixRef<c10::Half>& run, c10::Half* to) {
        for (int64_t i0 = 0; i0 < run.rows; i0 += kHalfTransposeBlock) {
          const int64_t i_end = std::min(run.rows, i0 + kHalfTransposeBlock);
          for (int64_t j = 0; j < cols; ++j) {
            for (int64_t i = i0; i < i_end; ++i) {
              to[j * packed.ld + first + i] = run.row(i)[j * run.column_stride];
            }
          }
        }
      });
  return packed;
}

// A float matrix of up to `rows` × `cols`, rows spread_row_stride apart,
// into which float16 blocks are widened.
struct WidenedBlock {
  WidenedBlock(int64_t rows, int64_t cols)
      : ld(spread_row_stride(cols, static_cast<int64_t>(sizeof(float)))),
        values(static_cast<size_t>(rows * ld)) {}

  // Rows [0, n) × [0, cols) = the float16 rows `from`, `from_ld` apart,
  // widened on `loops`.
  MatrixRef<float> widen(
      const CpuLoops& loops,
      const uint16_t* from,
      int64_t from_ld,
      int64_t n,
      int64_t cols) {
    for (int64_t r = 0; r < n; ++r) {
      widen_half_row(loops, from + r * from_ld, cols, values.data() + r * ld);
    }
    return {values.data(), n, cols, ld, 1};
  }

  int64_t ld;
  std::vector<float> values;
};

// The products of the float16 loops: attn's float micro-tiles, their
// operands widened to float per tile (Q, dO) and per block of keys (Kᵀ,
// Vᵀ transposed once per call in float16; K, V read in place); P and dS
// stay float. A block is widened once for a tile's 128 queries, not again
// by every 8-row micro-tile that reads it (docs/design/cpu-kernels.md,
// "The float16 loops").
template <typename Source = KeyValueSource<c10::Half>>
class Float16Operands : RequestHeads<c10::Half, Source> {
  using Base = RequestHeads<c10::Half, Source>;
  using Base::D, Base::Dv, Base::direction, Base::group, Base::kv, Base::loops, Base::q,
      Base::scale;

 public:
  using Element = c10::Half;
  // It accumulates dK and dV as the float loops do (keys × features).
  static constexpr bool kKeyGradientsTransposed = false;

  // Scores, softmax and accumulators in float, the accumulators memory of
  // the task's own (the outputs and gradients rounded once from them).
  using Accum = float;
  static constexpr bool kAccumulatesInPlace = false;

  static bool runs(const CpuLoops& loops) { return half_products_run(loops); }

  // It multiplies P as it is (add_weights_times_values): no remainder.
  static constexpr bool kRoundsWeights = false;

  Float16Operands(const AttentionParams& params, OperandDirection direction, const CpuLoops& loops)
      : Base(params, direction, loops),
        keys_t_(transposed_heads(kv, KeyOrValue::key, WorkspaceSlot::keys_transposed)) {
    TORCH_INTERNAL_ASSERT(
        kv.features_contiguous(KeyOrValue::key) && kv.features_contiguous(KeyOrValue::value),
        "the keys and values have rows of unit stride");
    if (direction == OperandDirection::backward) {
      values_t_ = transposed_heads(kv, KeyOrValue::value, WorkspaceSlot::values_transposed);
    }
  }

  // A task's float operands: the tile's Q (rows × D) and, in the
  // backward, dO (rows × Dv); a block of Kᵀ or Vᵀ (features × keys) and
  // one of V or K (keys × features).
  struct Scratch {
    std::vector<float> q, grad_out;
    WidenedBlock features_by_keys, keys_by_features;
    int64_t rows = 0; // of the tile
    typename Source::Buffer read;
  };

  Scratch scratch(int64_t rows, int64_t key_block) const {
    const bool backward = direction == OperandDirection::backward;
    const int64_t features = std::max(D, Dv);
    return Scratch{
        std::vector<float>(static_cast<size_t>(rows * D)),
        std::vector<float>(static_cast<size_t>(backward ? rows * Dv : 0)),
        WidenedBlock(features, key_block),
        WidenedBlock(key_block, features),
        0,
        {}};
  }

  // Where the float loops' products run, they compute only a causal or
  // windowed tile's bands (tile_addmm_banded), as the float kernel does.
  bool computes_bands(
      const Scratch& /*s*/,
      const QueryTile& /*tile*/,
      int64_t /*j0*/,
      const MatrixRef<float>& scores) const {
    return tile_loops_take(
        loops, scores, MatrixRef<float>{nullptr, scores.rows, D, D, 1},
        MatrixRef<float>{nullptr, D, scores.cols, scores.cols, 1}, 0);
  }

  // The tile's Q and, in the backward, dO widened.
  void start_tile(Scratch& s, const QueryTile& tile, const MatrixRef<c10::Half>& grad_out) const {
    s.rows = tile.rows;
    const auto q_tile = q.head(tile.b, tile.h).row_block(tile.i0, tile.rows);
    for (int64_t r = 0; r < tile.rows; ++r) {
      widen_row(q_tile.row(r), D, s.q.data() + r * D);
      if (direction == OperandDirection::backward) {
        widen_row(grad_out.row(r), Dv, s.grad_out.data() + r * Dv);
      }
    }
  }

  // scores = scale·Q Kᵀ for keys [j0, j0 + scores.cols) of `tile`, in its
  // bands.
  void score(
      Scratch& s,
      const QueryTile& tile,
      int64_t j0,
      const MatrixRef<float>& scores,
      const TileBands& bands) const {
    const auto keys_t = s.features_by_keys.widen(
        loops, keys_t_.head(tile.b, tile.h / group) + j0, keys_t_.ld, D, scores.cols);
    tile_addmm_banded(
        loops, scores, queries(s), keys_t, 0, scale, ProductBand::columns,
        bands.keys_of_query_block);
  }

  // The weights stay float: nothing to do per row.
  void take_weights_row(
      Scratch& /*s*/,
      const MatrixRef<float>& /*p*/,
      int64_t /*r*/,
      int64_t /*j0*/,
      const IndexRange& /*keys*/) const {}

  // out (p.rows × Dv) += P V, in the bands.
  void add_weights_times_values(
      Scratch& s,
      const QueryTile& tile,
      int64_t j0,
      const MatrixRef<float>& p,
      const MatrixRef<float>& out,
      const TileBands& bands) const {
    add_times_widened_rows(s, p, tile, KeyOrValue::value, j0, out, bands);
  }

  // dp = dO Vᵀ for keys [j0, j0 + dp.cols), in the bands.
  void grad_weights(
      Scratch& s,
      const QueryTile& tile,
      int64_t j0,
      const MatrixRef<c10::Half>& /*grad_out: widened in s*/,
      const MatrixRef<float>& dp,
      const TileBands& bands) const {
    const auto values_t = s.features_by_keys.widen(
        loops, values_t_.head(tile.b, tile.h / group) + j0, values_t_.ld, Dv, dp.cols);
    tile_addmm_banded(
        loops, dp, grad_outputs(s), values_t, 0, 1, ProductBand::columns,
        bands.keys_of_query_block);
  }

  // dV (p.cols × Dv) += Pᵀ dO, each key over the queries that computed it.
  void add_value_gradient(
      Scratch& s,
      const MatrixRef<float>& p,
      const MatrixRef<float>& dv,
      const TileBands& bands,
      const Accumulate& how) const {
    expect_plain_accumulation(how);
    tile_addmm_banded(
        loops, dv, p.transposed(), grad_outputs(s), 1, 1, ProductBand::depth,
        bands.queries_of_key_block);
  }

  // dQ (ds.rows × D) += dS K, without the scale, in the bands.
  void add_query_gradient(
      Scratch& s,
      const QueryTile& tile,
      int64_t j0,
      const MatrixRef<float>& ds,
      const MatrixRef<float>& dq,
      const TileBands& bands,
      const Accumulate& how) const {
    expect_plain_accumulation(how);
    add_times_widened_rows(s, ds, tile, KeyOrValue::key, j0, dq, bands);
  }

  // dK (ds.cols × D) += dSᵀ Q, without the scale, each key over the
  // queries that computed it.
  void add_key_gradient(
      Scratch& s,
      const MatrixRef<float>& ds,
      const MatrixRef<float>& dk,
      const TileBands& bands,
      const Accumulate& how) const {
    expect_plain_accumulation(how);
    tile_addmm_banded(
        loops, dk, ds.transposed(), queries(s), 1, 1, ProductBand::depth,
        bands.queries_of_key_block);
  }

  void round_row(const float* from, int64_t n, c10::Half* to) const {
    round_half_row(loops, from, n, half_bits(to));
  }

  void widen_row(const c10::Half* from, int64_t n, float* to) const {
    widen_half_row(loops, half_bits(from), n, to);
  }

 private:
  MatrixRef<float> queries(Scratch& s) const { return {s.q.data(), s.rows, D, D, 1}; }
  MatrixRef<float> grad_outputs(Scratch& s) const { return {s.grad_out.data(), s.rows, Dv, Dv, 1}; }

  // c (m.rows × features) += m times keys [j0, j0 + m.cols) of the
  // tile's kv head (its keys or values), widened, in the bands.
  void add_times_widened_rows(
      Scratch& s,
      const MatrixRef<float>& m,
      const QueryTile& tile,
      KeyOrValue which,
      int64_t j0,
      const MatrixRef<float>& c,
      const TileBands& bands) const {
    const auto keys = kv.rows(which, tile.b, tile.h / group, j0, m.cols, s.read);
    const auto rows = s.keys_by_features.widen(
        loops, half_bits(keys.data), keys.row_stride, keys.rows, keys.cols);
    tile_addmm_banded(loops, c, m, rows, 1, 1, ProductBand::depth, bands.keys_of_query_block);
  }

  PackedHeads keys_t_;   // Kᵀ, for the scores
  PackedHeads values_t_; // backward: Vᵀ, for dP = dO Vᵀ
};

} // namespace attn::detail
