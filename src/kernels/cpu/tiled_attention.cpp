#include "kernels/cpu/tiled_attention.h"

#include "kernels/cpu/heads.h"
#include "kernels/cpu/tiled_loops.h"

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace attn::detail {
namespace {

static_assert(kQueryTile == MaskBlocks::kRows, "a query tile is a row of mask blocks");

// tᵀ over its last two dimensions, for the products that read it as their
// right operand (scores = Q Kᵀ, dP = dO Vᵀ): tile_addmm reads that operand
// by rows, so its rows are made contiguous once per call, where attn's own
// products run and each row of Kᵀ is read by at least kMinRowsForCopy
// queries (a decoding step's one query would pay as much for the copy as
// for the product). BLAS reads the transposed view as it is.
constexpr int64_t kMinRowsForCopy = 16;

torch::Tensor transposed_for_products(
    const CpuLoops& loops,
    const torch::Tensor& t,
    int64_t queries,
    WorkspaceSlot slot) {
  if (queries < kMinRowsForCopy || !tile_products_run(loops, t.scalar_type())) {
    return t.transpose(2, 3);
  }
  const auto copy = spread_workspace_tensor(
      slot, {t.size(0), t.size(1), t.size(3), t.size(2)}, t.options());
  if (t.numel() > 0) {
    transpose_heads(loops, t, copy);
  }
  return copy;
}

// What the tiled loops read: the request's inputs (B, H, L, D),
// (B, Hkv, S, D), (B, Hkv, S, Dv), Kᵀ for the products, and what applies
// to each row of scores (RowInputs).
template <typename scalar_t>
struct KernelInputs : RowInputs<scalar_t> {
  KernelInputs(const AttentionParams& params, const CpuLoops& loops)
      : RowInputs<scalar_t>(params, loops),
        q(params.q),
        k(params.k),
        v(params.v),
        k_t(transposed_for_products(loops, k, params.L(), WorkspaceSlot::keys_transposed)),
        q_heads(q),
        k_heads(k),
        v_heads(v),
        k_t_heads(k_t) {}

  torch::Tensor q, k, v;
  torch::Tensor k_t; // Kᵀ (B, Hkv, D, S), see transposed_for_products
  Heads<scalar_t> q_heads, k_heads, v_heads, k_t_heads;
};

// A task's (kQueryTile, key_block) tile of scores or their gradients, over
// this thread's workspace, its rows spread over the cache sets (the
// backward reads it down its columns).
template <typename scalar_t>
OwnedMatrix<scalar_t> tile_matrix(WorkspaceSlot slot, const KernelInputs<scalar_t>& in) {
  return OwnedMatrix<scalar_t>(
      spread_workspace_tensor(slot, {std::min(kQueryTile, in.L), in.key_block}, in.q.options()));
}

// A forward task's working memory: one tile's scores and its rows' online
// softmax.
template <typename scalar_t>
struct ForwardScratch {
  OwnedMatrix<scalar_t> scores; // (kQueryTile, key_block)
  OnlineSoftmax<scalar_t> softmax;
  TileBands bands;
};

// Forward: out (B, H, L, Dv) and the row log-sum-exp lse (B, H, L),
// contiguous.
template <typename scalar_t>
void flash_forward(const KernelInputs<scalar_t>& in, const ForwardResult& result) {
  const torch::Tensor& out = result.out;
  const torch::Tensor& lse = result.lse;
  const int64_t Dv = in.v.size(3);
  const Heads<scalar_t> out_heads(out);
  scalar_t* const lse_data = lse.data_ptr<scalar_t>();

  const auto make_scratch = [&] {
    return ForwardScratch<scalar_t>{
        tile_matrix<scalar_t>(WorkspaceSlot::tile_scores, in), OnlineSoftmax<scalar_t>{},
        TileBands{}};
  };
  const double flops_per_tile = 2.0 * std::min(kQueryTile, in.L) * in.S * (in.q.size(3) + Dv);
  parallel_query_tiles(
      in.B, in.H, in.L, kQueryTile, flops_per_tile, make_scratch,
      [&](ForwardScratch<scalar_t>& scratch, const QueryTile& tile) {
        const auto [b, h, i0, rows] = tile;
        const auto q_tile = in.q_heads.head(b, h).row_block(i0, rows);  // (rows, D)
        const auto out_tile = out_heads.head(b, h).row_block(i0, rows); // (rows, Dv)
        zero_matrix(out_tile);
        scratch.softmax.start(in.modifiers.sink(h));

        const auto k_t_head = in.k_t_heads.head(b, h / in.group);
        const auto v_head = in.v_heads.head(b, h / in.group);
        const int64_t key_end = in.mask.tile_key_end(tile.i0, tile.rows);
        const auto next_keys = [&](int64_t from) {
          return in.mask.next_keys(tile.b, tile.h, tile.i0, from, key_end, in.key_block);
        };
        for (auto keys = next_keys(in.mask.tile_key_begin(tile.i0)); keys.begin < keys.end;
             keys = next_keys(keys.end)) {
          const int64_t j0 = keys.begin, cols = keys.end - keys.begin;
          const auto block = scratch.scores.matrix.row_block(0, rows).column_block(0, cols);
          const auto k_t_block = k_t_head.column_block(j0, cols);
          const auto& keys_of = scratch.bands.keys_of_query_block;
          scratch.bands.fit_queries(
              in.mask, tile, j0, cols, tile_loops_take(in.loops, block, q_tile, k_t_block, 0));
          tile_addmm_banded(
              in.loops, block, q_tile, k_t_block, 0, in.scale, ProductBand::columns, keys_of);
          for (int64_t r = 0; r < rows; ++r) {
            const auto [begin, end] = keys_of[r / kProductRowBlock];
            forward_row<scalar_t>(
                in, scratch.softmax, tile, r, j0 + begin, block.row(r) + begin, end - begin,
                out_tile.row(r), Dv);
          }
          tile_addmm_banded(
              in.loops, out_tile, block, v_head.row_block(j0, cols), 1, 1, ProductBand::depth,
              keys_of);
        }

        scalar_t* lse_row = lse_data + (b * in.H + h) * in.L + i0;
        for (int64_t r = 0; r < rows; ++r) {
          scale_row(out_tile.row(r), Dv, scratch.softmax.output_factor(r, in.keep_scale));
          lse_row[r] = scratch.softmax.lse(r);
        }
      });
}

// A backward task's working memory: one tile's probabilities and their
// gradients, and its rows' softmax-backward terms.
template <typename scalar_t>
struct BackwardScratch {
  OwnedMatrix<scalar_t> probs, grad_scores; // (kQueryTile, key_block)
  OwnedMatrix<scalar_t> score_slopes;       // (kQueryTile, key_block), see ModifierView
  std::vector<scalar_t> delta;              // (kQueryTile), see fill_row_deltas
  TileBands bands;
  std::vector<scalar_t> query_rows, grad_out_rows; // see compact_rows
};

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

// One query tile of the backward: where it is, which task computes it,
// its rows of Q and dO (see compact_rows) and its rows of dQ.
template <typename scalar_t>
struct BackwardTile {
  QueryTile tile;
  int64_t task;
  MatrixRef<scalar_t> q, grad_out, dq;
};

// What the backward reads besides the inputs, and the key/value gradients
// it accumulates.
template <typename scalar_t>
struct BackwardTensors {
  Heads<scalar_t> out, grad_out; // (B, H, L, Dv), rows of unit stride
  Heads<scalar_t> v_t;           // Vᵀ (B, Hkv, Dv, S), see transposed_for_products
  const scalar_t* lse;           // (B, H, L), contiguous
  Heads<scalar_t> dk, dv;        // (B, H, S, ·)
  ModifierGradients<scalar_t> modifiers;
};

// delta_i = Σ_d dO_id · O_id = Σ_j P_ij dP_ij, the softmax backward's row
// term, for the tile's rows: once per tile, not once per key block.
template <typename scalar_t>
void fill_row_deltas(
    const BackwardTensors<scalar_t>& t,
    const QueryTile& tile,
    std::vector<scalar_t>& delta) {
  const auto out = t.out.head(tile.b, tile.h).row_block(tile.i0, tile.rows);
  const auto grad_out = t.grad_out.head(tile.b, tile.h).row_block(tile.i0, tile.rows);
  if (out.data == nullptr) { // no values: every term is 0
    std::fill(delta.begin(), delta.begin() + tile.rows, scalar_t(0));
    return;
  }
  for (int64_t r = 0; r < tile.rows; ++r) {
    const scalar_t* out_row = out.row(r);
    const scalar_t* grad_row = grad_out.row(r);
    scalar_t sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t d = 0; d < out.cols; ++d) {
      sum += out_row[d] * grad_row[d];
    }
    delta[r] = sum;
  }
}

// How backward_block's products treat the gradients: 0 writes the block's
// share over what the rows held, 1 adds it.
struct GradientBetas {
  double dq = 1, dk_dv = 1;
};

// One query tile against keys [j0, j0 + cols): recomputes the tile's
// probabilities P and adds its shares of dV, dQ and dK, or writes them, as
// `betas` say.
template <typename scalar_t>
void backward_block(
    const KernelInputs<scalar_t>& in,
    const BackwardTensors<scalar_t>& t,
    BackwardScratch<scalar_t>& scratch,
    const BackwardTile<scalar_t>& query_tile,
    int64_t j0,
    int64_t cols,
    const GradientBetas& betas) {
  const QueryTile& tile = query_tile.tile;
  const auto [b, h, i0, rows] = tile;
  const int64_t kv_head = h / in.group;
  const auto& q_tile = query_tile.q;
  const auto& go_tile = query_tile.grad_out;
  const auto& dq_tile = query_tile.dq;
  const scalar_t* lse_rows = t.lse + (b * in.H + h) * in.L + i0;
  const auto p = scratch.probs.matrix.row_block(0, rows).column_block(0, cols);
  const auto ds = scratch.grad_scores.matrix.row_block(0, rows).column_block(0, cols);

  // P = exp(scale·Q Kᵀ + mask - lse), the forward's probabilities.
  const auto k_t_block = in.k_t_heads.head(b, kv_head).column_block(j0, cols);
  scratch.bands.fit_queries(
      in.mask, tile, j0, cols, tile_loops_take(in.loops, p, q_tile, k_t_block, 0));
  scratch.bands.fit_keys(rows, cols);
  const auto& keys_of = scratch.bands.keys_of_query_block;
  const auto& queries_of = scratch.bands.queries_of_key_block;
  tile_addmm_banded(in.loops, p, q_tile, k_t_block, 0, in.scale, ProductBand::columns, keys_of);
  const bool bent = in.modifiers.bends_scores();
  const auto slopes = bent ? scratch.score_slopes.matrix.row_block(0, rows).column_block(0, cols)
                           : MatrixRef<scalar_t>{};
  backward_probability_rows(in, tile, p, slopes, j0, lse_rows, keys_of);
  // dV += Pᵀ dO, with P as the forward multiplied it into V: dropped,
  // where dropout is, by the row pass below.
  // Named here: a C++17 lambda captures no structured binding (b, h).
  const auto dv_block = t.dv.head(b, h).row_block(j0, cols);
  const auto add_value_gradient = [&] {
    tile_addmm_banded(
        in.loops, dv_block, p.transposed(), go_tile, betas.dk_dv, 1, ProductBand::depth,
        queries_of);
  };
  if (!in.dropout.active()) {
    add_value_gradient();
  }
  tile_addmm_banded(
      in.loops, ds, go_tile, t.v_t.head(b, kv_head).column_block(j0, cols), 0, 1,
      ProductBand::columns, keys_of); // dP = dO Vᵀ
  softmax_backward_rows(in, tile, p, ds, j0, scratch.delta, keys_of);
  if (in.dropout.active()) {
    add_value_gradient();
  }
  if (bent || t.modifiers.any()) {
    modifier_backward_rows(in, t.modifiers, tile, query_tile.task, ds, slopes, j0, keys_of);
  }
  const auto k_block = in.k_heads.head(b, kv_head).row_block(j0, cols);
  tile_addmm_banded(
      in.loops, dq_tile, ds, k_block, betas.dq, in.scale, ProductBand::depth,
      keys_of); // dQ += s·dS K
  tile_addmm_banded(
      in.loops, t.dk.head(b, h).row_block(j0, cols), ds.transposed(), q_tile, betas.dk_dv, in.scale,
      ProductBand::depth, queries_of); // dK += s·dSᵀ Q
}

// A backward task's scratch: two score tiles, and a third for the
// scores' derivatives where they pass through a function (ModifierView).
template <typename scalar_t>
BackwardScratch<scalar_t> backward_scratch(const KernelInputs<scalar_t>& in) {
  return BackwardScratch<scalar_t>{
      tile_matrix<scalar_t>(WorkspaceSlot::tile_scores, in),
      tile_matrix<scalar_t>(WorkspaceSlot::tile_grad_scores, in),
      in.modifiers.bends_scores() ? tile_matrix<scalar_t>(WorkspaceSlot::tile_score_slopes, in)
                                  : OwnedMatrix<scalar_t>(torch::empty({0, 0}, in.q.options())),
      std::vector<scalar_t>(kQueryTile),
      TileBands{},
      {},
      {}};
}

// Backward: writes dq, dk, dv ((B, H, ·, ·), rows of unit stride: one
// key/value gradient per query head, which grouped-query callers sum). A
// task takes one range of keys of one (b, h) and owns their rows of dK and
// dV, which it accumulates into while they are in its cache; where a
// head's keys are split, each range writes its share of dQ into a buffer
// of its own, summed into dq at the end. No accumulation races.
template <typename scalar_t>
void flash_backward(
    const KernelInputs<scalar_t>& in,
    const ForwardResult& forward,
    const torch::Tensor& grad_out,
    const InputGradients& grads) {
  const auto v_t = transposed_for_products(in.loops, in.v, in.L, WorkspaceSlot::values_transposed);
  const int64_t splits = backward_key_splits(in.B * in.H, in.S, in.key_block);
  const ScoreGradientBuffers<scalar_t> score_grads(in, grads, splits);
  const BackwardTensors<scalar_t> t{Heads<scalar_t>(forward.out), Heads<scalar_t>(grad_out),
                                    Heads<scalar_t>(v_t),         forward.lse.data_ptr<scalar_t>(),
                                    Heads<scalar_t>(grads.dk),    Heads<scalar_t>(grads.dv),
                                    score_grads.for_tasks()};
  const int64_t keys_per_split = ceil_div(ceil_div(in.S, in.key_block), splits) * in.key_block;
  const auto dq_parts = splits == 1
      ? grads.dq.unsqueeze(0)
      : torch::empty({splits, in.B, in.H, in.L, in.q.size(3)}, grads.dq.options());
  std::vector<Heads<scalar_t>> dq_of_split;
  dq_of_split.reserve(splits);
  for (int64_t split = 0; split < splits; ++split) {
    dq_of_split.emplace_back(dq_parts[split]);
  }

  const auto make_scratch = [&] { return backward_scratch(in); };

  // Each task writes its tiles' rows of dQ with their first key block and
  // adds the others'. With one query tile per head and no blocks to skip,
  // every row of dK and dV gets at most one share, which it writes; else
  // the task zeroes its rows first and adds each tile's share. (Zeroing
  // all three took 6 % of the step at T = 128.)
  const bool writes_key_rows = in.L > 0 && in.L <= kQueryTile && in.mask.blocks.kinds == nullptr;
  // Five GEMMs of L·S·D per head.
  const double flops_per_task = 10.0 * in.L * in.S * in.q.size(3) / static_cast<double>(splits);
  parallel_units(
      in.B * in.H * splits, flops_per_task, make_scratch,
      [&](BackwardScratch<scalar_t>& scratch, int64_t unit) {
        const int64_t b = unit / (in.H * splits), h = unit / splits % in.H, split = unit % splits;
        const int64_t keys_begin = split * keys_per_split;
        const int64_t keys_end = std::min(in.S, keys_begin + keys_per_split);
        const auto dq_head = dq_of_split[split].head(b, h);
        const auto zero_key_rows = [&](int64_t first, int64_t last) {
          if (first < last) {
            zero_matrix(t.dk.head(b, h).row_block(first, last - first));
            zero_matrix(t.dv.head(b, h).row_block(first, last - first));
          }
        };
        if (!writes_key_rows) {
          zero_key_rows(keys_begin, keys_end);
        }
        for (int64_t i0 = 0; i0 < in.L; i0 += kQueryTile) {
          const QueryTile tile{b, h, i0, std::min(kQueryTile, in.L - i0)};
          const auto dq_tile = dq_head.row_block(i0, tile.rows);
          const int64_t begin = std::max(keys_begin, in.mask.tile_key_begin(i0));
          const int64_t end = std::max(
              begin, std::min(keys_end, in.mask.tile_key_end(i0, tile.rows)));
          const auto next_keys = [&](int64_t from) {
            return in.mask.next_keys(b, h, i0, from, end, in.key_block);
          };
          const IndexRange first = next_keys(begin);
          if (writes_key_rows) { // the keys no query sees
            zero_key_rows(keys_begin, begin);
            zero_key_rows(end, keys_end);
          }
          if (first.begin == first.end) { // a tile that sees none of these keys
            zero_matrix(dq_tile);
            continue;
          }
          const BackwardTile<scalar_t> query_tile{
              tile, unit,
              compact_rows(in.q_heads.head(b, h).row_block(i0, tile.rows), scratch.query_rows),
              compact_rows(t.grad_out.head(b, h).row_block(i0, tile.rows), scratch.grad_out_rows),
              dq_tile};
          fill_row_deltas(t, tile, scratch.delta);
          for (auto keys = first; keys.begin < keys.end; keys = next_keys(keys.end)) {
            const GradientBetas betas{
                keys.begin == first.begin ? 0.0 : 1.0, writes_key_rows ? 0.0 : 1.0};
            backward_block(in, t, scratch, query_tile, keys.begin, keys.end - keys.begin, betas);
          }
        }
      });
  if (splits > 1) {
    grads.dq.copy_(dq_parts.sum(0));
  }
  score_grads.finish(grads);
}

// Weights materialised in (B, H, L, S): each query tile's rows are scored
// straight into the output, normalised in place and multiplied into V.
template <typename scalar_t>
void forward_with_weights(const KernelInputs<scalar_t>& in, const ForwardResult& result) {
  const Heads<scalar_t> out_heads(result.out), weight_heads(result.weights);
  scalar_t* lse = result.lse.data_ptr<scalar_t>(); // (B, H, L), contiguous
  const auto no_scratch = [] { return 0; };
  const double flops_per_tile = 2.0 * std::min(kQueryTile, in.L) * in.S *
      (in.q.size(3) + in.v.size(3));
  parallel_query_tiles(
      in.B, in.H, in.L, kQueryTile, flops_per_tile, no_scratch,
      [&](int /*scratch*/, const QueryTile& tile) {
        const auto [b, h, i0, rows] = tile;
        const auto out_tile = out_heads.head(b, h).row_block(i0, rows);
        const auto w_tile = weight_heads.head(b, h).row_block(i0, rows); // (rows, S)
        scalar_t* tile_lse = lse + (b * in.H + h) * in.L + i0;
        const auto [key_begin, key_end] = start_weights_tile(in, tile, w_tile, out_tile, tile_lse);
        const int64_t cols = key_end - key_begin;
        if (cols == 0) {
          return;
        }
        const auto visible = w_tile.column_block(key_begin, cols);
        tile_addmm(
            in.loops, visible, in.q_heads.head(b, h).row_block(i0, rows),
            in.k_t_heads.head(b, h / in.group).column_block(key_begin, cols), 0, in.scale);
        for (int64_t r = 0; r < rows; ++r) {
          tile_lse[r] = weights_row<scalar_t>(in, b, h, i0 + r, key_begin, visible.row(r), cols);
        }
        tile_addmm(
            in.loops, out_tile, visible,
            in.v_heads.head(b, h / in.group).row_block(key_begin, cols), 0, 1);
      });
}

} // namespace

