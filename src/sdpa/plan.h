#pragma once

// One plan per call: which backend computes a request, in which dtype, on
// which CPU loops and under which kernel policies, decided here once from
// the request and the CPU's capabilities (cpu_levels(), capped by
// SDPAOptions::cpu_capability), and carried down unchanged: the kernels
// read theirs (kernels/kernel_plan.h) and derive nothing of it again.
// select_backend reports the plan's backend; tests read the plan.

#include "kernels/kernel_plan.h"

#include <attn/options.h>

#include <torch/types.h>

namespace attn::detail {

struct CallPlan {
  AttentionBackend backend = AttentionBackend::math;
  // The rule of docs/BACKENDS.md that chose the backend; "requested" where
  // SDPAOptions::backend named it.
  const char* rule = "";
  // The CPU capability the call runs at (kernel.cpu's level).
  CpuLevel level = CpuLevel::portable;
  // What attn's backends compute in: the inputs' dtype, or float32 for
  // half-precision inputs that the backend computes in float32 (converted
  // whole, its results rounded once).
  torch::ScalarType compute_dtype = torch::kFloat;
  // What a floating attn_mask reaches the kernels in: compute_dtype, or
  // float32 for a half-precision mask whose gradient sums over its
  // broadcast dims (summed in float32, then rounded once); undefined
  // without a floating mask.
  torch::ScalarType mask_dtype = torch::ScalarType::Undefined;
  // The kernels' loops and policies (its fused loops the tiled ones but
  // where the fused kernel runs the short heads').
  KernelPlan kernel;
};

// The plan of a request whose arguments are checked: the requested backend
// (which must be able to run it; a c10::Error names why not) or that of
// the first rule that applies (backend.h); a requested cpu_capability must
// be one of cpu_levels() (a c10::Error names those).
CallPlan plan_call(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const SDPAOptions& options);

// The plan of a part of a request in float32 or float64 without dropout
// or score modifiers (sdpa/partial_attention.h), on the widest CPU
// capability: the fused kernel's.
KernelPlan plan_part(const torch::Tensor& query, const torch::Tensor& key);

} // namespace attn::detail
