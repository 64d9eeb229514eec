#pragma once

// The short-heads kernel's loops (short_heads.h), written once over
// vectors of kLanes floats (GCC's vector extensions, with lanes.h's
// helpers) for the two files that compile them, each under its
// instruction set's target pragma: vector_loops_avx512.cpp (16 lanes) and
// vector_loops_avx2.cpp (8). Each file defines kLanes, Lanes and LaneBits
// as lanes.h says, includes lanes.h and this, and instantiates
// forward_heads and backward_heads with its registers' budget. Everything
// here takes that file's target, and lives in its anonymous namespace.
//
// It includes nothing: everything after the target pragma is compiled for
// the target, so the including file includes what this uses before the
// pragma (micro_tile.h, short_heads.h, short_heads_loops.h,
// tile_product.h, <algorithm>, <cmath>, <cstring>, <limits>,
// <type_traits>, <vector>).
//
// Names: C vectors of keys per row of scores, R rows per block of scores
// (rows_for: as many as kBudget accumulators hold), G query rows per
// product into V (group_rows), W vectors per row of a product block; Sp,
// Dp, Dvp the key count and the feature widths padded to whole vectors.

namespace attn::detail {
namespace {

static_assert(sizeof(Lanes) == kLanes * sizeof(float) && sizeof(LaneBits) == sizeof(Lanes));

// S's vectors at most.
constexpr int kMaxKeyVectors = static_cast<int>(kMaxShortKeys / kLanes);

// Rows of a product block of `vectors` vectors per row within `budget`
// accumulators: at most 8, at least 1.
constexpr int rows_for(int budget, int vectors) {
  return std::clamp(budget / vectors, 1, 8);
}

int64_t vectors_for(int64_t n) {
  return (n + kLanes - 1) / kLanes;
}

// A product block: acc[r][w] = Σ_t A(r, t) · B(t, 16w .. 16w + 16) over
// t < depth, where A(r, t) = a[r][t · a_step] and B's rows lie ldb apart.
template <int R, int W>
ATTN_INLINE void multiply_block(
    Lanes (&acc)[R][W],
    const float* const (&a)[R],
    int64_t a_step,
    const float* b,
    int64_t ldb,
    int64_t depth) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) {
      acc[r][w] = Lanes{};
    }
  }
  for (int64_t t = 0; t < depth; ++t) {
    Lanes b_row[W];
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) {
      b_row[w] = load(b + t * ldb + w * kLanes);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const Lanes a_rt = splat(a[r][t * a_step]);
#pragma GCC unroll 8
      for (int w = 0; w < W; ++w) {
        acc[r][w] += a_rt * b_row[w];
      }
    }
  }
}

// Rows [0, rows) of a block times alpha into `out` (row stride
// out_row_stride), columns [c0, c0 + 16·W) ∩ [0, cols).
template <int R, int W>
ATTN_INLINE void store_block(
    const Lanes (&acc)[R][W],
    int64_t rows,
    float alpha,
    float* out,
    int64_t out_row_stride,
    int64_t c0,
    int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) {
      const int64_t col = c0 + w * kLanes;
      const int64_t n = std::min(kLanes, cols - col);
      float* to = out + r * out_row_stride + col;
      if (n == kLanes) {
        store(to, acc[r][w] * alpha);
      } else if (n > 0) {
        float lanes[kLanes];
        store(lanes, acc[r][w] * alpha);
        std::memcpy(to, lanes, static_cast<size_t>(n) * sizeof(float));
      }
    }
  }
}

// A product into memory: rows × cols of the operands' c (micro_tile.h),
// B's rows padded to whole vectors. The loops write c: `accumulate` must
// be false.
struct Product {
  int64_t rows, cols;
  GemmOperands g;
};

// The product's columns [16·w0, 16·(w0 + W)), in blocks of R rows.
template <int R, int W>
ATTN_OWN_CODE void multiply_columns(const Product& p, int64_t w0) {
  for (int64_t r0 = 0; r0 < p.rows; r0 += R) {
    const float* a[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) { // rows past the end repeat the last
      a[r] = p.g.a + std::min<int64_t>(r0 + r, p.rows - 1) * p.g.a_row_stride;
    }
    Lanes acc[R][W];
    multiply_block<R, W>(acc, a, p.g.a_depth_stride, p.g.b + w0 * kLanes, p.g.ldb, p.g.depth);
    store_block<R, W>(
        acc, std::min<int64_t>(R, p.rows - r0), p.g.alpha, p.g.c + r0 * p.g.ldc, p.g.ldc,
        w0 * kLanes, p.cols);
  }
}

