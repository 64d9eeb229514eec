#pragma once

// The memory of a (B, H, T, F) tensor, whose heads the kernels' loops pass
// to the products as (T, F) matrices: no tensor per head or block. (Views
// made by select and narrow took a tenth of the tiled kernels' time at
// T = 128.) An empty tensor (F = 0: values or output of width 0) may have
// no data, and then neither have its heads.

#include "kernels/cpu/tile_product.h"

#include <torch/torch.h>

#include <cstdint>

namespace attn::detail {

template <typename scalar_t>
struct Heads {
  Heads() = default; // no heads: every head an empty matrix

  explicit Heads(const torch::Tensor& t)
      : data(t.numel() == 0 ? nullptr : t.data_ptr<scalar_t>()),
        rows(t.size(2)),
        cols(t.size(3)),
        batch_stride(t.stride(0)),
        head_stride(t.stride(1)),
        row_stride(t.stride(2)),
        column_stride(t.stride(3)) {}

  // One matrix that every (b, h) names: rows × cols, rows of unit stride
  // row_stride apart (a task's copy of the one head it computes).
  static Heads every_head_at(scalar_t* data, int64_t rows, int64_t cols, int64_t row_stride) {
    Heads one;
    one.data = data;
    one.rows = rows;
    one.cols = cols;
    one.row_stride = row_stride;
    one.column_stride = 1;
    return one;
  }

  MatrixRef<scalar_t> head(int64_t b, int64_t h) const {
    return {
        data == nullptr ? nullptr : data + b * batch_stride + h * head_stride, rows, cols,
        row_stride, column_stride};
  }

  scalar_t* data = nullptr;
  int64_t rows = 0, cols = 0, batch_stride = 0, head_stride = 0, row_stride = 0, column_stride = 0;
};

// A (B, H, T, F) view of memory laid out as (B, T, H, F), so that a kernel
// writing head h of token t lands where merged heads expect it.
inline torch::Tensor empty_heads_interleaved(
    int64_t B,
    int64_t H,
    int64_t T,
    int64_t F,
    const torch::TensorOptions& options) {
  return torch::empty({B, T, H, F}, options).permute({0, 2, 1, 3});
}

} // namespace attn::detail
