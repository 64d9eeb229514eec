#pragma once

// The register-tiled loops under attn's float products (tile_product.h),
// one set per x86 instruction set: a micro-tile of c = alpha·A·B (+ c)
// kept in vector registers over the whole depth, and a register transpose
// for the right operands the micro-tiles read by rows. Each set is
// compiled for its instructions alone (function target attributes), so a
// build runs on any x86 CPU and takes the widest set this one has.

#include <algorithm>
#include <cstdint>

namespace attn::detail {

// The operands of one product: c (rows, cols; row stride ldc) = alpha·A·B
// (+ c when `accumulate`), where A(r, i) = a[r·a_row_stride + i·a_depth_stride]
// and B(i, j) = b[i·ldb + j].
struct GemmOperands {
  int64_t depth;
  float alpha;
  const float* a;
  int64_t a_row_stride, a_depth_stride;
  const float* b;
  int64_t ldb;
  float* c;
  int64_t ldc;
  bool accumulate;
};

// c[r0, r0 + n) × [c0, c0 + width) of the product, for a micro-tile
// function of n rows.
using MicroTileFn = void (*)(const GemmOperands& g, int64_t r0, int64_t c0, int64_t width);

// A block × block square of `from` (rows of unit stride) transposed into
// `to`.
using TransposeBlockFn =
    void (*)(const float* from, int64_t from_row_stride, float* to, int64_t ld_to);

// The loops of one instruction set.
struct MicroTiles {
  int64_t rows, cols; // of a micro-tile
  // The rows of the micro-tiles of a banded product, whose row blocks
  // (tile_product.h) they must divide; at most `rows`.
  int64_t banded_rows;
  // [n - 1]: the micro-tile of n ≤ rows rows, of width cols (full) or
  // less (edge, with lane masks).
  const MicroTileFn* full;
  const MicroTileFn* edge;
  int64_t transpose_block;
  TransposeBlockFn transpose;
  // to[0..n) = from[0..n): float16 (its bits) widened to float (exact),
  // and floats rounded to the nearest float16 (ties to even; beyond its
  // range, infinity), as c10::Half converts. The AVX2 set's need F16C,
  // which its callers check.
  void (*widen_half_row)(const uint16_t* from, int64_t n, float* to);
  void (*round_half_row)(const float* from, int64_t n, uint16_t* to);
  // to[0..n) = from[0..n): bfloat16 (its bits) widened to float, exactly
  // (the bits shifted into float's upper half).
  void (*widen_bf16_row)(const uint16_t* from, int64_t n, float* to);
};

// The operands of one bfloat16 product with float accumulation: c (rows,
// cols; row stride ldc) = alpha·A·B (+ c when `accumulate`), where A(r, i)
// = a[r·a_row_stride + i] and B is held in pairs along the depth, as
// AVX512-BF16's vdpbf16ps reads it: B(i, j) = b[(i / 2)·ldb + 2j + i % 2]
// (pack_bf16_pairs in tile_product.h writes it). bfloat16 as its bits.
struct Bf16GemmOperands {
  int64_t depth;
  float alpha;
  const uint16_t* a;
  int64_t a_row_stride;
  const uint16_t* b;
  int64_t ldb; // elements between pairs of rows: at least 2·cols
  float* c;
  int64_t ldc;
  bool accumulate;
};

// c[r0, r0 + n) × [c0, c0 + width) of a bfloat16 product.
using Bf16MicroTileFn = void (*)(const Bf16GemmOperands& g, int64_t r0, int64_t c0, int64_t width);

// The bfloat16 micro-tiles: [n - 1] of n ≤ rows rows, of width cols (full)
// or less (edge).
struct Bf16MicroTiles {
  int64_t rows, cols;
  const Bf16MicroTileFn* full;
  const Bf16MicroTileFn* edge;
  // to[0..n) = from[0..n) rounded to the nearest bfloat16 (ties to even,
  // as c10::BFloat16 rounds; subnormals become 0, as the kernels' float
  // arithmetic has them: ScopedSubnormalsAsZero): the probabilities a
  // kernel multiplies into V.
  void (*round_row)(const float* from, int64_t n, uint16_t* to);
  // Two rows rounded so, in pairs: to[2j] = first[j], to[2j + 1] =
  // second[j] (0 where second is null), j < n: the layout of a product's
  // right operand whose depth runs down the rows (pack_bf16_pairs).
  void (*round_row_pairs)(const float* first, const float* second, int64_t n, uint16_t* to);
};

// A product (GemmOperands or Bf16GemmOperands) of rows × cols without
// elements to compute or depth to sum over, whose operands may then have
// no data (an empty head, a width of 0), so that no pointer into them may
// be formed: done here, c of depth 0 zeros (as it was when accumulating).
// Returns whether it was such a product. Every loop over operands starts
// with it.
template <typename Operands>
bool empty_product_done(int64_t rows, int64_t cols, const Operands& g) {
  if (rows > 0 && cols > 0 && g.depth > 0) {
    return false;
  }
  if (!g.accumulate && g.depth == 0) {
    for (int64_t r = 0; r < rows && cols > 0; ++r) {
      std::fill_n(g.c + r * g.ldc, cols, 0.0f);
    }
  }
  return true;
}

// Null where this build cannot compile the set; whether the CPU runs it is
// isa.h's question (isa_loops hands them out). AVX-512: 8 × 32
// micro-tiles. AVX2 with FMA: 6 × 16, and 4 × 16 in banded products.
const MicroTiles* avx512_micro_tiles();
const MicroTiles* avx2_micro_tiles();
// AVX512-BF16: 8 × 32 micro-tiles of vdpbf16ps (null where not compiled;
// isa.h says whether the CPU runs them).
const Bf16MicroTiles* avx512_bf16_micro_tiles();

} // namespace attn::detail
