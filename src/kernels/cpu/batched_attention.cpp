#include "kernels/cpu/batched_attention.h"

#include "runtime/compat.h"

#include "kernels/cpu/mask_view.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/row_ops.h"
#include "kernels/cpu/tile_product.h"
#include "kernels/cpu/tiled_loops.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace attn::detail {
namespace {

// The heads as batched GEMMs see them. Query head h reads key/value head
// h / group, so with q contiguous, the `group` query heads of one key/value
// head are consecutive: (B·Hkv, group·L, D) against (B·Hkv, S, D).
struct BatchedShape {
  int64_t B, H, Hkv, group, L, S;

  explicit BatchedShape(const torch::Tensor& q, const torch::Tensor& k)
      : B(q.size(0)),
        H(q.size(1)),
        Hkv(k.size(1)),
        group(Hkv > 0 ? H / Hkv : 1),
        L(q.size(2)),
        S(k.size(2)) {}

  torch::Tensor queries(const torch::Tensor& t) const {
    return t.contiguous().view({B * Hkv, group * L, t.size(3)});
  }
  torch::Tensor keys(const torch::Tensor& t) const {
    return t.contiguous().view({B * Hkv, S, t.size(3)});
  }
  // Row `row` of the (B·Hkv, group·L, ·) layout: its batch, query head and query.
  void locate(int64_t row, int64_t& b, int64_t& h, int64_t& i) const {
    const int64_t n = row / (group * L), within = row % (group * L);
    b = n / Hkv;
    h = n % Hkv * group + within / L;
    i = within % L;
  }
};

// Products of matrices this small (m·n·k multiply-adds) run in loops of
// attn's own over the batch, where a BLAS call per matrix costs more than
// the arithmetic: 1.5-1.6x faster end to end at 16 tokens of 16 features
// (docs/design/cpu-kernels.md, "The batched kernel's products"); at
// 20 × 20 × 64 BLAS measured faster again.
constexpr int64_t kSmallProduct = int64_t{16} * 16 * 32;

// One small product, c (m, n) = a (m, k) · b (k, n) with b row-major and a
// read through its strides; the row of c is vectorised over n.
template <typename scalar_t>
#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
void small_product(
    scalar_t* c,
    const scalar_t* a,
    int64_t a_row_stride,
    int64_t a_column_stride,
    const scalar_t* b,
    int64_t m,
    int64_t n,
    int64_t k) {
  for (int64_t i = 0; i < m; ++i) {
    scalar_t* c_row = c + i * n;
    std::fill(c_row, c_row + n, scalar_t(0));
    for (int64_t p = 0; p < k; ++p) {
      const scalar_t factor = a[i * a_row_stride + p * a_column_stride];
      const scalar_t* b_row = b + p * n;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        c_row[j] += factor * b_row[j];
      }
    }
  }
}

// Where attn's register-tiled loops, one product per matrix in parallel
// over the batch, multiply a batch of float matrices faster than
// torch::bmm (2 cores, AVX-512): at every size against LibTorch 1.13's bmm,
// which calls the BLAS once per matrix in turn, each call shared between
// the threads (1.5x at 20 × 20 × 64, 1.8x at 64 × 64 × 64, the kernel's
// forward); against LibTorch 2.15's (MKL) up to kSmallProduct multiply-adds
// (1.4x at 16 × 16 × 16), while at 64 × 64 × 64 and 128 × 128 × 64 MKL's
// was 1.1-1.2x faster. Other versions: as 1.13.
bool tile_loops_outrun_bmm(int64_t multiply_adds) {
  return !kLibTorchCpuRuleMeasured || multiply_adds <= kSmallProduct;
}

// b (N, k, n) with rows of unit stride, as the per-matrix loops read it.
// Float matrices stored transposed (Kᵀ and Vᵀ, views of K and V) are
// transposed in registers (transpose_heads); anything else is made
// contiguous.
torch::Tensor row_major(const CpuLoops& loops, const torch::Tensor& b) {
  if (b.is_contiguous() || b.scalar_type() != torch::kFloat || b.stride(1) != 1) {
    return b.contiguous();
  }
  auto rows = torch::empty(b.sizes(), b.options());
  transpose_heads(loops, b.transpose(1, 2).unsqueeze(0), rows.unsqueeze(0));
  return rows;
}

