#include "cpu_attention.h"

#include "blas_threads.h"
#include "row_ops.h"

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace attn::detail {
namespace {

// A query tile's scores (128 × 512 floats = 256 KiB) stay in L2 while they
// are masked, exponentiated and multiplied into V. Measured single-threaded
// at T = 1024 and 4096 (D = 64): 128 × 512 ran at ~70 % of sgemm, ahead of
// 64 × 512, 256 × 512, 128 × 256, 64 × 1024 and 256 × 1024.
constexpr int64_t kQueryTile = 128;
constexpr int64_t kKeyBlock = 512;

template <typename scalar_t>
constexpr scalar_t kNegativeInfinity = -std::numeric_limits<scalar_t>::infinity();

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Work below this many FLOPs runs on the calling thread: waking the thread
// pool, with OpenBLAS's workers still spinning from the projection before,
// costs milliseconds on two cores, while a decoding step's attention (one
// query against 512 keys, 8 heads) takes about 0.5 MFLOP.
constexpr double kMinParallelFlops = 4e6;

// at::parallel_for runs `units` inline when they number at most its grain:
// units per task such that each task does at least kMinParallelFlops.
int64_t parallel_grain(double flops_per_unit) {
  return static_cast<int64_t>(std::ceil(kMinParallelFlops / std::max(flops_per_unit, 1.0)));
}

// The kernels' parallel loop: BLAS on one thread inside the tasks when they
// run in parallel (two pools on the same cores would contend), inline with
// the BLAS as it is set otherwise.
template <typename Body>
void parallel_units(int64_t units, double flops_per_unit, const Body& body) {
  const int64_t grain = parallel_grain(flops_per_unit);
  c10::optional<ScopedSingleThreadedBlas> one_blas_thread_per_task;
  if (units > grain) {
    one_blas_thread_per_task.emplace();
  }
  at::parallel_for(0, units, grain, body);
}

// (B, H, T, F) view of memory laid out as (B, T, H, F), so that a kernel
// writing head h of token t lands where merged heads expect it.
torch::Tensor empty_heads_interleaved(
    int64_t B, int64_t H, int64_t T, int64_t F, const torch::TensorOptions& options) {
  return torch::empty({B, T, H, F}, options).permute({0, 2, 1, 3});
}

// Element access to the (B, H, L, S) mask through its (possibly zero,
// broadcast) strides, plus the band that `causal` and `window` leave
// visible: keys [key_begin(i), key_end(i)) for query i.
template <typename scalar_t>
struct MaskView {
  const bool* allowed = nullptr;  // bool mask: true = may attend
  const scalar_t* bias = nullptr; // additive mask
  int64_t stride_b = 0, stride_h = 0, stride_l = 0, stride_s = 0;
  bool causal = false;
  int64_t query_offset = 0, window = 0, S = 0;

  MaskView(const CpuAttentionConfig& config, int64_t S)
      : causal(config.causal), query_offset(config.query_offset),
        window(config.window), S(S) {
    const auto& mask = config.mask;
    if (!mask.defined()) {
      return;
    }
    stride_b = mask.stride(0);
    stride_h = mask.stride(1);
    stride_l = mask.stride(2);
    stride_s = mask.stride(3);
    if (mask.scalar_type() == torch::kBool) {
      allowed = mask.data_ptr<bool>();
    } else {
      bias = mask.data_ptr<scalar_t>();
    }
  }

  // First key query i may see; nondecreasing in i.
  int64_t key_begin(int64_t i) const {
    return window > 0 ? std::clamp<int64_t>(i + query_offset - window + 1, 0, S) : 0;
  }

  // One past the last key query i may see; nondecreasing in i.
  int64_t key_end(int64_t i) const {
    if (causal) {
      return std::clamp<int64_t>(i + query_offset + 1, 0, S);
    }
    return window > 0 ? std::clamp<int64_t>(i + query_offset + window, 0, S) : S;
  }

  // Applies the masks to the scores of query i against keys j0 .. j0+n-1.
  void apply(scalar_t* scores, int64_t n, int64_t b, int64_t h, int64_t i, int64_t j0) const {
    const int64_t base = b * stride_b + h * stride_h + i * stride_l + j0 * stride_s;
    if (allowed != nullptr) {
      for (int64_t j = 0; j < n; ++j) {
        if (!allowed[base + j * stride_s]) {
          scores[j] = kNegativeInfinity<scalar_t>;
        }
      }
    } else if (bias != nullptr) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        scores[j] += bias[base + j * stride_s];
      }
    }
    const int64_t visible_begin = std::clamp<int64_t>(key_begin(i) - j0, 0, n);
    const int64_t visible_end = std::clamp<int64_t>(key_end(i) - j0, visible_begin, n);
    std::fill(scores, scores + visible_begin, kNegativeInfinity<scalar_t>);
    std::fill(scores + visible_end, scores + n, kNegativeInfinity<scalar_t>);
  }
};