void tiled_forward(
    const CpuLoops& loops,
    const AttentionParams& params,
    const ForwardResult& result) {
  if (is_half_precision(params.q.scalar_type())) {
    TORCH_INTERNAL_ASSERT(
        tiled_forward_half(loops, params, result), "no half-precision products on these loops");
    return;
  }
  AT_DISPATCH_FLOATING_TYPES(params.q.scalar_type(), "tiled_forward", [&] {
    flash_forward<scalar_t>(KernelInputs<scalar_t>(params, loops), result);
  });
}

void tiled_backward(
    const CpuLoops& loops,
    const AttentionParams& params,
    const ForwardResult& forward,
    const torch::Tensor& grad_out,
    const InputGradients& grads) {
  if (is_half_precision(params.q.scalar_type())) {
    TORCH_INTERNAL_ASSERT(
        tiled_backward_half(loops, params, forward, grad_out, grads),
        "no half-precision products on these loops");
    return;
  }
  AT_DISPATCH_FLOATING_TYPES(params.q.scalar_type(), "tiled_backward", [&] {
    flash_backward<scalar_t>(KernelInputs<scalar_t>(params, loops), forward, grad_out, grads);
  });
}

ForwardResult tiled_forward_with_weights(const CpuLoops& loops, const AttentionParams& params) {
  TORCH_INTERNAL_ASSERT(!params.dropout.active(), "the weights kernel drops no weights");
  auto contiguous = params;
  contiguous.q = params.q.contiguous();
  contiguous.k = params.k.contiguous();
  contiguous.v = params.v.contiguous();
  const int64_t B = params.B(), H = params.H(), L = params.L();
  const auto dtype = params.q.scalar_type();
  const bool half = is_half_precision(dtype);
  const ForwardResult result{
      empty_heads_interleaved(B, H, L, params.Dv(), params.q.options()),
      torch::empty({B, H, L}, params.q.options().dtype(half ? torch::kFloat : dtype)),
      torch::empty({B, H, L, params.S()}, params.q.options())};
  if (half) {
    TORCH_INTERNAL_ASSERT(
        tiled_forward_with_weights_half(loops, contiguous, result),
        "no half-precision products on these loops");
    return result;
  }
  AT_DISPATCH_FLOATING_TYPES(dtype, "tiled_forward_with_weights", [&] {
    forward_with_weights<scalar_t>(KernelInputs<scalar_t>(contiguous, loops), result);
  });
  return result;
}

} // namespace attn::detail
