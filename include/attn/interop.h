#pragma once

/// \file
/// Weight exchange with `torch::nn::MultiheadAttention`, in C++ and from
/// Python files.
///
/// The built-in packs the Q/K/V weights into `in_proj_weight` (3E, E) when
/// `kdim == vdim == E` and keeps `q/k/v_proj_weight` otherwise; its biases
/// are always packed in `in_proj_bias` (3E), and `add_bias_kv` adds
/// `bias_k` and `bias_v`. attn keeps one `Linear` per projection. Both
/// modules must have the same `embed_dim`, `num_heads`, `kdim`, `vdim`,
/// `bias`, `add_bias_kv` and `add_zero_attn`, and attn's must have no
/// grouped-query heads and no rotary embeddings; values are copied (and cast) into the target's
/// existing parameters, so the target keeps its device and dtype.
///
/// attn's own modules round-trip through `torch::save` and `torch::load`
/// like any `torch::nn` module.

#include <attn/modules/multi_head_attention.h>

#include <torch/nn/modules/activation.h>

#include <string>

namespace attn {

/// Copies the built-in's weights into `target`.
///
/// Example:
/// ```
/// torch::nn::MultiheadAttention builtin(512, 8);
/// attn::MultiHeadAttention ours(512, 8);
/// attn::copy_weights(*builtin, *ours);
/// ```
void copy_weights(const torch::nn::MultiheadAttentionImpl& source, MultiHeadAttentionImpl& target);

/// Copies `source`'s weights into the built-in.
///
/// Example: `attn::copy_weights(*ours, *builtin);`
void copy_weights(const MultiHeadAttentionImpl& source, torch::nn::MultiheadAttentionImpl& target);

/// Loads into `target` the `state_dict` of a Python
/// `torch.nn.MultiheadAttention` saved with `torch.save` (PyTorch 1.6 to 2.x),
/// with packed `in_proj_weight` or separate `q/k/v_proj_weight`.
///
/// `prefix` selects the attention inside a whole model's state_dict, e.g.
/// `"encoder.layers.0.self_attn"` (a final `.` is implied); entries outside
/// it are ignored. Under
/// it, every entry the target needs must be present with its shape and no
/// other may be, or a `c10::Error` names the entry, the file and what was
/// expected. So does anything in the file that the reader does not know,
/// such as a dtype or pickle opcode of a newer PyTorch. After an error
/// `target` is unchanged. `target` must be built with the Python module's
/// options (and `batch_first` as the caller's tensors are laid out).
///
/// Example, after `torch.save(mha.state_dict(), "mha.pt")` in Python:
/// ```
/// attn::MultiHeadAttention mha(attn::MultiHeadAttentionOptions(512, 8));
/// attn::load_pytorch_state_dict(*mha, "mha.pt");
/// ```
void load_pytorch_state_dict(
    MultiHeadAttentionImpl& target,
    const std::string& path,
    const std::string& prefix = "");

} // namespace attn
