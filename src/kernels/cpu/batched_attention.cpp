#include "kernels/cpu/batched_attention.h"

#include "runtime/compat.h"

#include "kernels/cpu/mask_view.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/row_ops.h"
#include "kernels/cpu/tile_product.h"

#include <torch/torch.h>

#include <algorithm>

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
// (docs/BENCHMARKS.md); at 20 × 20 × 64 BLAS measured faster again.
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
torch::Tensor row_major(const torch::Tensor& b) {
  if (b.is_contiguous() || b.scalar_type() != torch::kFloat || b.stride(1) != 1) {
    return b.contiguous();
  }
  auto rows = torch::empty(b.sizes(), b.options());
  transpose_heads(b.transpose(1, 2).unsqueeze(0), rows.unsqueeze(0));
  return rows;
}

// out (N, m, n) = a · b, one matrix per call of `multiply(c, a,
// a_row_stride, a_depth_stride, b, m, n, k)` (b row-major), in parallel
// over the batch.
template <typename scalar_t, typename Multiply>
torch::Tensor product_per_matrix(
    const torch::Tensor& a,
    const torch::Tensor& b,
    const Multiply& multiply) {
  const int64_t N = a.size(0), m = a.size(1), k = a.size(2), n = b.size(2);
  const auto rows = row_major(b);
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

// One float product in attn's register-tiled loops (tile_product.h).
void tile_product(
    float* c,
    const float* a,
    int64_t a_row_stride,
    int64_t a_depth_stride,
    const float* b,
    int64_t m,
    int64_t n,
    int64_t k) {
  tile_gemm_float(m, n, k, 1.0f, a, a_row_stride, a_depth_stride, b, n, c, n, false);
}

// a (N, m, k) · b (N, k, n), any strides: torch::bmm, or attn's loops
// above, in parallel over the batch. (The scale stays in the row pass:
// torch::baddbmm with alpha took 1.6-1.7× bmm's time at 512 × 64 × 64 × 64
// on LibTorch 1.13.)
torch::Tensor batched_product(const torch::Tensor& a, const torch::Tensor& b) {
  const int64_t m = a.size(1), k = a.size(2), n = b.size(2);
  if (m * n * k == 0) {
    return torch::bmm(a, b);
  }
  if (tile_products_run(a.scalar_type()) && tile_loops_outrun_bmm(m * n * k)) {
    return product_per_matrix<float>(a, b, tile_product);
  }
  if (m * n * k > kSmallProduct) {
    return torch::bmm(a, b);
  }
  torch::Tensor out;
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "batched_product", [&] {
    out = product_per_matrix<scalar_t>(a, b, small_product<scalar_t>);
  });
  return out;
}

// scores (B·Hkv, group·L, S) → probabilities, in place: scaled, masked and
// normalised; a row that sees no key becomes zeros.
template <typename scalar_t>
void softmax_rows(
    const torch::Tensor& scores,
    const BatchedShape& shape,
    const AttentionParams& params) {
  const MaskView<scalar_t> mask(params);
  const auto scale = static_cast<scalar_t>(params.scale);
  scalar_t* data = scores.data_ptr<scalar_t>();
  const int64_t S = shape.S;
  parallel_for(
      0, scores.numel() / std::max<int64_t>(S, 1), parallel_grain(S, kMinRowPassScores),
      [&](int64_t begin, int64_t end) {
        for (int64_t row = begin; row < end; ++row) {
          scalar_t* x = data + row * S;
          int64_t b = 0, h = 0, i = 0;
          shape.locate(row, b, h, i);
          scale_row(x, S, scale);
          mask.apply(x, S, b, h, i, 0);
          const scalar_t largest = row_max(x, S);
          if (largest == kNegativeInfinity<scalar_t>) {
            std::fill(x, x + S, scalar_t(0));
            continue;
          }
          scale_row(x, S, scalar_t(1) / exp_shifted_sum(x, S, largest));
        }
      });
}

// grad_probs (rows, S) → scale · the scores' gradient, in place:
// dS_ij = P_ij (dP_ij - Σ_k P_ik dP_ik).
template <typename scalar_t>
void softmax_backward_rows(
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
          const scalar_t* p_row = p + row * S;
          scalar_t* g_row = g + row * S;
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
      });
}

class BatchedAttentionFunction : public torch::autograd::Function<BatchedAttentionFunction> {
 public:
  // Returns the output (B, H, L, Dv) and the probabilities (B, H, L, S).
  // q, k and v are params' own, passed apart so that autograd sees them.
  static torch::autograd::variable_list forward(
      torch::autograd::AutogradContext* ctx,
      const torch::Tensor& q,
      const torch::Tensor& k,
      const torch::Tensor& v,
      const AttentionParams& params,
      bool need_weights) {
    const BatchedShape shape(q, k);
    const auto q3 = shape.queries(q), k3 = shape.keys(k), v3 = shape.keys(v);
    auto probs = batched_product(q3, k3.transpose(1, 2)); // (B·Hkv, group·L, S)
    AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "cpu_batched_attention", [&] {
      softmax_rows<scalar_t>(probs, shape, params);
    });
    const auto out = batched_product(probs, v3).view({shape.B, shape.H, shape.L, v.size(3)});
    ctx->save_for_backward({q3, k3, v3, probs});
    ctx->saved_data["scale"] = params.scale;
    ctx->saved_data["sizes"] = std::vector<int64_t>{shape.B, shape.H, shape.Hkv, shape.L};
    const auto weights = probs.view({shape.B, shape.H, shape.L, shape.S});
    if (!need_weights) {
      ctx->mark_non_differentiable({weights});
    }
    return {out, weights};
  }

  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto &q3 = saved[0], &k3 = saved[1], &v3 = saved[2], &probs = saved[3];
    const auto sizes = ctx->saved_data["sizes"].toIntVector();
    const int64_t B = sizes[0], H = sizes[1], Hkv = sizes[2], L = sizes[3];
    const auto& grad_out = grad_outputs[0];
    const auto& grad_weights = grad_outputs[1];
    // (B·Hkv, group·L, ·) like the forward's products; an output that the
    // loss did not use has no gradient.
    const auto grad_out3 = grad_out.defined()
        ? grad_out.contiguous().view({probs.size(0), probs.size(1), v3.size(2)})
        : torch::zeros({probs.size(0), probs.size(1), v3.size(2)}, probs.options());
    const auto grad_v = batched_product(probs.transpose(1, 2), grad_out3);
    auto grad_probs = batched_product(grad_out3, v3.transpose(1, 2));
    if (grad_weights.defined()) {
      grad_probs += grad_weights.reshape(probs.sizes());
    }
    AT_DISPATCH_FLOATING_TYPES(probs.scalar_type(), "cpu_batched_attention_backward", [&] {
      softmax_backward_rows<scalar_t>(probs, grad_probs, ctx->saved_data["scale"].toDouble());
    });
    const auto grad_q = batched_product(grad_probs, k3);
    const auto grad_k = batched_product(grad_probs.transpose(1, 2), q3);
    return {
        grad_q.view({B, H, L, q3.size(2)}), grad_k.view({B, Hkv, k3.size(1), k3.size(2)}),
        grad_v.view({B, Hkv, v3.size(1), v3.size(2)}), torch::Tensor(), torch::Tensor()};
  }
};

} // namespace

std::tuple<torch::Tensor, torch::Tensor> batched_attention(
    const AttentionParams& params,
    bool need_weights) {
  const auto results = BatchedAttentionFunction::apply(
      params.q, params.k, params.v, params, need_weights);
  return {results[0], need_weights ? results[1] : torch::Tensor()};
}

} // namespace attn::detail