// out (N, m, n) = a · b, one matrix per call of `multiply(c, a,
// a_row_stride, a_depth_stride, b, m, n, k)` (b row-major), in parallel
// over the batch.
template <typename scalar_t, typename Multiply>
torch::Tensor product_per_matrix(
    const CpuLoops& loops,
    const torch::Tensor& a,
    const torch::Tensor& b,
    const Multiply& multiply) {
  const int64_t N = a.size(0), m = a.size(1), k = a.size(2), n = b.size(2);
  const auto rows = row_major(loops, b);
  auto out = torch::empty({N, m, n}, a.options());
  const scalar_t* a_data = a.data_ptr<scalar_t>();
  const scalar_t* b_data = rows.data_ptr<scalar_t>();
  scalar_t* out_data = out.data_ptr<scalar_t>();
  const int64_t grain = parallel_grain(static_cast<double>(m * n * k), kMinSmallProductWork);
  parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    for (int64_t batch = begin; batch < end; ++batch) {
      multiply(
          out_data + batch * m * n, a_data + batch * a.stride(0), a.stride(1), a.stride(2),
          b_data + batch * k * n, m, n, k);
    }
  });
  return out;
}

// a (N, m, k) · b (N, k, n), any strides: torch::bmm, or attn's loops
// (tile_product.h) or the small products above, in parallel over the
// batch. (The scale stays in the row pass: torch::baddbmm with alpha took
// 1.6-1.7× bmm's time at 512 × 64 × 64 × 64 on LibTorch 1.13.)
torch::Tensor batched_product(
    const CpuLoops& loops,
    const torch::Tensor& a,
    const torch::Tensor& b) {
  const int64_t m = a.size(1), k = a.size(2), n = b.size(2);
  if (m * n * k == 0) {
    return torch::bmm(a, b);
  }
  if (tile_products_run(loops, a.scalar_type()) && tile_loops_outrun_bmm(m * n * k)) {
    const auto tile_product = [&](float* c, const float* a_data, int64_t a_row_stride,
                                  int64_t a_depth_stride, const float* b_data, int64_t rows,
                                  int64_t cols, int64_t depth) {
      tile_gemm_float(
          loops, rows, cols, depth, 1.0f, a_data, a_row_stride, a_depth_stride, b_data, cols, c,
          cols, false);
    };
    return product_per_matrix<float>(loops, a, b, tile_product);
  }
  if (m * n * k > kSmallProduct) {
    return torch::bmm(a, b);
  }
  torch::Tensor out;
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "batched_product", [&] {
    out = product_per_matrix<scalar_t>(loops, a, b, small_product<scalar_t>);
  });
  return out;
}

// Row `row` of the (B·Hkv, group·L, S) scores x → its probabilities, in
// place: scaled, masked and normalised; a row that sees no key becomes
// zeros. Returns its log-sum-exp (-inf where it sees no key).
template <typename scalar_t>
scalar_t masked_softmax_row(
    const CpuLoops& loops,
    scalar_t* x,
    int64_t row,
    const BatchedShape& shape,
    const MaskView<scalar_t>& mask,
    scalar_t scale) {
  const int64_t S = shape.S;
  int64_t b = 0, h = 0, i = 0;
  shape.locate(row, b, h, i);
  scale_row(x, S, scale);
  mask.apply(x, S, b, h, i, 0);
  return softmax_row(loops, x, S, kNegativeInfinity<scalar_t>);
}