// Query heads per key/value head (1 when there are no heads at all).
int64_t kv_group(const torch::Tensor& q, const torch::Tensor& k) {
  return k.size(1) > 0 ? q.size(1) / k.size(1) : 1;
}

// Pointer to row t of head (b, h) of a (B, H, T, F) tensor.
template <typename scalar_t>
scalar_t* row_ptr(const torch::Tensor& t, int64_t b, int64_t h, int64_t row) {
  return t.data_ptr<scalar_t>() + b * t.stride(0) + h * t.stride(1) + row * t.stride(2);
}

template <typename scalar_t>
void scale_row(scalar_t* row, int64_t n, scalar_t factor) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    row[j] *= factor;
  }
}

// Forward: out (B, H, L, Dv) and the row log-sum-exp lse (B, H, L).
template <typename scalar_t>
void flash_forward(
    const torch::Tensor& q,
    const torch::Tensor& k,
    const torch::Tensor& v,
    const CpuAttentionConfig& config,
    const torch::Tensor& out,
    const torch::Tensor& lse) {
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), S = k.size(2);
  const int64_t Dv = v.size(3), group = kv_group(q, k);
  const int64_t tiles = ceil_div(L, kQueryTile);
  const int64_t key_block = std::clamp<int64_t>(S, 1, kKeyBlock);
  const MaskView<scalar_t> mask(config, S);
  const auto scale = static_cast<scalar_t>(config.scale);

  const int64_t tile_rows = std::min(kQueryTile, L);
  parallel_units(B * H * tiles, 2.0 * tile_rows * S * (q.size(3) + Dv), [&](int64_t begin, int64_t end) {
    // Grad mode is thread-local: worker threads start with it on.
    const torch::NoGradGuard no_grad;
    auto scores = torch::empty({tile_rows, key_block}, q.options());
    std::vector<scalar_t> running_max(kQueryTile), running_sum(kQueryTile);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t b = unit / (H * tiles), h = unit / tiles % H;
      const int64_t i0 = unit % tiles * kQueryTile;
      const int64_t rows = std::min(kQueryTile, L - i0);
      const auto q_tile = q[b][h].narrow(0, i0, rows);   // (rows, D)
      auto out_tile = out[b][h].narrow(0, i0, rows);     // (rows, Dv)
      out_tile.zero_();
      std::fill(running_max.begin(), running_max.end(), kNegativeInfinity<scalar_t>);
      std::fill(running_sum.begin(), running_sum.end(), scalar_t(0));

      const auto k_head = k[b][h / group], v_head = v[b][h / group];
      const int64_t key_end = mask.key_end(i0 + rows - 1);
      for (int64_t j0 = mask.key_begin(i0); j0 < key_end; j0 += key_block) {
        const int64_t cols = std::min(key_block, key_end - j0);
        auto block = scores.narrow(0, 0, rows).narrow(1, 0, cols); // (rows, cols)
        at::addmm_out(block, block, q_tile, k_head.narrow(0, j0, cols).t(), 0, scale);
        for (int64_t r = 0; r < rows; ++r) {
          scalar_t* row = scores.data_ptr<scalar_t>() + r * key_block;
          mask.apply(row, cols, b, h, i0 + r, j0);
          const scalar_t new_max = std::max(running_max[r], row_max(row, cols));
          if (new_max == kNegativeInfinity<scalar_t>) {
            std::fill(row, row + cols, scalar_t(0)); // nothing visible yet
            continue;
          }
          // Rescale what was accumulated under the previous maximum.
          const scalar_t correction = std::exp(running_max[r] - new_max);
          running_sum[r] = running_sum[r] * correction + exp_shifted_sum(row, cols, new_max);
          running_max[r] = new_max;
          if (correction != scalar_t(1)) {
            scale_row(row_ptr<scalar_t>(out, b, h, i0 + r), Dv, correction);
          }
        }
        at::addmm_out(out_tile, out_tile, block, v_head.narrow(0, j0, cols));
      }

      scalar_t* lse_row = lse[b][h].data_ptr<scalar_t>() + i0;
      for (int64_t r = 0; r < rows; ++r) {
        const bool any_visible = running_sum[r] > 0;
        scale_row(row_ptr<scalar_t>(out, b, h, i0 + r), Dv,
                  any_visible ? scalar_t(1) / running_sum[r] : scalar_t(0));
        lse_row[r] = any_visible ? running_max[r] + std::log(running_sum[r])
                                 : kNegativeInfinity<scalar_t>;
      }
    }
  });
}

