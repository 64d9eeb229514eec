// The tiled loops on bfloat16 products (tiled_loops.h), forward and
// backward: Q, K, V, the output and its gradient stay in bfloat16; every
// product accumulates in float (tile_product.h, gemm_bf16); the scores,
// their softmax and its backward run in float, as in the float loops; the
// probabilities P and the scores' gradients dS are rounded to bfloat16 per
// tile before they are multiplied; the outputs and gradients accumulate in
// float and are rounded once. The right operands of the products are
// packed in pairs along their depth (pack_bf16_pairs): K, Kᵀ, V and Vᵀ once
// per call, P and dS per tile. The backward accumulates dKᵀ and dVᵀ (the
// products' rows are the heads' features) and transposes them once.

#include "kernels/cpu/heads.h"
#include "kernels/cpu/micro_tile.h"
#include "kernels/cpu/tiled_loops.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace attn::detail {
namespace {

using bf16 = c10::BFloat16;

// x rounded to the nearest bfloat16, ties to even (NaN stays NaN), as
// c10::BFloat16 rounds: where the CPU has no AVX512-BF16 to round a row.
uint16_t bf16_bits(float x) {
  if (std::isnan(x)) {
    return 0x7FC0;
  }
  uint32_t bits = 0;
  std::memcpy(&bits, &x, sizeof(bits));
  return static_cast<uint16_t>((bits + 0x7FFFU + ((bits >> 16) & 1U)) >> 16);
}

void round_row_portable(const float* from, int64_t n, uint16_t* to) {
  for (int64_t j = 0; j < n; ++j) {
    to[j] = bf16_bits(from[j]);
  }
}

void round_row_pairs_portable(const float* first, const float* second, int64_t n, uint16_t* to) {
  for (int64_t j = 0; j < n; ++j) {
    to[2 * j] = bf16_bits(first[j]);
    to[2 * j + 1] = second != nullptr ? bf16_bits(second[j]) : uint16_t{0};
  }
}

// The roundings of Bf16MicroTiles (micro_tile.h): AVX512-BF16's where the
// CPU runs it, else the portable ones.
struct Rounding {
  void (*row)(const float* from, int64_t n, uint16_t* to);
  void (*row_pairs)(const float* first, const float* second, int64_t n, uint16_t* to);
};

Rounding rounding() {
  const Bf16MicroTiles* loops = bf16_micro_tiles();
  return loops != nullptr ? Rounding{loops->round_row, loops->round_row_pairs}
                          : Rounding{round_row_portable, round_row_pairs_portable};
}

// gemm_bf16, which the callers' check (bf16_gemm_runs) lets run.
void multiply(int64_t rows, int64_t cols, const Bf16GemmOperands& g) {
  TORCH_INTERNAL_ASSERT(gemm_bf16(rows, cols, g), "no bfloat16 products on this CPU");
}

const uint16_t* bits_of(const bf16* data) {
  return reinterpret_cast<const uint16_t*>(data);
}

// Per (b, kv head), a (B, Hkv, ·, ·) tensor packed in pairs along the
// depth of the product it is the right operand of (pack_bf16_pairs):
// Kᵀ (depth D, keys as columns) for the scores, V (depth S, its features
// as columns) for the output. `pairs` pairs of rows per head, ld elements
// from one pair to the next.
struct PackedHeads {
  torch::Tensor memory; // (B, Hkv, pairs, ld)
  int64_t pairs = 0, ld = 0;

