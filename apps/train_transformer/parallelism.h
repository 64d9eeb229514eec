#pragma once

// How the model is spread over processes. Alone, it is whole in one
// process. With --tensor-parallel, the W ranks that a launcher started
// (attn_launch_ranks or torchrun: RANK, WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT) each hold a share of every attention layer's heads
// (attn::distributed::TensorParallelMultiHeadAttention, over Gloo) and the
// other layers whole; every rank draws the same batches, so the layers
// held whole take the same steps everywhere.

#include <attn/options.h>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/optim/adamw.h>

#include <cstdint>
#include <memory>

namespace train {

class Parallelism {
 public:
  /// One process; or, with `tensor_parallel`, the process group the
  /// launcher's environment names. A missing or malformed variable is a
  /// c10::Error naming it.
  explicit Parallelism(bool tensor_parallel);
  ~Parallelism();
  Parallelism(Parallelism&&) noexcept;
  Parallelism& operator=(Parallelism&&) noexcept;

  int64_t rank() const;
  int64_t world_size() const;
  /// Whether this process reports: rank 0.
  bool reports() const { return rank() == 0; }

  /// A block's attention layer (causal self-attention by the caller):
  /// attn::MultiHeadAttention of `options`, or this rank's share of one,
  /// drawn whole from the random state first, as one process draws it.
  torch::nn::AnyModule attention(const attn::MultiHeadAttentionOptions& options) const;

  /// The L2 norm of the whole model's gradients, and the gradients scaled
  /// by `max_norm / norm` where that is below 1 (as
  /// torch::nn::utils::clip_grad_norm_ on the whole model). Returns the
  /// norm.
  double clip_gradients(torch::nn::Module& model, double max_norm) const;

  /// The parameters and optimizer moments of the whole model into
  /// `whole_model` and `whole_optimizer` (a model of the same layers in one
  /// process, and its AdamW), gathered from the ranks. A collective.
  void gather(
      const torch::nn::Module& model,
      const torch::optim::AdamW& optimizer,
      torch::nn::Module& whole_model,
      torch::optim::AdamW& whole_optimizer) const;
  /// The reverse of `gather`: this rank's share of `whole_model` and
  /// `whole_optimizer` into `model` and `optimizer`.
  void shard(
      const torch::nn::Module& whole_model,
      const torch::optim::AdamW& whole_optimizer,
      torch::nn::Module& model,
      torch::optim::AdamW& optimizer) const;

 private:
  struct Ranks;
  std::unique_ptr<Ranks> ranks_; // null in one process
};

} // namespace train
