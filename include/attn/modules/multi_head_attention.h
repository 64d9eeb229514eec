#pragma once

#include <attn/kv_cache.h>
#include <attn/modules/multi_head_attention_function.h>
#include <attn/modules/multi_head_layers.h>
#include <attn/modules/rotary_embedding.h>
#include <attn/options.h>

#include <torch/nn/cloneable.h>
#include <torch/nn/modules/common.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>
#include <torch/serialize/input-archive.h>
#include <torch/types.h>

#include <iosfwd>
#include <tuple>

namespace attn {

/// Multi-head attention: `Q = query·Wqᵀ + bq`, `K = key·Wkᵀ + bk`,
/// `V = value·Wvᵀ + bv`, split into H heads of width D = E / H, scaled
/// dot-product attention per head, heads merged and projected by `out_proj`.
///
/// Beyond the built-in's options it offers grouped-query attention
/// (`num_kv_heads`), rotary position embeddings (`rotary`), a KV cache for
/// incremental decoding and sliding-window attention (per call, in
/// `MultiHeadAttentionForwardOptions`).
///
/// It computes what `torch::nn::MultiheadAttention` computes with the same
/// weights (see `attn/interop.h` to copy them), with these differences:
/// inputs are batch-first by default; a bool `attn_mask` marks allowed pairs
/// with `true` (key_padding_mask keeps torch's `true` = padding); weights
/// are returned only when asked for (`need_weights`), and then per head
/// unless averaged; and a query whose keys are all masked gets zero
/// attention (output = `out_proj` bias) instead of NaN.
///
/// Example:
/// ```
/// attn::MultiHeadAttention mha(attn::MultiHeadAttentionOptions(512, 8));
/// auto [out, none] = mha(x, x, x);  // x: (B, T, 512) -> out (B, T, 512)
/// auto [out2, w] = mha(x, x, x, attn::MultiHeadAttentionForwardOptions().need_weights(true));
///                                   // w (B, 8, T, T)
/// ```
/// Its layers (`q_proj`, `k_proj`, `v_proj`, `out_proj`, `bias_k`, `bias_v`,
/// `rotary`) are the members of `MultiHeadLayers`, for all H heads.
class MultiHeadAttentionImpl : public torch::nn::Cloneable<MultiHeadAttentionImpl>,
                               public MultiHeadLayers {
 public:
  /// `embed_dim` E split into `num_heads` H heads; every other option at
  /// its default.
  MultiHeadAttentionImpl(int64_t embed_dim, int64_t num_heads)
      : MultiHeadAttentionImpl(MultiHeadAttentionOptions(embed_dim, num_heads)) {}
  /// Checks the options (E and H positive, H dividing E, num_kv_heads
  /// dividing H, dropout in [0, 1), rotary dim even and at most E / H) and
  /// creates the projections.
  explicit MultiHeadAttentionImpl(const MultiHeadAttentionOptions& options);

  /// query `(B, L, E)`, key `(B, S, kdim)`, value `(B, S, vdim)` (sequence
  /// first when `batch_first` is false). Returns the output, shaped like the
  /// query, and the weights `(B, H, L, S')`, or `(B, L, S')` when averaged,
  /// or an undefined tensor unless `need_weights` is set. S' counts every
  /// key attended to: the cached ones, the call's S, and one more for each
  /// of `add_bias_kv` and `add_zero_attn`.
  std::tuple<torch::Tensor, torch::Tensor> forward(
      const torch::Tensor& query,
      const torch::Tensor& key,
      const torch::Tensor& value,
      const MultiHeadAttentionForwardOptions& options = {});

  /// The module's layers as `attn::multi_head_attention_forward` takes
  /// them: the tensors themselves (not copies), for all H heads.
  MultiHeadAttentionParameters functional_parameters() const;

  /// Registers the projections (and `bias_k`, `bias_v`, `rotary` when
  /// asked for) and initialises them.
  void reset() override;

  /// Initialises the parameters as `torch::nn::MultiheadAttention` does:
  /// Xavier-uniform Q/K/V weights, zero biases, `out_proj` weight as in
  /// `torch::nn::Linear`, Xavier-normal `bias_k` and `bias_v`.
  void reset_parameters();

  /// As `torch::nn::Module`'s, keeping the Q/K/V weights stacked
  /// (`MultiHeadLayers::stack_input_projections`).
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, bool non_blocking = false) override;
  void load(torch::serialize::InputArchive& archive) override;
  std::shared_ptr<torch::nn::Module> clone(
      const c10::optional<torch::Device>& device = c10::nullopt) const override;

  /// Prints `attn::MultiHeadAttention(embed_dim=512, num_heads=8, ...)`.
  void pretty_print(std::ostream& stream) const override;

  /// The options the module was constructed with.
  MultiHeadAttentionOptions options;

 protected:
  FORWARD_HAS_DEFAULT_ARGS({3, torch::nn::AnyValue(MultiHeadAttentionForwardOptions())})
};

/// Holder of `MultiHeadAttentionImpl`, as `TORCH_MODULE` defines it.
TORCH_MODULE(MultiHeadAttention);

} // namespace attn
