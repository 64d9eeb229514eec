#pragma once

// Argument checks shared by the functional and module entry points. Every
// check throws a c10::Error that names what was expected and what arrived.

#include <torch/types.h>

namespace attn::detail {

// `mask` (named `name` in messages) must be bool or of `query`'s floating
// dtype, and live on `query`'s device. `caller` prefixes the message.
void check_mask_dtype_and_device(
    const char* caller,
    const char* name,
    const torch::Tensor& mask,
    const torch::Tensor& query);

} // namespace attn::detail