// Backward: accumulates dq, dk, dv (zero-initialised, (B, H, ·, ·): one
// key/value gradient per query head, which grouped-query callers sum). One
// (b, h) per task, so the accumulations never race.
template <typename scalar_t>
void flash_backward(
    const torch::Tensor& grad_out,
    const torch::Tensor& q,
    const torch::Tensor& k,
    const torch::Tensor& v,
    const torch::Tensor& out,
    const torch::Tensor& lse,
    const CpuAttentionConfig& config,
    const torch::Tensor& dq,
    const torch::Tensor& dk,
    const torch::Tensor& dv) {
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), S = k.size(2);
  const int64_t group = kv_group(q, k);
  const int64_t key_block = std::clamp<int64_t>(S, 1, kKeyBlock);
  const MaskView<scalar_t> mask(config, S);
  const auto scale = static_cast<scalar_t>(config.scale);
  // delta_i = Σ_d dO_id · O_id = Σ_j P_ij dP_ij: the softmax backward's
  // row term, computed once instead of once per key block.
  const auto delta = (grad_out * out).sum(-1).contiguous(); // (B, H, L)

  const int64_t tile_rows = std::min(kQueryTile, L);
  // Five GEMMs of L·S·D per (b, h).
  parallel_units(B * H, 10.0 * L * S * q.size(3), [&](int64_t begin, int64_t end) {
    // Grad mode is thread-local: worker threads start with it on.
    const torch::NoGradGuard no_grad;
    auto probs = torch::empty({tile_rows, key_block}, q.options());
    auto grad_scores = torch::empty({tile_rows, key_block}, q.options());
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t b = unit / H, h = unit % H;
      const scalar_t* lse_bh = lse[b][h].data_ptr<scalar_t>();
      const scalar_t* delta_bh = delta[b][h].data_ptr<scalar_t>();
      for (int64_t i0 = 0; i0 < L; i0 += kQueryTile) {
        const int64_t rows = std::min(kQueryTile, L - i0);
        const auto q_tile = q[b][h].narrow(0, i0, rows);
        const auto go_tile = grad_out[b][h].narrow(0, i0, rows);
        auto dq_tile = dq[b][h].narrow(0, i0, rows);
        const int64_t key_end = mask.key_end(i0 + rows - 1);
        for (int64_t j0 = mask.key_begin(i0); j0 < key_end; j0 += key_block) {
          const int64_t cols = std::min(key_block, key_end - j0);
          const auto k_block = k[b][h / group].narrow(0, j0, cols);
          const auto v_block = v[b][h / group].narrow(0, j0, cols);
          auto dk_block = dk[b][h].narrow(0, j0, cols);
          auto dv_block = dv[b][h].narrow(0, j0, cols);
          auto p = probs.narrow(0, 0, rows).narrow(1, 0, cols);
          auto ds = grad_scores.narrow(0, 0, rows).narrow(1, 0, cols);

          // P = exp(scale·Q Kᵀ + mask - lse), the forward's probabilities.
          at::addmm_out(p, p, q_tile, k_block.t(), 0, scale);
          for (int64_t r = 0; r < rows; ++r) {
            scalar_t* row = probs.data_ptr<scalar_t>() + r * key_block;
            mask.apply(row, cols, b, h, i0 + r, j0);
            if (lse_bh[i0 + r] == kNegativeInfinity<scalar_t>) {
              std::fill(row, row + cols, scalar_t(0)); // fully masked row
            } else {
              exp_shifted_sum(row, cols, lse_bh[i0 + r]);
            }
          }
          at::addmm_out(dv_block, dv_block, p.t(), go_tile);            // dV += Pᵀ dO
          at::addmm_out(ds, ds, go_tile, v_block.t(), 0, 1);             // dP = dO Vᵀ
          for (int64_t r = 0; r < rows; ++r) {
            const scalar_t* p_row = probs.data_ptr<scalar_t>() + r * key_block;
            scalar_t* ds_row = grad_scores.data_ptr<scalar_t>() + r * key_block;
            const scalar_t d = delta_bh[i0 + r];
#pragma omp simd
            for (int64_t j = 0; j < cols; ++j) {
              ds_row[j] = p_row[j] * (ds_row[j] - d);                    // dS
            }
          }
          at::addmm_out(dq_tile, dq_tile, ds, k_block, 1, scale);        // dQ += s·dS K
          at::addmm_out(dk_block, dk_block, ds.t(), q_tile, 1, scale);   // dK += s·dSᵀ Q
        }
      }
    }
  });
}

