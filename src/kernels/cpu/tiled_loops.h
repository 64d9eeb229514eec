#pragma once

// The row passes and tile structure of the tiled loops (tiled_template.h,
// one template over every element type's operand policy): the parallel
// loop over query tiles, the per-row inputs (mask, score modifiers,
// dropout), the forward's online softmax and the bands of a causal tile,
// all in float or double whatever the elements of Q, K and V.

#include "kernels/attention_params.h"
#include "kernels/cpu/dropout.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/mask_view.h"
#include "kernels/cpu/modifier_view.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/row_ops.h"
#include "kernels/cpu/tile_product.h"
#include "kernels/cpu/tiled_attention.h"
#include "kernels/cpu/workspace.h"
#include "runtime/threads.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace attn::detail {

inline int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// The kernels' parallel loop: `body(scratch, unit)` for units 0 .. units-1,
// with one `make_scratch()` per task. BLAS runs on one thread inside the
// tasks when they run in parallel (two pools on the same cores would
// contend), and as it is set when the loop runs inline.
template <typename MakeScratch, typename Body>
void parallel_units(
    int64_t units,
    double flops_per_unit,
    const MakeScratch& make_scratch,
    const Body& body) {
  const int64_t grain = parallel_grain(flops_per_unit, kMinTiledTaskFlops);
  c10::optional<ScopedSingleThreadedBlas> one_blas_thread_per_task;
  if (units > grain) {
    one_blas_thread_per_task.emplace();
  }
  parallel_for(0, units, grain, [&](int64_t begin, int64_t end) {
    // Grad mode is thread-local: worker threads start with it on.
    const torch::NoGradGuard no_grad;
    const ScopedSubnormalsAsZero flush; // isa.h: far keys' weights underflow
    auto scratch = make_scratch();
    for (int64_t unit = begin; unit < end; ++unit) {
      body(scratch, unit);
    }
  });
}

// One task's share of the forward: query rows [i0, i0 + rows) of head (b, h).
struct QueryTile {
  int64_t b = 0, h = 0, i0 = 0, rows = 0;
};

// parallel_units over every tile of `tile_rows` queries of every (b, h)
// head of a (B, H, L) grid: `body(scratch, tile)`.
template <typename MakeScratch, typename Body>
void parallel_query_tiles(
    int64_t B,
    int64_t H,
    int64_t L,
    int64_t tile_rows,
    double flops_per_tile,
    const MakeScratch& make_scratch,
    const Body& body) {
  const int64_t tiles = L > 0 ? ceil_div(L, tile_rows) : 0;
  parallel_units(B * H * tiles, flops_per_tile, make_scratch, [&](auto& scratch, int64_t unit) {
    const int64_t i0 = unit % tiles * tile_rows;
    body(scratch, QueryTile{unit / (H * tiles), unit / tiles % H, i0, std::min(tile_rows, L - i0)});
  });
}

// Zeroes a matrix whose rows have unit stride.
template <typename scalar_t>
void zero_matrix(const MatrixRef<scalar_t>& m) {
  if (m.data == nullptr) {
    return;
  }
  for (int64_t r = 0; r < m.rows; ++r) {
    std::fill(m.row(r), m.row(r) + m.cols, scalar_t(0));
  }
}

// A matrix over a tensor's memory, which the tensor keeps alive.
template <typename scalar_t>
struct OwnedMatrix {
  explicit OwnedMatrix(torch::Tensor memory)
      : memory(std::move(memory)), matrix(matrix_of<scalar_t>(this->memory)) {}
  torch::Tensor memory;
  MatrixRef<scalar_t> matrix;
};

// workspace_tensor of `sizes` whose rows (the last dimension) lie
// spread_row_stride apart: a view of a buffer with wider rows.
inline torch::Tensor spread_workspace_tensor(
    WorkspaceSlot slot,
    std::vector<int64_t> sizes,
    const torch::TensorOptions& options) {
  const int64_t cols = sizes.back();
  sizes.back() = spread_row_stride(cols, static_cast<int64_t>(options.dtype().itemsize()));
  return workspace_tensor(slot, sizes, options).narrow(-1, 0, cols);
}

