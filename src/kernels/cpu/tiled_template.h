#pragma once

// The tiled loops, written once over an operand policy (`Operands`):
// forward, the weights kernel's forward, and backward, for every dtype.
// The row passes (masks, modifiers, online softmax, dropout, softmax
// backward, modifier gradients) are tiled_loops.h's; a policy supplies the
// products and the elements they read and write:
// - FloatOperands<float>, FloatOperands<double> (operands_float.h): the
//   inputs as they are, the output and gradients accumulated where they
//   are written;
// - Bf16Operands (operands_bf16.h): bfloat16 products on operands packed
//   in pairs;
// - Float16Operands (operands_float16.h): float products on operands
//   widened per tile;
// the 16-bit ones accumulate in float memory of the task's own and round
// each result once into its tensor.
//
// A policy reads keys and values through its source (key_value_source.h).
//
// What a policy provides (each type's own file says how):
//   Element, Accum: the inputs' elements; the scores', softmax's and
//     accumulators' (float, or double for double);
//   kAccumulatesInPlace: the output, dQ, dK and dV accumulate in the
//     tensors written (Element is Accum), with each gradient product's
//     Accumulate; else in the task's memory, from zero, rounded after;
//   kKeyGradientsTransposed: that memory holds dK and dV as features ×
//     keys, else keys × features;
//   kRoundsWeights: P is rounded for P V (add_weights_remainder_times_values);
//   runs(loops); the constructor (params, direction, loops); Scratch and
//     scratch(rows, key_block); start_tile; computes_bands; score;
//     take_weights_row; add_weights_times_values; grad_weights;
//     add_value_gradient; add_query_gradient; add_key_gradient;
//     round_row; widen_row.

#include "kernels/cpu/heads.h"
#include "kernels/cpu/tiled_loops.h"
#include "kernels/cpu/tiled_operands.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace attn::detail {

// What every direction reads: the per-row inputs in the policy's Accum,
// and the operands of its products.
template <typename Operands>
struct TiledInputs : RowInputs<typename Operands::Accum> {
  TiledInputs(const AttentionParams& params, OperandDirection direction, const CpuLoops& loops)
      : RowInputs<typename Operands::Accum>(params, loops),
        D(params.D()),
        Dv(params.Dv()),
        products(params, direction, loops) {}
  int64_t D, Dv;
  Operands products;
};

// dst (n elements, Element or Accum) = src, rounded where dst is of a
// narrower Element.
template <typename Operands, typename T>
void store_row(const Operands& products, const typename Operands::Accum* src, int64_t n, T* dst) {
  if constexpr (std::is_same_v<T, typename Operands::Accum>) {
    std::copy(src, src + n, dst);
  } else {
    products.round_row(src, n, dst);
  }
}

// dst (rows × cols, Element or Accum) = factor · src (rows × cols,
// contiguous), which is scaled in place.
template <typename Operands, typename T>
void write_scaled(
    const Operands& products,
    const MatrixRef<T>& dst,
    typename Operands::Accum* src,
    typename Operands::Accum factor) {
  for (int64_t r = 0; r < dst.rows; ++r) {
    auto* row = src + r * dst.cols;
    for (int64_t c = 0; c < dst.cols; ++c) {
      row[c] *= factor;
    }
    store_row(products, row, dst.cols, dst.row(r));
  }
}

// ---------------------------------------------------------------------------
// Forward.

// A forward task's working memory: one tile's scores over `score_cols`
// keys (a block; every key for the weights kernel), the products' operands
// made per tile, its rows' online softmax, the output accumulated where it
// is not in place, and a row of the output widened back.
template <typename Operands>
struct TiledForwardScratch {
  using Accum = typename Operands::Accum;
  OwnedMatrix<Accum> scores; // (kQueryTile, score_cols)
  typename Operands::Scratch operands;
  std::vector<Accum> out; // (kQueryTile, Dv), where not in place
  OnlineSoftmax<Accum> softmax;
  TileBands bands;
  std::vector<Accum> widened; // (Dv), where not in place
};

template <typename Operands>
TiledForwardScratch<Operands> forward_scratch(const TiledInputs<Operands>& in, int64_t score_cols) {
  using Accum = typename Operands::Accum;
  const int64_t rows = std::min(kQueryTile, in.L);
  const auto own = [&](int64_t n) {
    return std::vector<Accum>(static_cast<size_t>(Operands::kAccumulatesInPlace ? 0 : n));
  };
  return TiledForwardScratch<Operands>{
      OwnedMatrix<Accum>(spread_workspace_tensor(
          WorkspaceSlot::tile_scores, {rows, score_cols},
          torch::dtype(c10::CppTypeToScalarType<Accum>::value))),
      in.products.scratch(rows, in.key_block),
      own(rows * in.Dv),
      OnlineSoftmax<Accum>{},
      TileBands{},
      own(in.Dv)};
}