// Weights materialised in (B, H, L, S): each query tile's rows are scored
// straight into the output, normalised in place and multiplied into V.
template <typename scalar_t>
void forward_with_weights(
    const torch::Tensor& q,
    const torch::Tensor& k,
    const torch::Tensor& v,
    const CpuAttentionConfig& config,
    const torch::Tensor& out,
    const torch::Tensor& weights) {
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), S = k.size(2);
  const int64_t group = kv_group(q, k);
  const int64_t tiles = ceil_div(L, kQueryTile);
  const MaskView<scalar_t> mask(config, S);
  const auto scale = static_cast<scalar_t>(config.scale);

  parallel_units(B * H * tiles, 2.0 * std::min(kQueryTile, L) * S * (q.size(3) + v.size(3)),
                 [&](int64_t begin, int64_t end) {
    // Grad mode is thread-local: worker threads start with it on.
    const torch::NoGradGuard no_grad;
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t b = unit / (H * tiles), h = unit / tiles % H;
      const int64_t i0 = unit % tiles * kQueryTile;
      const int64_t rows = std::min(kQueryTile, L - i0);
      auto out_tile = out[b][h].narrow(0, i0, rows);
      auto w_tile = weights[b][h].narrow(0, i0, rows); // (rows, S)
      // Keys outside [key_begin, key_end) are invisible to every row.
      const int64_t key_begin = mask.key_begin(i0);
      const int64_t key_end = std::max(key_begin, mask.key_end(i0 + rows - 1));
      const int64_t cols = key_end - key_begin;
      w_tile.narrow(1, 0, key_begin).zero_();
      w_tile.narrow(1, key_end, S - key_end).zero_();
      if (cols == 0) {
        out_tile.zero_();
        continue;
      }
      auto visible = w_tile.narrow(1, key_begin, cols);
      at::addmm_out(visible, visible, q[b][h].narrow(0, i0, rows),
                    k[b][h / group].narrow(0, key_begin, cols).t(), 0, scale);
      for (int64_t r = 0; r < rows; ++r) {
        scalar_t* row = row_ptr<scalar_t>(weights, b, h, i0 + r) + key_begin;
        mask.apply(row, cols, b, h, i0 + r, key_begin);
        const scalar_t largest = row_max(row, cols);
        if (largest == kNegativeInfinity<scalar_t>) {
          std::fill(row, row + cols, scalar_t(0));
          continue;
        }
        scale_row(row, cols, scalar_t(1) / exp_shifted_sum(row, cols, largest));
      }
      at::addmm_out(out_tile, out_tile, visible,
                    v[b][h / group].narrow(0, key_begin, cols), 0, 1);
    }
  });
}

