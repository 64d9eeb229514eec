#include "kernels/cpu/amx_products.h"

#include "kernels/cpu/isa.h"

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ATTN_HAVE_AMX 1
#include <immintrin.h>
#endif

namespace attn::detail {

#ifdef ATTN_HAVE_AMX
namespace {

// AMX's tile registers, as attn uses them: C blocks of 16 rows × 16 floats
// in tiles 0-3 (a 32 × 32 block of c), A in tiles 4-5 (16 rows × 32
// bfloat16 of the depth each) and B in tiles 6-7 (16 pairs of depth × 16
// columns each, the pairs layout of pack_bf16_pairs).
constexpr int64_t kBlock = 32;     // rows and columns of c per step
constexpr int64_t kTileRows = 16;  // rows of a tile
constexpr int64_t kTileDepth = 32; // bfloat16 of the depth per A tile
constexpr int64_t kTileBytes = 64; // bytes of a tile's row

// The tile configuration (Intel SDM, LDTILECFG): palette 1, every tile
// 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Held in static memory: GCC 12 does not count LDTILECFG as reading a
// local configuration, and dropped the stores that built one.
TileConfig every_tile_16_rows_of_64_bytes() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = kTileBytes;
    config.rows[t] = kTileRows;
  }
  return config;
}

__attribute__((target("amx-tile"))) void load_tile_config() {
  static const TileConfig config = every_tile_16_rows_of_64_bytes();
  _tile_loadconfig(&config);
}