// scores (B·Hkv, group·L, S) → probabilities, in place (masked_softmax_row).
// Writes each row's log-sum-exp into `lse` (one per row, in the same
// order: (B, H, L)).
template <typename scalar_t>
void softmax_rows(
    const CpuLoops& loops,
    const torch::Tensor& scores,
    const torch::Tensor& lse,
    const BatchedShape& shape,
    const AttentionParams& params) {
  const MaskView<scalar_t> mask(params, loops);
  const auto scale = static_cast<scalar_t>(params.scale);
  scalar_t* data = scores.data_ptr<scalar_t>();
  scalar_t* lse_data = lse.data_ptr<scalar_t>();
  const int64_t S = shape.S;
  parallel_for(
      0, scores.numel() / std::max<int64_t>(S, 1), parallel_grain(S, kMinRowPassScores),
      [&](int64_t begin, int64_t end) {
        for (int64_t row = begin; row < end; ++row) {
          lse_data[row] = masked_softmax_row(loops, data + row * S, row, shape, mask, scale);
        }
      });
}

// A row of the probabilities' gradient g → scale · the scores' gradient,
// in place: dS_j = P_j (dP_j - Σ_k P_k dP_k).
template <typename scalar_t>
void softmax_backward_row(const scalar_t* p_row, scalar_t* g_row, int64_t S, scalar_t scale) {
  scalar_t delta = 0;
#pragma omp simd reduction(+ : delta)
  for (int64_t j = 0; j < S; ++j) {
    delta += p_row[j] * g_row[j];
  }
#pragma omp simd
  for (int64_t j = 0; j < S; ++j) {
    g_row[j] = scale * p_row[j] * (g_row[j] - delta);
  }
}

// grad_probs (rows, S) → scale · the scores' gradient, in place, row by
// row (softmax_backward_row).
template <typename scalar_t>
void batched_softmax_backward_rows(
    const torch::Tensor& probs,
    const torch::Tensor& grad_probs,
    double scale_) {
  const auto scale = static_cast<scalar_t>(scale_);
  const scalar_t* p = probs.data_ptr<scalar_t>();
  scalar_t* g = grad_probs.data_ptr<scalar_t>();
  const int64_t S = probs.size(-1);
  parallel_for(
      0, probs.numel() / std::max<int64_t>(S, 1), parallel_grain(S, kMinRowPassScores),
      [&](int64_t begin, int64_t end) {
        for (int64_t row = begin; row < end; ++row) {
          softmax_backward_row(p + row * S, g + row * S, S, scale);
        }
      });
}

// The inputs as the batched products read them.
struct BatchedInputs {
  BatchedShape shape;
  torch::Tensor q, k, v; // (B·Hkv, group·L, D), (B·Hkv, S, D), (B·Hkv, S, Dv)

  explicit BatchedInputs(const AttentionParams& params)
      : shape(params.q, params.k),
        q(shape.queries(params.q)),
        k(shape.keys(params.k)),
        v(shape.keys(params.v)) {}
};

// ---------------------------------------------------------------------------
// Half precision (bfloat16, float16), with no float copy of a whole
// tensor (beyond the split dK and dV sums, SplitKeyGradients): a task
// widens one matrix of the batch's K and V, and its queries kHalfRows rows
// at a time, into float memory of its own; the products (attn's float
// loops, else the BLAS) and the row passes run in float as above, and the
// weights, the output and the gradients are rounded once into their
// tensors. The backward recomputes each chunk's probabilities as the
// forward computed them, so that no (B, H, L, S) float tensor is kept,
// and no gradient carries the weights' rounding to 8 or 11 bits.

// Query rows per chunk: its scores (kHalfRows × S floats) stay in cache
// at the short lengths that the batched kernel takes.
constexpr int64_t kHalfRows = 64;

// rows × cols of a task's float memory, rows `row_stride` apart, as the
// products (tile_addmm: attn's float loops, else the BLAS) take it.
MatrixRef<float> task_matrix(const float* data, int64_t rows, int64_t cols, int64_t row_stride) {
  return {const_cast<float*>(data), rows, cols, row_stride, 1};
}

