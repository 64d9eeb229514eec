#pragma once

// Per-thread working memory of the CPU kernels that outlives a call. A
// kernel's temporaries (Kᵀ, Vᵀ, a task's score tile) are megabytes that a
// fresh allocation maps page by page on every call: at 128 tokens of GPT-2
// small (B = 8, H = 12) the page faults took a fifth of the tiled forward's
// time. Reused buffers fault once. Each thread holds one buffer per slot,
// at most kMaxWorkspaceBytes each; larger requests get fresh memory, whose
// faults are small beside the work of a call that needs them.

#include <torch/types.h>

#include <cstddef>

namespace attn::detail {

// The temporaries one call holds at once; a slot's tensor stays valid until
// the same thread asks for the same slot again.
enum class WorkspaceSlot : int {
  keys_transposed,   // Kᵀ of a tiled call (in its operand policy's layout: tiled_template.h)
  values_transposed, // Vᵀ of a tiled backward, V in pairs of a bfloat16 forward
  keys_in_pairs,     // K in pairs of a bfloat16 backward
  tile_scores,       // a task's score or probability tile
  tile_grad_scores,  // a task's dP / dS tile in the backward
  tile_score_slopes, // a task's score derivatives (soft cap, user function) in the backward
};

inline constexpr size_t kWorkspaceSlots = 6;
inline constexpr size_t kMaxWorkspaceBytes = size_t{16} << 20;

// An uninitialised tensor of `sizes` and `options` (CPU), contiguous,
// over this thread's buffer for `slot` when it fits kMaxWorkspaceBytes.
// The buffer is a normal tensor (not an inference tensor) without autograd
// history: write into it with grad mode off.
torch::Tensor workspace_tensor(
    WorkspaceSlot slot,
    at::IntArrayRef sizes,
    const torch::TensorOptions& options);

} // namespace attn::detail
