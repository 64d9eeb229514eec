#include "kernels/cpu/mask_blocks.h"

#include "kernels/cpu/parallel.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>

namespace attn::detail {
namespace {

// The mask as its own shape: each broadcast dimension of the first three
// narrowed to one index.
torch::Tensor unexpanded(torch::Tensor mask) {
  for (int64_t dim = 0; dim < 3; ++dim) {
    if (mask.size(dim) > 1 && mask.stride(dim) == 0) {
      mask = mask.narrow(dim, 0, 1);
    }
  }
  return mask;
}

// How many of the n elements from `row` (stride apart) are true.
int64_t count_allowed(const bool* row, int64_t n, int64_t stride) {
  int64_t count = 0;
  if (stride == 1) {
    const auto* bytes = reinterpret_cast<const uint8_t*>(row);
#pragma omp simd reduction(+ : count)
    for (int64_t j = 0; j < n; ++j) {
      count += bytes[j] != 0 ? 1 : 0;
    }
    return count;
  }
  for (int64_t j = 0; j < n; ++j) {
    count += row[j * stride] ? 1 : 0;
  }
  return count;
}

// The kind of the block of `mask` (its own shape, bool) at rows
// [i0, i0 + rows) of head (b, h) and keys [j0, j0 + cols).
uint8_t block_kind(
    const torch::Tensor& mask,
    int64_t b,
    int64_t h,
    int64_t i0,
    int64_t rows,
    int64_t j0,
    int64_t cols) {
  const bool* data = mask.data_ptr<bool>();
  const int64_t base = b * mask.stride(0) + h * mask.stride(1) + j0 * mask.stride(3);
  int64_t seen = -1; // the count of every row so far: 0 or cols
  for (int64_t i = i0; i < i0 + rows; ++i) {
    const int64_t count = count_allowed(data + base + i * mask.stride(2), cols, mask.stride(3));
    if ((count != 0 && count != cols) || (seen >= 0 && count != seen)) {
      return kPartialBlock;
    }
    seen = count;
  }
  return seen == 0 ? kEmptyBlock : kFullBlock;
}

} // namespace

MaskBlocks blocks_of_bool_mask(const torch::Tensor& mask) {
  TORCH_INTERNAL_ASSERT(mask.dim() == 4 && mask.scalar_type() == torch::kBool);
  const auto own = unexpanded(mask);
  const int64_t Bm = own.size(0), Hm = own.size(1), Lm = own.size(2), S = own.size(3);
  const int64_t Qm = MaskBlocks::query_blocks(Lm), key_blocks = MaskBlocks::key_blocks(S);
  MaskBlocks blocks;
  blocks.kinds = torch::empty({Bm, Hm, Qm, key_blocks}, torch::kByte);
  uint8_t* kinds = blocks.kinds.data_ptr<uint8_t>();
  const double elements_per_row_of_blocks = static_cast<double>(
      std::min(Lm, MaskBlocks::kRows) * S);
  parallel_for(
      0, Bm * Hm * Qm, parallel_grain(elements_per_row_of_blocks, 1 << 16),
      [&](int64_t begin, int64_t end) {
        for (int64_t unit = begin; unit < end; ++unit) {
          const int64_t b = unit / (Hm * Qm), h = unit / Qm % Hm,
                        i0 = unit % Qm * MaskBlocks::kRows;
          const int64_t rows = std::min(MaskBlocks::kRows, Lm - i0);
          for (int64_t block = 0; block < key_blocks; ++block) {
            const int64_t j0 = block * MaskBlocks::kCols;
            kinds[unit * key_blocks + block] = block_kind(
                own, b, h, i0, rows, j0, std::min(MaskBlocks::kCols, S - j0));
          }
        }
      });
  return blocks;
}

} // namespace attn::detail