  const uint16_t* head(int64_t b, int64_t kv_head) const {
    return reinterpret_cast<const uint16_t*>(memory[b][kv_head].data_ptr<bf16>());
  }
};

// t (B, Hkv, rows, cols) packed as the product's right operand B(i, j):
// with `rows_are_depth`, B = t's head (V); else B = its transpose (Kᵀ).
PackedHeads packed_heads(const torch::Tensor& t, bool rows_are_depth, WorkspaceSlot slot) {
  const int64_t B = t.size(0), H = t.size(1);
  const int64_t depth = rows_are_depth ? t.size(2) : t.size(3);
  const int64_t cols = rows_are_depth ? t.size(3) : t.size(2);
  const int64_t depth_stride = rows_are_depth ? t.stride(2) : t.stride(3);
  const int64_t column_stride = rows_are_depth ? t.stride(3) : t.stride(2);
  PackedHeads packed;
  packed.pairs = ceil_div(depth, 2);
  packed.ld = spread_row_stride(2 * cols, static_cast<int64_t>(sizeof(bf16)));
  packed.memory = workspace_tensor(slot, {B, H, packed.pairs, packed.ld}, t.options());
  if (t.numel() == 0) {
    return packed;
  }
  const bf16* data = t.data_ptr<bf16>();
  bf16* to = packed.memory.data_ptr<bf16>();
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t head = begin; head < end; ++head) {
      const bf16* from = data + head / H * t.stride(0) + head % H * t.stride(1);
      pack_bf16_pairs(
          depth, cols, from, depth_stride, column_stride, to + head * packed.pairs * packed.ld,
          packed.ld);
    }
  });
  return packed;
}

// What both directions read: the per-row inputs in float, Q's heads and
// Kᵀ in pairs for the scores.
struct Bf16Inputs : RowInputs<float> {
  explicit Bf16Inputs(const AttentionParams& params)
      : RowInputs<float>(params),
        D(params.D()),
        Dv(params.Dv()),
        round(rounding()),
        q(params.q),
        keys_t(packed_heads(params.k, /*rows_are_depth=*/false, WorkspaceSlot::keys_transposed)) {}

  // scores (rows, cols) = scale·Q Kᵀ for keys [j0, j0 + cols) of `tile`.
  void score(const QueryTile& tile, int64_t j0, int64_t cols, const MatrixRef<float>& scores)
      const {
    const auto q_tile = q.head(tile.b, tile.h).row_block(tile.i0, tile.rows);
    multiply(
        tile.rows, cols,
        {D, scale, bits_of(q_tile.data), q_tile.row_stride,
         keys_t.head(tile.b, tile.h / group) + 2 * j0, keys_t.ld, scores.data, scores.row_stride,
         /*accumulate=*/false});
  }

  int64_t D, Dv;
  Rounding round;
  Heads<bf16> q;
  PackedHeads keys_t;
};

// Keys [j0, j0 + cols) as a product over K's or V's pairs (packed from
// key 0) takes them: the keys from the first even one in whole pairs; a
// first key at an odd j0 and a last key left over are added alone, in
// float (add_lone_keys), so that no product reads a key outside the block
// (0 times another document's Inf would be NaN).
struct PairedKeys {
  PairedKeys(int64_t j0, int64_t cols) : lead(j0 % 2), count((cols - j0 % 2) / 2 * 2) {}
  int64_t lead;  // 1 where key j0 is alone: the pairs start at column lead
  int64_t count; // keys in whole pairs
};

// A tile's rows of weights for its block's paired keys (PairedKeys),
// rounded to bfloat16, one key block apart: the left operand of P V and
// dS K.
struct RoundedRows {
  RoundedRows(int64_t rows, int64_t key_block)
      : ld(key_block), bits(static_cast<size_t>(rows * key_block)) {}

  // Row r of m (keys [j0, j0 + m.cols)): its paired keys rounded.
  void round(const Rounding& rounding, const MatrixRef<float>& m, int64_t r, int64_t j0) {
    const PairedKeys paired(j0, m.cols);
    rounding.row(m.row(r) + paired.lead, paired.count, bits.data() + r * ld);
  }

  int64_t ld;
  std::vector<uint16_t> bits;
};