template <int kBudget>
ATTN_INLINE void multiply(const Product& p) {
  if (empty_product_done(p.rows, p.cols, p.g)) {
    return;
  }
  const int64_t vectors = vectors_for(p.cols);
  for (int64_t w0 = 0; w0 < vectors; w0 += 4) {
    switch (std::min<int64_t>(4, vectors - w0)) {
      case 1: multiply_columns<rows_for(kBudget, 1), 1>(p, w0); break;
      case 2: multiply_columns<rows_for(kBudget, 2), 2>(p, w0); break;
      case 3: multiply_columns<rows_for(kBudget, 3), 3>(p, w0); break;
      default: multiply_columns<rows_for(kBudget, 4), 4>(p, w0); break;
    }
  }
}

// A head's operands copied into a task's buffers, padded with zeros to
// whole vectors: Kᵀ (D × Sp) and Vᵀ (Dv × Sp) for the products that score
// keys, and row copies (T × Fp) for those that sum over them.
void transpose_padded(
    const CpuLoops& loops,
    const MatrixRef<float>& from,
    std::vector<float>& to,
    int64_t ld) {
  to.assign(static_cast<size_t>(from.cols * ld), 0.0f);
  if (from.rows > 0 && from.cols > 0) {
    transpose_float(loops, from.rows, from.cols, from.data, from.row_stride, 1, to.data(), ld);
  }
}

void copy_padded(const MatrixRef<float>& from, std::vector<float>& to, int64_t ld) {
  to.assign(static_cast<size_t>(from.rows * ld), 0.0f);
  for (int64_t r = 0; r < from.rows && from.cols > 0; ++r) {
    std::memcpy(to.data() + r * ld, from.row(r), static_cast<size_t>(from.cols) * sizeof(float));
  }
}

// Row i's scores (C vectors, keys in lanes) scaled and masked: -inf for
// the keys it does not see and the lanes past S. `row` holds Sp floats.
template <int C>
ATTN_INLINE void scale_and_mask(
    Lanes (&x)[C],
    const ShortHeadsCall& call,
    int64_t b,
    int64_t h,
    int64_t i,
    float* row) {
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) {
    x[c] *= call.scale;
  }
  if (call.mask.tests_elements()) {
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      store(row + c * kLanes, x[c]);
    }
    call.mask.apply(row, call.S, b, h, i, 0); // the band too
    std::fill(row + call.S, row + C * kLanes, -kInfinity);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      x[c] = load(row + c * kLanes);
    }
    return;
  }
  // Without a mask tensor, the band alone: keys [begin, end), end ≤ S.
  const auto begin = static_cast<int32_t>(call.mask.band.begin(i));
  const auto end = static_cast<int32_t>(call.mask.band.end(i));
  const LaneBits lane = lane_indices();
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) {
    const LaneBits key = lane + static_cast<int32_t>(c * kLanes);
    x[c] = select((key >= begin) & (key < end), x[c], splat(-kInfinity));
  }
}

// softmax of R rows (C vectors each) into `probs` (R rows Sp floats apart)
// and their log-sum-exp into `lse`. A row that sees no key gets zeros and
// -inf. Each step runs for every row before the next, so that the rows'
// chains of dependent instructions (a reduction, a division) overlap.
template <int R, int C>
ATTN_INLINE void softmax_rows(Lanes (&x)[R][C], float* probs, float (&lse)[R]) {
  float largest[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    Lanes lanes = x[r][0];
#pragma GCC unroll 8
    for (int c = 1; c < C; ++c) {
      lanes = lane_max(lanes, x[r][c]);
    }
    largest[r] = reduce<true>(lanes);
  }
  float total[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    // A row without keys: every score -inf, every exp 0.
    const Lanes shift = splat(largest[r] == -kInfinity ? 0.0f : largest[r]);
    Lanes sum{};
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      x[r][c] = exp_lanes(x[r][c] - shift);
      sum += x[r][c];
    }
    total[r] = reduce<false>(sum);
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const Lanes inverse = splat(total[r] == 0 ? 0.0f : 1.0f / total[r]);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      store(probs + (int64_t{r} * C + c) * kLanes, x[r][c] * inverse);
    }
    lse[r] = total[r] == 0 ? -kInfinity : largest[r] + std::log(total[r]);
  }
}

// A forward task's buffers.
struct ForwardScratch {
  std::vector<float> k_t, v, probs, row;
};