// Where a query tile's output accumulates: its rows of the output where
// the policy accumulates in place, else the task's memory; zeroed.
template <typename Operands>
MatrixRef<typename Operands::Accum> output_accumulator(
    TiledForwardScratch<Operands>& scratch,
    const MatrixRef<typename Operands::Element>& out_tile,
    int64_t Dv) {
  if constexpr (Operands::kAccumulatesInPlace) {
    zero_matrix(out_tile);
    return out_tile;
  } else {
    std::fill(scratch.out.begin(), scratch.out.end(), typename Operands::Accum(0));
    return {scratch.out.data(), out_tile.rows, Dv, Dv};
  }
}

// Keys [j0, j0 + cols) of one query tile, in the bands its products
// compute (TileBands): the scores, the row pass (forward_row), and out +=
// P V; with `weights_unrounded`, P V from P as it is where the products
// round it (Operands::kRoundsWeights).
template <typename Operands>
void forward_block(
    const TiledInputs<Operands>& in,
    TiledForwardScratch<Operands>& scratch,
    const QueryTile& tile,
    int64_t j0,
    int64_t cols,
    const MatrixRef<typename Operands::Accum>& out,
    bool weights_unrounded) {
  using Accum = typename Operands::Accum;
  const auto scores = scratch.scores.matrix.row_block(0, tile.rows).column_block(0, cols);
  scratch.bands.fit_queries(
      in.mask, tile, j0, cols, in.products.computes_bands(scratch.operands, tile, j0, scores));
  const auto& keys_of = scratch.bands.keys_of_query_block;
  in.products.score(scratch.operands, tile, j0, scores, scratch.bands);
  for (int64_t r = 0; r < tile.rows; ++r) {
    const auto [begin, end] = keys_of[r / kProductRowBlock];
    forward_row<Accum>(
        in, scratch.softmax, tile, r, j0 + begin, scores.row(r) + begin, end - begin, out.row(r),
        in.Dv);
    in.products.take_weights_row(scratch.operands, scores, r, j0, keys_of[r / kProductRowBlock]);
  }
  in.products.add_weights_times_values(scratch.operands, tile, j0, scores, out, scratch.bands);
  if constexpr (Operands::kRoundsWeights) {
    if (weights_unrounded) {
      in.products.add_weights_remainder_times_values(
          scratch.operands, tile, j0, scores, out, scratch.bands);
    }
  }
}

// t's heads, or none where t is undefined (ForwardResult::out_rounding).
template <typename Element>
Heads<Element> heads_if_defined(const torch::Tensor& t) {
  return t.defined() ? Heads<Element>(t) : Heads<Element>();
}

// rounding (n elements) = what rounding `exact` into `rounded` lost,
// itself rounded (ForwardResult::out_rounding), 0 where `rounded`
// overflowed (so that the backward's sum is inf, as without it, not
// NaN); `widened`: n elements of Accum.
template <typename Operands>
void write_rounding(
    const Operands& products,
    const typename Operands::Accum* exact,
    const typename Operands::Element* rounded,
    int64_t n,
    typename Operands::Accum* widened,
    typename Operands::Element* rounding) {
  products.widen_row(rounded, n, widened);
  for (int64_t c = 0; c < n; ++c) {
    widened[c] = std::isfinite(widened[c]) ? exact[c] - widened[c] : 0;
  }
  products.round_row(widened, n, rounding);
}

// The tile's output rows: the accumulated rows times their softmax's
// factor, written (rounded where not in place; with what the rounding
// lost where the forward keeps it), and their log-sum-exp.
template <typename Operands>
void finish_output_tile(
    const TiledInputs<Operands>& in,
    TiledForwardScratch<Operands>& scratch,
    const MatrixRef<typename Operands::Accum>& out,
    const MatrixRef<typename Operands::Element>& out_tile,
    const MatrixRef<typename Operands::Element>& rounding_tile,
    typename Operands::Accum* lse_row) {
  using Element = typename Operands::Element;
  for (int64_t r = 0; r < out.rows; ++r) {
    const auto factor = scratch.softmax.output_factor(r, in.keep_scale);
    if constexpr (Operands::kAccumulatesInPlace) {
      scale_row(out.row(r), in.Dv, factor);
    } else {
      write_scaled(
          in.products, MatrixRef<Element>{out_tile.row(r), 1, in.Dv, in.Dv}, out.row(r), factor);
      if (rounding_tile.data != nullptr) {
        write_rounding(
            in.products, out.row(r), out_tile.row(r), in.Dv, scratch.widened.data(),
            rounding_tile.row(r));
      }
    }
    lse_row[r] = scratch.softmax.lse(r);
  }
}

