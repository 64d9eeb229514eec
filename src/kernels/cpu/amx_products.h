#pragma once

// bfloat16 products on AMX tiles (Intel Sapphire Rapids and later), with
// float accumulation: the operands of micro_tile.h's bfloat16 products
// (B in pairs along the depth, as pack_bf16_pairs writes it), computed in
// blocks of 32 × 32 by TDPBF16PS. Sizes that are not whole blocks (32 rows,
// 32 columns, 32 of the depth) are copied, zero-padded, first.

#include "kernels/cpu/micro_tile.h"

#include <cstdint>

namespace attn::detail {

// c (rows, cols) = alpha·A·B (+ c) on AMX tiles. Returns false, computing
// nothing, where the CPU has no AMX-BF16 or Linux did not grant this
// process the tile state (isa.h, amx_tiles_granted).
bool amx_gemm_bf16(int64_t rows, int64_t cols, const Bf16GemmOperands& g);

// Whether amx_gemm_bf16 computes here: this build compiled the tiles'
// products (GCC; a Clang build has none) and Linux granted the tile
// state.
bool amx_products_run();

} // namespace attn::detail
