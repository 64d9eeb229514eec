#pragma once

// The rules behind attn::select_backend: which backends can compute a
// request exactly as attn defines it, which of those runs, and which loops
// run the fused CPU kernel. Inputs are already checked.

#include "kernels/attention_params.h"
#include "kernels/cpu/fused_attention.h"

#include <attn/options.h>

#include <torch/types.h>

#include <string>

namespace attn::detail {

// Why `backend` cannot compute the request exactly as attn defines it, as
// a phrase completing "<backend> ..."; empty when it can.
std::string unsupported_reason(
    AttentionBackend backend,
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const SDPAOptions& options);

// A request as the rules read it.
struct BackendRequest {
  const torch::Tensor& query;
  const torch::Tensor& key;
  const torch::Tensor& value;
  const SDPAOptions& options;
};

// One rule of the automatic choice, as docs/BACKENDS.md names it: its
// backend runs a request that it can compute and for which `applies`
// holds, unless an earlier rule chose.
struct BackendRule {
  const char* name;
  AttentionBackend backend;
  bool (*applies)(const BackendRequest& request);
};

// The rules, in docs/BACKENDS.md's order; the last (math) applies to
// everything.
c10::ArrayRef<BackendRule> backend_rules();

// The first rule that chooses a backend for `request`.
const BackendRule& deciding_rule(const BackendRequest& request);

// The backend an automatic selection (options.backend() unset) runs: that
// of deciding_rule.
AttentionBackend choose_backend(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const SDPAOptions& options);

// The loops that compute the fused CPU kernel for `params`: the short
// heads' wherever they run, which are the faster there (backend.cpp,
// short_heads_faster), else the tiled ones.
FusedLoops fused_cpu_loops(const AttentionParams& params);

// Whether the fused CPU kernel computes `params`, whose q, k and v are
// bfloat16 or float16 (a floating mask in their dtype or float, the
// modifiers' tensors float), in
// their own dtype (products of half-precision operands, accumulated in
// float), where no size is 0:
// - on the short heads' loops wherever the same request in float32 takes
//   them: each head widened into float copies of its own (short_heads.h);
// - on the tiled loops where the products pay (kernels/cpu/tile_product.h):
//   for bfloat16, where this CPU's bfloat16 products outrun its float ones
//   (bf16_products_outrun_float: AMX tiles, or AVX512-BF16 on AMD's
//   cores); for float16, wherever attn's float loops widen float16 in
//   registers (half_products_run), at their float rate.
// Elsewhere the request is computed in float32, converted whole.
bool fused_cpu_computes_half(const AttentionParams& params);

// Whether the weights kernel (fused_cpu_weights) computes `params`, as
// fused_cpu_computes_half describes them, in their own dtype: where the
// products pay, as on the fused kernel's tiled loops, and no size is 0;
// its weights are each a float softmax rounded once into that dtype.
// Elsewhere the request is computed in float32, converted whole.
bool fused_cpu_weights_computes_half(const AttentionParams& params);

// Whether the batched kernel (batched_cpu) computes `params`, as
// fused_cpu_computes_half describes them, in their own dtype: wherever no
// size is 0 (its products and row passes in float, a chunk of one matrix
// of the batch at a time; kernels/cpu/batched_attention.h). Elsewhere the
// request is computed in float32, converted whole.
bool batched_cpu_computes_half(const AttentionParams& params);

} // namespace attn::detail