// Forward: out (B, H, L, Dv) in Element and the row log-sum-exp lse
// (B, H, L, contiguous) in Accum.
template <typename Operands>
void tiled_forward_loops(const TiledInputs<Operands>& in, const ForwardResult& result) {
  using Element = typename Operands::Element;
  using Accum = typename Operands::Accum;
  const Heads<Element> out_heads(result.out);
  const auto rounding_heads = heads_if_defined<Element>(result.out_rounding);
  Accum* const lse_data = result.lse.data_ptr<Accum>();
  const double flops_per_tile = 2.0 * std::min(kQueryTile, in.L) * in.S * (in.D + in.Dv);
  parallel_query_tiles(
      in.B, in.H, in.L, kQueryTile, flops_per_tile,
      [&] { return forward_scratch(in, in.key_block); },
      [&](TiledForwardScratch<Operands>& scratch, const QueryTile& tile) {
        const auto out_tile = out_heads.head(tile.b, tile.h).row_block(tile.i0, tile.rows);
        const auto out = output_accumulator(scratch, out_tile, in.Dv);
        scratch.softmax.start(in.modifiers.sink(tile.h));
        in.products.start_tile(scratch.operands, tile, MatrixRef<Element>{});
        const int64_t key_end = in.mask.tile_key_end(tile.i0, tile.rows);
        const auto next_keys = [&](int64_t from) {
          return in.mask.next_keys(tile.b, tile.h, tile.i0, from, key_end, in.key_block);
        };
        for (auto keys = next_keys(in.mask.tile_key_begin(tile.i0)); keys.begin < keys.end;
             keys = next_keys(keys.end)) {
          forward_block(
              in, scratch, tile, keys.begin, keys.end - keys.begin, out,
              rounding_heads.data != nullptr);
        }
        finish_output_tile(
            in, scratch, out, out_tile,
            rounding_heads.head(tile.b, tile.h).row_block(tile.i0, tile.rows),
            lse_data + (tile.b * in.H + tile.h) * in.L + tile.i0);
      });
}

// ---------------------------------------------------------------------------
// Forward with the weights.

// `step(j0, block)` for each block of up to key_block columns of
// `scores`, whose first column is key `key_begin`.
template <typename T, typename Step>
void for_each_key_block(
    const MatrixRef<T>& scores,
    int64_t key_begin,
    int64_t key_block,
    const Step& step) {
  for (int64_t c0 = 0; c0 < scores.cols; c0 += key_block) {
    step(key_begin + c0, scores.column_block(c0, std::min(key_block, scores.cols - c0)));
  }
}

// One query tile's weights over keys [key_begin, key_begin + scores.cols),
// every key the tile sees: the scores block by block, each row's softmax
// (weights_row), written into `weights` (the tile's rows of (L, S), at
// those keys: where `scores` are not those rows themselves, rounded once)
// and its log-sum-exp into `lse`; then out += P V block by block, P as
// the type's products take it.
template <typename Operands>
void weights_tile(
    const TiledInputs<Operands>& in,
    TiledForwardScratch<Operands>& scratch,
    const QueryTile& tile,
    int64_t key_begin,
    const MatrixRef<typename Operands::Accum>& scores,
    const MatrixRef<typename Operands::Element>& weights,
    const MatrixRef<typename Operands::Accum>& out,
    typename Operands::Accum* lse) {
  using Accum = typename Operands::Accum;
  auto& operands = scratch.operands;
  in.products.start_tile(operands, tile, {});
  for_each_key_block(
      scores, key_begin, in.key_block, [&](int64_t j0, const MatrixRef<Accum>& block) {
        scratch.bands.cover_whole(tile.rows, block.cols);
        in.products.score(operands, tile, j0, block, scratch.bands);
      });
  for (int64_t r = 0; r < tile.rows; ++r) {
    lse[r] = weights_row<Accum>(
        in, tile.b, tile.h, tile.i0 + r, key_begin, scores.row(r), scores.cols);
    if constexpr (!Operands::kAccumulatesInPlace) {
      store_row(in.products, scores.row(r), scores.cols, weights.row(r));
    }
  }
  for_each_key_block(
      scores, key_begin, in.key_block, [&](int64_t j0, const MatrixRef<Accum>& block) {
        scratch.bands.cover_whole(tile.rows, block.cols);
        for (int64_t r = 0; r < tile.rows; ++r) {
          in.products.take_weights_row(operands, block, r, j0, {0, block.cols});
        }
        in.products.add_weights_times_values(operands, tile, j0, block, out, scratch.bands);
      });
}

