#pragma once

#include <attn/distributed/process_group.h>
#include <attn/modules/multi_head_attention.h>
#include <attn/modules/multi_head_layers.h>

#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <iosfwd>
#include <string>
#include <tuple>

namespace attn::distributed {

/// `attn::MultiHeadAttention` split by heads over the W ranks of a group,
/// as Megatron-LM splits attention: rank r holds query heads
/// `[r·H/W, (r+1)·H/W)` and the key/value heads they read. Q/K/V are
/// column-parallel (each rank projects its heads' features only) and
/// `out_proj` is row-parallel (each rank multiplies its heads' columns);
/// the partial outputs are summed over the ranks and `out_proj`'s bias,
/// held whole by every rank, is added once after the sum.
///
/// On every rank: the inputs are whole (the same on every rank), and so
/// are the output and, when asked for, the attention weights, gathered `(B, H, L, S)`. The
/// parameters keep `MultiHeadAttention`'s names and hold the rank's part:
/// `q_proj.weight` `(H/W·D, E)`, `k_proj`/`v_proj` `(H_kv/W·D, kdim)`
/// (with fewer key/value heads than ranks, W divisible by H_kv: the one
/// head that the rank's queries read, copied on W/H_kv ranks whose
/// gradients are summed), `out_proj.weight` `(E, H/W·D)`, `out_proj.bias`
/// `(E)` whole; they are `MultiHeadLayers`' members. A KV cache holds the
/// rank's key/value heads.
///
/// One forward makes an all-gather of the query's sizes (so that ranks that
/// disagree fail with a message, not a hang), the all-reduce of the output
/// and, with weights, their all-gather; one backward the all-reduce of the
/// inputs' gradients (one per distinct input tensor).
///
/// Example:
/// ```
/// auto group = attn::distributed::init_process_group();
/// torch::manual_seed(0);  // the same full module on every rank
/// attn::MultiHeadAttention full(attn::MultiHeadAttentionOptions(512, 8));
/// attn::distributed::TensorParallelMultiHeadAttention mha(full, group);
/// auto [out, w] = mha(x, x, x);  // as full(x, x, x), each rank 4 heads
/// ```
class TensorParallelMultiHeadAttentionImpl
    : public torch::nn::Cloneable<TensorParallelMultiHeadAttentionImpl>,
      public MultiHeadLayers {
 public:
  /// The rank's part of `MultiHeadAttention(options)`: the full module is
  /// made (with the current random state, which must be the same on every
  /// rank) and split. Checks that W divides H and that H_kv and W divide
  /// one another.
  TensorParallelMultiHeadAttentionImpl(const MultiHeadAttentionOptions& options, Group group);
  /// The rank's part of `full` (its parameters copied, the same on every
  /// rank), e.g. of a module loaded from a PyTorch state_dict.
  TensorParallelMultiHeadAttentionImpl(const MultiHeadAttention& full, Group group);

  /// As `MultiHeadAttentionImpl::forward`, with the same inputs on every
  /// rank. A per-head `attn_mask`, `(B·H, L, S)` or `(B, H, L, S)`, is
  /// sliced to the rank's heads.
  std::tuple<torch::Tensor, torch::Tensor> forward(
      const torch::Tensor& query,
      const torch::Tensor& key,
      const torch::Tensor& value,
      const MultiHeadAttentionForwardOptions& options = {});

  /// The whole module, on every rank, with the parameters (and their
  /// gradients, where defined) gathered from the ranks: to save a
  /// checkpoint or compare with a single process. A collective: every rank
  /// calls it.
  MultiHeadAttention gather() const;

  /// Registers the rank's layers (their values drawn without touching the
  /// default generator's state), as `clone()` needs; the constructors then
  /// copy the rank's part of the whole module into them.
  void reset() override;
  /// A copy of this rank's part on the same group (every rank clones its
  /// own), its Q/K/V weights stacked again as the constructors leave them.
  std::shared_ptr<torch::nn::Module> clone(
      const c10::optional<torch::Device>& device = c10::nullopt) const override;

  /// This rank's part of `whole`, a tensor shaped like the full module's
  /// parameter `name` (the parameter, or a per-parameter tensor such as an
  /// optimizer's moment): to load a full checkpoint into the ranks.
  torch::Tensor shard(const std::string& name, const torch::Tensor& whole) const;
  /// The whole of `part`, a tensor shaped like this rank's parameter
  /// `name` (the parameter, its gradient, an optimizer's moment): to save
  /// a full checkpoint. A collective: every rank calls it.
  torch::Tensor gather(const std::string& name, const torch::Tensor& part) const;
  /// The squared L2 norm of the whole module's gradients, as the module
  /// that `gather()` returns holds them (parts summed over the ranks, a
  /// tensor held whole or copied counted once), in float64: to clip
  /// gradients by the norm of the whole model. A collective.
  torch::Tensor squared_gradient_norm() const;

  /// Prints `attn::distributed::TensorParallelMultiHeadAttention(embed_dim=512,
  /// num_heads=8, rank=0, world_size=2, local_heads=4, local_kv_heads=4)`.
  void pretty_print(std::ostream& stream) const override;

  const Group& group() const { return group_; }
  /// The query heads this rank computes: H / W.
  int64_t local_heads() const;
  /// The key/value heads this rank holds: H_kv / W, or the one head its
  /// queries read when there are fewer key/value heads than ranks.
  int64_t local_kv_heads() const;
  /// How many ranks hold a copy of each key/value head: W / H_kv when
  /// there are fewer key/value heads than ranks, else 1.
  int64_t kv_ranks_per_head() const;
  /// The options of the whole module.
  MultiHeadAttentionOptions options;

 protected:
  FORWARD_HAS_DEFAULT_ARGS({3, torch::nn::AnyValue(MultiHeadAttentionForwardOptions())})

 private:
  // How a parameter is split: whole it is the concatenation along `dim` of
  // W / ranks_per_part parts; part p is held by the ranks
  // [p·ranks_per_part, (p+1)·ranks_per_part).
  struct Split {
    int64_t dim;
    int64_t ranks_per_part;
  };
  Split split_of(const std::string& parameter_name) const;

  Group group_;
};

/// Holder of `TensorParallelMultiHeadAttentionImpl`, as `TORCH_MODULE`
/// defines it.
TORCH_MODULE(TensorParallelMultiHeadAttention);

} // namespace attn::distributed