// c (m.rows × key_rows.cols, rows ldc apart) += the columns of `m` (keys
// [j0, j0 + m.cols)) that PairedKeys leaves alone, times their rows of
// `key_rows` (K or V of one head), in float.
void add_lone_keys(
    const MatrixRef<float>& m,
    int64_t j0,
    const MatrixRef<bf16>& key_rows,
    float* c,
    int64_t ldc) {
  const PairedKeys paired(j0, m.cols);
  const auto add = [&](int64_t column) {
    const bf16* key = key_rows.row(j0 + column);
    for (int64_t r = 0; r < m.rows; ++r) {
      const float weight = m.row(r)[column];
      float* c_row = c + r * ldc;
      for (int64_t d = 0; d < key_rows.cols; ++d) {
        c_row[d] += weight * static_cast<float>(key[d]);
      }
    }
  };
  if (paired.lead == 1) {
    add(0);
  }
  if (paired.lead + paired.count < m.cols) {
    add(m.cols - 1);
  }
}

// c (rows × key_rows.cols) += `rounded` (m's rows, RoundedRows::round)
// times those keys' pairs, then the lone keys of `m` (add_lone_keys): m
// times the keys [j0, j0 + m.cols).
void add_times_keys(
    const MatrixRef<float>& m,
    int64_t j0,
    const RoundedRows& rounded,
    const PackedHeads& pairs,
    const uint16_t* head_pairs,
    const MatrixRef<bf16>& key_rows,
    float* c,
    int64_t ldc) {
  const PairedKeys paired(j0, m.cols);
  if (paired.count > 0) {
    multiply(
        m.rows, key_rows.cols,
        {paired.count, 1.0F, rounded.bits.data(), rounded.ld,
         head_pairs + (j0 + paired.lead) / 2 * pairs.ld, pairs.ld, c, ldc, /*accumulate=*/true});
  }
  add_lone_keys(m, j0, key_rows, c, ldc);
}

// The rows of `m` rounded in pairs (rows 2p and 2p + 1 into pair p, ld
// elements apart), as the right operand of a product whose depth is m's
// rows.
void round_rows_in_pairs(
    const Rounding& round,
    const MatrixRef<float>& m,
    uint16_t* to,
    int64_t ld) {
  for (int64_t r = 0; r < m.rows; r += 2) {
    round.row_pairs(m.row(r), r + 1 < m.rows ? m.row(r + 1) : nullptr, m.cols, to + r / 2 * ld);
  }
}

// ---------------------------------------------------------------------------
// Forward.

struct Bf16ForwardInputs : Bf16Inputs {
  explicit Bf16ForwardInputs(const AttentionParams& params)
      : Bf16Inputs(params),
        v(params.v),
        values(packed_heads(params.v, /*rows_are_depth=*/true, WorkspaceSlot::values_transposed)) {}
  Heads<bf16> v;
  PackedHeads values; // V in pairs along the keys
};

// A forward task's working memory: one tile's scores (float) and the
// probabilities of its paired keys (bfloat16, see PairedKeys), its rows'
// online softmax and output accumulated in float.
struct Bf16ForwardScratch {
  OwnedMatrix<float> scores; // (kQueryTile, key_block)
  RoundedRows probs;
  std::vector<float> out; // (kQueryTile, Dv)
  OnlineSoftmax<float> softmax;
};

Bf16ForwardScratch forward_scratch(const Bf16ForwardInputs& in) {
  const int64_t rows = std::min(kQueryTile, in.L);
  return Bf16ForwardScratch{
      OwnedMatrix<float>(spread_workspace_tensor(
          WorkspaceSlot::tile_scores, {rows, in.key_block}, torch::dtype(torch::kFloat))),
      RoundedRows(rows, in.key_block), std::vector<float>(static_cast<size_t>(rows * in.Dv)),
      OnlineSoftmax<float>{}};
}

