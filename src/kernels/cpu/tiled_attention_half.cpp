// The tiled loops on half-precision inputs (tiled_loops.h), forward,
// backward and the weights kernel's forward, for bfloat16 and float16:
// Q, K, V, the output and its gradient stay in their 16 bits; every
// product accumulates in float; the scores, their softmax and its backward
// run in float, as in the float loops; the outputs and gradients
// accumulate in float and are rounded once. One template runs both; the
// products, and the layout in which a backward task accumulates dK and
// dV, are each type's own:
// - bfloat16 (Bf16Operands): bfloat16 products (tile_product.h,
//   gemm_bf16) in a causal or windowed tile's bands (one product per run
//   of row blocks that share a band), their right operands packed in
//   pairs along the depth (pack_bf16_pairs): K, Kᵀ, V and Vᵀ once per
//   call, the probabilities P and the scores' gradients dS rounded to
//   bfloat16 per tile, in their bands; dKᵀ and dVᵀ accumulated (the
//   products' rows are the heads' features) and transposed once;
// - float16 (Float16Operands): the float loops' products (tile_addmm_banded,
//   in a causal or windowed tile's bands as the float kernel computes them)
//   on operands widened to float per tile: Q and dO per query tile, K, Kᵀ,
//   V and Vᵀ per block of keys (Kᵀ and Vᵀ transposed once per call in
//   float16); P and dS stay float.