// The weights kernel: each query tile's weights materialised in (B, H, L,
// S) in the inputs' dtype (where the policy accumulates in place, scored
// there), then multiplied into V; the output (B, H, L, Dv) in the inputs'
// dtype, lse in Accum.
template <typename Operands>
void tiled_forward_with_weights_loops(
    const TiledInputs<Operands>& in,
    const ForwardResult& result) {
  using Element = typename Operands::Element;
  using Accum = typename Operands::Accum;
  const Heads<Element> out_heads(result.out), weight_heads(result.weights);
  Accum* const lse_data = result.lse.data_ptr<Accum>();
  const double flops_per_tile = 2.0 * std::min(kQueryTile, in.L) * in.S * (in.D + in.Dv);
  // The scores' own memory only where they are not the weights'.
  const int64_t score_cols = Operands::kAccumulatesInPlace ? 1 : std::max<int64_t>(in.S, 1);
  parallel_query_tiles(
      in.B, in.H, in.L, kQueryTile, flops_per_tile, [&] { return forward_scratch(in, score_cols); },
      [&](TiledForwardScratch<Operands>& scratch, const QueryTile& tile) {
        const auto out_tile = out_heads.head(tile.b, tile.h).row_block(tile.i0, tile.rows);
        const auto w_tile = weight_heads.head(tile.b, tile.h).row_block(tile.i0, tile.rows);
        Accum* lse = lse_data + (tile.b * in.H + tile.h) * in.L + tile.i0;
        const auto [key_begin, key_end] = start_weights_tile(in, tile, w_tile, out_tile, lse);
        const int64_t cols = key_end - key_begin;
        if (cols == 0) {
          return;
        }
        const auto visible = w_tile.column_block(key_begin, cols);
        const auto out = output_accumulator(scratch, out_tile, in.Dv);
        MatrixRef<Accum> scores;
        if constexpr (Operands::kAccumulatesInPlace) {
          scores = visible;
        } else {
          scores = scratch.scores.matrix.row_block(0, tile.rows).column_block(0, cols);
        }
        weights_tile(in, scratch, tile, key_begin, scores, visible, out, lse);
        if constexpr (!Operands::kAccumulatesInPlace) {
          for (int64_t r = 0; r < tile.rows; ++r) {
            store_row(in.products, out.row(r), in.Dv, out_tile.row(r));
          }
        }
      });
}

// ---------------------------------------------------------------------------
// Backward.

// What the backward reads besides the inputs, and the gradients it writes.
template <typename Element, typename Accum>
struct TiledBackwardTensors {
  Heads<Element> out, grad_out; // (B, H, L, Dv), rows of unit stride
  Heads<Element> out_rounding;  // likewise, or no heads (ForwardResult::out_rounding)
  const Accum* lse;             // (B, H, L), contiguous
  torch::Tensor dk, dv;         // (B, H, S, ·), Element, or Accum to be summed over groups
  ModifierGradients<Accum> modifiers;
};

// A backward task's working memory: the tiles of the row passes, the
// products' operands made per tile, and, where the policy does not
// accumulate in place, the gradients it accumulates: dQ for a query tile,
// dK and dV for its range of keys (in the layout of key_gradient_block).
template <typename Operands>
struct TiledBackwardScratch {
  using Accum = typename Operands::Accum;
  OwnedMatrix<Accum> probs, grad_scores, score_slopes; // (kQueryTile, key_block)
  std::vector<Accum> delta;                            // (kQueryTile)
  std::vector<Accum> widened; // a row of dO, of O and of O's rounding: (3, Dv)
  TileBands bands;
  typename Operands::Scratch operands;
  std::vector<Accum> dq;     // (kQueryTile, D), where not in place
  std::vector<Accum> dk, dv; // D and Dv features of the task's keys, where not in place
};

template <typename Operands>
TiledBackwardScratch<Operands> backward_scratch(
    const TiledInputs<Operands>& in,
    int64_t keys_per_task) {
  using Accum = typename Operands::Accum;
  const int64_t rows = std::min(kQueryTile, in.L);
  const auto options = torch::dtype(c10::CppTypeToScalarType<Accum>::value);
  const auto tile = [&](WorkspaceSlot slot) {
    return OwnedMatrix<Accum>(spread_workspace_tensor(slot, {rows, in.key_block}, options));
  };
  const auto own = [](int64_t n) {
    return std::vector<Accum>(static_cast<size_t>(Operands::kAccumulatesInPlace ? 0 : n));
  };
  return TiledBackwardScratch<Operands>{
      tile(WorkspaceSlot::tile_scores),
      tile(WorkspaceSlot::tile_grad_scores),
      in.modifiers.bends_scores() ? tile(WorkspaceSlot::tile_score_slopes)
                                  : OwnedMatrix<Accum>(torch::empty({0, 0}, options)),
      std::vector<Accum>(static_cast<size_t>(kQueryTile)),
      std::vector<Accum>(static_cast<size_t>(3 * in.Dv)),
      TileBands{},
      in.products.scratch(rows, in.key_block),
      own(rows * in.D),
      own(in.D * keys_per_task),
      own(in.Dv * keys_per_task)};
}

