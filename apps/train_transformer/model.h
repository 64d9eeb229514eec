#pragma once

// A decoder-only transformer, GPT style, small enough to train on a laptop
// CPU in minutes: token and position embeddings, a stack of pre-norm blocks
// (causal attn::MultiHeadAttention, then a feed-forward layer, each added
// to its input), a final layer norm and a linear head over the vocabulary.
// Under tensor parallelism each rank holds a share of every attention
// layer's heads (parallelism.h) and the rest whole. For comparison, the
// attention can be torch::nn::MultiheadAttention instead, starting from the
// same weights; it has no KV cache.

#include "parallelism.h"

#include <attn/kv_cache.h>
#include <attn/modules/multi_head_attention.h>

#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>

#include <cstdint>
#include <vector>

namespace train {

/// Which module every block attends with.
enum class AttentionKind {
  /// attn::MultiHeadAttention (or, under tensor parallelism, a share of it).
  kAttn,
  /// torch::nn::MultiheadAttention, given the weights that an
  /// attn::MultiHeadAttention drew.
  kBuiltin,
};

/// "attn" or "builtin", as --attention names it.
const char* attention_name(AttentionKind kind);

/// What every attention layer adds to its scores (attn only).
enum class ScoreModifier {
  kNone,
  /// ALiBi with the paper's slopes.
  kAlibi,
  /// Soft-capping at 5 (the scores of this small model stay below ~10).
  kSoftcap,
  /// T5's learned relative-position table, causal buckets.
  kRelativeBias,
  /// A learned sink logit per head.
  kSinks,
};

/// "none", "alibi", "softcap", "t5" or "sinks", as --modifier names it.
const char* score_modifier_name(ScoreModifier modifier);

struct TransformerConfig {
  int64_t vocabulary_size;
  /// Longest input the position embedding covers.
  int64_t max_length;
  int64_t d_model = 64;
  int64_t heads = 4;
  int64_t layers = 2;
  /// Width of the feed-forward layer's hidden activation.
  int64_t feed_forward_width = 256;
  AttentionKind attention = AttentionKind::kAttn;
  /// The attention layers' dropout while training.
  double attention_dropout = 0.0;
  ScoreModifier score_modifier = ScoreModifier::kNone;
};

/// x + attention(norm(x)), then x + feed_forward(norm(x)).
class DecoderBlockImpl : public torch::nn::Module {
 public:
  DecoderBlockImpl(const TransformerConfig& config, const Parallelism& parallelism);

  /// (B, T, E) -> (B, T, E); position t sees positions 0..t only. With a
  /// cache, x holds the tokens after the cached ones, which it also sees
  /// (AttentionKind::kAttn only). With `document_ids` (B, T), each
  /// position sees only the earlier ones of its own document
  /// (AttentionKind::kAttn only).
  torch::Tensor forward(
      const torch::Tensor& x,
      attn::KVCache* cache = nullptr,
      const torch::Tensor& document_ids = {});

  /// Wall time spent in the attention module's forward so far, on CUDA
  /// with the device synchronised around it.
  double attention_forward_seconds() const { return attention_forward_seconds_; }

 private:
  // Causal self-attention of `normed` (B, T, E) by whichever module the
  // block holds, timed.
  torch::Tensor attend(
      const torch::Tensor& normed,
      attn::KVCache* cache,
      const torch::Tensor& document_ids);
  torch::Tensor attend_with_attn(
      const torch::Tensor& normed,
      attn::KVCache* cache,
      const torch::Tensor& document_ids);
  // The built-in takes (T, B, E) and a float mask, and no cache.
  torch::Tensor attend_with_builtin(const torch::Tensor& normed, const attn::KVCache* cache);

  torch::nn::LayerNorm attention_norm_ = nullptr;
  // attn::MultiHeadAttention, or a rank's share of one; empty where the
  // block holds the built-in.
  torch::nn::AnyModule attention_;
  torch::nn::MultiheadAttention builtin_attention_ = nullptr;
  double attention_forward_seconds_ = 0.0;
  torch::nn::LayerNorm feed_forward_norm_ = nullptr;
  torch::nn::Sequential feed_forward_ = nullptr;
};
TORCH_MODULE(DecoderBlock);

class TransformerImpl : public torch::nn::Module {
 public:
  /// Its attention layers whole, or split as `parallelism` says.
  TransformerImpl(const TransformerConfig& config, const Parallelism& parallelism);

  /// Token ids (B, T), T <= max_length -> next-token logits (B, T, V).
  torch::Tensor forward(const torch::Tensor& tokens);

  /// Rows of several strings or padded ones: token ids (R, T) at
  /// `positions` (R, T), each below max_length; with `document_ids`
  /// (R, T), rows packing several documents, each attending to its own
  /// (AttentionKind::kAttn only). Next-token logits (R, T, V).
  torch::Tensor forward_rows(
      const torch::Tensor& tokens,
      const torch::Tensor& positions,
      const torch::Tensor& document_ids = {});

  /// Incremental decoding: `tokens` (B, T) continue the sequence whose
  /// keys and values `caches` (one per block, created on the first call)
  /// hold, and are appended to them. Logits as `forward` gives them for
  /// these positions, at the cost of the new tokens only.
  /// AttentionKind::kAttn only: the built-in keeps no cache.
  torch::Tensor decode(const torch::Tensor& tokens, std::vector<attn::KVCache>& caches);

  /// The blocks' attention_forward_seconds, summed.
  double attention_forward_seconds() const;

  const TransformerConfig& config() const { return config_; }

 private:
  // Embeds tokens standing at positions first, first + 1, ...
  torch::Tensor embed(const torch::Tensor& tokens, int64_t first);

  TransformerConfig config_;
  torch::nn::Embedding token_embedding_ = nullptr;
  torch::nn::Embedding position_embedding_ = nullptr;
  torch::nn::ModuleList blocks_ = nullptr;
  torch::nn::LayerNorm final_norm_ = nullptr;
  torch::nn::Linear head_ = nullptr;
};
TORCH_MODULE(Transformer);

} // namespace train
