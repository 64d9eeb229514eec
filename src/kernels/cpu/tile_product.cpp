#include "kernels/cpu/tile_product.h"

#include "kernels/cpu/amx_products.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/micro_tile.h"
#include "kernels/cpu/parallel.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace attn::detail {
namespace {

// Which part of each row block a product computes (tile_addmm_banded):
// all of it where `ranges` is null.
struct RowBlockBands {
  ProductBand band = ProductBand::columns;
  const IndexRange* ranges = nullptr;
};

// The operands restricted to depth [range.begin, range.end).
GemmOperands with_depth(const GemmOperands& g, const IndexRange& range) {
  GemmOperands part = g;
  part.depth = range.end - range.begin;
  part.a += range.begin * g.a_depth_stride;
  part.b += range.begin * g.ldb;
  return part;
}

// Column panels outside, row blocks inside: a panel of b (depth ×
// tiles.cols) is read from cache by every row block in turn. (Splitting
// the depth into blocks of 128 or 256, for a panel that stays in L1,
// measured no faster.) A micro-tile lies within one row block and one
// column panel of the banded products.
void gemm_by_micro_tiles(
    const MicroTiles& tiles,
    int64_t rows,
    int64_t cols,
    const GemmOperands& g,
    const RowBlockBands& bands = {}) {
  if (empty_product_done(rows, cols, g)) {
    return;
  }
  for (int64_t c0 = 0; c0 < cols; c0 += tiles.cols) {
    const int64_t width = std::min(tiles.cols, cols - c0);
    const MicroTileFn* by_rows = width == tiles.cols ? tiles.full : tiles.edge;
    const int64_t step = bands.ranges == nullptr ? tiles.rows : tiles.banded_rows;
    for (int64_t r0 = 0; r0 < rows; r0 += step) {
      const MicroTileFn tile = by_rows[std::min(step, rows - r0) - 1];
      if (bands.ranges == nullptr) {
        tile(g, r0, c0, width);
        continue;
      }
      const IndexRange& range = bands.ranges[r0 / kProductRowBlock];
      if (bands.band == ProductBand::depth) {
        tile(with_depth(g, range), r0, c0, width);
      } else if (c0 >= range.begin && c0 < range.end) {
        tile(g, r0, c0, width);
      }
    }
  }
}

// The operands of out = beta·out + alpha·a·b for attn's loops.
GemmOperands operands_of(
    const MatrixRef<float>& out,
    const MatrixRef<float>& a,
    const MatrixRef<float>& b,
    double beta,
    double alpha) {
  return {a.cols,          static_cast<float>(alpha),
          a.data,          a.row_stride,
          a.column_stride, b.data,
          b.row_stride,    out.data,
          out.row_stride,  beta == 1};
}

// Rows and columns per block of the portable transpose.
constexpr int64_t kTransposeBlock = 16;

void transpose_by_blocks(
    int64_t rows,
    int64_t cols,
    const float* from,
    int64_t from_row_stride,
    int64_t from_column_stride,
    float* to,
    int64_t ld_to) {
  for (int64_t i0 = 0; i0 < rows; i0 += kTransposeBlock) {
    const int64_t i_end = std::min(rows, i0 + kTransposeBlock);
    for (int64_t j0 = 0; j0 < cols; j0 += kTransposeBlock) {
      const int64_t j_end = std::min(cols, j0 + kTransposeBlock);
      for (int64_t i = i0; i < i_end; ++i) {
        for (int64_t j = j0; j < j_end; ++j) {
          to[j * ld_to + i] = from[i * from_row_stride + j * from_column_stride];
        }
      }
    }
  }
}

// Whether attn's loops can compute this product: rows of b and of out
// contiguous, beta 0 or 1.
bool fits_tile_gemm(const MatrixRef<float>& out, const MatrixRef<float>& b, double beta) {
  return (beta == 0 || beta == 1) && (out.cols <= 1 || out.column_stride == 1) &&
      (b.cols <= 1 || b.column_stride == 1);
}

// attn's loops run on the calling thread: inside a parallel task, with one
// thread, or on a product too small to share. A kernel whose tiles are too
// few for a task per thread (one head of 128 queries against many keys)
// leaves its products to a BLAS that uses every thread.
bool product_stays_on_one_thread(int64_t rows, int64_t cols, int64_t depth) {
  return at::in_parallel_region() || at::get_num_threads() == 1 ||
      static_cast<double>(rows) * static_cast<double>(cols) * static_cast<double>(depth) <
      kMinSharedProduct;
}

// The micro-tiles of `loops`, which divide the banded products' row blocks
// and column panels; null: the BLAS's products.
const MicroTiles* micro_tiles_of(const CpuLoops& loops) {
  const MicroTiles* tiles = loops.isa == nullptr ? nullptr : loops.isa->micro_tiles;
  TORCH_INTERNAL_ASSERT(
      tiles == nullptr ||
      (kProductRowBlock % tiles->banded_rows == 0 && tiles->banded_rows <= tiles->rows &&
       kProductColumnPanel % tiles->cols == 0));
  return tiles;
}

} // namespace

