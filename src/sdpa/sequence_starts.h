#pragma once

// Packed sequences described by their starts (FlashAttention's cu_seqlens:
// N + 1 offsets, 0 first, the total length last), as varlen_attention and
// the modules on packed input read them.

#include <torch/types.h>

#include <cstdint>
#include <vector>

namespace attn::detail {

// `starts` (named `name`; `caller` prefixes the messages) as int64 values,
// checked: (N + 1) integers, 0 first, nondecreasing, `total` last, no
// sequence longer than `longest` where one is stated.
std::vector<int64_t> sequence_starts(
    const char* caller,
    const char* name,
    const torch::Tensor& starts,
    int64_t total,
    const c10::optional<int64_t>& longest = c10::nullopt);

// Sequence n's index at each of its positions: (total) int64 on the CPU.
torch::Tensor document_ids_of(const std::vector<int64_t>& starts);

} // namespace attn::detail
