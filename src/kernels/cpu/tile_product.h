#pragma once

// The matrix products of the tiled CPU kernels: out = beta·out + alpha·a·b
// on 2-D tensors or on matrices in memory (MatrixRef), as at::addmm_out
// computes them. For float, on x86 CPUs with AVX-512 or with AVX2 and
// FMA, attn's own register-tiled loops (micro_tile.h) compute them: a
// score tile is 128 × 512 × D, small enough that a BLAS call's packing of
// both operands and its set-up on every call show (the forward measured
// 1.00-1.07× with attn's loops against OpenBLAS's, docs/design/cpu-kernels.md).
// Other dtypes, CPUs and layouts go to at::addmm_out, and so do large
// products called outside a parallel region, which the BLAS shares
// between threads.

#include "kernels/cpu/isa.h"

#include <c10/util/ArrayRef.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace attn::detail {

struct Bf16GemmOperands; // micro_tile.h

// Every function below computes on the loops of `loops` (isa.h: the call's
// plan chose them): attn's micro-tiles where loops.isa has them, else the
// BLAS's (at::addmm_out).

// Whether tile_addmm runs attn's own loops for this dtype on `loops`
// (where its right operand's rows are contiguous).
bool tile_products_run(const CpuLoops& loops, torch::ScalarType dtype);

// out = beta·out + alpha·a·b with `beta` 0 or 1: a (m, k), b (k, n) and out
// (m, n), any strides.
void tile_addmm(
    const CpuLoops& loops,
    const torch::Tensor& out,
    const torch::Tensor& a,
    const torch::Tensor& b,
    double beta,
    double alpha);

// attn's loops compute `out` in blocks of kProductRowBlock rows, and a
// row block in panels of kProductColumnPanel columns (each instruction
// set's micro-tiles divide both).
constexpr int64_t kProductRowBlock = 8;
constexpr int64_t kProductColumnPanel = 32;

// Indices [begin, end).
struct IndexRange {
  int64_t begin = 0, end = 0;
  bool operator==(const IndexRange& other) const {
    return begin == other.begin && end == other.end;
  }
};

// A matrix in memory, as the kernels' tile loops pass their blocks to the
// products without a tensor per block: element (r, c) at
// data[r·row_stride + c·column_stride]. An empty matrix may have no data.
template <typename T>
struct MatrixRef {
  T* data = nullptr;
  int64_t rows = 0, cols = 0, row_stride = 0, column_stride = 1;

  // Rows [r0, r0 + n) and columns [c0, c0 + n).
  MatrixRef row_block(int64_t r0, int64_t n) const {
    return {data == nullptr ? nullptr : data + r0 * row_stride, n, cols, row_stride, column_stride};
  }
  MatrixRef column_block(int64_t c0, int64_t n) const {
    return {
        data == nullptr ? nullptr : data + c0 * column_stride, rows, n, row_stride, column_stride};
  }
  MatrixRef transposed() const { return {data, cols, rows, column_stride, row_stride}; }
  // Row r; null where the matrix has no data.
  T* row(int64_t r) const { return data == nullptr ? nullptr : data + r * row_stride; }
};

// The matrix of a 2-D tensor of dtype T.
template <typename T>
MatrixRef<T> matrix_of(const torch::Tensor& t) {
  return {
      t.numel() == 0 ? nullptr : t.data_ptr<T>(), t.size(0), t.size(1), t.stride(0), t.stride(1)};
}

// Whether tile_addmm_banded would run attn's loops on this product (on the
// calling thread) rather than hand it to at::addmm_out.
template <typename T>
bool tile_loops_take(
    const CpuLoops& loops,
    const MatrixRef<T>& out,
    const MatrixRef<T>& a,
    const MatrixRef<T>& b,
    double beta);

// tile_addmm on matrices of dtype T (float or double).
template <typename T>
void tile_addmm(
    const CpuLoops& loops,
    const MatrixRef<T>& out,
    const MatrixRef<T>& a,
    const MatrixRef<T>& b,
    double beta,
    double alpha);