bool tile_products_run(const CpuLoops& loops, torch::ScalarType dtype) {
  return dtype == torch::kFloat && micro_tiles_of(loops) != nullptr;
}

bool tile_gemm_float(
    const CpuLoops& loops,
    int64_t rows,
    int64_t cols,
    int64_t depth,
    float alpha,
    const float* a,
    int64_t a_row_stride,
    int64_t a_depth_stride,
    const float* b,
    int64_t ldb,
    float* c,
    int64_t ldc,
    bool accumulate) {
  const MicroTiles* tiles = micro_tiles_of(loops);
  if (tiles == nullptr) {
    return false;
  }
  gemm_by_micro_tiles(
      *tiles, rows, cols,
      {depth, alpha, a, a_row_stride, a_depth_stride, b, ldb, c, ldc, accumulate});
  return true;
}

bool half_products_run(const CpuLoops& loops) {
  return micro_tiles_of(loops) != nullptr && loops.half_rows_in_registers;
}

namespace {

void widen_half_row_portable(const uint16_t* from, int64_t n, float* to) {
  for (int64_t j = 0; j < n; ++j) {
    to[j] = static_cast<float>(c10::Half(from[j], c10::Half::from_bits()));
  }
}

void round_half_row_portable(const float* from, int64_t n, uint16_t* to) {
  for (int64_t j = 0; j < n; ++j) {
    to[j] = c10::Half(from[j]).x;
  }
}

// float16's conversions on the loops' instructions, or portable.
HalfRows float16_rows(const CpuLoops& loops) {
  const MicroTiles* tiles = loops.half_rows_in_registers ? micro_tiles_of(loops) : nullptr;
  return tiles != nullptr ? HalfRows{tiles->widen_half_row, tiles->round_half_row}
                          : HalfRows{widen_half_row_portable, round_half_row_portable};
}

} // namespace

void widen_half_row(const CpuLoops& loops, const uint16_t* from, int64_t n, float* to) {
  float16_rows(loops).widen(from, n, to);
}

void round_half_row(const CpuLoops& loops, const float* from, int64_t n, uint16_t* to) {
  float16_rows(loops).round(from, n, to);
}

namespace {

// x rounded to the nearest bfloat16, ties to even (NaN stays NaN), as
// c10::BFloat16 rounds: where the CPU has no AVX512-BF16 to round a row.
uint16_t bf16_bits(float x) {
  if (std::isnan(x)) {
    return 0x7FC0;
  }
  uint32_t bits = 0;
  std::memcpy(&bits, &x, sizeof(bits));
  return static_cast<uint16_t>((bits + 0x7FFFU + ((bits >> 16) & 1U)) >> 16);
}

void round_bf16_row_portable(const float* from, int64_t n, uint16_t* to) {
  for (int64_t j = 0; j < n; ++j) {
    to[j] = bf16_bits(from[j]);
  }
}

void round_bf16_row_pairs_portable(
    const float* first,
    const float* second,
    int64_t n,
    uint16_t* to) {
  for (int64_t j = 0; j < n; ++j) {
    to[2 * j] = bf16_bits(first[j]);
    to[2 * j + 1] = second != nullptr ? bf16_bits(second[j]) : uint16_t{0};
  }
}

// bfloat16 is float's upper half: widening is exact, a shift.
void widen_bf16_row_portable(const uint16_t* from, int64_t n, float* to) {
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t bits = uint32_t{from[j]} << 16;
    std::memcpy(to + j, &bits, sizeof(bits));
  }
}

