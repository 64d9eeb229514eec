#pragma once

// SDPAOptions' score modifiers at the API boundary: their checks, and their
// kernel form (kernels/attention_params.h, ScoreModifiers). ALiBi and the
// relative-position table both depend on the head and the distance j - i'
// alone, so they become one (H, L + S - 1) tensor per call, differentiable
// in the slopes and the table, which the kernels index by distance.

#include "kernels/attention_params.h"

#include <attn/options.h>

#include <torch/types.h>

#include <cstdint>

namespace attn::detail {

// Whether any score modifier is set.
bool has_score_modifiers(const SDPAOptions& options);

// The modifiers' options, for a query (..., H, L, E): each tensor floating,
// on the query's device, finite, with one entry per query head (the table
// (H, buckets)); softcap positive and finite; the buckets positive and
// able to index T5's scheme. `caller` prefixes the messages.
void check_score_modifiers(
    const char* caller,
    const torch::Tensor& query,
    const SDPAOptions& options);

// `buckets` can index a table: num_buckets and max_distance positive, and
// for T5's schemes enough buckets to split and a max_distance beyond the
// exact ones. `caller` prefixes the message.
void check_position_buckets(const char* caller, const PositionBuckets& buckets);

// T5's bucket (or the clipped offset's) of each distance j - i' in
// `distances` (int64), as `buckets` defines it.
torch::Tensor position_buckets(const torch::Tensor& distances, const PositionBuckets& buckets);

// The kernel form of the modifiers for H heads, L queries and S keys with
// query i at position i + query_offset, in `dtype`: undefined tensors where
// a modifier is not set.
ScoreModifiers score_modifiers(
    const SDPAOptions& options,
    int64_t H,
    int64_t L,
    int64_t S,
    torch::ScalarType dtype);

} // namespace attn::detail