// What the tiled loops apply to each row of scores, whatever the elements
// of Q, K and V: their sizes, the masks, the scale, the score modifiers and
// dropout, in scalar_t (float or double).
template <typename scalar_t>
struct RowInputs {
  RowInputs(const AttentionParams& params, const CpuLoops& loops)
      : loops(loops),
        B(params.B()),
        H(params.H()),
        L(params.L()),
        S(params.S()),
        group(params.group()),
        key_block(std::clamp<int64_t>(S, 1, kKeyBlock)),
        mask(params, loops),
        modifiers(params, loops),
        scale(static_cast<scalar_t>(params.scale)),
        dropout(params.dropout),
        dropout_stream(detail::dropout_stream(params.dropout)),
        keep_scale(static_cast<scalar_t>(dropout_keep_scale(params.dropout.p))) {}

  // The dropout stream of query i of head (b, h), from key j on.
  DropoutRow dropout_row(int64_t b, int64_t h, int64_t i, int64_t j) const {
    return detail::dropout_row(dropout_stream, b * H + h, i, S, j);
  }

  CpuLoops loops; // the call's plan's (kernel_plan.h)
  int64_t B, H, L, S;
  int64_t group;     // query heads per key/value head
  int64_t key_block; // keys scored per product
  MaskView<scalar_t> mask;
  ModifierView<scalar_t> modifiers;
  scalar_t scale;
  DropoutDraw dropout;
  DropoutRow dropout_stream; // the seed and threshold, taken once
  scalar_t keep_scale;       // the inverse of the keep probability (dropout.h): 1 without dropout
};

// A forward task's running maximum and sum of each row of its query tile
// (online softmax), over the blocks of keys seen so far.
template <typename scalar_t>
struct OnlineSoftmax {
  std::vector<scalar_t> running_max = std::vector<scalar_t>(kQueryTile);
  std::vector<scalar_t> running_sum = std::vector<scalar_t>(kQueryTile);

  // Before a tile's first block: a sink starts each row's softmax as a key
  // of weight exp(sink) would.
  void start(scalar_t sink) {
    std::fill(running_max.begin(), running_max.end(), sink);
    std::fill(
        running_sum.begin(), running_sum.end(),
        scalar_t(sink == kNegativeInfinity<scalar_t> ? 0 : 1));
  }

  // Folds one block of scores (row r of the tile, already masked) into
  // row r's running maximum and sum, turning the scores into
  // exp(score - max) and rescaling the output row accumulated under the
  // previous maximum.
  void fold(
      const CpuLoops& loops,
      int64_t r,
      scalar_t* row,
      int64_t cols,
      scalar_t* out_row,
      int64_t Dv) {
    scalar_t& max = running_max[r];
    const scalar_t new_max = std::max(max, row_max(loops, row, cols));
    if (new_max == kNegativeInfinity<scalar_t>) {
      std::fill(row, row + cols, scalar_t(0)); // nothing visible yet
      return;
    }
    const scalar_t correction = std::exp(max - new_max);
    running_sum[r] = running_sum[r] * correction + exp_shifted_sum(loops, row, cols, new_max);
    max = new_max;
    if (correction != scalar_t(1)) {
      scale_row(out_row, Dv, correction);
    }
  }

  // After the last block: what row r's accumulated output is multiplied by
  // (the dropout's keep scale over the sum), and the row's log-sum-exp.
  scalar_t output_factor(int64_t r, scalar_t keep_scale) const {
    return running_sum[r] > 0 ? keep_scale / running_sum[r] : scalar_t(0);
  }
  scalar_t lse(int64_t r) const {
    return running_sum[r] > 0 ? running_max[r] + std::log(running_sum[r])
                              : kNegativeInfinity<scalar_t>;
  }
};

// The forward's pass over row r of a tile's block of scores: keys
// [j0, j0 + cols) of query tile.i0 + r. Modifies and masks the scores,
// folds them into the online softmax (leaving exp(score - max)) and drops
// the weights dropout drops.
template <typename scalar_t>
void forward_row(
    const RowInputs<scalar_t>& in,
    OnlineSoftmax<scalar_t>& softmax,
    const QueryTile& tile,
    int64_t r,
    int64_t j0,
    scalar_t* row,
    int64_t cols,
    scalar_t* out_row,
    int64_t Dv) {
  const int64_t i = tile.i0 + r;
  if (in.modifiers.changes_scores()) {
    in.modifiers.apply(row, cols, tile.b, tile.h, i, j0, nullptr);
  }
  in.mask.apply(row, cols, tile.b, tile.h, i, j0);
  softmax.fold(in.loops, r, row, cols, out_row, Dv);
  if (in.dropout.active()) { // after the row's sum, which counts every weight
    drop_row(in.loops, row, cols, in.dropout_row(tile.b, tile.h, i, j0));
  }
}

