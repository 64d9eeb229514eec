#pragma once

// The register-tiled loops under attn's float products (tile_product.h),
// one set per x86 instruction set: a micro-tile of c = alpha·A·B (+ c)
// kept in vector registers over the whole depth, and a register transpose
// for the right operands the micro-tiles read by rows. Each set is
// compiled for its instructions alone (function target attributes), so a
// build runs on any x86 CPU and takes the widest set this one has.

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
};

// Null where this build cannot compile the set; whether the CPU runs it is
// isa.h's question (isa_loops hands them out). AVX-512: 8 × 32
// micro-tiles. AVX2 with FMA: 6 × 16, and 4 × 16 in banded products.
const MicroTiles* avx512_micro_tiles();
const MicroTiles* avx2_micro_tiles();

} // namespace attn::detail
