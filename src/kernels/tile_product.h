#pragma once

// The matrix products of the tiled CPU kernels: out = beta·out + alpha·a·b
// on 2-D views, as at::addmm_out computes them. For float, on CPUs with
// AVX-512, attn's own register-tiled loops compute them: a score tile is
// 128 × 512 × D, small enough that a BLAS call's packing of both operands
// and its set-up on every call show (the forward measured 1.00-1.07× with
// attn's loops against OpenBLAS's, docs/BENCHMARKS.md). Other dtypes, CPUs
// and layouts go to at::addmm_out, and so do large products called outside
// a parallel region, which the BLAS shares between threads.

#include <c10/util/ArrayRef.h>
#include <torch/types.h>

#include <cstdint>

namespace attn::detail {

// Whether tile_addmm runs attn's own loops for this dtype on this CPU
// (where its right operand's rows are contiguous).
bool tile_products_run(torch::ScalarType dtype);

// While one lives, tile_addmm hands every product to at::addmm_out, so
// that tests and benchmarks can compare the two ways in one process. Set it
// while no kernel runs on another thread.
class ScopedBlasProducts {
 public:
  ScopedBlasProducts();
  ~ScopedBlasProducts();
  ScopedBlasProducts(const ScopedBlasProducts&) = delete;
  ScopedBlasProducts& operator=(const ScopedBlasProducts&) = delete;

 private:
  bool previous_;
};

// out = beta·out + alpha·a·b with `beta` 0 or 1: a (m, k), b (k, n) and out
// (m, n), any strides.
void tile_addmm(
    const torch::Tensor& out,
    const torch::Tensor& a,
    const torch::Tensor& b,
    double beta,
    double alpha);

// attn's loops compute `out` in blocks of kProductRowBlock rows, and a
// row block in panels of kProductColumnPanel columns.
constexpr int64_t kProductRowBlock = 8;
constexpr int64_t kProductColumnPanel = 32;

// Indices [begin, end).
struct IndexRange {
  int64_t begin = 0, end = 0;
  bool operator==(const IndexRange& other) const {
    return begin == other.begin && end == other.end;
  }
};

// Whether tile_addmm would run attn's loops on this product (on the calling
// thread) rather than hand it to at::addmm_out.
bool tile_loops_take(
    const torch::Tensor& out,
    const torch::Tensor& a,
    const torch::Tensor& b,
    double beta);

// What a banded product restricts in each row block of `out`.
enum class ProductBand {
  columns, // the columns of out it writes
  depth,   // the part of the depth it sums over (the columns of a, rows of b)
};

// tile_addmm for tiles whose rows need different parts of the product (a
// causal or windowed tile of scores): row block k of `out`, rows
// [k·kProductRowBlock, (k+1)·kProductRowBlock), gets the product restricted
// to `row_block_bands[k]`, one range per row block. Column bands must begin
// on a panel (a multiple of kProductColumnPanel) and end on one or at the
// last column; the columns outside a row block's band are left as they
// were. A depth band sums over its part of the depth only (with beta 0 and
// an empty band, that row block becomes zero). Where tile_loops_take says
// no, the row blocks go to at::addmm_out, one call per distinct band.
void tile_addmm_banded(
    const torch::Tensor& out,
    const torch::Tensor& a,
    const torch::Tensor& b,
    double beta,
    double alpha,
    ProductBand band,
    c10::ArrayRef<IndexRange> row_block_bands);

// The float product of attn's loops on raw pointers, for a caller that
// runs many small products itself (one per matrix of a batch): c (rows,
// cols; row stride ldc) = alpha·A·B, plus c when `accumulate`, where
// A(r, i) = a[r·a_row_stride + i·a_depth_stride] and B(i, j) = b[i·ldb + j].
// Returns false, computing nothing, where tile_products_run(kFloat) is
// false.
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
    bool accumulate);

} // namespace attn::detail