// What a banded product restricts in each row block of `out`.
enum class ProductBand {
  columns, // the columns of out it writes
  depth,   // the part of the depth it sums over (the columns of a, rows of b)
};

// out = beta·out + alpha·a·b (beta 0 or 1; T float or double) for tiles
// whose rows need different parts of the product (a causal or windowed
// tile of scores): row block k of `out`, rows [k·kProductRowBlock,
// (k+1)·kProductRowBlock), gets the product restricted to
// `row_block_bands[k]`, one range per row block. Column bands must begin
// on a panel (a multiple of kProductColumnPanel) and end on one or at the
// last column; the columns outside a row block's band are left as they
// were. A depth band sums over its part of the depth only (with beta 0 and
// an empty band, that row block becomes zero). Where tile_loops_take says
// no, the row blocks go to at::addmm_out, one call per distinct band.
template <typename T>
void tile_addmm_banded(
    const CpuLoops& loops,
    const MatrixRef<T>& out,
    const MatrixRef<T>& a,
    const MatrixRef<T>& b,
    double beta,
    double alpha,
    ProductBand band,
    c10::ArrayRef<IndexRange> row_block_bands);

// `product(first, count, band)` for each run of consecutive blocks of
// kProductRowBlock (`extent` rows or keys in all) whose `bands` are
// equal, empty ones included: a banded product as one product per run.
template <typename Product>
void for_each_band_run(c10::ArrayRef<IndexRange> bands, int64_t extent, const Product& product) {
  for (size_t first = 0; first < bands.size();) {
    size_t last = first + 1;
    while (last < bands.size() && bands[last] == bands[first]) {
      ++last;
    }
    const auto begin = static_cast<int64_t>(first) * kProductRowBlock;
    product(
        begin, std::min(extent, static_cast<int64_t>(last) * kProductRowBlock) - begin,
        bands[first]);
    first = last;
  }
}

// The float product of attn's loops on raw pointers, for a caller that
// runs many small products itself (one per matrix of a batch): c (rows,
// cols; row stride ldc) = alpha·A·B, plus c when `accumulate`, where
// A(r, i) = a[r·a_row_stride + i·a_depth_stride] and B(i, j) = b[i·ldb + j].
// Returns false, computing nothing, where tile_products_run(loops, kFloat)
// is false.
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
    bool accumulate);

// Whether attn's loops compute the float products on `loops` and widen
// float16 in registers (AVX-512, or AVX2 with F16C): the float16 kernels'
// products, float products of operands widened per tile (widen_half_row).
bool half_products_run(const CpuLoops& loops);

// to[0..n) = from[0..n): float16 (its bits) widened to float, and floats
// rounded to the nearest float16 (ties to even), as c10::Half converts; in
// registers where loops.half_rows_in_registers, else one by one.
void widen_half_row(const CpuLoops& loops, const uint16_t* from, int64_t n, float* to);
void round_half_row(const CpuLoops& loops, const float* from, int64_t n, uint16_t* to);

// Floats rounded to the nearest bfloat16 (its bits; ties to even, NaN
// kept): one row, and two rows in pairs (to[2j] = first[j], to[2j + 1] =
// second[j], 0 where second is null: pack_bf16_pairs's layout). On
// AVX512-BF16's instructions where `loops` have them (subnormals become 0,
// as the kernels' float arithmetic has them), else one by one as
// c10::BFloat16 rounds.
struct Bf16Rounding {
  void (*row)(const float* from, int64_t n, uint16_t* to);
  void (*row_pairs)(const float* first, const float* second, int64_t n, uint16_t* to);
};
Bf16Rounding bf16_rounding(const CpuLoops& loops);

// Rows of one half precision (its bits) and float, both ways: widened
// exactly, and rounded to the nearest (as widen_half_row and
// round_half_row for float16; a shift and bf16_rounding(loops).row for
// bfloat16), on the instructions of `loops`: callers keep the pair for a
// task's rows.
struct HalfRows {
  void (*widen)(const uint16_t* from, int64_t n, float* to);
  void (*round)(const float* from, int64_t n, uint16_t* to);
};
HalfRows half_rows(const CpuLoops& loops, torch::ScalarType dtype); // kBFloat16 or kHalf