#include "kernels/cpu/heads.h"
#include "kernels/cpu/micro_tile.h"
#include "kernels/cpu/tiled_loops.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace attn::detail {
namespace {

using bf16 = c10::BFloat16;
using half = c10::Half;

// Which of the loops' calls operands are made for: the forward reads Kᵀ
// and V, the backward Kᵀ, K and Vᵀ.
enum class Direction { forward, backward };

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
PackedHeads empty_packed_heads(
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

// ---------------------------------------------------------------------------
// bfloat16: products of bfloat16 operands.

// gemm_bf16, which the callers' check (bf16_gemm_runs) lets run.
void multiply(const CpuLoops& loops, int64_t rows, int64_t cols, const Bf16GemmOperands& g) {
  TORCH_INTERNAL_ASSERT(gemm_bf16(loops, rows, cols, g), "no bfloat16 products on these loops");
}

// t (B, Hkv, rows, cols) in pairs along the depth of the product it is the
// right operand of (pack_bf16_pairs): with `rows_are_depth`, B = t's head
// (V for the output, K for dQ); else its transpose (Kᵀ for the scores, Vᵀ
// for dP). PackedHeads::rows counts the pairs.
PackedHeads packed_pairs(
    const CpuLoops& loops,
    const torch::Tensor& t,
    bool rows_are_depth,
    WorkspaceSlot slot) {
  const int64_t depth = rows_are_depth ? t.size(2) : t.size(3);
  const int64_t cols = rows_are_depth ? t.size(3) : t.size(2);
  const int64_t depth_stride = rows_are_depth ? t.stride(2) : t.stride(3);
  const int64_t column_stride = rows_are_depth ? t.stride(3) : t.stride(2);
  auto packed = empty_packed_heads(t, ceil_div(depth, 2), 2 * cols, slot);
  pack_each_head<bf16>(t, packed, [&](const bf16* from, bf16* to) {
    pack_bf16_pairs(loops, depth, cols, from, depth_stride, column_stride, to, packed.ld);
  });
  return packed;
}

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

// A tile's rows of weights for its block's paired keys (PairedKeys),
// rounded to bfloat16, one key block apart: the left operand of P V and
// dS K. A row's band of keys [k0, k1) of the block (TileBands) is held
// from column k0, which holds the band's first paired key (PairedKeys:
// key j0 + k0, or the next one where that is alone).
struct RoundedRows {
  RoundedRows(int64_t rows, int64_t key_block)
      : ld(key_block), bits(static_cast<size_t>(rows * key_block)) {}

  // Row r of m (keys [j0, j0 + m.cols)) in its band `keys` (columns of
  // m): its paired keys rounded.
  void round(
      const Bf16Rounding& rounding,
      const MatrixRef<float>& m,
      int64_t r,
      int64_t j0,
      const IndexRange& keys) {
    const PairedKeys paired(j0 + keys.begin, keys.end - keys.begin);
    rounding.row(
        m.row(r) + keys.begin + paired.lead, paired.count, bits.data() + r * ld + keys.begin);
  }

  // Replaces row r's bits, as round() left them, with what that rounding
  // lost, rounded in turn; `lost`: a key block of floats.
  void round_remainder(
      const Bf16Rounding& rounding,
      const MatrixRef<float>& m,
      int64_t r,
      int64_t j0,
      const IndexRange& keys,
      float* lost) {
    const PairedKeys paired(j0 + keys.begin, keys.end - keys.begin);
    const float* exact = m.row(r) + keys.begin + paired.lead;
    uint16_t* rounded = bits.data() + r * ld + keys.begin;
    for (int64_t c = 0; c < paired.count; ++c) { // widening bfloat16 is exact
      lost[c] = exact[c] -
          static_cast<float>(c10::BFloat16(rounded[c], c10::BFloat16::from_bits()));
    }
    rounding.row(lost, paired.count, rounded);
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

// Whether add_times_keys adds the keys that PairedKeys leaves alone.
enum class LoneKeys { add, skip };

// c (rows × key_rows.cols) += `rounded` (m's rows, RoundedRows::round)
// times those keys' pairs, then the lone keys of `m` (add_lone_keys): m
// times the keys [j0, j0 + m.cols), each run of row blocks over its band
// of keys (for_each_band), on `loops`' products. With LoneKeys::skip, the
// pairs alone.
void add_times_keys(
    const CpuLoops& loops,
    const MatrixRef<float>& m,
    int64_t j0,
    const RoundedRows& rounded,
    const PackedHeads& pairs,
    const uint16_t* head_pairs,
    const MatrixRef<bf16>& key_rows,
    const MatrixRef<float>& c,
    const TileBands& bands,
    LoneKeys lone_keys = LoneKeys::add) {
  for_each_band(bands.keys_of_query_block, m.rows, [&](int64_t r0, int64_t rows, IndexRange keys) {
    const auto block = m.row_block(r0, rows).column_block(keys.begin, keys.end - keys.begin);
    const int64_t k0 = j0 + keys.begin;
    const PairedKeys paired(k0, block.cols);
    if (paired.count > 0) {
      multiply(
          loops, rows, key_rows.cols,
          {paired.count, 1.0F, rounded.bits.data() + r0 * rounded.ld + keys.begin, rounded.ld,
           head_pairs + (k0 + paired.lead) / 2 * pairs.ld, pairs.ld, c.row(r0), c.row_stride,
           /*accumulate=*/true});
    }
    if (lone_keys == LoneKeys::add) {
      add_lone_keys(block, k0, key_rows, c.row(r0), c.row_stride);
    }
  });
}

// What the operands of either type read of a request: its sizes, scale
// and direction, and its heads in their 16 bits.
template <typename Element>
struct RequestHeads {
  RequestHeads(const AttentionParams& params, Direction direction, const CpuLoops& loops)
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
  Direction direction;
  Heads<Element> q, k, v;
};

// The products of the bfloat16 loops, on bfloat16 operands: Q and dO as
// they are (and transposed per tile), K, Kᵀ, V and Vᵀ packed in pairs per
// call, P and dS rounded per tile.
class Bf16Operands : RequestHeads<bf16> {
 public:
  using Element = bf16;
  // It accumulates dK and dV transposed (features × keys), the rows of
  // its products' left operands of unit stride.
  static constexpr bool kKeyGradientsTransposed = true;

  static bool runs(const CpuLoops& loops) { return bf16_gemm_runs(loops); }

  // It multiplies P rounded: add_weights_remainder_times_values adds the
  // remainder where the forward asks for P V of P itself.
  static constexpr bool kRoundsWeights = true;

  Bf16Operands(const AttentionParams& params, Direction direction, const CpuLoops& loops)
      : RequestHeads<bf16>(params, direction, loops),
        round_(bf16_rounding(loops)),
        keys_t_(packed_pairs(
            loops,
            params.k,
            /*rows_are_depth=*/false,
            WorkspaceSlot::keys_transposed)) {
    if (direction == Direction::forward) {
      values_ = packed_pairs(
          loops, params.v, /*rows_are_depth=*/true, WorkspaceSlot::values_transposed);
    } else {
      keys_ = packed_pairs(loops, params.k, /*rows_are_depth=*/true, WorkspaceSlot::keys_in_pairs);
      values_t_ = packed_pairs(
          loops, params.v, /*rows_are_depth=*/false, WorkspaceSlot::values_transposed);
    }
  }

  // A task's operands made per tile: P or dS rounded; in the backward, dS
  // or P in pairs of rows, and the tile's Qᵀ and dOᵀ, the left operands of
  // dKᵀ += Qᵀ dS and dVᵀ += dOᵀ P; in the forward, a row of what P's
  // rounding lost (add_weights_remainder_times_values).
  struct Scratch {
    RoundedRows rows;
    std::vector<uint16_t> pairs;     // (rows / 2, 2 key_block)
    std::vector<uint16_t> q_t, go_t; // (D, rows), (Dv, rows)
    std::vector<float> lost;         // forward: (key_block), RoundedRows::round_remainder
  };

  Scratch scratch(int64_t rows, int64_t key_block) const {
    const auto size = [&](int64_t n) {
      return static_cast<size_t>(direction == Direction::backward ? n : 0);
    };
    return Scratch{
        RoundedRows(rows, key_block),
        std::vector<uint16_t>(size(ceil_div(rows, 2) * 2 * key_block)),
        std::vector<uint16_t>(size(D * rows)), std::vector<uint16_t>(size(Dv * rows)),
        std::vector<float>(static_cast<size_t>(direction == Direction::forward ? key_block : 0))};
  }

  // The backward's Qᵀ and dOᵀ of `tile`; nothing in the forward.
  void start_tile(Scratch& s, const QueryTile& tile, const MatrixRef<bf16>& grad_out) const {
    if (direction == Direction::forward) {
      return;
    }
    const auto q_tile = q.head(tile.b, tile.h).row_block(tile.i0, tile.rows);
    for (int64_t r = 0; r < tile.rows; ++r) {
      const uint16_t* q_row = half_bits(q_tile.row(r));
      for (int64_t d = 0; d < D; ++d) {
        s.q_t[d * tile.rows + r] = q_row[d];
      }
      const uint16_t* go_row = half_bits(grad_out.row(r));
      for (int64_t d = 0; d < Dv; ++d) {
        s.go_t[d * tile.rows + r] = go_row[d];
      }
    }
  }

  // Its products compute a causal or windowed tile's bands, one product
  // per run of row blocks that share one (for_each_band).
  static bool computes_bands(const MatrixRef<float>& /*scores*/) { return true; }

  // scores = scale·Q Kᵀ for keys [j0, j0 + scores.cols) of `tile`, in its
  // bands.
  void score(
      Scratch& /*s*/,
      const QueryTile& tile,
      int64_t j0,
      const MatrixRef<float>& scores,
      const TileBands& bands) const {
    const auto q_tile = q.head(tile.b, tile.h).row_block(tile.i0, tile.rows);
    multiply_in_bands(
        q_tile, D, static_cast<float>(scale), keys_t_,
        keys_t_.head(tile.b, tile.h / group) + 2 * j0, scores, bands);
  }

  // Row r of the forward's weights `p` (keys from j0) is final in its band
  // `keys`: rounded while it is in cache.
  void take_weights_row(
      Scratch& s,
      const MatrixRef<float>& p,
      int64_t r,
      int64_t j0,
      const IndexRange& keys) const {
    s.rows.round(round_, p, r, j0, keys);
  }

  // out (p.rows × Dv) += P V, in the bands, p's rows taken
  // (take_weights_row).
  void add_weights_times_values(
      Scratch& s,
      const QueryTile& tile,
      int64_t j0,
      const MatrixRef<float>& p,
      const MatrixRef<float>& out,
      const TileBands& bands) const {
    add_rows_times_values(s, tile, j0, p, out, bands, LoneKeys::add);
  }

  // P V from P as it is, not rounded (the forward that keeps what its
  // output's rounding lost, ForwardResult::out_rounding): after
  // add_weights_times_values, out += (P - P rounded) V, the remainder
  // rounded in turn (the lone keys took P itself).
  void add_weights_remainder_times_values(
      Scratch& s,
      const QueryTile& tile,
      int64_t j0,
      const MatrixRef<float>& p,
      const MatrixRef<float>& out,
      const TileBands& bands) const {
    for (int64_t r = 0; r < p.rows; ++r) {
      s.rows.round_remainder(
          round_, p, r, j0, bands.keys_of_query_block[r / kProductRowBlock], s.lost.data());
    }
    add_rows_times_values(s, tile, j0, p, out, bands, LoneKeys::skip);
  }

  // dp = dO Vᵀ for keys [j0, j0 + dp.cols), in the bands.
  void grad_weights(
      Scratch& /*s*/,
      const QueryTile& tile,
      int64_t j0,
      const MatrixRef<bf16>& grad_out,
      const MatrixRef<float>& dp,
      const TileBands& bands) const {
    multiply_in_bands(
        grad_out, Dv, 1.0F, values_t_, values_t_.head(tile.b, tile.h / group) + 2 * j0, dp, bands);
  }

  // dVᵀ (Dv × p.cols: columns of `dv_t`) += dOᵀ P, each key over the
  // queries that computed it.
  void add_value_gradient(
      Scratch& s,
      const MatrixRef<float>& p,
      const MatrixRef<float>& dv_t,
      const TileBands& bands) const {
    add_left_times_pairs(s, p, s.go_t.data(), dv_t, bands);
  }

  // dQ (ds.rows × D) += dS K, without the scale, in the bands.
  void add_query_gradient(
      Scratch& s,
      const QueryTile& tile,
      int64_t j0,
      const MatrixRef<float>& ds,
      const MatrixRef<float>& dq,
      const TileBands& bands) const {
    for (int64_t r = 0; r < ds.rows; ++r) {
      s.rows.round(round_, ds, r, j0, bands.keys_of_query_block[r / kProductRowBlock]);
    }
    const int64_t kv_head = tile.h / group;
    add_times_keys(
        loops, ds, j0, s.rows, keys_, keys_.head(tile.b, kv_head), k.head(tile.b, kv_head), dq,
        bands);
  }

  // dKᵀ (D × ds.cols: columns of `dk_t`) += Qᵀ dS, without the scale, each
  // key over the queries that computed it.
  void add_key_gradient(
      Scratch& s,
      const MatrixRef<float>& ds,
      const MatrixRef<float>& dk_t,
      const TileBands& bands) const {
    add_left_times_pairs(s, ds, s.q_t.data(), dk_t, bands);
  }

  void round_row(const float* from, int64_t n, bf16* to) const {
    round_.row(from, n, half_bits(to));
  }

  static void widen_row(const bf16* from, int64_t n, float* to) { std::copy(from, from + n, to); }

 private:
  // out (left's rows × keys, the columns [j0, …) of `right`'s pairs from
  // `head_pairs`) = alpha · left times them, in the bands: each run of row
  // blocks over its band of keys (for_each_band).
  void multiply_in_bands(
      const MatrixRef<bf16>& left,
      int64_t depth,
      float alpha,
      const PackedHeads& right,
      const uint16_t* head_pairs,
      const MatrixRef<float>& out,
      const TileBands& bands) const {
    for_each_band(
        bands.keys_of_query_block, out.rows, [&](int64_t r0, int64_t rows, IndexRange keys) {
          multiply(
              loops, rows, keys.end - keys.begin,
              {depth, alpha, half_bits(left.row(r0)), left.row_stride, head_pairs + 2 * keys.begin,
               right.ld, out.row(r0) + keys.begin, out.row_stride,
               /*accumulate=*/false});
        });
  }

  // c (rows × m.cols) += `left` (rows × m.rows, the tile's queries, rows
  // m.rows apart) times m's rows rounded in pairs (rows 2p and 2p + 1 into
  // pair p, in their row block's band), the right operand of a product
  // whose depth is m's rows: each run of key blocks over the queries that
  // computed it (for_each_band).
  void add_left_times_pairs(
      Scratch& s,
      const MatrixRef<float>& m,
      const uint16_t* left,
      const MatrixRef<float>& c,
      const TileBands& bands) const {
    const int64_t pairs_ld = 2 * s.rows.ld;
    for (int64_t r = 0; r < m.rows; r += 2) {
      const auto& keys = bands.keys_of_query_block[r / kProductRowBlock];
      round_.row_pairs(
          m.row(r) + keys.begin, r + 1 < m.rows ? m.row(r + 1) + keys.begin : nullptr,
          keys.end - keys.begin, s.pairs.data() + r / 2 * pairs_ld + 2 * keys.begin);
    }
    for_each_band(
        bands.queries_of_key_block, m.cols, [&](int64_t c0, int64_t cols, IndexRange queries) {
          multiply(
              loops, c.rows, cols,
              {queries.end - queries.begin, 1.0F, left + queries.begin, m.rows,
               s.pairs.data() + queries.begin / 2 * pairs_ld + 2 * c0, pairs_ld, c.data + c0,
               c.row_stride, /*accumulate=*/true});
        });
  }

  // out += P V as add_times_keys takes it: P's rows as s.rows holds them,
  // times the tile's values.
  void add_rows_times_values(
      Scratch& s,
      const QueryTile& tile,
      int64_t j0,
      const MatrixRef<float>& p,
      const MatrixRef<float>& out,
      const TileBands& bands,
      LoneKeys lone_keys) const {
    const int64_t kv_head = tile.h / group;
    add_times_keys(
        loops, p, j0, s.rows, values_, values_.head(tile.b, kv_head), v.head(tile.b, kv_head), out,
        bands, lone_keys);
  }

  Bf16Rounding round_;
  PackedHeads keys_t_;   // Kᵀ in pairs along the features, for the scores
  PackedHeads values_;   // forward: V in pairs along the keys, for P V
  PackedHeads keys_;     // backward: K in pairs along the keys, for dQ = dS K
  PackedHeads values_t_; // backward: Vᵀ in pairs along the features, for dP = dO Vᵀ
};

// ---------------------------------------------------------------------------
// float16: the float loops' products on blocks widened per tile.

// Rows and columns per block of transposed_heads' copy.
constexpr int64_t kHalfTransposeBlock = 16;

// t (B, Hkv, rows, cols) transposed per head into (cols, rows) matrices of
// 16-bit elements: Kᵀ for the scores, Vᵀ for dP.
PackedHeads transposed_heads(const torch::Tensor& t, WorkspaceSlot slot) {
  const int64_t rows = t.size(2), cols = t.size(3);
  const int64_t row_stride = t.stride(2), column_stride = t.stride(3);
  auto packed = empty_packed_heads(t, cols, rows, slot);
  pack_each_head<half>(t, packed, [&](const half* from, half* to) {
    for (int64_t i0 = 0; i0 < rows; i0 += kHalfTransposeBlock) {
      const int64_t i_end = std::min(rows, i0 + kHalfTransposeBlock);
      for (int64_t j = 0; j < cols; ++j) {
        for (int64_t i = i0; i < i_end; ++i) {
          to[j * packed.ld + i] = from[i * row_stride + j * column_stride];
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
class Float16Operands : RequestHeads<half> {
 public:
  using Element = half;
  // It accumulates dK and dV as the float loops do (keys × features).
  static constexpr bool kKeyGradientsTransposed = false;

  static bool runs(const CpuLoops& loops) { return half_products_run(loops); }

  // It multiplies P as it is (add_weights_times_values): no remainder.
  static constexpr bool kRoundsWeights = false;

  Float16Operands(const AttentionParams& params, Direction direction, const CpuLoops& loops)
      : RequestHeads<half>(params, direction, loops),
        keys_t_(transposed_heads(params.k, WorkspaceSlot::keys_transposed)) {
    TORCH_INTERNAL_ASSERT(
        (k.cols <= 1 || k.column_stride == 1) && (v.cols <= 1 || v.column_stride == 1),
        "the keys and values have rows of unit stride");
    if (direction == Direction::backward) {
      values_t_ = transposed_heads(params.v, WorkspaceSlot::values_transposed);
    }
  }

  // A task's float operands: the tile's Q (rows × D) and, in the
  // backward, dO (rows × Dv); a block of Kᵀ or Vᵀ (features × keys) and
  // one of V or K (keys × features).
  struct Scratch {
    std::vector<float> q, grad_out;
    WidenedBlock features_by_keys, keys_by_features;
    int64_t rows = 0; // of the tile
  };

  Scratch scratch(int64_t rows, int64_t key_block) const {
    const bool backward = direction == Direction::backward;
    const int64_t features = std::max(D, Dv);
    return Scratch{
        std::vector<float>(static_cast<size_t>(rows * D)),
        std::vector<float>(static_cast<size_t>(backward ? rows * Dv : 0)),
        WidenedBlock(features, key_block), WidenedBlock(key_block, features)};
  }

  // Where the float loops' products run, they compute only a causal or
  // windowed tile's bands (tile_addmm_banded), as the float kernel does.
  bool computes_bands(const MatrixRef<float>& scores) const {
    return tile_loops_take(
        loops, scores, MatrixRef<float>{nullptr, scores.rows, D, D, 1},
        MatrixRef<float>{nullptr, D, scores.cols, scores.cols, 1}, 0);
  }

  // The tile's Q and, in the backward, dO widened.
  void start_tile(Scratch& s, const QueryTile& tile, const MatrixRef<half>& grad_out) const {
    s.rows = tile.rows;
    const auto q_tile = q.head(tile.b, tile.h).row_block(tile.i0, tile.rows);
    for (int64_t r = 0; r < tile.rows; ++r) {
      widen_row(q_tile.row(r), D, s.q.data() + r * D);
      if (direction == Direction::backward) {
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
    add_times_widened_rows(s, p, v.head(tile.b, tile.h / group), j0, out, bands);
  }

  // dp = dO Vᵀ for keys [j0, j0 + dp.cols), in the bands.
  void grad_weights(
      Scratch& s,
      const QueryTile& tile,
      int64_t j0,
      const MatrixRef<half>& /*grad_out: widened in s*/,
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
      const TileBands& bands) const {
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
      const TileBands& bands) const {
    add_times_widened_rows(s, ds, k.head(tile.b, tile.h / group), j0, dq, bands);
  }

  // dK (ds.cols × D) += dSᵀ Q, without the scale, each key over the
  // queries that computed it.
  void add_key_gradient(
      Scratch& s,
      const MatrixRef<float>& ds,
      const MatrixRef<float>& dk,
      const TileBands& bands) const {
    tile_addmm_banded(
        loops, dk, ds.transposed(), queries(s), 1, 1, ProductBand::depth,
        bands.queries_of_key_block);
  }

  void round_row(const float* from, int64_t n, half* to) const {
    round_half_row(loops, from, n, half_bits(to));
  }

  void widen_row(const half* from, int64_t n, float* to) const {
    widen_half_row(loops, half_bits(from), n, to);
  }

 private:
  MatrixRef<float> queries(Scratch& s) const { return {s.q.data(), s.rows, D, D, 1}; }
  MatrixRef<float> grad_outputs(Scratch& s) const { return {s.grad_out.data(), s.rows, Dv, Dv, 1}; }

  // c (m.rows × keys.cols) += m times the rows [j0, j0 + m.cols) of
  // `keys` (V or K of one head), widened, in the bands.
  void add_times_widened_rows(
      Scratch& s,
      const MatrixRef<float>& m,
      const MatrixRef<half>& keys,
      int64_t j0,
      const MatrixRef<float>& c,
      const TileBands& bands) const {
    const auto rows = s.keys_by_features.widen(
        loops, half_bits(keys.row(j0)), keys.row_stride, m.cols, keys.cols);
    tile_addmm_banded(loops, c, m, rows, 1, 1, ProductBand::depth, bands.keys_of_query_block);
  }

  PackedHeads keys_t_;   // Kᵀ, for the scores
  PackedHeads values_t_; // backward: Vᵀ, for dP = dO Vᵀ
};

// ---------------------------------------------------------------------------
// The loops, on either type's operands.

// What both directions read: the per-row inputs in float, and the
// operands of the products (Bf16Operands or Float16Operands).
template <typename Operands>
struct HalfInputs : RowInputs<float> {
  HalfInputs(const AttentionParams& params, Direction direction, const CpuLoops& loops)
      : RowInputs<float>(params, loops),
        D(params.D()),
        Dv(params.Dv()),
        products(params, direction, loops) {}
  int64_t D, Dv;
  Operands products;
};

// dst (n elements, 16-bit or float) = src, rounded where dst is 16-bit.
template <typename Operands>
void store_row(
    const Operands& products,
    const float* src,
    int64_t n,
    typename Operands::Element* dst) {
  products.round_row(src, n, dst);
}
template <typename Operands>
void store_row(const Operands& /*products*/, const float* src, int64_t n, float* dst) {
  std::copy(src, src + n, dst);
}

// dst (rows × cols, 16-bit or float) = factor · src (rows × cols,
// contiguous), which is scaled in place.
template <typename Operands, typename T>
void write_scaled(const Operands& products, const MatrixRef<T>& dst, float* src, float factor) {
  for (int64_t r = 0; r < dst.rows; ++r) {
    float* row = src + r * dst.cols;
    for (int64_t c = 0; c < dst.cols; ++c) {
      row[c] *= factor;
    }
    store_row(products, row, dst.cols, dst.row(r));
  }
}

// ---------------------------------------------------------------------------
// Forward.

// A forward task's working memory: one tile's scores (float) over
// `score_cols` keys (a block; every key for the weights kernel), the
// products' operands made per tile, its rows' online softmax and output
// accumulated in float, and a row of the output widened back.
template <typename Operands>
struct HalfForwardScratch {
  OwnedMatrix<float> scores; // (kQueryTile, score_cols)
  typename Operands::Scratch operands;
  std::vector<float> out; // (kQueryTile, Dv)
  OnlineSoftmax<float> softmax;
  TileBands bands;
  std::vector<float> widened; // (Dv)
};

template <typename Operands>
HalfForwardScratch<Operands> forward_scratch(const HalfInputs<Operands>& in, int64_t score_cols) {
  const int64_t rows = std::min(kQueryTile, in.L);
  return HalfForwardScratch<Operands>{
      OwnedMatrix<float>(spread_workspace_tensor(
          WorkspaceSlot::tile_scores, {rows, score_cols}, torch::dtype(torch::kFloat))),
      in.products.scratch(rows, in.key_block),
      std::vector<float>(static_cast<size_t>(rows * in.Dv)),
      OnlineSoftmax<float>{},
      TileBands{},
      std::vector<float>(static_cast<size_t>(in.Dv))};
}

// Keys [j0, j0 + cols) of one query tile, in the bands its products
// compute (TileBands): the scores, the row pass (forward_row), and out +=
// P V; with `weights_unrounded`, P V from P as it is where the products
// round it (Operands::kRoundsWeights).
template <typename Operands>
void forward_block(
    const HalfInputs<Operands>& in,
    HalfForwardScratch<Operands>& scratch,
    const QueryTile& tile,
    int64_t j0,
    int64_t cols,
    bool weights_unrounded) {
  const auto scores = scratch.scores.matrix.row_block(0, tile.rows).column_block(0, cols);
  scratch.bands.fit_queries(in.mask, tile, j0, cols, in.products.computes_bands(scores));
  const auto& keys_of = scratch.bands.keys_of_query_block;
  in.products.score(scratch.operands, tile, j0, scores, scratch.bands);
  for (int64_t r = 0; r < tile.rows; ++r) {
    const auto [begin, end] = keys_of[r / kProductRowBlock];
    forward_row<float>(
        in, scratch.softmax, tile, r, j0 + begin, scores.row(r) + begin, end - begin,
        scratch.out.data() + r * in.Dv, in.Dv);
    in.products.take_weights_row(scratch.operands, scores, r, j0, keys_of[r / kProductRowBlock]);
  }
  const MatrixRef<float> out{scratch.out.data(), tile.rows, in.Dv, in.Dv};
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
// NaN); `widened`: n floats.
template <typename Operands>
void write_rounding(
    const Operands& products,
    const float* exact,
    const typename Operands::Element* rounded,
    int64_t n,
    float* widened,
    typename Operands::Element* rounding) {
  products.widen_row(rounded, n, widened);
  for (int64_t c = 0; c < n; ++c) {
    widened[c] = std::isfinite(widened[c]) ? exact[c] - widened[c] : 0.0F;
  }
  products.round_row(widened, n, rounding);
}

template <typename Operands>
void half_forward(const HalfInputs<Operands>& in, const ForwardResult& result) {
  using Element = typename Operands::Element;
  const Heads<Element> out_heads(result.out);
  const auto rounding_heads = heads_if_defined<Element>(result.out_rounding);
  float* const lse_data = result.lse.data_ptr<float>();
  const double flops_per_tile = 2.0 * std::min(kQueryTile, in.L) * in.S * (in.D + in.Dv);
  parallel_query_tiles(
      in.B, in.H, in.L, kQueryTile, flops_per_tile,
      [&] { return forward_scratch(in, in.key_block); },
      [&](HalfForwardScratch<Operands>& scratch, const QueryTile& tile) {
        std::fill(scratch.out.begin(), scratch.out.end(), 0.0F);
        scratch.softmax.start(in.modifiers.sink(tile.h));
        in.products.start_tile(scratch.operands, tile, MatrixRef<Element>{});
        const int64_t key_end = in.mask.tile_key_end(tile.i0, tile.rows);
        const auto next_keys = [&](int64_t from) {
          return in.mask.next_keys(tile.b, tile.h, tile.i0, from, key_end, in.key_block);
        };
        for (auto keys = next_keys(in.mask.tile_key_begin(tile.i0)); keys.begin < keys.end;
             keys = next_keys(keys.end)) {
          forward_block(
              in, scratch, tile, keys.begin, keys.end - keys.begin, rounding_heads.data != nullptr);
        }
        const auto out_tile = out_heads.head(tile.b, tile.h).row_block(tile.i0, tile.rows);
        const auto rounding_tile =
            rounding_heads.head(tile.b, tile.h).row_block(tile.i0, tile.rows);
        float* lse_row = lse_data + (tile.b * in.H + tile.h) * in.L + tile.i0;
        for (int64_t r = 0; r < tile.rows; ++r) {
          float* acc = scratch.out.data() + r * in.Dv;
          write_scaled(
              in.products, MatrixRef<Element>{out_tile.row(r), 1, in.Dv, in.Dv}, acc,
              scratch.softmax.output_factor(r, in.keep_scale));
          if (rounding_tile.data != nullptr) {
            write_rounding(
                in.products, acc, out_tile.row(r), in.Dv, scratch.widened.data(),
                rounding_tile.row(r));
          }
          lse_row[r] = scratch.softmax.lse(r);
        }
      });
}

// ---------------------------------------------------------------------------
// Forward with the weights.

// `step(j0, block)` for each block of up to key_block columns of
// `scores`, whose first column is key `key_begin`.
template <typename Step>
void for_each_key_block(
    const MatrixRef<float>& scores,
    int64_t key_begin,
    int64_t key_block,
    const Step& step) {
  for (int64_t c0 = 0; c0 < scores.cols; c0 += key_block) {
    step(key_begin + c0, scores.column_block(c0, std::min(key_block, scores.cols - c0)));
  }
}

// One query tile's weights over keys [key_begin, key_begin + scores.cols),
// every key the tile sees: the scores block by block, each row's softmax
// (weights_row) in float, rounded once into `weights` (the tile's rows of
// (L, S), at those keys) and its log-sum-exp into `lse`; then out += P V
// block by block, P as the type's products take it.
template <typename Operands>
void weights_tile(
    const HalfInputs<Operands>& in,
    HalfForwardScratch<Operands>& scratch,
    const QueryTile& tile,
    int64_t key_begin,
    const MatrixRef<float>& scores,
    const MatrixRef<typename Operands::Element>& weights,
    float* lse) {
  auto& operands = scratch.operands;
  in.products.start_tile(operands, tile, {});
  for_each_key_block(
      scores, key_begin, in.key_block, [&](int64_t j0, const MatrixRef<float>& block) {
        scratch.bands.cover_whole(tile.rows, block.cols);
        in.products.score(operands, tile, j0, block, scratch.bands);
      });
  for (int64_t r = 0; r < tile.rows; ++r) {
    lse[r] = weights_row<float>(
        in, tile.b, tile.h, tile.i0 + r, key_begin, scores.row(r), scores.cols);
    store_row(in.products, scores.row(r), scores.cols, weights.row(r));
  }
  const MatrixRef<float> out{scratch.out.data(), tile.rows, in.Dv, in.Dv};
  std::fill(scratch.out.begin(), scratch.out.end(), 0.0F);
  for_each_key_block(
      scores, key_begin, in.key_block, [&](int64_t j0, const MatrixRef<float>& block) {
        scratch.bands.cover_whole(tile.rows, block.cols);
        for (int64_t r = 0; r < tile.rows; ++r) {
          in.products.take_weights_row(operands, block, r, j0, {0, block.cols});
        }
        in.products.add_weights_times_values(operands, tile, j0, block, out, scratch.bands);
      });
}

// The weights kernel in half precision: each query tile's weights
// materialised in (B, H, L, S), in the inputs' dtype, then multiplied
// into V; the output (B, H, L, Dv) in the inputs' dtype, lse in float.
template <typename Operands>
void half_forward_with_weights(const HalfInputs<Operands>& in, const ForwardResult& result) {
  using Element = typename Operands::Element;
  const Heads<Element> out_heads(result.out), weight_heads(result.weights);
  float* const lse_data = result.lse.data_ptr<float>();
  const double flops_per_tile = 2.0 * std::min(kQueryTile, in.L) * in.S * (in.D + in.Dv);
  parallel_query_tiles(
      in.B, in.H, in.L, kQueryTile, flops_per_tile,
      [&] { return forward_scratch(in, std::max<int64_t>(in.S, 1)); },
      [&](HalfForwardScratch<Operands>& scratch, const QueryTile& tile) {
        const auto out_tile = out_heads.head(tile.b, tile.h).row_block(tile.i0, tile.rows);
        const auto w_tile = weight_heads.head(tile.b, tile.h).row_block(tile.i0, tile.rows);
        float* lse = lse_data + (tile.b * in.H + tile.h) * in.L + tile.i0;
        const auto [key_begin, key_end] = start_weights_tile(in, tile, w_tile, out_tile, lse);
        const int64_t cols = key_end - key_begin;
        if (cols == 0) {
          return;
        }
        weights_tile(
            in, scratch, tile, key_begin,
            scratch.scores.matrix.row_block(0, tile.rows).column_block(0, cols),
            w_tile.column_block(key_begin, cols), lse);
        for (int64_t r = 0; r < tile.rows; ++r) {
          store_row(in.products, scratch.out.data() + r * in.Dv, in.Dv, out_tile.row(r));
        }
      });
}

// ---------------------------------------------------------------------------
// Backward.

// What the backward reads besides the inputs, and the gradients it writes.
template <typename Element>
struct HalfBackwardTensors {
  Heads<Element> out, grad_out; // (B, H, L, Dv), rows of unit stride
  Heads<Element> out_rounding;  // likewise, or no heads (ForwardResult::out_rounding)
  const float* lse;             // (B, H, L), contiguous
  torch::Tensor dk, dv;         // (B, H, S, ·), 16-bit, or float to be summed over groups
  ModifierGradients<float> modifiers;
};

// A backward task's working memory: the float tiles of the float loops,
// the products' operands made per tile, and the gradients it accumulates
// in float: dQ for a query tile, dK and dV for its range of keys (in the
// layout of key_gradient_block).
template <typename Operands>
struct HalfBackwardScratch {
  OwnedMatrix<float> probs, grad_scores, score_slopes; // (kQueryTile, key_block)
  std::vector<float> delta;                            // (kQueryTile)
  std::vector<float> widened; // a row of dO, of O and of O's rounding: (3, Dv)
  TileBands bands;
  typename Operands::Scratch operands;
  std::vector<float> dq;     // (kQueryTile, D)
  std::vector<float> dk, dv; // D and Dv features of the task's keys
};

template <typename Operands>
HalfBackwardScratch<Operands> backward_scratch(
    const HalfInputs<Operands>& in,
    int64_t keys_per_task) {
  const int64_t rows = std::min(kQueryTile, in.L);
  const auto tile = [&](WorkspaceSlot slot) {
    return OwnedMatrix<float>(
        spread_workspace_tensor(slot, {rows, in.key_block}, torch::dtype(torch::kFloat)));
  };
  const auto size = [](int64_t n) { return static_cast<size_t>(n); };
  return HalfBackwardScratch<Operands>{
      tile(WorkspaceSlot::tile_scores),
      tile(WorkspaceSlot::tile_grad_scores),
      in.modifiers.bends_scores() ? tile(WorkspaceSlot::tile_score_slopes)
                                  : OwnedMatrix<float>(torch::empty({0, 0})),
      std::vector<float>(size(kQueryTile)),
      std::vector<float>(size(3 * in.Dv)),
      TileBands{},
      in.products.scratch(rows, in.key_block),
      std::vector<float>(size(rows * in.D)),
      std::vector<float>(size(in.D * keys_per_task)),
      std::vector<float>(size(in.Dv * keys_per_task))};
}

// One query tile of a backward task: where it is, and the rows it reads.
template <typename Element>
struct HalfBackwardTile {
  QueryTile tile;
  int64_t task;
  int64_t keys_begin; // the task's first key: the first of dk and dv
  MatrixRef<Element> grad_out;
  const float* lse;
};

// The tile's operands (Operands::start_tile) and its rows' delta_i =
// Σ_d dO_id · O_id (fill_row_deltas of the float loops), in float: O
// the output plus what its rounding lost where the forward kept it.
template <typename Operands>
void start_backward_tile(
    const HalfInputs<Operands>& in,
    const HalfBackwardTensors<typename Operands::Element>& t,
    HalfBackwardScratch<Operands>& scratch,
    const HalfBackwardTile<typename Operands::Element>& bt) {
  const QueryTile& tile = bt.tile;
  in.products.start_tile(scratch.operands, tile, bt.grad_out);
  const auto out = t.out.head(tile.b, tile.h).row_block(tile.i0, tile.rows);
  const auto rounding = t.out_rounding.head(tile.b, tile.h).row_block(tile.i0, tile.rows);
  float* go_row = scratch.widened.data();
  float* out_row = go_row + in.Dv;
  float* rounding_row = out_row + in.Dv;
  for (int64_t r = 0; r < tile.rows; ++r) {
    in.products.widen_row(bt.grad_out.row(r), in.Dv, go_row);
    in.products.widen_row(out.row(r), in.Dv, out_row);
    if (rounding.data != nullptr) {
      in.products.widen_row(rounding.row(r), in.Dv, rounding_row);
      for (int64_t d = 0; d < in.Dv; ++d) {
        out_row[d] += rounding_row[d];
      }
    }
    float delta = 0;
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
MatrixRef<float> key_gradient_block(
    std::vector<float>& accumulator,
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

// One query tile against keys [j0, j0 + cols), in the bands its products
// compute (TileBands): P recomputed, dP = dO Vᵀ, dS through the float
// loops' row passes, and their products added to dQ, dK and dV (dQ and dK
// without the scale, which the writes apply).
template <typename Operands>
void backward_block(
    const HalfInputs<Operands>& in,
    const HalfBackwardTensors<typename Operands::Element>& t,
    HalfBackwardScratch<Operands>& scratch,
    const HalfBackwardTile<typename Operands::Element>& bt,
    int64_t j0,
    int64_t cols,
    int64_t keys_per_task) {
  const QueryTile& tile = bt.tile;
  const int64_t rows = tile.rows;
  const auto p = scratch.probs.matrix.row_block(0, rows).column_block(0, cols);
  const auto ds = scratch.grad_scores.matrix.row_block(0, rows).column_block(0, cols);
  const bool bent = in.modifiers.bends_scores();
  const auto slopes = bent ? scratch.score_slopes.matrix.row_block(0, rows).column_block(0, cols)
                           : MatrixRef<float>{};
  auto& bands = scratch.bands;
  bands.fit_queries(in.mask, tile, j0, cols, in.products.computes_bands(p));
  bands.fit_keys(rows, cols);
  const auto& keys_of = bands.keys_of_query_block;
  const int64_t column = j0 - bt.keys_begin; // of dk and dv
  const auto dk = key_gradient_block<Operands>(scratch.dk, in.D, keys_per_task, column, cols);
  const auto dv = key_gradient_block<Operands>(scratch.dv, in.Dv, keys_per_task, column, cols);
  auto& operands = scratch.operands;

  in.products.score(operands, tile, j0, p, bands);
  backward_probability_rows<float>(in, tile, p, slopes, j0, bt.lse, keys_of);
  // dV += Pᵀ dO, with P as the forward multiplied it into V.
  const auto add_value_gradient = [&] { in.products.add_value_gradient(operands, p, dv, bands); };
  if (!in.dropout.active()) {
    add_value_gradient();
  }
  in.products.grad_weights(operands, tile, j0, bt.grad_out, ds, bands); // dP = dO Vᵀ
  softmax_backward_rows<float>(in, tile, p, ds, j0, scratch.delta, keys_of);
  if (in.dropout.active()) {
    add_value_gradient();
  }
  if (bent || t.modifiers.any()) {
    modifier_backward_rows<float>(in, t.modifiers, tile, bt.task, ds, slopes, j0, keys_of);
  }
  in.products.add_query_gradient(
      operands, tile, j0, ds, MatrixRef<float>{scratch.dq.data(), rows, in.D, in.D},
      bands);                                            // dQ += dS K
  in.products.add_key_gradient(operands, ds, dk, bands); // dK += dSᵀ Q
}

// dst (rows × cols, 16-bit or float) = factor · srcᵀ, src (cols × rows,
// rows `ld` apart): kTransposeRows rows at a time, each read in runs of
// src's rows and transposed through a float block, then stored whole.
template <typename Operands, typename T>
void write_transposed(
    const Operands& products,
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
      store_row(products, block.data() + k * dst.cols, dst.cols, dst.row(r0 + k));
    }
  }
}

// dst (n keys × features, 16-bit or float) = factor · the task's
// accumulator `src` of `keys` keys (key_gradient_block's layout), which
// may be scaled in place.
template <typename Operands, typename T>
void write_key_gradient(
    const Operands& products,
    const MatrixRef<T>& dst,
    float* src,
    int64_t keys,
    float factor) {
  if constexpr (Operands::kKeyGradientsTransposed) {
    write_transposed(products, dst, src, keys, factor);
  } else {
    write_scaled(products, dst, src, factor);
  }
}

// Rows [first, first + n) of head (b, h) of a key or value gradient
// (16-bit, or float where grouped heads' gradients are summed after) =
// factor · the task's accumulator `src` of `keys` keys.
template <typename Operands>
void write_key_rows(
    const Operands& products,
    const torch::Tensor& grad,
    int64_t b,
    int64_t h,
    int64_t first,
    int64_t n,
    float* src,
    int64_t keys,
    float factor) {
  if (grad.scalar_type() == torch::kFloat) {
    write_key_gradient(
        products, Heads<float>(grad).head(b, h).row_block(first, n), src, keys, factor);
  } else {
    using Element = typename Operands::Element;
    write_key_gradient(
        products, Heads<Element>(grad).head(b, h).row_block(first, n), src, keys, factor);
  }
}

// Backward, as the float loops' flash_backward divides it: a task takes
// one range of keys of one (b, h), accumulates their dK and dV and
// writes their rows of dK and dV once; where a head's keys are split,
// each range writes its share of dQ (float) into a buffer of its own,
// summed into dq at the end.
template <typename Operands>
void half_backward(
    const HalfInputs<Operands>& in,
    const ForwardResult& forward,
    const torch::Tensor& grad_out,
    const InputGradients& grads) {
  using Element = typename Operands::Element;
  const int64_t splits = backward_key_splits(in.B * in.H, in.S, in.key_block);
  const ScoreGradientBuffers<float> score_grads(in, grads, splits);
  const HalfBackwardTensors<Element> t{
      Heads<Element>(forward.out),
      Heads<Element>(grad_out),
      heads_if_defined<Element>(forward.out_rounding),
      forward.lse.data_ptr<float>(),
      grads.dk,
      grads.dv,
      score_grads.for_tasks()};
  const int64_t keys_per_split = ceil_div(ceil_div(in.S, in.key_block), splits) * in.key_block;
  const int64_t keys_per_task = std::min(in.S, keys_per_split);
  const torch::Tensor dq_parts = splits == 1
      ? torch::Tensor()
      : torch::empty({splits, in.B, in.H, in.L, in.D}, torch::kFloat);
  const Heads<Element> dq_heads(grads.dq);
  const double flops_per_task = 10.0 * in.L * in.S * in.D / static_cast<double>(splits);
  parallel_units(
      in.B * in.H * splits, flops_per_task, [&] { return backward_scratch(in, keys_per_task); },
      [&](HalfBackwardScratch<Operands>& scratch, int64_t unit) {
        const int64_t b = unit / (in.H * splits), h = unit / splits % in.H, split = unit % splits;
        const int64_t keys_begin = std::min(in.S, split * keys_per_split);
        const int64_t keys_end = std::min(in.S, keys_begin + keys_per_split);
        std::fill(scratch.dk.begin(), scratch.dk.end(), 0.0F);
        std::fill(scratch.dv.begin(), scratch.dv.end(), 0.0F);
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
            const HalfBackwardTile<Element> bt{
                tile, unit, keys_begin, t.grad_out.head(b, h).row_block(i0, tile.rows),
                t.lse + (b * in.H + h) * in.L + i0};
            start_backward_tile(in, t, scratch, bt);
            for (auto keys = first; keys.begin < keys.end; keys = next_keys(keys.end)) {
              backward_block(in, t, scratch, bt, keys.begin, keys.end - keys.begin, keys_per_task);
            }
          }
          if (splits == 1) {
            write_scaled(
                in.products, dq_heads.head(b, h).row_block(i0, tile.rows), scratch.dq.data(),
                in.scale);
          } else {
            float* part = dq_parts.data_ptr<float>() +
                (((split * in.B + b) * in.H + h) * in.L + i0) * in.D;
            write_scaled(
                in.products, MatrixRef<float>{part, tile.rows, in.D, in.D}, scratch.dq.data(),
                in.scale);
          }
        }
        const int64_t n = keys_end - keys_begin;
        write_key_rows(
            in.products, t.dk, b, h, keys_begin, n, scratch.dk.data(), keys_per_task, in.scale);
        write_key_rows(
            in.products, t.dv, b, h, keys_begin, n, scratch.dv.data(), keys_per_task, 1.0F);
      });
  if (splits > 1) {
    grads.dq.copy_(dq_parts.sum(0));
  }
  score_grads.finish(grads);
}

// `loops_of_type(inputs)` on Operands' inputs for `params` in `direction`;
// false, running nothing, where `loops` cannot run that type's products.
template <typename Operands, typename Loops>
bool run_tiled_on(
    const CpuLoops& loops,
    const AttentionParams& params,
    Direction direction,
    const Loops& loops_of_type) {
  if (!Operands::runs(loops)) {
    return false;
  }
  loops_of_type(HalfInputs<Operands>(params, direction, loops));
  return true;
}

// run_tiled_on with the operands of params' dtype; false for any other dtype.
template <typename Loops>
bool run_tiled_in_half(
    const CpuLoops& loops,
    const AttentionParams& params,
    Direction direction,
    const Loops& loops_of_type) {
  switch (params.q.scalar_type()) {
    case torch::kBFloat16:
      return run_tiled_on<Bf16Operands>(loops, params, direction, loops_of_type);
    case torch::kHalf:
      return run_tiled_on<Float16Operands>(loops, params, direction, loops_of_type);
    default: return false;
  }
}

} // namespace

bool tiled_forward_half(
    const CpuLoops& loops,
    const AttentionParams& params,
    const ForwardResult& result) {
  return run_tiled_in_half(
      loops, params, Direction::forward, [&](const auto& in) { half_forward(in, result); });
}

bool tiled_backward_half(
    const CpuLoops& loops,
    const AttentionParams& params,
    const ForwardResult& forward,
    const torch::Tensor& grad_out,
    const InputGradients& grads) {
  return run_tiled_in_half(loops, params, Direction::backward, [&](const auto& in) {
    half_backward(in, forward, grad_out, grads);
  });
}

bool tiled_forward_with_weights_half(
    const CpuLoops& loops,
    const AttentionParams& params,
    const ForwardResult& result) {
  return run_tiled_in_half(loops, params, Direction::forward, [&](const auto& in) {
    half_forward_with_weights(in, result);
  });
}

} // namespace attn::detail