class FlashAttentionFunction
    : public torch::autograd::Function<FlashAttentionFunction> {
 public:
  // q, k, v (B, H, ·, ·); returns the output as (B, L, H, Dv).
  static torch::Tensor forward(
      torch::autograd::AutogradContext* ctx,
      const torch::Tensor& q,
      const torch::Tensor& k,
      const torch::Tensor& v,
      const CpuAttentionConfig& config) {
    const int64_t B = q.size(0), H = q.size(1), L = q.size(2);
    // The kernel writes through a (B, H, L, Dv) view; the function returns
    // the underlying (B, L, H, Dv) tensor itself, not a view of it.
    auto out = torch::empty({B, L, H, v.size(3)}, q.options());
    const auto lse = torch::empty({B, H, L}, q.options());
    AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "cpu_flash_attention", [&] {
      flash_forward<scalar_t>(q, k, v, config, out.permute({0, 2, 1, 3}), lse);
    });
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["mask"] = config.mask;
    ctx->saved_data["scale"] = config.scale;
    ctx->saved_data["causal"] = config.causal;
    ctx->saved_data["query_offset"] = config.query_offset;
    ctx->saved_data["window"] = config.window;
    return out;
  }

  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &lse = saved[4];
    const auto out = saved[3].permute({0, 2, 1, 3}); // (B, H, L, Dv)
    const CpuAttentionConfig config{
        ctx->saved_data["mask"].toTensor(), ctx->saved_data["scale"].toDouble(),
        ctx->saved_data["causal"].toBool(), ctx->saved_data["query_offset"].toInt(),
        ctx->saved_data["window"].toInt()};
    const auto grad_out = grad_outputs[0].permute({0, 2, 1, 3}).contiguous();
    // Gradients of the contiguous inputs, accumulated tile by tile; with
    // grouped queries, one key/value gradient per query head, summed below.
    const int64_t B = q.size(0), H = q.size(1), Hkv = k.size(1), S = k.size(2);
    const auto dq = torch::zeros_like(q);
    const auto dk = torch::zeros({B, H, S, k.size(3)}, k.options());
    const auto dv = torch::zeros({B, H, S, v.size(3)}, v.options());
    AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "cpu_flash_attention_backward", [&] {
      flash_backward<scalar_t>(grad_out, q, k, v, out, lse, config, dq, dk, dv);
    });
    if (Hkv == H) {
      return {dq, dk, dv, torch::Tensor()}; // nothing for the config
    }
    const auto sum_groups = [&](const torch::Tensor& grad) {
      return grad.view({B, Hkv, H / Hkv, S, grad.size(3)}).sum(2);
    };
    return {dq, sum_groups(dk), sum_groups(dv), torch::Tensor()};
  }
};

} // namespace

torch::Tensor cpu_flash_attention(
    const torch::Tensor& q,
    const torch::Tensor& k,
    const torch::Tensor& v,
    const CpuAttentionConfig& config) {
  // Heads whose rows interleave with other heads' (MultiHeadAttention's
  // (B, L, H, D) projections seen as (B, H, L, D)) slow every tile's GEMM
  // by a third at T = 4096; copying the inputs once costs far less.
  return FlashAttentionFunction::apply(q.contiguous(), k.contiguous(), v.contiguous(), config)
      .permute({0, 2, 1, 3});
}

std::tuple<torch::Tensor, torch::Tensor> cpu_attention_with_weights(
    const torch::Tensor& q,
    const torch::Tensor& k,
    const torch::Tensor& v,
    const CpuAttentionConfig& config) {
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), S = k.size(2);
  const auto out = empty_heads_interleaved(B, H, L, v.size(3), q.options());
  const auto weights = torch::empty({B, H, L, S}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "cpu_attention_with_weights", [&] {
    forward_with_weights<scalar_t>(
        q.contiguous(), k.contiguous(), v.contiguous(),
        config, out, weights);
  });
  return {out, weights};
}

} // namespace attn::detail
