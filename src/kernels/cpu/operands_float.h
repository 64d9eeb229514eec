#pragma once

// The float32 and float64 operand policy of the tiled loops
// (tiled_template.h): the products (tile_product.h, tile_addmm_banded:
// attn's loops for float where they run, else the BLAS) on the inputs as
// they are, in a causal or windowed tile's bands, Kᵀ and Vᵀ transposed
// once per call where attn's loops multiply; the output and the gradients
// accumulate where they are written (kAccumulatesInPlace).

#include "kernels/cpu/tiled_operands.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

namespace attn::detail {

// Kᵀ or Vᵀ (B, Hkv, features, keys), for the products that read it as
// their right operand (scores = Q Kᵀ, dP = dO Vᵀ): tile_addmm reads that
// operand by rows, so its rows are made contiguous once per call, where
// attn's own products run and each row of Kᵀ is read by at least
// kMinRowsForCopy queries (a decoding step's one query would pay as much
// for the copy as for the product). Elsewhere undefined: the products
// read the source's rows transposed where they are (BLAS takes any
// strides).
inline constexpr int64_t kMinRowsForCopy = 16;

template <typename Source>
torch::Tensor transposed_for_products(
    const CpuLoops& loops,
    const Source& source,
    KeyOrValue which,
    int64_t queries,
    WorkspaceSlot slot) {
  if constexpr (std::is_same_v<typename Source::Element, float>) {
    if (queries < kMinRowsForCopy || !tile_products_run(loops, torch::kFloat)) {
      return {};
    }
    const int64_t features = source.width(which);
    const auto copy = spread_workspace_tensor(
        slot, {source.batch(), source.kv_heads(), features, source.length()},
        torch::dtype(torch::kFloat));
    make_each_head<float>(
        source, which, copy,
        parallel_grain(static_cast<double>(source.length() * features), kMinParallelTranspose),
        [&](int64_t first, const MatrixRef<float>& run, float* to) {
          transpose_float(
              loops, run.rows, features, run.data, run.row_stride, run.column_stride, to + first,
              copy.stride(2));
        });
    return copy;
  } else {
    return {}; // attn's products are float's alone (tile_products_run)
  }
}

// A query tile's rows of Q or dO as the backward's products read them.
// Where the heads' rows interleave with other heads' ((B, L, H, D) memory,
// rows thousands of bytes apart), they are copied into `buffer`, one row
// after the other: dK += dSᵀ Q and dV += Pᵀ dO read them down their
// columns, and rows so far apart fall into a few cache sets, which cannot
// hold a tile's panel from one row block of the product to the next.
template <typename scalar_t>
MatrixRef<scalar_t> compact_rows(const MatrixRef<scalar_t>& m, std::vector<scalar_t>& buffer) {
  if (m.data == nullptr || (m.row_stride == m.cols && m.column_stride == 1)) {
    return m;
  }
  buffer.resize(static_cast<size_t>(m.rows * m.cols));
  for (int64_t r = 0; r < m.rows; ++r) {
    const scalar_t* from = m.row(r);
    scalar_t* to = buffer.data() + r * m.cols;
    for (int64_t c = 0; c < m.cols; ++c) {
      to[c] = from[c * m.column_stride];
    }
  }
  return {buffer.data(), m.rows, m.cols, m.cols, 1};
}

template <typename scalar_t, typename Source = KeyValueSource<scalar_t>>
class FloatOperands : RequestHeads<scalar_t, Source> {
  using Base = RequestHeads<scalar_t, Source>;

 public:
  using Element = scalar_t;
  // The scores and accumulators in the inputs' own dtype, the output and
  // the gradients accumulated where they are written.
  using Accum = scalar_t;
  static constexpr bool kAccumulatesInPlace = true;
  // It accumulates dK and dV as keys × features, the gradients' layout.
  static constexpr bool kKeyGradientsTransposed = false;
  // It multiplies P as it is: no remainder.
  static constexpr bool kRoundsWeights = false;

  static bool runs(const CpuLoops& /*loops*/) { return true; }

  FloatOperands(const AttentionParams& params, OperandDirection direction, const CpuLoops& loops)
      : Base(params, direction, loops),
        keys_t_(transposed_for_products(
            loops,
            this->kv,
            KeyOrValue::key,
            params.L(),
            WorkspaceSlot::keys_transposed)),
        values_t_(torch::Tensor()) {
    if (direction == OperandDirection::backward) {
      values_t_ = Transposed(transposed_for_products(
          loops, this->kv, KeyOrValue::value, params.L(), WorkspaceSlot::values_transposed));
    }
  }

  // A task's rows of the tile: Q (compacted in the backward, as the key
  // gradient's product reads it down its columns) and the backward's dO.
  struct Scratch {
    MatrixRef<scalar_t> q_tile, grad_out_tile;
    std::vector<scalar_t> query_rows, grad_out_rows; // compact_rows' copies
    typename Source::Buffer read;
  };

  Scratch scratch(int64_t /*rows*/, int64_t /*key_block*/) const { return {}; }

  void start_tile(Scratch& s, const QueryTile& tile, const MatrixRef<scalar_t>& grad_out) const {
    const auto q_tile = this->q.head(tile.b, tile.h).row_block(tile.i0, tile.rows);
    if (this->direction == OperandDirection::forward) {
      s.q_tile = q_tile;
      return;
    }
    s.q_tile = compact_rows(q_tile, s.query_rows);
    s.grad_out_tile = compact_rows(grad_out, s.grad_out_rows);
  }