// The bfloat16 micro-tiles' product, in micro-tiles of the loops' set.
void gemm_by_bf16_micro_tiles(
    const Bf16MicroTiles& tiles,
    int64_t rows,
    int64_t cols,
    const Bf16GemmOperands& g) {
  if (empty_product_done(rows, cols, g)) {
    return;
  }
  for (int64_t c0 = 0; c0 < cols; c0 += tiles.cols) {
    const int64_t width = std::min(tiles.cols, cols - c0);
    const Bf16MicroTileFn* by_rows = width == tiles.cols ? tiles.full : tiles.edge;
    for (int64_t r0 = 0; r0 < rows; r0 += tiles.rows) {
      by_rows[std::min(tiles.rows, rows - r0) - 1](g, r0, c0, width);
    }
  }
}

} // namespace

Bf16Rounding bf16_rounding(const CpuLoops& loops) {
  return loops.bf16 != nullptr
      ? Bf16Rounding{loops.bf16->round_row, loops.bf16->round_row_pairs}
      : Bf16Rounding{round_bf16_row_portable, round_bf16_row_pairs_portable};
}

HalfRows half_rows(const CpuLoops& loops, torch::ScalarType dtype) {
  TORCH_INTERNAL_ASSERT(dtype == torch::kBFloat16 || dtype == torch::kHalf, "not a half precision");
  if (dtype == torch::kHalf) {
    return float16_rows(loops);
  }
  const MicroTiles* tiles = micro_tiles_of(loops);
  return {
      tiles != nullptr ? tiles->widen_bf16_row : widen_bf16_row_portable, bf16_rounding(loops).row};
}

bool bf16_gemm_runs(const CpuLoops& loops) {
  return loops.amx || loops.bf16 != nullptr;
}

bool bf16_products_outrun_float(const CpuLoops& loops) {
  return loops.bf16_outruns_float;
}

bool gemm_bf16(const CpuLoops& loops, int64_t rows, int64_t cols, const Bf16GemmOperands& g) {
  if (loops.amx) {
    return amx_gemm_bf16(rows, cols, g);
  }
  if (loops.bf16 != nullptr) {
    gemm_by_bf16_micro_tiles(*loops.bf16, rows, cols, g);
    return true;
  }
  return false;
}

namespace {

// Whether p lies on a 4-byte boundary, as a 32-bit word.
bool word_aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % sizeof(uint32_t) == 0;
}

// One row of pairs from two rows of unit stride (second null: zeros),
// each pair a 32-bit word: the first row's element in its low half, as
// memory holds it on x86.
void interleave_rows(const uint16_t* first, const uint16_t* second, int64_t cols, uint16_t* to) {
  for (int64_t j = 0; j < cols; ++j) {
    const uint32_t word = first[j] | (second != nullptr ? uint32_t{second[j]} << 16 : 0U);
    std::memcpy(to + 2 * j, &word, sizeof word);
  }
}

} // namespace

void pack_bf16_pairs(
    const CpuLoops& loops,
    int64_t depth,
    int64_t cols,
    const c10::BFloat16* from,
    int64_t from_row_stride,
    int64_t from_column_stride,
    c10::BFloat16* to,
    int64_t ld_to) {
  const uint16_t* src = half_bits(from);
  uint16_t* dst = half_bits(to);
  int64_t i = 0;
  // Pairs adjacent in memory (B's columns of unit stride: Kᵀ and Vᵀ read
  // from K and V) are 32-bit words of it, transposed whole in registers.
  if (from_row_stride == 1 && from_column_stride % 2 == 0 && ld_to % 2 == 0 && word_aligned(src) &&
      word_aligned(dst) && depth >= 2 && cols > 0) {
    const int64_t pairs = depth / 2;
    transpose_float(
        loops, cols, pairs, reinterpret_cast<const float*>(src), from_column_stride / 2, 1,
        reinterpret_cast<float*>(dst), ld_to / 2);
    i = 2 * pairs;
  }
  for (; i < depth; i += 2) {
    const uint16_t* first = src + i * from_row_stride;
    const uint16_t* second = i + 1 < depth ? first + from_row_stride : nullptr;
    uint16_t* row = dst + (i / 2) * ld_to;
    if (from_column_stride == 1) {
      interleave_rows(first, second, cols, row);
      continue;
    }
    for (int64_t j = 0; j < cols; ++j) {
      row[2 * j] = first[j * from_column_stride];
      row[2 * j + 1] = second != nullptr ? second[j * from_column_stride] : uint16_t{0};
    }
  }
}