// One query tile of a backward task: where it is, the rows it reads, and
// where its dQ accumulates.
template <typename Operands>
struct TiledBackwardTile {
  QueryTile tile;
  int64_t task;
  int64_t keys_begin; // the task's first key: the first of the task's dk and dv
  MatrixRef<typename Operands::Element> grad_out;
  const typename Operands::Accum* lse;
  MatrixRef<typename Operands::Accum> dq;
};

// The tile's operands (Operands::start_tile) and its rows' delta_i =
// Σ_d dO_id · O_id, in Accum: O the output plus what its rounding lost
// where the forward kept it.
template <typename Operands>
void start_backward_tile(
    const TiledInputs<Operands>& in,
    const TiledBackwardTensors<typename Operands::Element, typename Operands::Accum>& t,
    TiledBackwardScratch<Operands>& scratch,
    const TiledBackwardTile<Operands>& bt) {
  using Accum = typename Operands::Accum;
  const QueryTile& tile = bt.tile;
  in.products.start_tile(scratch.operands, tile, bt.grad_out);
  const auto out = t.out.head(tile.b, tile.h).row_block(tile.i0, tile.rows);
  const auto rounding = t.out_rounding.head(tile.b, tile.h).row_block(tile.i0, tile.rows);
  Accum* go_row = scratch.widened.data();
  Accum* out_row = go_row + in.Dv;
  Accum* rounding_row = out_row + in.Dv;
  for (int64_t r = 0; r < tile.rows; ++r) {
    in.products.widen_row(bt.grad_out.row(r), in.Dv, go_row);
    in.products.widen_row(out.row(r), in.Dv, out_row);
    if (rounding.data != nullptr) {
      in.products.widen_row(rounding.row(r), in.Dv, rounding_row);
      for (int64_t d = 0; d < in.Dv; ++d) {
        out_row[d] += rounding_row[d];
      }
    }
    Accum delta = 0;
    for (int64_t d = 0; d < in.Dv; ++d) {
      delta += go_row[d] * out_row[d];
    }
    scratch.delta[r] = delta;
  }
}

// Keys [column, column + cols) of a task's key-gradient accumulator of
// `features` per key, `keys` keys in all: features × keys where
// Operands::kKeyGradientsTransposed, else keys × features.
template <typename Operands>
MatrixRef<typename Operands::Accum> key_gradient_block(
    std::vector<typename Operands::Accum>& accumulator,
    int64_t features,
    int64_t keys,
    int64_t column,
    int64_t cols) {
  if constexpr (Operands::kKeyGradientsTransposed) {
    return {accumulator.data() + column, features, cols, keys};
  } else {
    return {accumulator.data() + column * features, cols, features, features};
  }
}

// How a backward block adds into dQ, dK and dV: where the policy
// accumulates in place, the products scale dQ and dK, and the first block
// of a tile writes dQ (`first`), as the first share of a key row writes
// dK and dV where `writes_key_rows`; else each adds, unscaled, into
// memory that starts at zero.
struct BlockAccumulation {
  Accumulate dq, dk, dv;
};
template <typename Operands>
BlockAccumulation block_accumulation(double scale, bool first, bool writes_key_rows) {
  if constexpr (Operands::kAccumulatesInPlace) {
    const double key_beta = writes_key_rows ? 0.0 : 1.0;
    return {{scale, first ? 0.0 : 1.0}, {scale, key_beta}, {1.0, key_beta}};
  } else {
    return {};
  }
}

