#include "kernels/cpu/batched_attention.h"

#include "runtime/compat.h"

#include "kernels/cpu/mask_view.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/row_ops.h"
#include "kernels/cpu/tile_product.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>

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
// normalised; a row that sees no key becomes zeros. Writes each row's
// log-sum-exp into `lse` (one per row, in the same order: (B, H, L)).
template <typename scalar_t>
void softmax_rows(
    const torch::Tensor& scores,
    const torch::Tensor& lse,
    const BatchedShape& shape,
    const AttentionParams& params) {
  const MaskView<scalar_t> mask(params);
  const auto scale = static_cast<scalar_t>(params.scale);
  scalar_t* data = scores.data_ptr<scalar_t>();
  scalar_t* lse_data = lse.data_ptr<scalar_t>();
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
          lse_data[row] = largest;
          if (largest == kNegativeInfinity<scalar_t>) {
            std::fill(x, x + S, scalar_t(0));
            continue;
          }
          const scalar_t sum = exp_shifted_sum(x, S, largest);
          lse_data[row] += std::log(sum);
          scale_row(x, S, scalar_t(1) / sum);
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
      bool need_weights) {
    // Contiguous once: the products read them so, forward and backward.
    auto contiguous = params;
    contiguous.q = q.contiguous();
    contiguous.k = k.contiguous();
    contiguous.v = v.contiguous();
    const auto result = batched_forward(contiguous);
    ctx->save_for_backward({contiguous.q, contiguous.k, contiguous.v, result.weights});
    params.save_settings_to(*ctx);
    if (!need_weights) {
      ctx->mark_non_differentiable({result.weights});
    }
    return {result.out, result.weights};
  }

  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    auto params = AttentionParams::restore_settings_from(*ctx);
    params.q = saved[0];
    params.k = saved[1];
    params.v = saved[2];
    ForwardResult forward;
    forward.weights = saved[3];
    // An output that the loss did not use has no gradient.
    const auto grad_out = grad_outputs[0].defined()
        ? grad_outputs[0]
        : torch::zeros({params.B(), params.H(), params.L(), params.Dv()}, params.q.options());
    const auto grads = batched_backward(params, forward, grad_out, grad_outputs[1]);
    return {
        grads.dq, grads.dk, grads.dv, torch::Tensor(),
        torch::Tensor()}; // nothing for params, need_weights
  }
};

} // namespace

ForwardResult batched_forward(const AttentionParams& params) {
  TORCH_INTERNAL_ASSERT(!params.dropout.active(), "the batched kernel drops no weights");
  const BatchedInputs in(params);
  const auto& shape = in.shape;
  auto probs = batched_product(in.q, in.k.transpose(1, 2)); // (B·Hkv, group·L, S)
  auto lse = torch::empty({shape.B, shape.H, shape.L}, probs.options());
  AT_DISPATCH_FLOATING_TYPES(probs.scalar_type(), "batched_forward", [&] {
    softmax_rows<scalar_t>(probs, lse, shape, params);
  });
  const auto out = batched_product(probs, in.v).view({shape.B, shape.H, shape.L, params.Dv()});
  return {out, lse, probs.view({shape.B, shape.H, shape.L, shape.S})};
}

InputGradients batched_backward(
    const AttentionParams& params,
    const ForwardResult& forward,
    const torch::Tensor& grad_out,
    const torch::Tensor& grad_weights) {
  const BatchedInputs in(params);
  const auto& shape = in.shape;
  const auto probs = forward.weights.view({shape.B * shape.Hkv, shape.group * shape.L, shape.S});
  const auto grad_out3 = grad_out.contiguous().view({probs.size(0), probs.size(1), params.Dv()});
  const auto grad_v = batched_product(probs.transpose(1, 2), grad_out3);
  auto grad_probs = batched_product(grad_out3, in.v.transpose(1, 2));
  if (grad_weights.defined()) {
    grad_probs += grad_weights.reshape(probs.sizes());
  }
  AT_DISPATCH_FLOATING_TYPES(probs.scalar_type(), "batched_backward", [&] {
    softmax_backward_rows<scalar_t>(probs, grad_probs, params.scale);
  });
  const auto grad_q = batched_product(grad_probs, in.k);
  const auto grad_k = batched_product(grad_probs.transpose(1, 2), in.q);
  const int64_t B = shape.B, Hkv = shape.Hkv, S = shape.S;
  return {
      grad_q.view(params.q.sizes()), grad_k.view({B, Hkv, S, params.D()}),
      grad_v.view({B, Hkv, S, params.Dv()})};
}

std::tuple<torch::Tensor, torch::Tensor> batched_attention(
    const AttentionParams& params,
    bool need_weights) {
  const auto results = BatchedAttentionFunction::apply(
      params.q, params.k, params.v, params, need_weights);
  return {results[0], need_weights ? results[1] : torch::Tensor()};
}

} // namespace attn::detail
