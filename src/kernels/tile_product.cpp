#include "tile_product.h"

#include "kernels/parallel_grain.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <type_traits>
#include <utility>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define ATTN_HAVE_X86_AVX512 1
#include <immintrin.h>
#endif

namespace attn::detail {
namespace {

// Which part of each row block a product computes (tile_addmm_banded):
// all of it where `ranges` is null.
struct RowBlockBands {
  ProductBand band = ProductBand::columns;
  const IndexRange* ranges = nullptr;
};

#ifdef ATTN_HAVE_X86_AVX512

// A micro-tile is up to kTileRows rows of c by up to kTileCols columns
// (kTileVectors 16-float registers per row): kTileRows · kTileVectors
// accumulators, fed per step of the depth loop by kTileVectors loads of b
// and kTileRows broadcasts of a. Measured on the kernels' products (128 ×
// 512 × 64, 128 × 64 × 512, 512 × 64 × 128; AMD EPYC, one thread): 8 × 2,
// 12 × 2, 6 × 4 and 4 × 4 registers within 3 % of each other, 14 × 2 4 %
// slower.
constexpr int kTileRows = 8;
constexpr int64_t kLanes = 16; // floats per register
constexpr int64_t kTileVectors = 2;
constexpr int64_t kTileCols = kLanes * kTileVectors;

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

// c[r0 .. r0+Rows) × [c0 .. c0+width) of the product, width ≤ kTileCols;
// kFull: width == kTileCols, whose loads and stores need no lane masks (the
// masks of the edge version, kept in memory, cost a load per step: the full
// version made the tiled backward 1.2x faster on an AVX-512 Xeon).
template <int Rows, bool kFull>
__attribute__((target("avx512f"))) void micro_tile(
    const GemmOperands& g,
    int64_t r0,
    int64_t c0,
    int64_t width) {
  __mmask16 lanes[kTileVectors];
  for (int64_t v = 0; v < kTileVectors; ++v) {
    const int64_t n = kFull ? kLanes : std::clamp<int64_t>(width - kLanes * v, 0, kLanes);
    lanes[v] = static_cast<__mmask16>((1u << n) - 1u);
  }
  __m512 acc[Rows][kTileVectors];
  const float* a_rows[Rows];
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r) {
#pragma GCC unroll 4
    for (int64_t v = 0; v < kTileVectors; ++v) {
      acc[r][v] = _mm512_setzero_ps();
    }
    a_rows[r] = g.a + (r0 + r) * g.a_row_stride;
  }
  const float* b_row = g.b + c0;
  const int64_t depth = g.depth, ldb = g.ldb, a_step = g.a_depth_stride;
  for (int64_t i = 0, a_offset = 0; i < depth; ++i, b_row += ldb, a_offset += a_step) {
    __m512 b_values[kTileVectors];
#pragma GCC unroll 4
    for (int64_t v = 0; v < kTileVectors; ++v) {
      if constexpr (kFull) {
        b_values[v] = _mm512_loadu_ps(b_row + kLanes * v);
      } else {
        b_values[v] = _mm512_maskz_loadu_ps(lanes[v], b_row + kLanes * v);
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < Rows; ++r) {
      const __m512 a_value = _mm512_set1_ps(a_rows[r][a_offset]);
#pragma GCC unroll 4
      for (int64_t v = 0; v < kTileVectors; ++v) {
        acc[r][v] = _mm512_fmadd_ps(a_value, b_values[v], acc[r][v]);
      }
    }
  }
  const __m512 alpha = _mm512_set1_ps(g.alpha);
#pragma GCC unroll 16
  for (int r = 0; r < Rows; ++r) {
    float* c_row = g.c + (r0 + r) * g.ldc + c0;
#pragma GCC unroll 4
    for (int64_t v = 0; v < kTileVectors; ++v) {
      __m512 result = _mm512_mul_ps(acc[r][v], alpha);
      if constexpr (kFull) {
        if (g.accumulate) {
          result = _mm512_add_ps(result, _mm512_loadu_ps(c_row + kLanes * v));
        }
        _mm512_storeu_ps(c_row + kLanes * v, result);
      } else {
        if (g.accumulate) {
          result = _mm512_add_ps(result, _mm512_maskz_loadu_ps(lanes[v], c_row + kLanes * v));
        }
        _mm512_mask_storeu_ps(c_row + kLanes * v, lanes[v], result);
      }
    }
  }
}

using MicroTileFn = void (*)(const GemmOperands&, int64_t, int64_t, int64_t);

template <bool kFull, int... Rows>
constexpr std::array<MicroTileFn, sizeof...(Rows)> micro_tiles(
    std::integer_sequence<int, Rows...>) {
  return {micro_tile<Rows + 1, kFull>...};
}

// micro_tile for 1 .. kTileRows rows, for full and partial widths.
constexpr auto kFullMicroTiles = micro_tiles<true>(std::make_integer_sequence<int, kTileRows>());
constexpr auto kEdgeMicroTiles = micro_tiles<false>(std::make_integer_sequence<int, kTileRows>());

static_assert(kTileRows == kProductRowBlock && kTileCols == kProductColumnPanel);

// The operands restricted to depth [range.begin, range.end).
GemmOperands with_depth(const GemmOperands& g, const IndexRange& range) {
  GemmOperands part = g;
  part.depth = range.end - range.begin;
  part.a += range.begin * g.a_depth_stride;
  part.b += range.begin * g.ldb;
  return part;
}

// Column panels outside, row blocks inside: a panel of b (depth × kTileCols)
// is read from cache by every row block in turn. (Splitting the depth into
// blocks of 128 or 256, for a panel that stays in L1, measured no faster.)
void gemm_by_micro_tiles(
    int64_t rows,
    int64_t cols,
    const GemmOperands& g,
    const RowBlockBands& bands = {}) {
  for (int64_t c0 = 0; c0 < cols; c0 += kTileCols) {
    const int64_t width = std::min(kTileCols, cols - c0);
    const auto& tiles = width == kTileCols ? kFullMicroTiles : kEdgeMicroTiles;
    for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
      const auto& tile = tiles[std::min<int64_t>(kTileRows, rows - r0) - 1];
      if (bands.ranges == nullptr) {
        tile(g, r0, c0, width);
        continue;
      }
      const IndexRange& range = bands.ranges[r0 / kTileRows];
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

bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
}

// A 16 × 16 block of `from` (rows of unit stride) transposed into `to`,
// in registers: pairs of rows interleaved at 32, then 64 bits, within
// 128-bit lanes, then the lanes exchanged twice. (GCC 12's unpack
// intrinsics start from a vector initialised from itself, which
// -Wuninitialized, and with sanitizers -Wmaybe-uninitialized, report at
// every call.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
__attribute__((target("avx512f"))) void transpose_block16(
    const float* from,
    int64_t from_row_stride,
    float* to,
    int64_t ld_to) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) {
    r[i] = _mm512_loadu_ps(from + i * from_row_stride);
  }
  for (int i = 0; i < 16;
       i += 2) { // lane k of t[i]: rows i, i+1 at columns 4k, 4k+1 (lo) or 4k+2, 4k+3 (hi)
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) { // lane k of r[i + c]: rows i .. i+3 at column 4k + c
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 1] = _mm512_castpd_ps(
        _mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(
        _mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(
        _mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  for (int c = 0; c < 4;
       ++c) { // lanes of rows 0-3, 4-7 (and 8-11, 12-15) at columns c + {0, 8} or c + {4, 12}
    t[c] = _mm512_shuffle_f32x4(r[c], r[c + 4], 0x88);
    t[c + 4] = _mm512_shuffle_f32x4(r[c], r[c + 4], 0xdd);
    t[c + 8] = _mm512_shuffle_f32x4(r[c + 8], r[c + 12], 0x88);
    t[c + 12] = _mm512_shuffle_f32x4(r[c + 8], r[c + 12], 0xdd);
  }
  for (int c = 0; c < 8; ++c) { // column c and c + 8, all 16 rows
    _mm512_storeu_ps(to + c * ld_to, _mm512_shuffle_f32x4(t[c], t[c + 8], 0x88));
    _mm512_storeu_ps(to + (c + 8) * ld_to, _mm512_shuffle_f32x4(t[c], t[c + 8], 0xdd));
  }
}
#pragma GCC diagnostic pop

#endif

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

// Multiply-adds from which a product outside the kernels' parallel tasks
// goes to the BLAS, which shares it between threads: as much work as the
// kernels give one task (kMinParallelFlops in cpu_attention.cpp).
constexpr double kMinSharedProduct = 2e6;

// attn's loops run on the calling thread: inside a parallel task, with one
// thread, or on a product too small to share. A kernel whose tiles are too
// few for a task per thread (one head of 128 queries against many keys)
// leaves its products to a BLAS that uses every thread.
bool product_stays_on_one_thread(int64_t rows, int64_t cols, int64_t depth) {
  return at::in_parallel_region() || at::get_num_threads() == 1 ||
      static_cast<double>(rows) * static_cast<double>(cols) * static_cast<double>(depth) <
      kMinSharedProduct;
}

// False while a ScopedBlasProducts lives.
std::atomic<bool> tile_products_allowed{true};

bool cpu_runs_tile_gemm() {
#ifdef ATTN_HAVE_X86_AVX512
  static const bool available = cpu_has_avx512();
  return available && tile_products_allowed.load(std::memory_order_relaxed);
#else
  return false;
#endif
}

} // namespace

ScopedBlasProducts::ScopedBlasProducts()
    : previous_(tile_products_allowed.exchange(false, std::memory_order_relaxed)) {}

ScopedBlasProducts::~ScopedBlasProducts() {
  tile_products_allowed.store(previous_, std::memory_order_relaxed);
}

bool tile_products_run(torch::ScalarType dtype) {
  return dtype == torch::kFloat && cpu_runs_tile_gemm();
}

bool tile_gemm_float(
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
#ifdef ATTN_HAVE_X86_AVX512
  if (!cpu_runs_tile_gemm()) {
    return false;
  }
  gemm_by_micro_tiles(
      rows, cols, {depth, alpha, a, a_row_stride, a_depth_stride, b, ldb, c, ldc, accumulate});
  return true;
#else
  return false;
#endif
}

template <typename T>
bool tile_loops_take(
    const MatrixRef<T>& out,
    const MatrixRef<T>& a,
    const MatrixRef<T>& b,
    double beta) {
  if constexpr (std::is_same_v<T, float>) {
    return out.rows > 0 && out.cols > 0 && a.cols > 0 && fits_tile_gemm(out, b, beta) &&
        product_stays_on_one_thread(out.rows, out.cols, a.cols) && cpu_runs_tile_gemm();
  } else {
    return false;
  }
}

namespace {

// Runs the product in attn's loops where tile_loops_take says so, and
// says whether it did.
template <typename T>
bool ran_tile_loops(
    const MatrixRef<T>& out,
    const MatrixRef<T>& a,
    const MatrixRef<T>& b,
    double beta,
    [[maybe_unused]] double alpha,
    [[maybe_unused]] const RowBlockBands& bands = {}) {
  if (!tile_loops_take(out, a, b, beta)) {
    return false;
  }
#ifdef ATTN_HAVE_X86_AVX512
  if constexpr (std::is_same_v<T, float>) {
    gemm_by_micro_tiles(out.rows, out.cols, operands_of(out, a, b, beta, alpha), bands);
    return true;
  }
#endif
  return false; // unreachable: tile_loops_take says no without the loops
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
    const MatrixRef<T>& out,
    const MatrixRef<T>& a,
    const MatrixRef<T>& b,
    double beta,
    double alpha) {
  if (out.rows == 0 || out.cols == 0 || ran_tile_loops(out, a, b, beta, alpha)) {
    return;
  }
  auto result = tensor_over(out); // addmm_out takes its output by reference
  at::addmm_out(result, result, tensor_over(a), tensor_over(b), beta, alpha);
}

void tile_addmm(
    const torch::Tensor& out,
    const torch::Tensor& a,
    const torch::Tensor& b,
    double beta,
    double alpha) {
  const bool floats = out.scalar_type() == torch::kFloat && a.scalar_type() == torch::kFloat &&
      b.scalar_type() == torch::kFloat;
  if (floats) {
    tile_addmm(matrix_of<float>(out), matrix_of<float>(a), matrix_of<float>(b), beta, alpha);
    return;
  }
  torch::Tensor result = out; // addmm_out takes its output by reference
  at::addmm_out(result, out, a, b, beta, alpha);
}

template <typename T>
void tile_addmm_banded(
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
  if (ran_tile_loops(out, a, b, beta, alpha, {band, row_block_bands.data()})) {
    return;
  }
  // Row blocks with equal bands in one call each.
  for (size_t first = 0; first < blocks;) {
    size_t last = first + 1;
    while (last < blocks && row_block_bands[last] == row_block_bands[first]) {
      ++last;
    }
    const int64_t r0 = static_cast<int64_t>(first) * kProductRowBlock;
    const int64_t n = std::min(rows, static_cast<int64_t>(last) * kProductRowBlock) - r0;
    const auto [begin, end] = row_block_bands[first];
    const auto out_rows = out.row_block(r0, n), a_rows = a.row_block(r0, n);
    if (band == ProductBand::columns) {
      tile_addmm(
          out_rows.column_block(begin, end - begin), a_rows, b.column_block(begin, end - begin),
          beta, alpha);
    } else {
      tile_addmm(
          out_rows, a_rows.column_block(begin, end - begin), b.row_block(begin, end - begin), beta,
          alpha);
    }
    first = last;
  }
}

void transpose_float(
    int64_t rows,
    int64_t cols,
    const float* from,
    int64_t from_row_stride,
    int64_t from_column_stride,
    float* to,
    int64_t ld_to) {
#ifdef ATTN_HAVE_X86_AVX512
  static const bool blocks_in_registers = cpu_has_avx512();
  if (blocks_in_registers && from_column_stride == 1) {
    const int64_t full_rows = rows / kLanes * kLanes, full_cols = cols / kLanes * kLanes;
    for (int64_t i0 = 0; i0 < full_rows; i0 += kLanes) {
      for (int64_t j0 = 0; j0 < full_cols; j0 += kLanes) {
        transpose_block16(
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
#endif
  transpose_by_blocks(rows, cols, from, from_row_stride, from_column_stride, to, ld_to);
}

// Elements from which transposing splits its heads between threads.
constexpr double kMinParallelTranspose = 1 << 16;

void transpose_heads(const torch::Tensor& t, const torch::Tensor& transposed) {
  const int64_t H = t.size(1), S = t.size(2), D = t.size(3);
  const float* source = t.data_ptr<float>();
  float* target = transposed.data_ptr<float>();
  const int64_t grain = parallel_grain(static_cast<double>(S * D), kMinParallelTranspose);
  at::parallel_for(0, t.size(0) * H, grain, [&](int64_t begin, int64_t end) {
    for (int64_t head = begin; head < end; ++head) {
      const int64_t b = head / H, h = head % H;
      transpose_float(
          S, D, source + b * t.stride(0) + h * t.stride(1), t.stride(2), t.stride(3),
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
#define ATTN_TILE_PRODUCTS(T)                                                                     \
  template bool tile_loops_take(                                                                  \
      const MatrixRef<T>&, const MatrixRef<T>&, const MatrixRef<T>&, double);                     \
  template void tile_addmm(                                                                       \
      const MatrixRef<T>&, const MatrixRef<T>&, const MatrixRef<T>&, double, double);             \
  template void tile_addmm_banded(                                                                \
      const MatrixRef<T>&, const MatrixRef<T>&, const MatrixRef<T>&, double, double, ProductBand, \
      c10::ArrayRef<IndexRange>);
ATTN_TILE_PRODUCTS(float)
ATTN_TILE_PRODUCTS(double)
#undef ATTN_TILE_PRODUCTS

} // namespace attn::detail
