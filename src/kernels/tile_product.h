#pragma once

// The matrix products of the tiled CPU kernels: out = beta·out + alpha·a·b
// on 2-D views, as at::addmm_out computes them. For float, on CPUs with
// AVX-512, attn's own register-tiled loops compute them: a score tile is
// 128 × 512 × D, small enough that a BLAS call's packing of both operands
// and its set-up on every call show (the forward measured 1.00-1.07× with
// attn's loops against OpenBLAS's, docs/BENCHMARKS.md). Other dtypes, CPUs
// and layouts go to at::addmm_out, and so do large products called outside
// a parallel region, which the BLAS shares between threads.

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

// The register-tiled float product behind tile_addmm, for tests:
// c (rows, cols; row stride ldc) = alpha·A·B (+ c when `accumulate`), where
// A(r, i) = a[r·a_row_stride + i·a_depth_stride] and B(i, j) = b[i·ldb + j].
// Returns false, computing nothing, where the CPU has no AVX-512 (or a
// ScopedBlasProducts lives).
bool tile_gemm_avx512(
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