// A half-precision call as its tasks read it: the inputs as (N = B·Hkv,
// ·, ·) matrices, the mask, the conversions of its dtype.
struct HalfBatch {
  HalfBatch(const CpuLoops& loops, const AttentionParams& params)
      : loops(loops),
        in(params),
        mask(params, loops),
        conversion(half_rows(loops, params.q.scalar_type())),
        scale(static_cast<float>(params.scale)),
        N(in.shape.B * in.shape.Hkv),
        rows(in.shape.group * in.shape.L),
        S(in.shape.S),
        D(params.D()),
        Dv(params.Dv()) {}

  int64_t chunks() const { return ceil_div(rows, kHalfRows); }
  // Rows [begin, end) of a matrix's queries: chunk `chunk`.
  IndexRange chunk_rows(int64_t chunk) const {
    return {chunk * kHalfRows, std::min(rows, (chunk + 1) * kHalfRows)};
  }

  CpuLoops loops; // the call's plan's (kernel_plan.h)
  BatchedInputs in;
  MaskView<float> mask;
  HalfRows conversion;
  float scale;
  int64_t N, rows, S, D, Dv;
};

// Which layouts of a widened matrix its task's products read.
enum class Layouts { rows, transposed, both };

// A task's float copy of rows of one matrix of the batch (K or V of a
// key/value head, a chunk of queries or of the output's gradient),
// widened from half precision: as rows, transposed, or both, as the
// products read it.
class WidenedRows {
 public:
  WidenedRows(int64_t rows, int64_t cols, Layouts layouts)
      : cols_(cols),
        rows_(static_cast<size_t>(rows * cols)),
        transposed_(layouts == Layouts::rows ? 0 : rows_.size()),
        keep_rows_(layouts != Layouts::transposed) {}

  // `rows` rows of cols elements from `from` (contiguous), unless they are
  // those of `tag` (a matrix's index, or -1: none) already.
  // Widened and transposed on the batch's loops.
  void widen(const HalfBatch& batch, const uint16_t* from, int64_t rows, int64_t tag = -1) {
    if (tag >= 0 && tag == held_) {
      return;
    }
    held_ = tag;
    batch.conversion.widen(from, rows * cols_, rows_.data());
    if (!transposed_.empty()) {
      transpose_float(batch.loops, rows, cols_, rows_.data(), cols_, 1, transposed_.data(), rows);
    }
  }

  const float* rows() const {
    TORCH_INTERNAL_ASSERT(keep_rows_, "a widened matrix kept transposed only");
    return rows_.data();
  }
  const float* transposed() const { return transposed_.data(); }

 private:
  int64_t cols_, held_ = -1;
  std::vector<float> rows_, transposed_; // rows_: also the transpose's source
  bool keep_rows_;
};

// Row r of matrix n of t (N, ·, cols), contiguous and 16-bit: its bits.
uint16_t* half_row(const torch::Tensor& t, int64_t n, int64_t r) {
  return static_cast<uint16_t*>(t.data_ptr()) + (n * t.size(1) + r) * t.size(2);
}

// Rows `rows` of matrix n: their scores from `queries` (those rows,
// widened) and `keys` (Kᵀ widened), then their softmax in float
// (masked_softmax_row) into `probs`; each row's log-sum-exp into lse (null: not
// wanted).
void half_probabilities(
    const HalfBatch& batch,
    int64_t n,
    const IndexRange& rows,
    const float* queries,
    const WidenedRows& keys,
    float* probs,
    float* lse) {
  const int64_t count = rows.end - rows.begin, S = batch.S;
  tile_addmm(
      batch.loops, task_matrix(probs, count, S, S), task_matrix(queries, count, batch.D, batch.D),
      task_matrix(keys.transposed(), batch.D, S, S), /*beta=*/0, /*alpha=*/1);
  const int64_t first = n * batch.rows + rows.begin; // of the (B·Hkv, group·L) rows
  for (int64_t r = 0; r < count; ++r) {
    const float row_lse = masked_softmax_row(
        batch.loops, probs + r * S, first + r, batch.in.shape, batch.mask, batch.scale);
    if (lse != nullptr) {
      lse[r] = row_lse;
    }
  }
}