// The keys [begin, end) that a query tile of the weights kernels sees,
// the band of every row: the tile's rows of the weights (L, S) outside
// them are zeroed. Where it sees none, its output rows are zeroed too and
// their log-sum-exp is the head's sink.
template <typename scalar_t, typename Element>
IndexRange start_weights_tile(
    const RowInputs<scalar_t>& in,
    const QueryTile& tile,
    const MatrixRef<Element>& weights,
    const MatrixRef<Element>& out,
    scalar_t* lse) {
  const IndexRange keys{in.mask.tile_key_begin(tile.i0), in.mask.tile_key_end(tile.i0, tile.rows)};
  zero_matrix(weights.column_block(0, keys.begin));
  zero_matrix(weights.column_block(keys.end, in.S - keys.end));
  if (keys.begin == keys.end) {
    zero_matrix(out);
    std::fill(lse, lse + tile.rows, in.modifiers.sink(tile.h));
  }
  return keys;
}

// The weights kernels' pass over a row of scores: keys [j0, j0 + cols) of
// query i of head (b, h), every key that row's tile sees. Modifies and
// masks the scores and turns them into the row's weights in place (the
// head's sink counted in their sum; zeros in a row that sees no key).
// Returns the row's log-sum-exp.
template <typename scalar_t>
scalar_t weights_row(
    const RowInputs<scalar_t>& in,
    int64_t b,
    int64_t h,
    int64_t i,
    int64_t j0,
    scalar_t* row,
    int64_t cols) {
  if (in.modifiers.changes_scores()) {
    in.modifiers.apply(row, cols, b, h, i, j0, nullptr);
  }
  in.mask.apply(row, cols, b, h, i, j0);
  return softmax_row(in.loops, row, cols, in.modifiers.sink(h));
}

// The backward's first pass over a tile's block of scores `p` (keys
// [j0, j0 + cols) of its rows, scaled): modifies and masks them (their
// derivatives into `slopes` where the scores bend) and turns them into the
// forward's probabilities exp(score - lse), 0 in rows that see no key.
template <typename scalar_t>
void backward_probability_rows(
    const RowInputs<scalar_t>& in,
    const QueryTile& tile,
    const MatrixRef<scalar_t>& p,
    const MatrixRef<scalar_t>& slopes,
    int64_t j0,
    const scalar_t* lse_rows,
    const std::vector<IndexRange>& keys_of) {
  for (int64_t r = 0; r < tile.rows; ++r) {
    const auto [begin, end] = keys_of[r / kProductRowBlock];
    scalar_t* row = p.row(r) + begin;
    const int64_t i = tile.i0 + r;
    if (in.modifiers.changes_scores()) {
      in.modifiers.apply(
          row, end - begin, tile.b, tile.h, i, j0 + begin,
          slopes.data != nullptr ? slopes.row(r) + begin : nullptr);
    }
    in.mask.apply(row, end - begin, tile.b, tile.h, i, j0 + begin);
    if (lse_rows[r] == kNegativeInfinity<scalar_t>) {
      std::fill(row, row + (end - begin), scalar_t(0)); // fully masked row
    } else {
      exp_shifted_sum(in.loops, row, end - begin, lse_rows[r]);
    }
  }
}