// Probabilities of query rows [i0, i0 + rows), rows ≤ R, into `probs`
// (rows Sp floats apart), and their log-sum-exp: the block scored against
// every key in registers and normalised there.
template <int R, int C>
ATTN_INLINE void probabilities(
    const ShortHeadsCall& call,
    ForwardScratch& s,
    int64_t b,
    int64_t h,
    int64_t i0,
    int64_t rows,
    float* probs) {
  const auto q = call.q.head(b, h);
  const float* q_rows[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) { // rows past the end repeat the last
    q_rows[r] = q.row(i0 + std::min<int64_t>(r, rows - 1));
  }
  Lanes scores[R][C];
  multiply_block<R, C>(scores, q_rows, 1, s.k_t.data(), C * kLanes, call.D);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    scale_and_mask<C>(scores[r], call, b, h, i0 + std::min<int64_t>(r, rows - 1), s.row.data());
  }
  float lse_rows[R];
  softmax_rows<R, C>(scores, probs, lse_rows);
  std::copy(lse_rows, lse_rows + rows, call.lse_out + (b * call.H + h) * call.L + i0);
}

// Query rows per product into V: whole blocks of the scores' R rows, at
// least 8, so that the product's own row blocks are filled (with one row
// per block of scores, AVX2's 64 keys, a product per block ran 3x slower).
constexpr int group_rows(int R) {
  return R * ((8 + R - 1) / R);
}

// One head of the forward: each group of queries' probabilities, then
// their product into V.
template <int kBudget, int C>
ATTN_OWN_CODE void forward_head(
    const ShortHeadsCall& call,
    ForwardScratch& s,
    int64_t b,
    int64_t h) {
  constexpr int R = rows_for(kBudget, C);
  constexpr int64_t Sp = C * kLanes, G = group_rows(R);
  const int64_t kv_head = h / call.group, Dvp = vectors_for(call.Dv) * kLanes;
  transpose_padded(call.loops, call.k.head(b, kv_head), s.k_t, Sp);
  copy_padded(call.v.head(b, kv_head), s.v, Dvp);
  s.probs.resize(static_cast<size_t>(G * Sp));
  s.row.resize(static_cast<size_t>(Sp));
  const auto out = call.out.head(b, h);
  for (int64_t i0 = 0; i0 < call.L; i0 += G) {
    const int64_t rows = std::min(G, call.L - i0);
    for (int64_t r0 = 0; r0 < rows; r0 += R) {
      probabilities<R, C>(
          call, s, b, h, i0 + r0, std::min<int64_t>(R, rows - r0), s.probs.data() + r0 * Sp);
    }
    // The keys some row of the group sees: the others' probabilities are 0.
    const int64_t begin = call.mask.tile_key_begin(i0);
    const int64_t end = call.mask.tile_key_end(i0, rows);
    multiply<kBudget>(
        {rows,
         call.Dv,
         {end - begin, 1.0f, s.probs.data() + begin, Sp, 1, s.v.data() + begin * Dvp, Dvp,
          out.row(i0), out.row_stride, false}});
  }
}

// A backward task's buffers: the head's operands, and its probabilities
// P and score gradients dS (L × Sp).
struct BackwardScratch {
  std::vector<float> k_t, v_t, k, q, grad_out, probs, grad_scores, row;
};

// P and dS of query rows [i0, i0 + rows): P = exp(scores - lse) from the
// scores recomputed in registers, dP = dO·Vᵀ, dS = P ∘ (dP - Σ_d dO·O).
template <int kBudget, int C>
ATTN_INLINE void score_gradients(
    const ShortHeadsCall& call,
    BackwardScratch& s,
    int64_t b,
    int64_t h,
    int64_t i0,
    int64_t rows) {
  constexpr int R = rows_for(kBudget, C);
  constexpr int64_t Sp = C * kLanes;
  const int64_t Dp = vectors_for(call.D) * kLanes, Dvp = vectors_for(call.Dv) * kLanes;
  const float* lse = call.lse + (b * call.H + h) * call.L;
  const float *q_rows[R], *grad_rows[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const int64_t i = i0 + std::min<int64_t>(r, rows - 1);
    q_rows[r] = s.q.data() + i * Dp;
    grad_rows[r] = s.grad_out.data() + i * Dvp;
  }
  Lanes x[R][C];
  multiply_block<R, C>(x, q_rows, 1, s.k_t.data(), Sp, call.D);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) { // rows past the end repeat the last
    const int64_t i = i0 + std::min<int64_t>(r, rows - 1);
    scale_and_mask<C>(x[r], call, b, h, i, s.row.data());
    const Lanes shift = splat(lse[i] == -kInfinity ? kInfinity : lse[i]); // no key: P = 0
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      store(s.probs.data() + i * Sp + c * kLanes, exp_lanes(x[r][c] - shift));
    }
  }
  multiply_block<R, C>(x, grad_rows, 1, s.v_t.data(), Sp, call.Dv); // dP
  const auto out = call.out.head(b, h);
  for (int64_t r = 0; r < rows; ++r) {
    const float* out_row = out.row(i0 + r);
    float delta = 0;
    for (int64_t d = 0; d < call.Dv; ++d) {
      delta += out_row[d] * grad_rows[r][d];
    }
    const float* p = s.probs.data() + (i0 + r) * Sp;
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      store(
          s.grad_scores.data() + (i0 + r) * Sp + c * kLanes,
          load(p + c * kLanes) * (x[r][c] - delta));
    }
  }
}