// Keys [j0, j0 + cols) of one query tile: the scores, the row pass
// (forward_row), and out += P V with P rounded to bfloat16.
void forward_block(
    const Bf16ForwardInputs& in,
    Bf16ForwardScratch& scratch,
    const QueryTile& tile,
    int64_t j0,
    int64_t cols) {
  const auto scores = scratch.scores.matrix.row_block(0, tile.rows).column_block(0, cols);
  in.score(tile, j0, cols, scores);
  for (int64_t r = 0; r < tile.rows; ++r) {
    forward_row<float>(
        in, scratch.softmax, tile, r, j0, scores.row(r), cols, scratch.out.data() + r * in.Dv,
        in.Dv);
    scratch.probs.round(in.round, scores, r, j0);
  }
  const int64_t kv_head = tile.h / in.group;
  add_times_keys(
      scores, j0, scratch.probs, in.values, in.values.head(tile.b, kv_head),
      in.v.head(tile.b, kv_head), scratch.out.data(), in.Dv);
}

void bf16_forward(const Bf16ForwardInputs& in, const ForwardResult& result) {
  const Heads<bf16> out_heads(result.out);
  float* const lse_data = result.lse.data_ptr<float>();
  const double flops_per_tile = 2.0 * std::min(kQueryTile, in.L) * in.S * (in.D + in.Dv);
  parallel_query_tiles(
      in.B, in.H, in.L, kQueryTile, flops_per_tile, [&] { return forward_scratch(in); },
      [&](Bf16ForwardScratch& scratch, const QueryTile& tile) {
        std::fill(scratch.out.begin(), scratch.out.end(), 0.0F);
        scratch.softmax.start(in.modifiers.sink(tile.h));
        const int64_t key_end = in.mask.tile_key_end(tile.i0, tile.rows);
        const auto next_keys = [&](int64_t from) {
          return in.mask.next_keys(tile.b, tile.h, tile.i0, from, key_end, in.key_block);
        };
        for (auto keys = next_keys(in.mask.tile_key_begin(tile.i0)); keys.begin < keys.end;
             keys = next_keys(keys.end)) {
          forward_block(in, scratch, tile, keys.begin, keys.end - keys.begin);
        }
        const auto out_tile = out_heads.head(tile.b, tile.h).row_block(tile.i0, tile.rows);
        float* lse_row = lse_data + (tile.b * in.H + tile.h) * in.L + tile.i0;
        for (int64_t r = 0; r < tile.rows; ++r) {
          const float factor = scratch.softmax.output_factor(r, in.keep_scale);
          const float* acc = scratch.out.data() + r * in.Dv;
          bf16* out_row = out_tile.row(r);
          for (int64_t d = 0; d < in.Dv; ++d) {
            out_row[d] = bf16(acc[d] * factor);
          }
          lse_row[r] = scratch.softmax.lse(r);
        }
      });
}

// ---------------------------------------------------------------------------
// Backward.

struct Bf16BackwardInputs : Bf16Inputs {
  explicit Bf16BackwardInputs(const AttentionParams& params)
      : Bf16Inputs(params),
        k(params.k),
        keys(packed_heads(params.k, /*rows_are_depth=*/true, WorkspaceSlot::keys_in_pairs)),
        values_t(
            packed_heads(params.v, /*rows_are_depth=*/false, WorkspaceSlot::values_transposed)) {}
  Heads<bf16> k;
  PackedHeads keys;     // K in pairs along the keys, for dQ = dS K
  PackedHeads values_t; // Vᵀ in pairs along the features, for dP = dO Vᵀ
};

// What the backward reads besides the inputs, and the gradients it writes.
struct Bf16BackwardTensors {
  Heads<bf16> out, grad_out; // (B, H, L, Dv), rows of unit stride
  const float* lse;          // (B, H, L), contiguous
  torch::Tensor dk, dv;      // (B, H, S, ·), bfloat16, or float to be summed over groups
  ModifierGradients<float> modifiers;
};