// A forward task's float memory: one matrix's Kᵀ and V, one chunk's
// queries, probabilities and output.
struct HalfForwardMemory {
  explicit HalfForwardMemory(const HalfBatch& batch)
      : keys(batch.S, batch.D, Layouts::transposed),
        values(batch.S, batch.Dv, Layouts::rows),
        queries(kHalfRows, batch.D, Layouts::rows),
        probs(static_cast<size_t>(kHalfRows * batch.S)),
        out(static_cast<size_t>(kHalfRows * batch.Dv)) {}

  WidenedRows keys, values, queries;
  std::vector<float> probs, out;
};

// batched_forward for q, k, v in bfloat16 or float16: out and, where
// `need_weights`, the weights in their dtype (else an empty tensor); lse
// in float. One task per chunk of a matrix's queries.
ForwardResult batched_forward_half(
    const CpuLoops& loops,
    const AttentionParams& params,
    bool need_weights) {
  TORCH_INTERNAL_ASSERT(!params.dropout.active(), "the batched kernel drops no weights");
  const HalfBatch batch(loops, params);
  const auto& shape = batch.in.shape;
  const int64_t S = batch.S, Dv = batch.Dv, chunks = batch.chunks();
  auto out = torch::empty({batch.N, batch.rows, Dv}, params.q.options());
  auto lse = torch::empty({shape.B, shape.H, shape.L}, params.q.options().dtype(torch::kFloat));
  auto weights = torch::empty({need_weights ? batch.N : 0, batch.rows, S}, params.q.options());
  const double flops = 2.0 * std::min(kHalfRows, batch.rows) * S * (batch.D + Dv);
  parallel_units(
      batch.N * chunks, flops, [&] { return HalfForwardMemory(batch); },
      [&](HalfForwardMemory& m, int64_t unit) {
        const int64_t n = unit / chunks;
        const auto rows = batch.chunk_rows(unit % chunks);
        const int64_t count = rows.end - rows.begin;
        m.keys.widen(batch, half_row(batch.in.k, n, 0), S, n);
        m.values.widen(batch, half_row(batch.in.v, n, 0), S, n);
        m.queries.widen(batch, half_row(batch.in.q, n, rows.begin), count);
        half_probabilities(
            batch, n, rows, m.queries.rows(), m.keys, m.probs.data(),
            lse.data_ptr<float>() + n * batch.rows + rows.begin);
        if (need_weights) {
          batch.conversion.round(m.probs.data(), count * S, half_row(weights, n, rows.begin));
        }
        tile_addmm(
            loops, task_matrix(m.out.data(), count, Dv, Dv),
            task_matrix(m.probs.data(), count, S, S), task_matrix(m.values.rows(), S, Dv, Dv),
            /*beta=*/0, /*alpha=*/1);
        batch.conversion.round(m.out.data(), count * Dv, half_row(out, n, rows.begin));
      });
  return {
      out.view({shape.B, shape.H, shape.L, Dv}), lse,
      need_weights ? weights.view({shape.B, shape.H, shape.L, S}) : weights};
}

// A backward task's float memory: one matrix's K, Kᵀ and Vᵀ, one chunk's
// queries, output gradient, probabilities, score gradients and dQ rows,
// and the task's dK and dV sums.
struct HalfBackwardMemory {
  explicit HalfBackwardMemory(const HalfBatch& batch)
      : keys(batch.S, batch.D, Layouts::both),
        values(batch.S, batch.Dv, Layouts::transposed),
        queries(kHalfRows, batch.D, Layouts::rows),
        grad_out(kHalfRows, batch.Dv, Layouts::rows),
        probs(static_cast<size_t>(kHalfRows * batch.S)),
        ds(probs.size()),
        dq(static_cast<size_t>(kHalfRows * batch.D)),
        dk(static_cast<size_t>(batch.S * batch.D)),
        dv(static_cast<size_t>(batch.S * batch.Dv)) {}

  WidenedRows keys, values, queries, grad_out;
  std::vector<float> probs, ds, dq, dk, dv;
};

