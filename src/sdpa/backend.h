#pragma once

// The rules behind a call's plan (sdpa/plan.h): which backends can compute
// a request exactly as attn defines it, which of those runs, and which
// loops run the fused CPU kernel. Inputs are already checked.

#include "kernels/attention_params.h"
#include "kernels/cpu/isa.h"
#include "kernels/kernel_plan.h"

#include <attn/options.h>

#include <torch/types.h>

#include <string>

namespace attn::detail {

// The kernels' CpuLevel of the public CpuCapability, and back: one for one.
CpuLevel cpu_level_of(CpuCapability capability);
CpuCapability cpu_capability_of(CpuLevel level);

// Why `backend` cannot compute the request exactly as attn defines it, as
// a phrase completing "<backend> ..."; empty when it can.
std::string unsupported_reason(
    AttentionBackend backend,
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const SDPAOptions& options);

// A request as the rules read it, on the CPU capability of its call
// (the plan's: sdpa/plan.h).
struct BackendRequest {
  BackendRequest(
      const torch::Tensor& query,
      const torch::Tensor& key,
      const torch::Tensor& value,
      const SDPAOptions& options,
      CpuLevel level)
      : query(query), key(key), value(value), options(options), level(level) {}

  const torch::Tensor& query;
  const torch::Tensor& key;
  const torch::Tensor& value;
  const SDPAOptions& options;
  CpuLevel level;
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

// Whether the request asks for what, of the fused kernel's loops, only the
// tiled ones compute: dropout while training, score modifiers, a mask's
// gradient.
bool needs_tiled_loops(const SDPAOptions& options);

// The fused CPU kernel's loops for a request of L queries and S keys in
// `dtype` (or in float32, which takes the same loops) on `loops`: the
// short heads' wherever they run and the request is `plain` (no dropout,
// score modifiers or mask gradient, which only the tiled loops compute),
// the faster there (backend.cpp, short_heads_faster); else the tiled ones.
FusedLoops fused_cpu_loops(
    const CpuLoops& loops,
    torch::ScalarType dtype,
    int64_t L,
    int64_t S,
    bool plain);

// Whether the tiled loops' products on `loops` pay for computing `dtype`
// (bfloat16 or float16) in its own dtype: for bfloat16, where the loops'
// bfloat16 products outrun their float ones (tile_product.h,
// bf16_products_outrun_float: AMX tiles, or AVX512-BF16 on AMD's cores);
// for float16, wherever attn's float loops widen float16 in registers
// (half_products_run), at their float rate.
bool half_products_pay(const CpuLoops& loops, torch::ScalarType dtype);

} // namespace attn::detail