// A 32 × 32 block of c = A·B, plus c where `add_c`: A's rows from a (row
// stride lda, depth a multiple of kTileDepth), B's pairs from b (ldb
// elements between pairs of rows), c's rows ldc floats apart.
__attribute__((target("amx-tile,amx-bf16"))) void block(
    const uint16_t* a,
    int64_t lda,
    const uint16_t* b,
    int64_t ldb,
    int64_t depth,
    float* c,
    int64_t ldc,
    bool add_c) {
  const int64_t c_stride = ldc * static_cast<int64_t>(sizeof(float));
  float* const c_tiles[] = {c, c + kTileRows, c + kTileRows * ldc, c + kTileRows * ldc + kTileRows};
  if (add_c) {
    _tile_loadd(0, c_tiles[0], c_stride);
    _tile_loadd(1, c_tiles[1], c_stride);
    _tile_loadd(2, c_tiles[2], c_stride);
    _tile_loadd(3, c_tiles[3], c_stride);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t a_stride = lda * 2, b_stride = ldb * 2;
  for (int64_t k = 0; k < depth; k += kTileDepth) {
    _tile_loadd(4, a + k, a_stride);
    _tile_loadd(5, a + kTileRows * lda + k, a_stride);
    _tile_loadd(6, b + (k / 2) * ldb, b_stride);
    _tile_loadd(7, b + (k / 2) * ldb + 2 * kTileRows, b_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c_tiles[0], c_stride);
  _tile_stored(1, c_tiles[1], c_stride);
  _tile_stored(2, c_tiles[2], c_stride);
  _tile_stored(3, c_tiles[3], c_stride);
}

// c (height × width of a block, rows ldc apart) = alpha·result (+ c),
// result a 32 × 32 block: for blocks that are not whole, or that add alpha·A·B
// to c with alpha other than 1.
__attribute__((target("avx512f"))) void write_block(
    const float* result,
    int64_t height,
    int64_t width,
    float alpha,
    bool accumulate,
    float* c,
    int64_t ldc) {
  const __m512 scale = _mm512_set1_ps(alpha);
  for (int64_t r = 0; r < height; ++r) {
    for (int64_t j = 0; j < width; j += 16) {
      const auto lanes = static_cast<__mmask16>(
          width - j >= 16 ? 0xFFFFU : (1U << static_cast<unsigned>(width - j)) - 1U);
      const __m512 product = _mm512_mul_ps(scale, _mm512_loadu_ps(result + r * kBlock + j));
      float* to = c + r * ldc + j;
      const __m512 sum = accumulate ? _mm512_add_ps(product, _mm512_maskz_loadu_ps(lanes, to))
                                    : product;
      _mm512_mask_storeu_ps(to, lanes, sum);
    }
  }
}

// c's whole 32 × 32 block (rows ldc apart) times alpha, in place.
__attribute__((target("avx512f"))) void scale_block(float* c, int64_t ldc, float alpha) {
  const __m512 scale = _mm512_set1_ps(alpha);
  for (int64_t r = 0; r < kBlock; ++r) {
    for (int64_t j = 0; j < kBlock; j += 16) {
      _mm512_storeu_ps(c + r * ldc + j, _mm512_mul_ps(scale, _mm512_loadu_ps(c + r * ldc + j)));
    }
  }
}

// The operands as the blocks read them: in place where the sizes are
// whole blocks, else zero-padded copies in this thread's buffers.
struct BlockOperands {
  const uint16_t* a;
  int64_t lda;
  const uint16_t* b;
  int64_t ldb;
  int64_t rows, cols, depth; // rounded up to whole blocks
};

int64_t round_up(int64_t n, int64_t step) {
  return (n + step - 1) / step * step;
}

BlockOperands block_operands(int64_t rows_of_c, int64_t cols_of_c, const Bf16GemmOperands& g) {
  BlockOperands o{
      g.a,
      g.a_row_stride,
      g.b,
      g.ldb,
      round_up(rows_of_c, kBlock),
      round_up(cols_of_c, kBlock),
      round_up(g.depth, kTileDepth)};
  if (o.rows == rows_of_c && o.cols == cols_of_c && o.depth == g.depth) {
    return o;
  }
  thread_local std::vector<uint16_t> padded_a, padded_b;
  padded_a.assign(o.rows * o.depth, 0);
  for (int64_t r = 0; r < rows_of_c; ++r) {
    std::memcpy(&padded_a[r * o.depth], g.a + r * g.a_row_stride, g.depth * sizeof(uint16_t));
  }
  padded_b.assign((o.depth / 2) * 2 * o.cols, 0);
  for (int64_t p = 0; p < (g.depth + 1) / 2; ++p) {
    std::memcpy(&padded_b[p * 2 * o.cols], g.b + p * g.ldb, 2 * cols_of_c * sizeof(uint16_t));
  }
  o.a = padded_a.data();
  o.lda = o.depth;
  o.b = padded_b.data();
  o.ldb = 2 * o.cols;
  return o;
}

__attribute__((target("amx-tile"))) void release_tiles() {
  _tile_release();
}

} // namespace

bool amx_gemm_bf16(int64_t rows_of_c, int64_t cols_of_c, const Bf16GemmOperands& g) {
  if (!amx_tiles_granted()) {
    return false;
  }
  if (empty_product_done(rows_of_c, cols_of_c, g)) {
    return true;
  }
  const BlockOperands o = block_operands(rows_of_c, cols_of_c, g);
  load_tile_config();
  alignas(64) float scratch[kBlock * kBlock];
  for (int64_t r0 = 0; r0 < o.rows; r0 += kBlock) {
    for (int64_t c0 = 0; c0 < o.cols; c0 += kBlock) {
      const int64_t height = std::min(kBlock, rows_of_c - r0);
      const int64_t width = std::min(kBlock, cols_of_c - c0);
      const uint16_t* a = o.a + r0 * o.lda;
      const uint16_t* b = o.b + 2 * c0;
      float* c = g.c + r0 * g.ldc + c0;
      // Whole blocks go through the tiles straight into c (adding c there
      // when alpha is 1), and are scaled in place.
      if (height == kBlock && width == kBlock && (g.alpha == 1.0F || !g.accumulate)) {
        block(a, o.lda, b, o.ldb, o.depth, c, g.ldc, g.accumulate);
        if (g.alpha != 1.0F) {
          scale_block(c, g.ldc, g.alpha);
        }
      } else {
        block(a, o.lda, b, o.ldb, o.depth, scratch, kBlock, /*add_c=*/false);
        write_block(scratch, height, width, g.alpha, g.accumulate, c, g.ldc);
      }
    }
  }
  release_tiles(); // the tile state back to its initial state, which a context switch need not save
  return true;
}

bool amx_products_run() {
  return amx_tiles_granted();
}

#else

bool amx_gemm_bf16(int64_t /*rows_of_c*/, int64_t /*cols_of_c*/, const Bf16GemmOperands& /*g*/) {
  return false;
}

bool amx_products_run() {
  return false;
}

#endif

} // namespace attn::detail