// One head of the backward: P and dS of every query, then dQ = s·dS K,
// dK = s·dSᵀ Q and dV = Pᵀ dO.
template <int kBudget, int C>
ATTN_OWN_CODE void backward_head(
    const ShortHeadsCall& call,
    BackwardScratch& s,
    int64_t b,
    int64_t h) {
  constexpr int R = rows_for(kBudget, C);
  constexpr int64_t Sp = C * kLanes;
  const int64_t kv_head = h / call.group;
  const int64_t Dp = vectors_for(call.D) * kLanes, Dvp = vectors_for(call.Dv) * kLanes;
  const ShortHeadsGradients& g = *call.gradients;
  transpose_padded(call.loops, call.k.head(b, kv_head), s.k_t, Sp);
  transpose_padded(call.loops, call.v.head(b, kv_head), s.v_t, Sp);
  copy_padded(call.k.head(b, kv_head), s.k, Dp);
  copy_padded(call.q.head(b, h), s.q, Dp);
  copy_padded(g.grad_out.head(b, h), s.grad_out, Dvp);
  s.probs.resize(static_cast<size_t>(call.L * Sp));
  s.grad_scores.resize(static_cast<size_t>(call.L * Sp));
  s.row.resize(static_cast<size_t>(Sp));
  for (int64_t i0 = 0; i0 < call.L; i0 += R) {
    score_gradients<kBudget, C>(call, s, b, h, i0, std::min<int64_t>(R, call.L - i0));
  }
  const auto dq = g.dq.head(b, h), dk = g.dk.head(b, h), dv = g.dv.head(b, h);
  multiply<kBudget>(
      {call.L,
       call.D,
       {call.S, call.scale, s.grad_scores.data(), Sp, 1, s.k.data(), Dp, dq.data, dq.row_stride,
        false}});
  multiply<kBudget>(
      {call.S,
       call.D,
       {call.L, call.scale, s.grad_scores.data(), 1, Sp, s.q.data(), Dp, dk.data, dk.row_stride,
        false}});
  multiply<kBudget>(
      {call.S,
       call.Dv,
       {call.L, 1.0f, s.probs.data(), 1, Sp, s.grad_out.data(), Dvp, dv.data, dv.row_stride,
        false}});
}

// head<kBudget, C>(...) for C, the vectors of S's keys (1 to kMaxKeyVectors).
template <int kBudget, typename Scratch, int C = 1>
ATTN_INLINE void run_head(
    int64_t key_vectors,
    const ShortHeadsCall& call,
    Scratch& scratch,
    int64_t b,
    int64_t h) {
  if constexpr (C < kMaxKeyVectors) {
    if (key_vectors > C) {
      run_head<kBudget, Scratch, C + 1>(key_vectors, call, scratch, b, h);
      return;
    }
  }
  if constexpr (std::is_same_v<Scratch, ForwardScratch>) {
    forward_head<kBudget, C>(call, scratch, b, h);
  } else {
    backward_head<kBudget, C>(call, scratch, b, h);
  }
}

// Heads [begin, end) of the call's (B, H) grid, forward or backward.
template <int kBudget, typename Scratch>
void run_heads(const ShortHeadsCall& call, int64_t begin, int64_t end) {
  Scratch scratch;
  const int64_t key_vectors = vectors_for(std::max<int64_t>(call.S, 1));
  for (int64_t unit = begin; unit < end; ++unit) {
    const int64_t b = unit / call.H, h = unit % call.H;
    if (call.conversion != nullptr) {
      call.conversion->widen_head(b, h);
    }
    run_head<kBudget, Scratch>(key_vectors, call, scratch, b, h);
    if (call.conversion != nullptr) {
      call.conversion->round_head(b, h);
    }
  }
}

template <int kBudget>
void forward_heads(const ShortHeadsCall& call, int64_t begin, int64_t end) {
  run_heads<kBudget, ForwardScratch>(call, begin, end);
}

template <int kBudget>
void backward_heads(const ShortHeadsCall& call, int64_t begin, int64_t end) {
  run_heads<kBudget, BackwardScratch>(call, begin, end);
}

} // namespace
} // namespace attn::detail
