#pragma once

// Everything attn knows about mask tensors, in one place: the band of keys
// that `is_causal` and `window` leave visible (kernels/attention_params.h) as a
// bool tensor for the math path and the module, the checks every mask
// argument passes, and the combination of several masks into one.
//
// Conventions: a bool mask is true where a query *may attend*; a floating
// mask is added to the scaled scores, -inf forbidding a pair.

#include "kernels/attention_params.h"

#include <attn/options.h>

#include <torch/types.h>

#include <cstdint>
#include <initializer_list>

namespace attn::detail {

// The same band as an (L, S) bool tensor: true where query i may see key j.
torch::Tensor visible_band(
    int64_t L,
    int64_t S,
    int64_t query_offset,
    bool causal,
    const c10::optional<int64_t>& window,
    torch::Device device);
torch::Tensor visible_band(const KeyBand& band, int64_t L, torch::Device device);

// `mask` (named `name` in messages) must be bool or of `query`'s floating
// dtype, and live on `query`'s device. `caller` prefixes the message.
void check_mask_dtype_and_device(
    const char* caller,
    const char* name,
    const torch::Tensor& mask,
    const torch::Tensor& query);

// A bool mask as an additive one of `dtype` (0 allowed, -inf forbidden);
// a floating mask unchanged.
torch::Tensor as_additive_mask(const torch::Tensor& mask, torch::ScalarType dtype);

// The pairs that every mask allows; the masks broadcast against each other
// and undefined ones are skipped (none defined: undefined). All bool: the
// result is bool; otherwise the sum of their additive forms.
torch::Tensor intersect_masks(std::initializer_list<torch::Tensor> masks, torch::ScalarType dtype);

// Whether a request's `attn_mask`, `is_causal` and `window` say more than
// LibTorch's own causal flag can (a causal band on a square, L == S, with
// no query_offset): any mask or window, or a causal band elsewhere.
bool needs_explicit_mask(const SDPAOptions& options, int64_t L, int64_t S);

// The request's `attn_mask`, causal band and window as one mask
// broadcastable to (..., L, S): bool when `attn_mask` is bool or undefined,
// else additive in `dtype`.
torch::Tensor explicit_mask(
    const SDPAOptions& options,
    int64_t L,
    int64_t S,
    torch::ScalarType dtype,
    torch::Device device);

// A mask in which no query row forbids every key, for a kernel that would
// give such rows NaN: those rows let every key through instead, and
// `empty_rows` (the mask's shape with last dim 1) marks them, for the
// caller to zero their output. Zeroing them also zeroes every gradient they
// pass back, which is what attn defines for a query that sees no key.
struct MaskWithoutEmptyRows {
  torch::Tensor mask;
  torch::Tensor empty_rows;
};
MaskWithoutEmptyRows without_empty_rows(const torch::Tensor& mask);

// `mask` (..., S) with `extra` more keys at the end that every query sees.
torch::Tensor allow_extra_keys(const torch::Tensor& mask, int64_t extra);

} // namespace attn::detail