// A backward task's working memory: the float tiles of the float loops,
// the bfloat16 operands made per tile, and the gradients it accumulates
// in float: dQ for a query tile, dKᵀ and dVᵀ for its range of keys.
struct Bf16BackwardScratch {
  OwnedMatrix<float> probs, grad_scores, score_slopes; // (kQueryTile, key_block)
  std::vector<float> delta;                            // (kQueryTile)
  std::vector<IndexRange> whole_rows;                  // every row block sees every key
  std::vector<uint16_t> pairs;     // P or dS in pairs of rows: (kQueryTile / 2, 2 key_block)
  RoundedRows ds_rows;             // dS rounded
  std::vector<uint16_t> q_t, go_t; // the tile's Qᵀ (D, kQueryTile) and dOᵀ (Dv, kQueryTile)
  std::vector<float> dq;           // (kQueryTile, D)
  std::vector<float> dk_t, dv_t;   // (D, keys), (Dv, keys) of the task's keys
};

Bf16BackwardScratch backward_scratch(const Bf16BackwardInputs& in, int64_t keys_per_task) {
  const int64_t rows = std::min(kQueryTile, in.L);
  const auto tile = [&](WorkspaceSlot slot) {
    return OwnedMatrix<float>(
        spread_workspace_tensor(slot, {rows, in.key_block}, torch::dtype(torch::kFloat)));
  };
  const auto size = [](int64_t n) { return static_cast<size_t>(n); };
  return Bf16BackwardScratch{
      tile(WorkspaceSlot::tile_scores),
      tile(WorkspaceSlot::tile_grad_scores),
      in.modifiers.bends_scores() ? tile(WorkspaceSlot::tile_score_slopes)
                                  : OwnedMatrix<float>(torch::empty({0, 0})),
      std::vector<float>(size(kQueryTile)),
      {},
      std::vector<uint16_t>(size(ceil_div(rows, 2) * 2 * in.key_block)),
      RoundedRows(rows, in.key_block),
      std::vector<uint16_t>(size(in.D * rows)),
      std::vector<uint16_t>(size(in.Dv * rows)),
      std::vector<float>(size(rows * in.D)),
      std::vector<float>(size(in.D * keys_per_task)),
      std::vector<float>(size(in.Dv * keys_per_task))};
}

// One query tile of a backward task: where it is, and the rows it reads.
struct Bf16BackwardTile {
  QueryTile tile;
  int64_t task;
  int64_t keys_begin; // the task's first key: column 0 of dk_t and dv_t
  MatrixRef<bf16> grad_out;
  const float* lse;
};

// The tile's Qᵀ and dOᵀ in bfloat16, the left operands of dKᵀ += Qᵀ dS
// and dVᵀ += dOᵀ P, whose depth is the tile's queries; and the rows' delta_i
// = Σ_d dO_id · O_id (fill_row_deltas of the float loops).
void prepare_tile(
    const Bf16BackwardInputs& in,
    const Bf16BackwardTensors& t,
    Bf16BackwardScratch& scratch,
    const Bf16BackwardTile& bt) {
  const QueryTile& tile = bt.tile;
  const auto q_tile = in.q.head(tile.b, tile.h).row_block(tile.i0, tile.rows);
  const auto out = t.out.head(tile.b, tile.h).row_block(tile.i0, tile.rows);
  for (int64_t r = 0; r < tile.rows; ++r) {
    const uint16_t* q_row = bits_of(q_tile.row(r));
    for (int64_t d = 0; d < in.D; ++d) {
      scratch.q_t[d * tile.rows + r] = q_row[d];
    }
    const uint16_t* go_row = bits_of(bt.grad_out.row(r));
    float delta = 0;
    for (int64_t d = 0; d < in.Dv; ++d) {
      scratch.go_t[d * tile.rows + r] = go_row[d];
      delta += static_cast<float>(bt.grad_out.row(r)[d]) * static_cast<float>(out.row(r)[d]);
    }
    scratch.delta[r] = delta;
  }
}

