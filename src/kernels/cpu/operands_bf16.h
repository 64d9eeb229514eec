#pragma once

// The bfloat16 operand policy of the tiled loops (tiled_template.h):
// bfloat16 products (tile_product.h, gemm_bf16) in a causal or windowed
// tile's bands (one product per run of row blocks that share a band),
// their right operands packed in pairs along the depth (pack_bf16_pairs):
// K, Kᵀ, V and Vᵀ once per call, the probabilities P and the scores'
// gradients dS rounded to bfloat16 per tile, in their bands; dKᵀ and dVᵀ
// accumulated (the products' rows are the heads' features) and
// transposed once.

#include "kernels/cpu/micro_tile.h"
#include "kernels/cpu/tiled_operands.h"

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace attn::detail {

// gemm_bf16, which the callers' check (bf16_gemm_runs) lets run.
inline void multiply_bf16(
    const CpuLoops& loops,
    int64_t rows,
    int64_t cols,
    const Bf16GemmOperands& g) {
  TORCH_INTERNAL_ASSERT(gemm_bf16(loops, rows, cols, g), "no bfloat16 products on these loops");
}

// `source`'s keys or values per kv head, in pairs along the depth of the
// product they are the right operand of (pack_bf16_pairs): with
// `keys_are_depth`, B = the head's keys (V for the output, K for dQ); else
// its transpose (Kᵀ for the scores, Vᵀ for dP). PackedHeads::rows counts
// the pairs.
template <typename Source>
PackedHeads packed_pairs(
    const CpuLoops& loops,
    const Source& source,
    KeyOrValue which,
    bool keys_are_depth,
    WorkspaceSlot slot) {
  const int64_t keys = source.length(), features = source.width(which);
  const int64_t depth = keys_are_depth ? keys : features;
  const int64_t cols = keys_are_depth ? features : keys;
  auto packed = empty_packed_heads(source, ceil_div(depth, 2), 2 * cols, slot);
  make_each_head<c10::BFloat16>(
      source, which, packed.memory, 1,
      [&](int64_t first, const MatrixRef<c10::BFloat16>& run, c10::BFloat16* to) {
        if (keys_are_depth) {
          TORCH_INTERNAL_ASSERT(first % 2 == 0, "a run of keys starts within a pair");
          pack_bf16_pairs(
              loops, run.rows, features, run.data, run.row_stride, run.column_stride,
              to + first / 2 * packed.ld, packed.ld);
        } else {
          pack_bf16_pairs(
              loops, features, run.rows, run.data, run.column_stride, run.row_stride,
              to + 2 * first, packed.ld);
        }
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
// `key_rows` (those keys of K or V, from key j0), in float.
inline void add_lone_keys(
    const MatrixRef<float>& m,
    int64_t j0,
    const MatrixRef<c10::BFloat16>& key_rows,
    float* c,
    int64_t ldc) {
  const PairedKeys paired(j0, m.cols);
  const auto add = [&](int64_t column) {
    const c10::BFloat16* key = key_rows.row(column);
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
// times the keys [j0, j0 + m.cols) (`key_rows`, from key j0), each run of
// row blocks over its band of keys (for_each_band), on `loops`' products.
// With LoneKeys::skip, the pairs alone.
inline void add_times_keys(
    const CpuLoops& loops,
    const MatrixRef<float>& m,
    int64_t j0,
    const RoundedRows& rounded,
    const PackedHeads& pairs,
    const uint16_t* head_pairs,
    const MatrixRef<c10::BFloat16>& key_rows,
    const MatrixRef<float>& c,
    const TileBands& bands,
    LoneKeys lone_keys = LoneKeys::add) {
  for_each_band(bands.keys_of_query_block, m.rows, [&](int64_t r0, int64_t rows, IndexRange keys) {
    const auto block = m.row_block(r0, rows).column_block(keys.begin, keys.end - keys.begin);
    const int64_t k0 = j0 + keys.begin;
    const PairedKeys paired(k0, block.cols);
    if (paired.count > 0) {
      multiply_bf16(
          loops, rows, key_rows.cols,
          {paired.count, 1.0F, rounded.bits.data() + r0 * rounded.ld + keys.begin, rounded.ld,
           head_pairs + (k0 + paired.lead) / 2 * pairs.ld, pairs.ld, c.row(r0), c.row_stride,
           /*accumulate=*/true});
    }
    if (lone_keys == LoneKeys::add) {
      add_lone_keys(block, k0, key_rows.row_block(keys.begin, block.cols), c.row(r0), c.row_stride);
    }
  });
}

// The products of the bfloat16 loops, on bfloat16 operands: Q and dO as
// they are (and transposed per tile), K, Kᵀ, V and Vᵀ packed in pairs per
// call, P and dS rounded per tile.
template <typename Source = KeyValueSource<c10::BFloat16>>
class Bf16Operands : RequestHeads<c10::BFloat16, Source> {
  using Base = RequestHeads<c10::BFloat16, Source>;
  using Base::D, Base::Dv, Base::direction, Base::group, Base::kv, Base::loops, Base::q,
      Base::scale;

 public:
  using Element = c10::BFloat16;
  // It accumulates dK and dV transposed (features × keys), the rows of
  // its products' left operands of unit stride.
  static constexpr bool kKeyGradientsTransposed = true;

  // Scores, softmax and accumulators in float, the accumulators memory of
  // the task's own (the outputs and gradients rounded once from them).
  using Accum = float;
  static constexpr bool kAccumulatesInPlace = false;

  static bool runs(const CpuLoops& loops) { return bf16_gemm_runs(loops); }

  // It multiplies P rounded: add_weights_remainder_times_values adds the
  // remainder where the forward asks for P V of P itself.
  static constexpr bool kRoundsWeights = true;

  Bf16Operands(const AttentionParams& params, OperandDirection direction, const CpuLoops& loops)
      : Base(params, direction, loops),
        round_(bf16_rounding(loops)),
        keys_t_(packed_pairs(
            loops,
            kv,
            KeyOrValue::key,
            /*keys_are_depth=*/false,
            WorkspaceSlot::keys_transposed)) {
    if (direction == OperandDirection::forward) {
      values_ = packed_pairs(
          loops, kv, KeyOrValue::value, /*keys_are_depth=*/true, WorkspaceSlot::values_transposed);
    } else {
      keys_ = packed_pairs(
          loops, kv, KeyOrValue::key, /*keys_are_depth=*/true, WorkspaceSlot::keys_in_pairs);
      values_t_ = packed_pairs(
          loops, kv, KeyOrValue::value, /*keys_are_depth=*/false, WorkspaceSlot::values_transposed);
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
    typename Source::Buffer read;
  };

  Scratch scratch(int64_t rows, int64_t key_block) const {
    const auto size = [&](int64_t n) {
      return static_cast<size_t>(direction == OperandDirection::backward ? n : 0);
    };
    return Scratch{
        RoundedRows(rows, key_block),
        std::vector<uint16_t>(size(ceil_div(rows, 2) * 2 * key_block)),
        std::vector<uint16_t>(size(D * rows)),
        std::vector<uint16_t>(size(Dv * rows)),
        std::vector<float>(
            static_cast<size_t>(direction == OperandDirection::forward ? key_block : 0)),
        {}};
  }

  // The backward's Qᵀ and dOᵀ of `tile`; nothing in the forward.
  void start_tile(Scratch& s, const QueryTile& tile, const MatrixRef<c10::BFloat16>& grad_out)
      const {
    if (direction == OperandDirection::forward) {
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
  static bool computes_bands(
      const Scratch& /*s*/,
      const QueryTile& /*tile*/,
      int64_t /*j0*/,
      const MatrixRef<float>& /*scores*/) {
    return true;
  }

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
      const MatrixRef<c10::BFloat16>& grad_out,
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
      const TileBands& bands,
      const Accumulate& how) const {
    expect_plain_accumulation(how);
    add_left_times_pairs(s, p, s.go_t.data(), dv_t, bands);
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
    for (int64_t r = 0; r < ds.rows; ++r) {
      s.rows.round(round_, ds, r, j0, bands.keys_of_query_block[r / kProductRowBlock]);
    }
    const int64_t kv_head = tile.h / group;
    add_times_keys(
        loops, ds, j0, s.rows, keys_, keys_.head(tile.b, kv_head),
        kv.rows(KeyOrValue::key, tile.b, kv_head, j0, ds.cols, s.read), dq, bands);
  }

  // dKᵀ (D × ds.cols: columns of `dk_t`) += Qᵀ dS, without the scale, each
  // key over the queries that computed it.
  void add_key_gradient(
      Scratch& s,
      const MatrixRef<float>& ds,
      const MatrixRef<float>& dk_t,
      const TileBands& bands,
      const Accumulate& how) const {
    expect_plain_accumulation(how);
    add_left_times_pairs(s, ds, s.q_t.data(), dk_t, bands);
  }

  void round_row(const float* from, int64_t n, c10::BFloat16* to) const {
    round_.row(from, n, half_bits(to));
  }

  static void widen_row(const c10::BFloat16* from, int64_t n, float* to) {
    std::copy(from, from + n, to);
  }

 private:
  // out (left's rows × keys, the columns [j0, …) of `right`'s pairs from
  // `head_pairs`) = alpha · left times them, in the bands: each run of row
  // blocks over its band of keys (for_each_band).
  void multiply_in_bands(
      const MatrixRef<c10::BFloat16>& left,
      int64_t depth,
      float alpha,
      const PackedHeads& right,
      const uint16_t* head_pairs,
      const MatrixRef<float>& out,
      const TileBands& bands) const {
    for_each_band(
        bands.keys_of_query_block, out.rows, [&](int64_t r0, int64_t rows, IndexRange keys) {
          multiply_bf16(
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
          multiply_bf16(
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
        loops, p, j0, s.rows, values_, values_.head(tile.b, kv_head),
        kv.rows(KeyOrValue::value, tile.b, kv_head, j0, p.cols, s.read), out, bands, lone_keys);
  }

  Bf16Rounding round_;
  PackedHeads keys_t_;   // Kᵀ in pairs along the features, for the scores
  PackedHeads values_;   // forward: V in pairs along the keys, for P V
  PackedHeads keys_;     // backward: K in pairs along the keys, for dQ = dS K
  PackedHeads values_t_; // backward: Vᵀ in pairs along the features, for dP = dO Vᵀ
};

} // namespace attn::detail
