#pragma once

/// \file
/// The implementations behind `attn::scaled_dot_product_attention`, and
/// the CPU instructions attn's CPU kernels may use; `attn::select_backend`
/// (in sdpa.h) chooses between the backends.

#include <ostream>
#include <vector>

namespace attn {

/// An implementation of scaled dot-product attention. Every backend computes
/// what `attn::scaled_dot_product_attention` documents; they differ in speed,
/// memory and what they support. `attn::select_backend` says which one a call
/// takes; `SDPAOptions::backend` asks for one.
///
/// Example:
/// ```
/// if (attn::select_backend(q, k, v) == attn::AttentionBackend::fused_cpu) { ... }
/// ```
enum class AttentionBackend {
  /// attn's fused CPU kernel (FlashAttention style: query tiles against key
  /// blocks, online softmax, no `L×S` tensor) and its fused backward; heads
  /// of up to 128 queries and 64 keys run whole, each row's scores in
  /// registers. CPU only; returns no weights. Draws dropout inside the
  /// kernel, applies the score modifiers (ALiBi, soft-cap, the
  /// relative-position table, sinks, a `score_function`) and gives a
  /// floating `attn_mask` its gradient, in its tiled loops. bfloat16 and
  /// float16 are computed in their own dtype with float32 softmax and
  /// accumulators where docs/BACKENDS.md says, else in float32.
  fused_cpu,
  /// attn's CPU kernel that writes the weights as it goes, score modifiers
  /// included. CPU only, for inference: no gradients, no dropout. bfloat16
  /// and float16 are computed as the fused kernel's tiled loops compute
  /// them, the weights returned in their dtype, where docs/BACKENDS.md
  /// says, else in float32.
  fused_cpu_weights,
  /// attn's CPU kernel for short sequences: every head's scores in one
  /// batched GEMM, masked and normalised in one pass, then one batched GEMM
  /// into V; the backward likewise from the kept probabilities. Holds the
  /// `(B, H, L, S)` probabilities; returns them as the weights when asked,
  /// differentiable too. CPU only; no dropout, no score modifiers; a mask
  /// must not need a gradient. bfloat16 and float16 are computed in
  /// float32, 64 query rows of one matrix of the batch at a time, their
  /// results rounded once; in those the backward keeps no probabilities
  /// and computes them again.
  batched_cpu,
  /// LibTorch's own `at::scaled_dot_product_attention` (LibTorch 2.0 and
  /// later; a custom `scale` needs 2.1 and must be positive): flash and
  /// memory-efficient kernels on CUDA, a fused kernel on the CPU. No
  /// weights, no score modifiers, no gradient for `attn_mask`, grouped queries only with as many
  /// key/value heads as query heads. An `attn_mask`, a `window` or a causal
  /// band other than the square one (`L == S`, no `query_offset`) reaches
  /// it as one explicit mask (bool, or additive with a floating
  /// `attn_mask`), in which a query that sees no key is given every key and
  /// its output then zeroed: such a query gets a zero output and zero
  /// gradients, as on every backend. Half precision is computed as LibTorch
  /// computes it (bfloat16 products, float32 sums), not in float32
  /// throughout.
  libtorch,
  /// ATen operations written as the formula reads; any device and dtype,
  /// dropout, and gradients for everything, the mask included. Materialises
  /// the `(..., L, S)` scores.
  math,
};

/// The backend's name as the docs write it, such as `"fused_cpu"`.
const char* backend_name(AttentionBackend backend);

/// Writes `backend_name(backend)`.
std::ostream& operator<<(std::ostream& stream, AttentionBackend backend);

/// How far up the x86 instruction sets attn's CPU kernels may reach, each
/// level adding to the one below (`SDPAOptions::cpu_capability`): a call
/// computes on the loops of one level, and the backend rules read it as
/// the CPU's (docs/BACKENDS.md).
///
/// Example: run as on an AVX2-only CPU, on any CPU that has AVX2.
/// ```
/// auto [out, none] = attn::scaled_dot_product_attention(
///     q, k, v, attn::SDPAOptions().cpu_capability(attn::CpuCapability::avx2));
/// ```
enum class CpuCapability {
  /// Portable C++ and the BLAS's matrix products: every CPU.
  portable,
  /// attn's AVX2 and FMA loops (float16 conversions where the CPU has F16C).
  avx2,
  /// attn's AVX-512 loops.
  avx512,
  /// And bfloat16 products on AVX512-BF16.
  avx512_bf16,
  /// And bfloat16 products on AMX's tiles.
  amx,
};

/// The capability's name, as `ATTN_CPU_CAPABILITY` takes it: `"portable"`,
/// `"avx2"`, `"avx512"`, `"avx512_bf16"`, `"amx"`.
const char* cpu_capability_name(CpuCapability capability);

/// Writes `cpu_capability_name(capability)`.
std::ostream& operator<<(std::ostream& stream, CpuCapability capability);

/// The capabilities this CPU runs, narrowest first; the last is what a
/// call uses unless `SDPAOptions::cpu_capability` asks for less. Where the
/// environment sets `ATTN_CPU_CAPABILITY` (read once, when attn first
/// asks), none above the one it names: the process then runs as on a CPU
/// that has no more.
std::vector<CpuCapability> cpu_capabilities();

} // namespace attn
