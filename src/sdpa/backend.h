#pragma once

// The rules behind attn::select_backend: which backends can compute a
// request exactly as attn defines it, and which of those runs.
// Inputs are already checked.

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

// The backend an automatic selection (options.backend() unset) runs.
AttentionBackend choose_backend(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const SDPAOptions& options);

} // namespace attn::detail