  // Where attn's loops take the tile's scores, they compute its bands alone.
  bool computes_bands(
      Scratch& s,
      const QueryTile& tile,
      int64_t j0,
      const MatrixRef<scalar_t>& scores) const {
    return tile_loops_take(
        this->loops, scores, s.q_tile, keys_t_block(s, tile, j0, scores.cols), 0);
  }

  // scores = scale·Q Kᵀ for keys [j0, j0 + scores.cols) of `tile`, in its
  // bands.
  void score(
      Scratch& s,
      const QueryTile& tile,
      int64_t j0,
      const MatrixRef<scalar_t>& scores,
      const TileBands& bands) const {
    tile_addmm_banded(
        this->loops, scores, s.q_tile, keys_t_block(s, tile, j0, scores.cols), 0, this->scale,
        ProductBand::columns, bands.keys_of_query_block);
  }

  void take_weights_row(
      Scratch& /*s*/,
      const MatrixRef<scalar_t>& /*p*/,
      int64_t /*r*/,
      int64_t /*j0*/,
      const IndexRange& /*keys*/) const {}

  // out (p.rows × Dv) += P V, in the bands.
  void add_weights_times_values(
      Scratch& s,
      const QueryTile& tile,
      int64_t j0,
      const MatrixRef<scalar_t>& p,
      const MatrixRef<scalar_t>& out,
      const TileBands& bands) const {
    tile_addmm_banded(
        this->loops, out, p, block(s, KeyOrValue::value, tile, j0, p.cols), 1, 1,
        ProductBand::depth, bands.keys_of_query_block);
  }

  // dp = dO Vᵀ for keys [j0, j0 + dp.cols), in the bands.
  void grad_weights(
      Scratch& s,
      const QueryTile& tile,
      int64_t j0,
      const MatrixRef<scalar_t>& /*grad_out: compacted in s*/,
      const MatrixRef<scalar_t>& dp,
      const TileBands& bands) const {
    tile_addmm_banded(
        this->loops, dp, s.grad_out_tile,
        transposed_block(s, values_t_, KeyOrValue::value, tile, j0, dp.cols), 0, 1,
        ProductBand::columns, bands.keys_of_query_block);
  }

  // dV (p.cols × Dv) = beta·dV + alpha·Pᵀ dO, each key over the queries
  // that computed it.
  void add_value_gradient(
      Scratch& s,
      const MatrixRef<scalar_t>& p,
      const MatrixRef<scalar_t>& dv,
      const TileBands& bands,
      const Accumulate& how) const {
    tile_addmm_banded(
        this->loops, dv, p.transposed(), s.grad_out_tile, how.beta, how.alpha, ProductBand::depth,
        bands.queries_of_key_block);
  }

  // dQ (ds.rows × D) = beta·dQ + alpha·dS K, in the bands.
  void add_query_gradient(
      Scratch& s,
      const QueryTile& tile,
      int64_t j0,
      const MatrixRef<scalar_t>& ds,
      const MatrixRef<scalar_t>& dq,
      const TileBands& bands,
      const Accumulate& how) const {
    tile_addmm_banded(
        this->loops, dq, ds, block(s, KeyOrValue::key, tile, j0, ds.cols), how.beta, how.alpha,
        ProductBand::depth, bands.keys_of_query_block);
  }

  // dK (ds.cols × D) = beta·dK + alpha·dSᵀ Q, each key over the queries
  // that computed it.
  void add_key_gradient(
      Scratch& s,
      const MatrixRef<scalar_t>& ds,
      const MatrixRef<scalar_t>& dk,
      const TileBands& bands,
      const Accumulate& how) const {
    tile_addmm_banded(
        this->loops, dk, ds.transposed(), s.q_tile, how.beta, how.alpha, ProductBand::depth,
        bands.queries_of_key_block);
  }

  static void round_row(const scalar_t* from, int64_t n, scalar_t* to) {
    std::copy(from, from + n, to);
  }
  static void widen_row(const scalar_t* from, int64_t n, scalar_t* to) {
    std::copy(from, from + n, to);
  }

 private:
  // Keys [j0, j0 + cols) of the tile's kv head: its keys or values.
  MatrixRef<scalar_t> block(
      Scratch& s,
      KeyOrValue which,
      const QueryTile& tile,
      int64_t j0,
      int64_t cols) const {
    return this->kv.rows(which, tile.b, tile.h / this->group, j0, cols, s.read);
  }

  // Kᵀ or Vᵀ where transposed_for_products made it.
  struct Transposed {
    explicit Transposed(torch::Tensor copy)
        : memory(std::move(copy)),
          heads(memory.defined() ? Heads<scalar_t>(memory) : Heads<scalar_t>()) {}
    torch::Tensor memory;
    Heads<scalar_t> heads;
  };

  // Those keys' columns of Kᵀ or Vᵀ: of its copy where one was made,
  // else of the source's rows transposed.
  MatrixRef<scalar_t> transposed_block(
      Scratch& s,
      const Transposed& transposed,
      KeyOrValue which,
      const QueryTile& tile,
      int64_t j0,
      int64_t cols) const {
    if (transposed.memory.defined()) {
      return transposed.heads.head(tile.b, tile.h / this->group).column_block(j0, cols);
    }
    return block(s, which, tile, j0, cols).transposed();
  }

  MatrixRef<scalar_t> keys_t_block(Scratch& s, const QueryTile& tile, int64_t j0, int64_t cols)
      const {
    return transposed_block(s, keys_t_, KeyOrValue::key, tile, j0, cols);
  }

  Transposed keys_t_, values_t_;
};

} // namespace attn::detail