// One query tile against keys [j0, j0 + cols), in the bands its products
// compute (TileBands): P recomputed, dP = dO Vᵀ, dS through the row
// passes, and their products added to dQ, dK and dV (`dk`, `dv`: the
// block's rows or columns of the task's accumulators).
template <typename Operands>
void backward_block(
    const TiledInputs<Operands>& in,
    const TiledBackwardTensors<typename Operands::Element, typename Operands::Accum>& t,
    TiledBackwardScratch<Operands>& scratch,
    const TiledBackwardTile<Operands>& bt,
    int64_t j0,
    int64_t cols,
    const MatrixRef<typename Operands::Accum>& dk,
    const MatrixRef<typename Operands::Accum>& dv,
    const BlockAccumulation& how) {
  using Accum = typename Operands::Accum;
  const QueryTile& tile = bt.tile;
  const int64_t rows = tile.rows;
  const auto p = scratch.probs.matrix.row_block(0, rows).column_block(0, cols);
  const auto ds = scratch.grad_scores.matrix.row_block(0, rows).column_block(0, cols);
  const bool bent = in.modifiers.bends_scores();
  const auto slopes = bent ? scratch.score_slopes.matrix.row_block(0, rows).column_block(0, cols)
                           : MatrixRef<Accum>{};
  auto& bands = scratch.bands;
  auto& operands = scratch.operands;
  bands.fit_queries(in.mask, tile, j0, cols, in.products.computes_bands(operands, tile, j0, p));
  bands.fit_keys(rows, cols);
  const auto& keys_of = bands.keys_of_query_block;

  in.products.score(operands, tile, j0, p, bands);
  backward_probability_rows<Accum>(in, tile, p, slopes, j0, bt.lse, keys_of);
  // dV += Pᵀ dO, with P as the forward multiplied it into V: dropped,
  // where dropout is, by the row pass below.
  const auto add_value_gradient = [&] {
    in.products.add_value_gradient(operands, p, dv, bands, how.dv);
  };
  if (!in.dropout.active()) {
    add_value_gradient();
  }
  in.products.grad_weights(operands, tile, j0, bt.grad_out, ds, bands); // dP = dO Vᵀ
  softmax_backward_rows<Accum>(in, tile, p, ds, j0, scratch.delta, keys_of);
  if (in.dropout.active()) {
    add_value_gradient();
  }
  if (bent || t.modifiers.any()) {
    modifier_backward_rows<Accum>(in, t.modifiers, tile, bt.task, ds, slopes, j0, keys_of);
  }
  in.products.add_query_gradient(operands, tile, j0, ds, bt.dq, bands, how.dq); // dQ += dS K
  in.products.add_key_gradient(operands, ds, dk, bands, how.dk);                // dK += dSᵀ Q
}

// dst (rows × cols, Element or Accum) = factor · srcᵀ, src (cols × rows,
// rows `ld` apart): kTransposeRows rows at a time, each read in runs of
// src's rows and transposed through a block, then stored whole.
template <typename Operands, typename T>
void write_transposed(
    const Operands& products,
    const MatrixRef<T>& dst,
    const typename Operands::Accum* src,
    int64_t ld,
    typename Operands::Accum factor) {
  constexpr int64_t kTransposeRows = 16;
  std::vector<typename Operands::Accum> block(static_cast<size_t>(kTransposeRows * dst.cols));
  for (int64_t r0 = 0; r0 < dst.rows; r0 += kTransposeRows) {
    const int64_t n = std::min(kTransposeRows, dst.rows - r0);
    for (int64_t c = 0; c < dst.cols; ++c) {
      const auto* from = src + c * ld + r0;
      for (int64_t k = 0; k < n; ++k) {
        block[static_cast<size_t>(k * dst.cols + c)] = factor * from[k];
      }
    }
    for (int64_t k = 0; k < n; ++k) {
      store_row(products, block.data() + k * dst.cols, dst.cols, dst.row(r0 + k));
    }
  }
}

// dst (n keys × features, Element or Accum) = factor · the task's
// accumulator `src` of `keys` keys (key_gradient_block's layout), which
// may be scaled in place.
template <typename Operands, typename T>
void write_key_gradient(
    const Operands& products,
    const MatrixRef<T>& dst,
    typename Operands::Accum* src,
    int64_t keys,
    typename Operands::Accum factor) {
  if constexpr (Operands::kKeyGradientsTransposed) {
    write_transposed(products, dst, src, keys, factor);
  } else {
    write_scaled(products, dst, src, factor);
  }
}

// Rows [first, first + n) of head (b, h) of a key or value gradient
// (Element, or Accum where grouped heads' gradients are summed after) =
// factor · the task's accumulator `src` of `keys` keys.
template <typename Operands>
void write_key_rows(
    const Operands& products,
    const torch::Tensor& grad,
    int64_t b,
    int64_t h,
    int64_t first,
    int64_t n,
    typename Operands::Accum* src,
    int64_t keys,
    typename Operands::Accum factor) {
  using Element = typename Operands::Element;
  using Accum = typename Operands::Accum;
  if (grad.scalar_type() == c10::CppTypeToScalarType<Accum>::value) {
    write_key_gradient(
        products, Heads<Accum>(grad).head(b, h).row_block(first, n), src, keys, factor);
  } else {
    write_key_gradient(
        products, Heads<Element>(grad).head(b, h).row_block(first, n), src, keys, factor);
  }
}