template <typename T>
bool tile_loops_take(
    const CpuLoops& loops,
    const MatrixRef<T>& out,
    const MatrixRef<T>& a,
    const MatrixRef<T>& b,
    double beta) {
  if constexpr (std::is_same_v<T, float>) {
    return out.rows > 0 && out.cols > 0 && a.cols > 0 && fits_tile_gemm(out, b, beta) &&
        product_stays_on_one_thread(out.rows, out.cols, a.cols) && micro_tiles_of(loops) != nullptr;
  } else {
    return false;
  }
}

namespace {

// Runs the product in attn's loops where tile_loops_take says so, and
// says whether it did.
template <typename T>
bool ran_tile_loops(
    const CpuLoops& loops,
    const MatrixRef<T>& out,
    const MatrixRef<T>& a,
    const MatrixRef<T>& b,
    double beta,
    [[maybe_unused]] double alpha,
    [[maybe_unused]] const RowBlockBands& bands = {}) {
  if (!tile_loops_take(loops, out, a, b, beta)) {
    return false;
  }
  if constexpr (std::is_same_v<T, float>) {
    gemm_by_micro_tiles(
        *micro_tiles_of(loops), out.rows, out.cols, operands_of(out, a, b, beta, alpha), bands);
    return true;
  }
  return false; // unreachable: tile_loops_take says no to other dtypes
}

// A matrix as a tensor over its memory, for at::addmm_out.
template <typename T>
torch::Tensor tensor_over(const MatrixRef<T>& m) {
  return torch::from_blob(
      m.data, {m.rows, m.cols}, {m.row_stride, m.column_stride},
      torch::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value));
}

} // namespace

template <typename T>
void tile_addmm(
    const CpuLoops& loops,
    const MatrixRef<T>& out,
    const MatrixRef<T>& a,
    const MatrixRef<T>& b,
    double beta,
    double alpha) {
  if (out.rows == 0 || out.cols == 0 || ran_tile_loops(loops, out, a, b, beta, alpha)) {
    return;
  }
  auto result = tensor_over(out); // addmm_out takes its output by reference
  at::addmm_out(result, result, tensor_over(a), tensor_over(b), beta, alpha);
}

void tile_addmm(
    const CpuLoops& loops,
    const torch::Tensor& out,
    const torch::Tensor& a,
    const torch::Tensor& b,
    double beta,
    double alpha) {
  const bool floats = out.scalar_type() == torch::kFloat && a.scalar_type() == torch::kFloat &&
      b.scalar_type() == torch::kFloat;
  if (floats) {
    tile_addmm(loops, matrix_of<float>(out), matrix_of<float>(a), matrix_of<float>(b), beta, alpha);
    return;
  }
  torch::Tensor result = out; // addmm_out takes its output by reference
  at::addmm_out(result, out, a, b, beta, alpha);
}

template <typename T>
void tile_addmm_banded(
    const CpuLoops& loops,
    const MatrixRef<T>& out,
    const MatrixRef<T>& a,
    const MatrixRef<T>& b,
    double beta,
    double alpha,
    ProductBand band,
    c10::ArrayRef<IndexRange> row_block_bands) {
  const int64_t rows = out.rows;
  const auto blocks = static_cast<size_t>((rows + kProductRowBlock - 1) / kProductRowBlock);
  TORCH_INTERNAL_ASSERT(row_block_bands.size() == blocks, "one band per row block");
  if (rows == 0 || out.cols == 0) {
    return;
  }
  // Bands that agree in every row block (no mask, or one on keys alone)
  // make one product of the band, whose micro-tiles need not stay within
  // row blocks.
  const bool one_band = std::all_of(
      row_block_bands.begin(), row_block_bands.end(),
      [&](const IndexRange& range) { return range == row_block_bands.front(); });
  if (!one_band && ran_tile_loops(loops, out, a, b, beta, alpha, {band, row_block_bands.data()})) {
    return;
  }
  // Row blocks with equal bands in one call each.
  for_each_band_run(row_block_bands, rows, [&](int64_t r0, int64_t n, const IndexRange& range) {
    const auto [begin, end] = range;
    const auto out_rows = out.row_block(r0, n), a_rows = a.row_block(r0, n);
    if (band == ProductBand::columns) {
      tile_addmm(
          loops, out_rows.column_block(begin, end - begin), a_rows,
          b.column_block(begin, end - begin), beta, alpha);
    } else {
      tile_addmm(
          loops, out_rows, a_rows.column_block(begin, end - begin), b.row_block(begin, end - begin),
          beta, alpha);
    }
  });
}

