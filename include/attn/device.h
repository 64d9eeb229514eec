#pragma once

#include <torch/types.h>

#include <string>

namespace attn {

/// Turns a device request into a `torch::Device`.
///
/// Accepted: `"auto"` (CUDA when available, else CPU), `"cpu"`, `"cuda"`
/// (the current CUDA device) and `"cuda:N"`. Asking for CUDA where there is
/// none, for an index past the last GPU, or for anything else throws a
/// `c10::Error` that names the request and the accepted values.
///
/// Example:
/// ```
/// auto device = attn::select_device("auto");
/// mha->to(device);
/// ```
torch::Device select_device(const std::string& request);

} // namespace attn