// Where a backward task's dK and dV accumulate, and how it finishes them:
// in the gradients' rows of its keys (zeroed first unless each row gets
// one share, written by `writes_key_rows`) where the policy accumulates in
// place, else in the task's memory, zeroed, then written once.
template <typename Operands>
struct KeyGradientRows {
  using Accum = typename Operands::Accum;
  const TiledInputs<Operands>& in;
  const TiledBackwardTensors<typename Operands::Element, Accum>& t;
  TiledBackwardScratch<Operands>& scratch;
  int64_t b, h, keys_begin, keys_end, keys_per_task;
  bool writes_key_rows;

  // Rows [first, last) of the gradients of the task's head, zeroed.
  void zero(int64_t first, int64_t last) const {
    if constexpr (Operands::kAccumulatesInPlace) {
      if (first < last) {
        zero_matrix(Heads<Accum>(t.dk).head(b, h).row_block(first, last - first));
        zero_matrix(Heads<Accum>(t.dv).head(b, h).row_block(first, last - first));
      }
    }
  }

  void start() const {
    if constexpr (Operands::kAccumulatesInPlace) {
      if (!writes_key_rows) {
        zero(keys_begin, keys_end);
      }
    } else {
      std::fill(scratch.dk.begin(), scratch.dk.end(), Accum(0));
      std::fill(scratch.dv.begin(), scratch.dv.end(), Accum(0));
    }
  }

  // The accumulators of keys [j0, j0 + cols).
  MatrixRef<Accum> dk(int64_t j0, int64_t cols) const {
    return block(t.dk, scratch.dk, in.D, j0, cols);
  }
  MatrixRef<Accum> dv(int64_t j0, int64_t cols) const {
    return block(t.dv, scratch.dv, in.Dv, j0, cols);
  }

  void finish() const {
    if constexpr (!Operands::kAccumulatesInPlace) {
      const int64_t n = keys_end - keys_begin;
      write_key_rows(
          in.products, t.dk, b, h, keys_begin, n, scratch.dk.data(), keys_per_task,
          static_cast<Accum>(in.scale));
      write_key_rows(
          in.products, t.dv, b, h, keys_begin, n, scratch.dv.data(), keys_per_task, Accum(1));
    }
  }

 private:
  MatrixRef<Accum> block(
      const torch::Tensor& grad,
      std::vector<Accum>& own,
      int64_t features,
      int64_t j0,
      int64_t cols) const {
    if constexpr (Operands::kAccumulatesInPlace) {
      return Heads<Accum>(grad).head(b, h).row_block(j0, cols);
    } else {
      return key_gradient_block<Operands>(own, features, keys_per_task, j0 - keys_begin, cols);
    }
  }
};

// One query tile of a backward task, against the task's keys that it
// sees: its dQ accumulated in its rows of dq (of the task's part of it,
// dq_parts, where a head's keys are split) where the policy accumulates
// in place, else in the task's memory, written once (and scaled) after.
template <typename Operands>
void backward_tile(
    const TiledInputs<Operands>& in,
    const TiledBackwardTensors<typename Operands::Element, typename Operands::Accum>& t,
    TiledBackwardScratch<Operands>& scratch,
    const KeyGradientRows<Operands>& key_rows,
    const QueryTile& tile,
    int64_t unit,
    int64_t split,
    const Heads<typename Operands::Element>& dq_heads,
    const torch::Tensor& dq_parts) {
  using Accum = typename Operands::Accum;
  // Plain locals: a C++17 lambda captures no structured binding.
  const int64_t b = tile.b, h = tile.h, i0 = tile.i0, rows = tile.rows;
  const int64_t begin = std::max(key_rows.keys_begin, in.mask.tile_key_begin(i0));
  const int64_t end = std::max(begin, std::min(key_rows.keys_end, in.mask.tile_key_end(i0, rows)));
  const auto next_keys = [&](int64_t from) {
    return in.mask.next_keys(b, h, i0, from, end, in.key_block);
  };
  const IndexRange first = next_keys(begin);
  if (key_rows.writes_key_rows) { // the keys no query sees
    key_rows.zero(key_rows.keys_begin, begin);
    key_rows.zero(end, key_rows.keys_end);
  }
  const MatrixRef<Accum> part = dq_parts.defined()
      ? MatrixRef<
            Accum>{dq_parts.data_ptr<Accum>() + (((split * in.B + b) * in.H + h) * in.L + i0) * in.D, rows, in.D, in.D}
      : MatrixRef<Accum>{};
  MatrixRef<Accum> dq;
  if constexpr (Operands::kAccumulatesInPlace) {
    dq = part.data != nullptr ? part : dq_heads.head(b, h).row_block(i0, rows);
  } else {
    dq = {scratch.dq.data(), rows, in.D, in.D};
    std::fill(scratch.dq.begin(), scratch.dq.end(), Accum(0));
  }
  if (first.begin < first.end) {
    const TiledBackwardTile<Operands> bt{
        tile,
        unit,
        key_rows.keys_begin,
        t.grad_out.head(b, h).row_block(i0, rows),
        t.lse + (b * in.H + h) * in.L + i0,
        dq};
    start_backward_tile(in, t, scratch, bt);
    for (auto keys = first; keys.begin < keys.end; keys = next_keys(keys.end)) {
      const int64_t cols = keys.end - keys.begin;
      backward_block(
          in, t, scratch, bt, keys.begin, cols, key_rows.dk(keys.begin, cols),
          key_rows.dv(keys.begin, cols),
          block_accumulation<Operands>(
              in.scale, keys.begin == first.begin, key_rows.writes_key_rows));
    }
  } else if constexpr (Operands::kAccumulatesInPlace) {
    zero_matrix(dq); // a tile that sees none of these keys
  }
  if constexpr (!Operands::kAccumulatesInPlace) {
    const auto factor = static_cast<Accum>(in.scale);
    if (part.data != nullptr) {
      write_scaled(in.products, part, scratch.dq.data(), factor);
    } else {
      write_scaled(in.products, dq_heads.head(b, h).row_block(i0, rows), scratch.dq.data(), factor);
    }
  }
}