// One chunk of matrix n: P recomputed, dP = dO Vᵀ (+ the weights'
// gradient), dS; dQ of its rows rounded into `dq`, dK and dV added to
// the task's sums.
void half_backward_chunk(
    const HalfBatch& batch,
    HalfBackwardMemory& m,
    int64_t n,
    const IndexRange& rows,
    const torch::Tensor& grad_out,
    const torch::Tensor& grad_weights,
    const torch::Tensor& dq) {
  const int64_t count = rows.end - rows.begin, S = batch.S, D = batch.D, Dv = batch.Dv;
  m.queries.widen(batch, half_row(batch.in.q, n, rows.begin), count);
  m.grad_out.widen(batch, half_row(grad_out, n, rows.begin), count);
  half_probabilities(batch, n, rows, m.queries.rows(), m.keys, m.probs.data(), nullptr);
  const auto probs = task_matrix(m.probs.data(), count, S, S);
  const auto ds = task_matrix(m.ds.data(), count, S, S);
  const auto grad_rows = task_matrix(m.grad_out.rows(), count, Dv, Dv);
  // dP = dO Vᵀ, added to the weights' gradient where given.
  const bool weights_gradient = grad_weights.defined();
  if (weights_gradient) {
    batch.conversion.widen(half_row(grad_weights, n, rows.begin), count * S, m.ds.data());
  }
  const auto& loops = batch.loops;
  tile_addmm(
      loops, ds, grad_rows, task_matrix(m.values.transposed(), Dv, S, S), weights_gradient ? 1 : 0,
      1);
  // dV += Pᵀ dO
  tile_addmm(loops, task_matrix(m.dv.data(), S, Dv, Dv), probs.transposed(), grad_rows, 1, 1);
  for (int64_t r = 0; r < count; ++r) {
    softmax_backward_row(m.probs.data() + r * S, m.ds.data() + r * S, S, batch.scale);
  }
  // dQ = dS K; dK += dSᵀ Q
  tile_addmm(
      loops, task_matrix(m.dq.data(), count, D, D), ds, task_matrix(m.keys.rows(), S, D, D), 0, 1);
  batch.conversion.round(m.dq.data(), count * D, half_row(dq, n, rows.begin));
  tile_addmm(
      loops, task_matrix(m.dk.data(), S, D, D), ds.transposed(),
      task_matrix(m.queries.rows(), count, D, D), 1, 1);
}

// dK and dV of the matrices whose chunks several tasks share (as many as
// backward_key_splits gives: one task per thread where there are fewer
// matrices than threads): each task's float sums, (N, splits, S, ·),
// added and rounded once per matrix after. With one split per matrix, a
// task rounds its sums itself and these hold nothing.
struct SplitKeyGradients {
  SplitKeyGradients(const HalfBatch& batch, int64_t splits)
      : splits(splits),
        dk(torch::empty({splits > 1 ? batch.N : 0, splits, batch.S, batch.D}, torch::kFloat)),
        dv(torch::empty({splits > 1 ? batch.N : 0, splits, batch.S, batch.Dv}, torch::kFloat)) {}

  // Task (n, split)'s sums `from` into its part of `to`.
  void keep(const std::vector<float>& from, const torch::Tensor& to, int64_t n, int64_t split)
      const {
    std::copy(from.begin(), from.end(), to.data_ptr<float>() + (n * splits + split) * from.size());
  }

  // Matrix n's sums, added and rounded into its rows of `grad` (N, S, ·).
  static void round_sum(
      const HalfBatch& batch,
      const torch::Tensor& sums,
      int64_t n,
      const torch::Tensor& grad) {
    const auto total = sums[n].sum(0);
    batch.conversion.round(total.data_ptr<float>(), total.numel(), half_row(grad, n, 0));
  }

  int64_t splits;
  torch::Tensor dk, dv;
};