// c (rows, cols; ld) += the product of `left` (rows × the tile's queries)
// and the rows of `m` in pairs: dKᵀ += Qᵀ dS, dVᵀ += dOᵀ P.
void add_left_times_pairs(
    const Bf16BackwardInputs& in,
    Bf16BackwardScratch& scratch,
    const MatrixRef<float>& m,
    const uint16_t* left,
    int64_t rows,
    float* c,
    int64_t ld) {
  const int64_t pairs_ld = 2 * in.key_block;
  round_rows_in_pairs(in.round, m, scratch.pairs.data(), pairs_ld);
  multiply(
      rows, m.cols,
      {m.rows, 1.0F, left, m.rows, scratch.pairs.data(), pairs_ld, c, ld,
       /*accumulate=*/true});
}

// One query tile against keys [j0, j0 + cols): P recomputed, dP = dO Vᵀ,
// dS through the float loops' row passes, and their products added to dQ,
// dKᵀ and dVᵀ (dQ and dKᵀ without the scale, which the writes apply).
void backward_block(
    const Bf16BackwardInputs& in,
    const Bf16BackwardTensors& t,
    Bf16BackwardScratch& scratch,
    const Bf16BackwardTile& bt,
    int64_t j0,
    int64_t cols,
    int64_t keys_per_task) {
  const QueryTile& tile = bt.tile;
  const int64_t rows = tile.rows, kv_head = tile.h / in.group;
  const auto p = scratch.probs.matrix.row_block(0, rows).column_block(0, cols);
  const auto ds = scratch.grad_scores.matrix.row_block(0, rows).column_block(0, cols);
  const bool bent = in.modifiers.bends_scores();
  const auto slopes = bent ? scratch.score_slopes.matrix.row_block(0, rows).column_block(0, cols)
                           : MatrixRef<float>{};
  scratch.whole_rows.assign(static_cast<size_t>(ceil_div(rows, kProductRowBlock)), {0, cols});
  const auto& keys_of = scratch.whole_rows;
  const int64_t column = j0 - bt.keys_begin; // of dk_t and dv_t

  in.score(tile, j0, cols, p);
  backward_probability_rows<float>(in, tile, p, slopes, j0, bt.lse, keys_of);
  const auto add_value_gradient = [&] { // dVᵀ += dOᵀ P, P as the forward multiplied it
    add_left_times_pairs(
        in, scratch, p, scratch.go_t.data(), in.Dv, scratch.dv_t.data() + column, keys_per_task);
  };
  if (!in.dropout.active()) {
    add_value_gradient();
  }
  multiply(
      rows, cols,
      {in.Dv, 1.0F, bits_of(bt.grad_out.data), bt.grad_out.row_stride,
       in.values_t.head(tile.b, kv_head) + 2 * j0, in.values_t.ld, ds.data, ds.row_stride,
       /*accumulate=*/false}); // dP = dO Vᵀ
  softmax_backward_rows<float>(in, tile, p, ds, j0, scratch.delta, keys_of);
  if (in.dropout.active()) {
    add_value_gradient();
  }
  if (bent || t.modifiers.any()) {
    modifier_backward_rows<float>(in, t.modifiers, tile, bt.task, ds, slopes, j0, keys_of);
  }
  for (int64_t r = 0; r < rows; ++r) {
    scratch.ds_rows.round(in.round, ds, r, j0);
  }
  add_times_keys(
      ds, j0, scratch.ds_rows, in.keys, in.keys.head(tile.b, kv_head), in.k.head(tile.b, kv_head),
      scratch.dq.data(), in.D); // dQ += dS K
  add_left_times_pairs(
      in, scratch, ds, scratch.q_t.data(), in.D, scratch.dk_t.data() + column,
      keys_per_task); // dKᵀ += Qᵀ dS
}