// Backward: a task takes one range of keys of one (b, h), accumulates
// their dK and dV (KeyGradientRows); where a head's keys are split, each
// range writes its share of dQ into a buffer (Accum) of its own, summed
// into dq at the end. No accumulation races.
template <typename Operands>
void tiled_backward_loops(
    const TiledInputs<Operands>& in,
    const ForwardResult& forward,
    const torch::Tensor& grad_out,
    const InputGradients& grads) {
  using Element = typename Operands::Element;
  using Accum = typename Operands::Accum;
  const int64_t splits = backward_key_splits(in.B * in.H, in.S, in.key_block);
  const ScoreGradientBuffers<Accum> score_grads(in, grads, splits);
  const TiledBackwardTensors<Element, Accum> t{
      Heads<Element>(forward.out),
      Heads<Element>(grad_out),
      heads_if_defined<Element>(forward.out_rounding),
      forward.lse.data_ptr<Accum>(),
      grads.dk,
      grads.dv,
      score_grads.for_tasks()};
  const int64_t keys_per_split = ceil_div(ceil_div(in.S, in.key_block), splits) * in.key_block;
  const int64_t keys_per_task = std::min(in.S, keys_per_split);
  const auto accum_options = torch::dtype(c10::CppTypeToScalarType<Accum>::value);
  const torch::Tensor dq_parts = splits == 1
      ? torch::Tensor()
      : torch::empty({splits, in.B, in.H, in.L, in.D}, accum_options);
  const Heads<Element> dq_heads(grads.dq);
  // With one query tile per head and no blocks to skip, every row of dK
  // and dV gets at most one share, which writes it (zeroing them first
  // took 6 % of the step at T = 128).
  const bool writes_key_rows = Operands::kAccumulatesInPlace && in.L > 0 && in.L <= kQueryTile &&
      in.mask.blocks.kinds == nullptr;
  // Five GEMMs of L·S·D per head.
  const double flops_per_task = 10.0 * in.L * in.S * in.D / static_cast<double>(splits);
  parallel_units(
      in.B * in.H * splits, flops_per_task, [&] { return backward_scratch(in, keys_per_task); },
      [&](TiledBackwardScratch<Operands>& scratch, int64_t unit) {
        const int64_t b = unit / (in.H * splits), h = unit / splits % in.H, split = unit % splits;
        const int64_t keys_begin = std::min(in.S, split * keys_per_split);
        const int64_t keys_end = std::min(in.S, keys_begin + keys_per_split);
        const KeyGradientRows<Operands> key_rows{
            in, t, scratch, b, h, keys_begin, keys_end, keys_per_task, writes_key_rows};
        key_rows.start();
        for (int64_t i0 = 0; i0 < in.L; i0 += kQueryTile) {
          const QueryTile tile{b, h, i0, std::min(kQueryTile, in.L - i0)};
          backward_tile(in, t, scratch, key_rows, tile, unit, split, dq_heads, dq_parts);
        }
        key_rows.finish();
      });
  if (splits > 1) {
    grads.dq.copy_(dq_parts.sum(0));
  }
  score_grads.finish(grads);
}

} // namespace attn::detail