// batched_backward for q, k, v in bfloat16 or float16: the gradients in
// their dtype. Each task takes a range of one matrix's chunks, summing dK
// and dV over them in float (SplitKeyGradients).
InputGradients batched_backward_half(
    const CpuLoops& loops,
    const AttentionParams& params,
    const torch::Tensor& grad_out,
    const torch::Tensor& grad_weights) {
  const HalfBatch batch(loops, params);
  const auto& shape = batch.in.shape;
  const auto dtype = params.q.scalar_type();
  const auto as_matrices = [&](const torch::Tensor& t, int64_t cols) {
    return t.defined() ? t.to(dtype).contiguous().view({batch.N, batch.rows, cols}) : t;
  };
  const auto grad_out3 = as_matrices(grad_out, batch.Dv);
  const auto grad_weights3 = as_matrices(grad_weights, batch.S);
  auto dq = torch::empty_like(batch.in.q), dk = torch::empty_like(batch.in.k);
  auto dv = torch::empty_like(batch.in.v);
  const int64_t chunks = batch.chunks();
  const SplitKeyGradients split(batch, backward_key_splits(batch.N, batch.rows, kHalfRows));
  const int64_t splits = split.splits;
  const double flops = 2.0 * batch.rows * batch.S * (3 * batch.D + 2 * batch.Dv) /
      static_cast<double>(splits);
  parallel_units(
      batch.N * splits, flops, [&] { return HalfBackwardMemory(batch); },
      [&](HalfBackwardMemory& m, int64_t unit) {
        const int64_t n = unit / splits, part = unit % splits;
        m.keys.widen(batch, half_row(batch.in.k, n, 0), batch.S, n);
        m.values.widen(batch, half_row(batch.in.v, n, 0), batch.S, n);
        std::fill(m.dk.begin(), m.dk.end(), 0.0F);
        std::fill(m.dv.begin(), m.dv.end(), 0.0F);
        for (int64_t chunk = part * chunks / splits; chunk < (part + 1) * chunks / splits;
             ++chunk) {
          half_backward_chunk(batch, m, n, batch.chunk_rows(chunk), grad_out3, grad_weights3, dq);
        }
        if (splits > 1) {
          split.keep(m.dk, split.dk, n, part);
          split.keep(m.dv, split.dv, n, part);
          return;
        }
        batch.conversion.round(m.dk.data(), batch.S * batch.D, half_row(dk, n, 0));
        batch.conversion.round(m.dv.data(), batch.S * batch.Dv, half_row(dv, n, 0));
      });
  if (splits > 1) {
    for (int64_t n = 0; n < batch.N; ++n) {
      SplitKeyGradients::round_sum(batch, split.dk, n, dk);
      SplitKeyGradients::round_sum(batch, split.dv, n, dv);
    }
  }
  return {
      dq.view(params.q.sizes()), dk.view({shape.B, shape.Hkv, batch.S, batch.D}),
      dv.view({shape.B, shape.Hkv, batch.S, batch.Dv})};
}

// Inputs: q, k, v (params' own, passed apart so that autograd sees them).
// Outputs: the output (B, H, L, Dv) and the weights (B, H, L, S),
// differentiable only when asked for.
class BatchedAttentionFunction : public torch::autograd::Function<BatchedAttentionFunction> {
 public:
  static torch::autograd::variable_list forward(
      torch::autograd::AutogradContext* ctx,
      const torch::Tensor& q,
      const torch::Tensor& k,
      const torch::Tensor& v,
      const AttentionParams& params,
      const KernelPlan& plan,
      bool need_weights) {
    const auto& loops = plan.cpu;
    // Contiguous once: the products read them so, forward and backward.
    auto contiguous = params;
    contiguous.q = q.contiguous();
    contiguous.k = k.contiguous();
    contiguous.v = v.contiguous();
    // Half precision computes the probabilities again in the backward.
    const bool half = is_half_precision(q.scalar_type());
    const auto result = half ? batched_forward_half(loops, contiguous, need_weights)
                             : batched_forward(loops, contiguous);
    ctx->save_for_backward(
        {contiguous.q, contiguous.k, contiguous.v, half ? torch::Tensor() : result.weights});
    save_call(*ctx, params, plan);
    ctx->saved_data["need_weights"] = need_weights;
    if (!need_weights) {
      ctx->mark_non_differentiable({result.weights});
    }
    return {result.out, result.weights};
  }

  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    auto [params, plan] = restore_call(*ctx);
    params.q = saved[0];
    params.k = saved[1];
    params.v = saved[2];
    ForwardResult forward;
    forward.weights = saved[3];
    // An output that the loss did not use has no gradient.
    const auto grad_out = grad_outputs[0].defined()
        ? grad_outputs[0]
        : torch::zeros({params.B(), params.H(), params.L(), params.Dv()}, params.q.options());
    // The weights' gradient where they were returned (autograd hands zeros
    // for an output marked non-differentiable).
    const auto grad_weights = ctx->saved_data.at("need_weights").toBool() ? grad_outputs[1]
                                                                          : torch::Tensor();
    const auto grads = batched_backward(plan.cpu, params, forward, grad_out, grad_weights);
    return {grads.dq,        grads.dk,       grads.dv, torch::Tensor(),
            torch::Tensor(), torch::Tensor()}; // nothing for params, plan, need_weights
  }
};

} // namespace