// The tile's scores' gradient dS = P ∘ (dP - delta) in `ds`, which holds
// dP = dO Vᵀ, row by row over each row's keys. With dropout, dP is the
// gradient of the dropped probabilities, and `p` becomes them
// (dropout_softmax_backward_row).
template <typename scalar_t>
void softmax_backward_rows(
    const RowInputs<scalar_t>& in,
    const QueryTile& tile,
    const MatrixRef<scalar_t>& p,
    const MatrixRef<scalar_t>& ds,
    int64_t j0,
    const std::vector<scalar_t>& delta,
    const std::vector<IndexRange>& keys_of) {
  for (int64_t r = 0; r < tile.rows; ++r) {
    // Plain locals: OpenMP's simd loop below cannot capture a structured binding.
    const IndexRange keys = keys_of[r / kProductRowBlock];
    const int64_t begin = keys.begin, end = keys.end;
    scalar_t* p_row = p.row(r);
    scalar_t* ds_row = ds.row(r);
    const scalar_t d = delta[r];
    if (in.dropout.active()) {
      dropout_softmax_backward_row(
          in.loops, p_row + begin, ds_row + begin, end - begin, d, in.keep_scale,
          in.dropout_row(tile.b, tile.h, tile.i0 + r, j0 + begin));
      continue;
    }
#pragma omp simd
    for (int64_t j = begin; j < end; ++j) {
      ds_row[j] = p_row[j] * (ds_row[j] - d);
    }
  }
}

// After softmax_backward_rows: `ds` holds the gradient of the modified
// scores, which is that of each bias added to them (written out where
// asked for), and becomes the gradient of the scaled scores (times the
// derivative `slopes` of the soft cap and the user's function, where the
// scores pass through them).
template <typename scalar_t>
void modifier_backward_rows(
    const RowInputs<scalar_t>& in,
    const ModifierGradients<scalar_t>& grads,
    const QueryTile& tile,
    int64_t task,
    const MatrixRef<scalar_t>& ds,
    const MatrixRef<scalar_t>& slopes,
    int64_t j0,
    const std::vector<IndexRange>& keys_of) {
  for (int64_t r = 0; r < tile.rows; ++r) {
    const IndexRange keys = keys_of[r / kProductRowBlock];
    const int64_t begin = keys.begin, end = keys.end;
    scalar_t* ds_row = ds.row(r);
    grads.add_row(
        in.modifiers, ds_row + begin, end - begin, task, tile.b, tile.h, tile.i0 + r, j0 + begin);
    if (slopes.data != nullptr) {
      const scalar_t* slope_row = slopes.row(r);
#pragma omp simd
      for (int64_t j = begin; j < end; ++j) {
        ds_row[j] *= slope_row[j];
      }
    }
  }
}

// Where the backward's tasks write the gradients of what the modifiers
// and a floating mask add to the scores (InputGradients' d_offset_bias and
// d_mask, where defined): the mask's in place, zeroed first; the offset
// bias's in a row per task (`splits` per head), summed per head by finish.
template <typename scalar_t>
struct ScoreGradientBuffers {
  ScoreGradientBuffers(const RowInputs<scalar_t>& in, const InputGradients& grads, int64_t splits)
      : in(in),
        splits(splits),
        offset_rows(
            grads.d_offset_bias.defined() ? torch::zeros(
                                                {in.B * in.H * splits, in.modifiers.offsets},
                                                grads.d_offset_bias.options())
                                          : torch::Tensor()),
        mask(grads.d_mask) {
    if (mask.defined()) {
      mask.zero_();
    }
  }

  ModifierGradients<scalar_t> for_tasks() const {
    ModifierGradients<scalar_t> tasks{
        data_or_null<scalar_t>(offset_rows), nullptr, in.H, in.L, in.S};
    if (mask.defined() && is_half_precision(mask.scalar_type())) {
      TORCH_INTERNAL_ASSERT(
          (std::is_same_v<scalar_t, float>), "a half-precision mask's gradient from float scores");
      tasks.half_mask = static_cast<uint16_t*>(mask.data_ptr());
      tasks.round_row = half_rows(in.loops, mask.scalar_type()).round;
    } else {
      tasks.mask = data_or_null<scalar_t>(mask);
    }
    return tasks;
  }

  // The offset bias's rows, one per (b, h, split), summed per head.
  void finish(const InputGradients& grads) const {
    if (offset_rows.defined()) {
      grads.d_offset_bias.copy_(
          offset_rows.view({in.B, in.H, splits, in.modifiers.offsets}).sum(at::IntArrayRef{0, 2}));
    }
  }

  const RowInputs<scalar_t>& in;
  int64_t splits;
  torch::Tensor offset_rows, mask;
};