// `to` (n elements) = `from`, rounded to bfloat16 where `to` is.
void store_row(const Rounding& round, const float* from, int64_t n, bf16* to) {
  round.row(from, n, reinterpret_cast<uint16_t*>(to));
}
void store_row(const Rounding& /*round*/, const float* from, int64_t n, float* to) {
  std::copy(from, from + n, to);
}

// dst (rows × cols, bfloat16 or float) = factor · src (rows × cols,
// contiguous), which is scaled in place.
template <typename T>
void write_scaled(const Rounding& round, const MatrixRef<T>& dst, float* src, float factor) {
  for (int64_t r = 0; r < dst.rows; ++r) {
    float* row = src + r * dst.cols;
    for (int64_t c = 0; c < dst.cols; ++c) {
      row[c] *= factor;
    }
    store_row(round, row, dst.cols, dst.row(r));
  }
}

// dst (rows × cols, bfloat16 or float) = factor · srcᵀ, src (cols × rows,
// rows `ld` apart): kTransposeRows rows at a time, each read in runs of
// src's rows and transposed through a float block, then stored whole.
template <typename T>
void write_transposed(
    const Rounding& round,
    const MatrixRef<T>& dst,
    const float* src,
    int64_t ld,
    float factor) {
  constexpr int64_t kTransposeRows = 16;
  std::vector<float> block(static_cast<size_t>(kTransposeRows * dst.cols));
  for (int64_t r0 = 0; r0 < dst.rows; r0 += kTransposeRows) {
    const int64_t n = std::min(kTransposeRows, dst.rows - r0);
    for (int64_t c = 0; c < dst.cols; ++c) {
      const float* from = src + c * ld + r0;
      for (int64_t k = 0; k < n; ++k) {
        block[static_cast<size_t>(k * dst.cols + c)] = factor * from[k];
      }
    }
    for (int64_t k = 0; k < n; ++k) {
      store_row(round, block.data() + k * dst.cols, dst.cols, dst.row(r0 + k));
    }
  }
}

// Rows [first, first + n) of head (b, h) of a key or value gradient
// (bfloat16, or float where grouped heads' gradients are summed after) =
// factor · srcᵀ, src the task's (features, keys) accumulator.
void write_key_rows(
    const Rounding& round,
    const torch::Tensor& grad,
    int64_t b,
    int64_t h,
    int64_t first,
    int64_t n,
    const float* src,
    int64_t ld,
    float factor) {
  if (grad.scalar_type() == torch::kFloat) {
    write_transposed(round, Heads<float>(grad).head(b, h).row_block(first, n), src, ld, factor);
  } else {
    write_transposed(round, Heads<bf16>(grad).head(b, h).row_block(first, n), src, ld, factor);
  }
}