// The bits of half-precision elements (c10::BFloat16, c10::Half), as the
// conversions above read and write them.
template <typename Element>
const uint16_t* half_bits(const Element* data) {
  static_assert(sizeof(Element) == sizeof(uint16_t), "a 16-bit element");
  return reinterpret_cast<const uint16_t*>(data);
}
template <typename Element>
uint16_t* half_bits(Element* data) {
  static_assert(sizeof(Element) == sizeof(uint16_t), "a 16-bit element");
  return reinterpret_cast<uint16_t*>(data);
}

// The bfloat16 product of attn's loops, accumulated in float: c (rows,
// cols) = alpha·A·B (+ c), the operands as micro_tile.h's
// Bf16GemmOperands describe them (A's rows of unit stride, B in pairs along
// the depth as pack_bf16_pairs writes it), on AMX's tiles where loops.amx,
// else AVX512-BF16's micro-tiles (loops.bf16). Returns false, computing
// nothing, where `loops` have neither (bf16_gemm_runs).
bool gemm_bf16(const CpuLoops& loops, int64_t rows, int64_t cols, const Bf16GemmOperands& g);

// Whether gemm_bf16 computes on `loops`.
bool bf16_gemm_runs(const CpuLoops& loops);

// Whether the bfloat16 products of `loops` outrun their float ones
// (tile_gemm), so that attn's loops multiply bfloat16 in bfloat16: AMX's
// tiles, or AVX512-BF16 on AMD's cores, whose vdpbf16ps makes twice the
// products of a float FMA per cycle (Zen 4: 1.9-2.0x the float loops,
// `attn_training_bench --products`; later AMD cores unmeasured). On Intel's
// cores AVX512-BF16 alone measured 0.53-0.57x the float loops: false there.
bool bf16_products_outrun_float(const CpuLoops& loops);

// B (depth, cols), element (i, j) at from[i·from_row_stride +
// j·from_column_stride], in pairs along the depth for gemm_bf16:
// to[(i / 2)·ld_to + 2j + i % 2] = B(i, j), the second half of an odd
// depth's last pair zero. ld_to ≥ 2·cols.
void pack_bf16_pairs(
    const CpuLoops& loops,
    int64_t depth,
    int64_t cols,
    const c10::BFloat16* from,
    int64_t from_row_stride,
    int64_t from_column_stride,
    c10::BFloat16* to,
    int64_t ld_to);

// to = fromᵀ in float, for the right operands that attn's loops read by
// rows (Kᵀ, Vᵀ): from (rows, cols) with strides (from_row_stride,
// from_column_stride), to (cols, rows) with row stride ld_to. From rows of
// unit stride, in register blocks of loops.isa's instruction set where it
// has one, else one by one.
void transpose_float(
    const CpuLoops& loops,
    int64_t rows,
    int64_t cols,
    const float* from,
    int64_t from_row_stride,
    int64_t from_column_stride,
    float* to,
    int64_t ld_to);

// transposed (B, H, D, S), rows of unit stride, = t (B, H, S, D) as
// floats, whose rows have any strides: transpose_float per head, in
// parallel over the heads. (ATen's element-by-element copy of the
// transposed view took 7 % of the tiled forward at T = 128.)
void transpose_heads(
    const CpuLoops& loops,
    const torch::Tensor& t,
    const torch::Tensor& transposed);

// A row stride for matrices of `cols` elements of `element_size` bytes
// whose rows the products read down a column (Kᵀ and Vᵀ, score tiles):
// at least `cols`, a whole and odd number of 64-byte cache lines, so that
// consecutive rows fall in different cache sets. With a power-of-two
// stride (Kᵀ of 1024 or 4096 keys) every row of a micro-tile's panel maps
// to the same few sets of L1, and the panel is fetched again for every
// row block.
int64_t spread_row_stride(int64_t cols, int64_t element_size);

} // namespace attn::detail