// The part of one query tile × key block that the band (causal, window)
// leaves visible, in the blocks that attn's products work in
// (tile_addmm_banded): for each block of kProductRowBlock queries, the keys
// (from the block's first) that some row of it sees, widened to whole
// panels; for each block of kProductRowBlock keys, the queries of the
// query blocks that compute it. The products compute, and the row passes
// visit, only these parts. Where BLAS computes the products, every part is
// the whole tile.
struct TileBands {
  std::vector<IndexRange> keys_of_query_block, queries_of_key_block;

  template <typename scalar_t>
  void fit_queries(
      const MaskView<scalar_t>& mask,
      const QueryTile& tile,
      int64_t j0,
      int64_t cols,
      bool banded) {
    if (!banded) {
      cover_whole(tile.rows, cols);
      return;
    }
    keys_of_query_block.resize(ceil_div(tile.rows, kProductRowBlock));
    for (size_t block = 0; block < keys_of_query_block.size(); ++block) {
      const int64_t first = tile.i0 + static_cast<int64_t>(block) * kProductRowBlock;
      const int64_t last = std::min(tile.i0 + tile.rows, first + kProductRowBlock) - 1;
      const auto keys = mask.rows_keys(tile.b, first, last);
      const int64_t begin = std::clamp<int64_t>(keys.begin - j0, 0, cols);
      const int64_t end = std::clamp<int64_t>(keys.end - j0, 0, cols);
      if (begin >= end) {
        keys_of_query_block[block] = {0, 0};
      } else {
        keys_of_query_block[block] = {
            begin / kProductColumnPanel * kProductColumnPanel,
            std::min(cols, ceil_div(end, kProductColumnPanel) * kProductColumnPanel)};
      }
    }
    if (mask.bounds_keys()) {
      fill_inner_gaps();
    }
  }

  // Every row block of a tile of `rows` queries computes all `cols` keys
  // of a block: no band is narrower.
  void cover_whole(int64_t rows, int64_t cols) {
    keys_of_query_block.assign(ceil_div(rows, kProductRowBlock), IndexRange{0, cols});
  }

  // Key bounds may leave a query block between two others empty (a
  // sequence without keys): it takes its predecessor's keys, all hidden
  // from its rows, so that the blocks that compute any one key stay
  // consecutive, as fit_keys needs.
  void fill_inner_gaps() {
    const auto empty = [](const IndexRange& range) { return range.begin >= range.end; };
    const auto first = std::find_if_not(
        keys_of_query_block.begin(), keys_of_query_block.end(), empty);
    const auto last = std::find_if_not(
        keys_of_query_block.rbegin(), keys_of_query_block.rend(), empty);
    if (first == keys_of_query_block.end()) {
      return;
    }
    for (auto block = first + 1; block < last.base(); ++block) {
      if (empty(*block)) {
        *block = *(block - 1);
      }
    }
  }

  // After fit_queries, for products whose rows are the block's keys.
  void fit_keys(int64_t rows, int64_t cols) {
    queries_of_key_block.resize(ceil_div(cols, kProductRowBlock));
    for (size_t block = 0; block < queries_of_key_block.size(); ++block) {
      const int64_t key = static_cast<int64_t>(block) * kProductRowBlock;
      // Query blocks' key ranges are nondecreasing, apart from empty ones:
      // those that hold `key` are consecutive.
      int64_t first = -1, last = -1;
      for (size_t q = 0; q < keys_of_query_block.size(); ++q) {
        if (keys_of_query_block[q].begin <= key && key < keys_of_query_block[q].end) {
          first = first < 0 ? static_cast<int64_t>(q) : first;
          last = static_cast<int64_t>(q);
        }
      }
      queries_of_key_block[block] = first < 0
          ? IndexRange{0, 0}
          : IndexRange{first * kProductRowBlock, std::min(rows, (last + 1) * kProductRowBlock)};
    }
  }
};

// Into how many key ranges the backward splits each head: one when there
// are at least as many heads as threads; else enough ranges of whole key
// blocks for a task per thread, as far as the keys allow.
inline int64_t backward_key_splits(int64_t heads, int64_t S, int64_t key_block) {
  const int64_t threads = at::get_num_threads();
  if (heads >= threads) {
    return 1;
  }
  return std::clamp<int64_t>(
      ceil_div(threads, std::max<int64_t>(heads, 1)), 1,
      std::max<int64_t>(ceil_div(S, key_block), 1));
}

} // namespace attn::detail