// Backward, as the float loops' flash_backward divides it: a task takes
// one range of keys of one (b, h), accumulates their dKᵀ and dVᵀ and
// writes their rows of dK and dV once; where a head's keys are split,
// each range writes its share of dQ (float) into a buffer of its own,
// summed into dq at the end.
void bf16_backward(
    const Bf16BackwardInputs& in,
    const ForwardResult& forward,
    const torch::Tensor& grad_out,
    const InputGradients& grads) {
  const int64_t splits = backward_key_splits(in.B * in.H, in.S, in.key_block);
  const ScoreGradientBuffers<float> score_grads(in, grads, splits);
  const Bf16BackwardTensors t{Heads<bf16>(forward.out),
                              Heads<bf16>(grad_out),
                              forward.lse.data_ptr<float>(),
                              grads.dk,
                              grads.dv,
                              score_grads.for_tasks()};
  const int64_t keys_per_split = ceil_div(ceil_div(in.S, in.key_block), splits) * in.key_block;
  const int64_t keys_per_task = std::min(in.S, keys_per_split);
  const auto dq_parts = splits == 1 ? torch::Tensor()
                                    : torch::empty({splits, in.B, in.H, in.L, in.D}, torch::kFloat);
  const Heads<bf16> dq_heads(grads.dq);
  const double flops_per_task = 10.0 * in.L * in.S * in.D / static_cast<double>(splits);
  parallel_units(
      in.B * in.H * splits, flops_per_task, [&] { return backward_scratch(in, keys_per_task); },
      [&](Bf16BackwardScratch& scratch, int64_t unit) {
        const int64_t b = unit / (in.H * splits), h = unit / splits % in.H, split = unit % splits;
        const int64_t keys_begin = std::min(in.S, split * keys_per_split);
        const int64_t keys_end = std::min(in.S, keys_begin + keys_per_split);
        std::fill(scratch.dk_t.begin(), scratch.dk_t.end(), 0.0F);
        std::fill(scratch.dv_t.begin(), scratch.dv_t.end(), 0.0F);
        for (int64_t i0 = 0; i0 < in.L; i0 += kQueryTile) {
          const QueryTile tile{b, h, i0, std::min(kQueryTile, in.L - i0)};
          const int64_t begin = std::max(keys_begin, in.mask.tile_key_begin(i0));
          const int64_t end = std::max(
              begin, std::min(keys_end, in.mask.tile_key_end(i0, tile.rows)));
          const auto next_keys = [&](int64_t from) {
            return in.mask.next_keys(b, h, i0, from, end, in.key_block);
          };
          std::fill(scratch.dq.begin(), scratch.dq.end(), 0.0F);
          const IndexRange first = next_keys(begin);
          if (first.begin < first.end) {
            const Bf16BackwardTile bt{
                tile, unit, keys_begin, t.grad_out.head(b, h).row_block(i0, tile.rows),
                t.lse + (b * in.H + h) * in.L + i0};
            prepare_tile(in, t, scratch, bt);
            for (auto keys = first; keys.begin < keys.end; keys = next_keys(keys.end)) {
              backward_block(in, t, scratch, bt, keys.begin, keys.end - keys.begin, keys_per_task);
            }
          }
          if (splits == 1) {
            write_scaled(
                in.round, dq_heads.head(b, h).row_block(i0, tile.rows), scratch.dq.data(),
                in.scale);
          } else {
            float* part = dq_parts.data_ptr<float>() +
                (((split * in.B + b) * in.H + h) * in.L + i0) * in.D;
            write_scaled(
                in.round, MatrixRef<float>{part, tile.rows, in.D, in.D}, scratch.dq.data(),
                in.scale);
          }
        }
        const int64_t n = keys_end - keys_begin;
        write_key_rows(
            in.round, t.dk, b, h, keys_begin, n, scratch.dk_t.data(), keys_per_task, in.scale);
        write_key_rows(
            in.round, t.dv, b, h, keys_begin, n, scratch.dv_t.data(), keys_per_task, 1.0F);
      });
  if (splits > 1) {
    grads.dq.copy_(dq_parts.sum(0));
  }
  score_grads.finish(grads);
}

std::atomic<int64_t>& bf16_calls() {
  static std::atomic<int64_t> calls{0};
  return calls;
}

} // namespace

int64_t tiled_bf16_calls() {
  return bf16_calls().load(std::memory_order_relaxed);
}

bool tiled_forward_bf16(const AttentionParams& params, const ForwardResult& result) {
  if (!bf16_gemm_runs()) {
    return false;
  }
  bf16_calls().fetch_add(1, std::memory_order_relaxed);
  bf16_forward(Bf16ForwardInputs(params), result);
  return true;
}

bool tiled_backward_bf16(
    const AttentionParams& params,
    const ForwardResult& forward,
    const torch::Tensor& grad_out,
    const InputGradients& grads) {
  if (!bf16_gemm_runs()) {
    return false;
  }
  bf16_calls().fetch_add(1, std::memory_order_relaxed);
  bf16_backward(Bf16BackwardInputs(params), forward, grad_out, grads);
  return true;
}

} // namespace attn::detail
