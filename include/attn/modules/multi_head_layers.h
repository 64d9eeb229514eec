#pragma once

#include <attn/modules/rotary_embedding.h>
#include <attn/options.h>

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/types.h>

#include <memory>

namespace attn {

/// The layers of a multi-head attention module, under the names of
/// `torch::nn::MultiheadAttention`'s state_dict. `MultiHeadAttention` holds
/// them for all H heads; `distributed::TensorParallelMultiHeadAttention` for
/// one rank's share, so that H and H_kv below are then the rank's heads.
struct MultiHeadLayers {
  /// `E -> H·D`: the query heads.
  torch::nn::Linear q_proj = nullptr;
  /// `kdim -> H_kv·D` (H_kv = H unless grouped).
  torch::nn::Linear k_proj = nullptr;
  /// `vdim -> H_kv·D`.
  torch::nn::Linear v_proj = nullptr;
  /// `H·D -> E`, applied to the merged heads.
  torch::nn::Linear out_proj = nullptr;
  /// `(1, 1, H_kv·D)` with `add_bias_kv`: the extra key; undefined otherwise.
  torch::Tensor bias_k;
  /// `(1, 1, H_kv·D)` with `add_bias_kv`: the extra key's value; undefined
  /// otherwise.
  torch::Tensor bias_v;
  /// Applied to queries and keys when `options.rotary()` is set; null
  /// otherwise. Has no parameters.
  RotaryEmbedding rotary = nullptr;
  /// `(H, buckets)` with `options.position_buckets()`: the learned
  /// relative-position table; undefined otherwise.
  torch::Tensor position_bias;
  /// `(H)` with `options.sinks()`: the sinks' logits; undefined otherwise.
  torch::Tensor sinks;

 protected:
  /// Registers the layers in `owner` (the module deriving from this) as
  /// `options` asks (biases, `add_bias_kv`, `rotary`, `position_bias`,
  /// `sinks`), `query_width` = H·D and `kv_width` = H_kv·D features wide.
  /// Parameters are not initialised.
  void register_layers(
      torch::nn::Module& owner,
      const MultiHeadAttentionOptions& options,
      int64_t query_width,
      int64_t kv_width);

  /// Makes the weights of `q_proj`, `k_proj` and `v_proj` (and their
  /// biases) consecutive row blocks of one tensor, values kept, so that
  /// self-attention projects with one product and no copy. Does nothing
  /// when they are stacked already, when kdim or vdim differ from E, or
  /// when they differ in dtype or device. `register_layers` calls it, and
  /// `MultiHeadAttention` again after `to`, `load` and `clone`, which
  /// replace their storage; replacing it otherwise (`set_data`) ends the
  /// stacking, though not the results.
  void stack_input_projections();

  /// `copy`, the `Cloneable::clone` of a module deriving from this, with
  /// its input projections stacked again: the clone of every multi-head
  /// module.
  static std::shared_ptr<torch::nn::Module> with_stacked_input_projections(
      std::shared_ptr<torch::nn::Module> copy);
};

} // namespace attn
