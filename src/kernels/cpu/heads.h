#pragma once

// The memory of a (B, H, T, F) tensor, whose heads the kernels' loops pass
// to the products as (T, F) matrices: no tensor per head or block. (Views
// made by select and narrow took a tenth of the tiled kernels' time at
// T = 128.) An empty tensor (F = 0: values or output of width 0) may have
// no data, and then neither have its heads.

#include "kernels/cpu/tile_product.h"

#include <torch/types.h>

#include <cstdint>

namespace attn::detail {

template <typename scalar_t>
struct Heads {
  explicit Heads(const torch::Tensor& t)
      : data(t.numel() == 0 ? nullptr : t.data_ptr<scalar_t>()),
        rows(t.size(2)),
        cols(t.size(3)),
        batch_stride(t.stride(0)),
        head_stride(t.stride(1)),
        row_stride(t.stride(2)),
        column_stride(t.stride(3)) {}

  MatrixRef<scalar_t> head(int64_t b, int64_t h) const {
    return {
        data == nullptr ? nullptr : data + b * batch_stride + h * head_stride, rows, cols,
        row_stride, column_stride};
  }

  scalar_t* data;
  int64_t rows, cols, batch_stride, head_stride, row_stride, column_stride;
};

} // namespace attn::detail