ForwardResult batched_forward(const CpuLoops& loops, const AttentionParams& params) {
  TORCH_INTERNAL_ASSERT(!params.dropout.active(), "the batched kernel drops no weights");
  if (is_half_precision(params.q.scalar_type())) {
    return batched_forward_half(loops, params, /*need_weights=*/true);
  }
  const BatchedInputs in(params);
  const auto& shape = in.shape;
  auto probs = batched_product(loops, in.q, in.k.transpose(1, 2)); // (B·Hkv, group·L, S)
  auto lse = torch::empty({shape.B, shape.H, shape.L}, probs.options());
  AT_DISPATCH_FLOATING_TYPES(probs.scalar_type(), "batched_forward", [&] {
    softmax_rows<scalar_t>(loops, probs, lse, shape, params);
  });
  const auto out =
      batched_product(loops, probs, in.v).view({shape.B, shape.H, shape.L, params.Dv()});
  return {out, lse, probs.view({shape.B, shape.H, shape.L, shape.S})};
}

InputGradients batched_backward(
    const CpuLoops& loops,
    const AttentionParams& params,
    const ForwardResult& forward,
    const torch::Tensor& grad_out,
    const torch::Tensor& grad_weights) {
  if (is_half_precision(params.q.scalar_type())) {
    return batched_backward_half(loops, params, grad_out, grad_weights);
  }
  const BatchedInputs in(params);
  const auto& shape = in.shape;
  const auto probs = forward.weights.view({shape.B * shape.Hkv, shape.group * shape.L, shape.S});
  const auto grad_out3 = grad_out.contiguous().view({probs.size(0), probs.size(1), params.Dv()});
  const auto grad_v = batched_product(loops, probs.transpose(1, 2), grad_out3);
  auto grad_probs = batched_product(loops, grad_out3, in.v.transpose(1, 2));
  if (grad_weights.defined()) {
    grad_probs += grad_weights.reshape(probs.sizes());
  }
  AT_DISPATCH_FLOATING_TYPES(probs.scalar_type(), "batched_backward", [&] {
    batched_softmax_backward_rows<scalar_t>(probs, grad_probs, params.scale);
  });
  const auto grad_q = batched_product(loops, grad_probs, in.k);
  const auto grad_k = batched_product(loops, grad_probs.transpose(1, 2), in.q);
  const int64_t B = shape.B, Hkv = shape.Hkv, S = shape.S;
  return {
      grad_q.view(params.q.sizes()), grad_k.view({B, Hkv, S, params.D()}),
      grad_v.view({B, Hkv, S, params.Dv()})};
}

std::tuple<torch::Tensor, torch::Tensor> batched_attention(
    const KernelPlan& plan,
    const AttentionParams& params,
    bool need_weights) {
  const auto results = BatchedAttentionFunction::apply(
      params.q, params.k, params.v, params, plan, need_weights);
  return {results[0], need_weights ? results[1] : torch::Tensor()};
}

} // namespace attn::detail
