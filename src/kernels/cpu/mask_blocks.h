#pragma once

// The blocks of a bool mask (MaskBlocks, kernels/attention_params.h):
// which of them the mask hides entirely, leaves whole or only in part, so
// that the tiled loops skip the first and test no element of the second.

#include "kernels/attention_params.h"

#include <torch/types.h>

namespace attn::detail {

// The blocks of `mask`, bool (B, H, L, S) expanded from its own shape:
// a dimension it broadcasts (stride 0) is one row of blocks for every
// index. Reads each element at most once, and a partial block only up to
// the row that shows it partial. The partial blocks' elements stay the
// mask's (no tiles).
MaskBlocks blocks_of_bool_mask(const torch::Tensor& mask);

} // namespace attn::detail