void transpose_float(
    const CpuLoops& loops,
    int64_t rows,
    int64_t cols,
    const float* from,
    int64_t from_row_stride,
    int64_t from_column_stride,
    float* to,
    int64_t ld_to) {
  const MicroTiles* tiles = micro_tiles_of(loops);
  if (tiles != nullptr && from_column_stride == 1) {
    const int64_t block = tiles->transpose_block;
    const int64_t full_rows = rows / block * block, full_cols = cols / block * block;
    for (int64_t i0 = 0; i0 < full_rows; i0 += block) {
      for (int64_t j0 = 0; j0 < full_cols; j0 += block) {
        tiles->transpose(
            from + i0 * from_row_stride + j0, from_row_stride, to + j0 * ld_to + i0, ld_to);
      }
    }
    // The edges: the last columns of the full rows, then the last rows.
    transpose_by_blocks(
        full_rows, cols - full_cols, from + full_cols, from_row_stride, 1, to + full_cols * ld_to,
        ld_to);
    transpose_by_blocks(
        rows - full_rows, cols, from + full_rows * from_row_stride, from_row_stride, 1,
        to + full_rows, ld_to);
    return;
  }
  transpose_by_blocks(rows, cols, from, from_row_stride, from_column_stride, to, ld_to);
}

void transpose_heads(
    const CpuLoops& loops,
    const torch::Tensor& t,
    const torch::Tensor& transposed) {
  const int64_t H = t.size(1), S = t.size(2), D = t.size(3);
  const float* source = t.data_ptr<float>();
  float* target = transposed.data_ptr<float>();
  const int64_t grain = parallel_grain(static_cast<double>(S * D), kMinParallelTranspose);
  parallel_for(0, t.size(0) * H, grain, [&](int64_t begin, int64_t end) {
    for (int64_t head = begin; head < end; ++head) {
      const int64_t b = head / H, h = head % H;
      transpose_float(
          loops, S, D, source + b * t.stride(0) + h * t.stride(1), t.stride(2), t.stride(3),
          target + b * transposed.stride(0) + h * transposed.stride(1), transposed.stride(2));
    }
  });
}

int64_t spread_row_stride(int64_t cols, int64_t element_size) {
  constexpr int64_t kLineBytes = 64;
  const int64_t per_line = std::max<int64_t>(1, kLineBytes / element_size);
  const int64_t lines = (cols + per_line - 1) / per_line;
  return (lines % 2 == 0 ? lines + 1 : lines) * per_line;
}

// The products for the two dtypes the kernels dispatch to.
#define ATTN_TILE_PRODUCTS(T)                                                                  \
  template bool tile_loops_take(                                                               \
      const CpuLoops&, const MatrixRef<T>&, const MatrixRef<T>&, const MatrixRef<T>&, double); \
  template void tile_addmm(                                                                    \
      const CpuLoops&, const MatrixRef<T>&, const MatrixRef<T>&, const MatrixRef<T>&, double,  \
      double);                                                                                 \
  template void tile_addmm_banded(                                                             \
      const CpuLoops&, const MatrixRef<T>&, const MatrixRef<T>&, const MatrixRef<T>&, double,  \
      double, ProductBand, c10::ArrayRef<IndexRange>);
ATTN_TILE_PRODUCTS(float)
ATTN_TILE_PRODUCTS(double)
#undef ATTN_TILE_PRODUCTS

} // namespace attn::detail
