#include "model.h"

#include <attn/interop.h>

#include <torch/cuda.h>
#include <torch/torch.h>

#include <chrono>
#include <limits>
#include <mutex>

namespace train {
namespace {

// torch::nn::MultiheadAttention holding `drawn`'s weights. Its own
// initialisation draws from the random state as well; the state is put
// back, so that the layers after it draw what they draw in the attn model.
torch::nn::MultiheadAttention builtin_copy(const attn::MultiHeadAttentionImpl& drawn) {
  auto generator = at::detail::getDefaultCPUGenerator();
  const auto state = [&] {
    const std::lock_guard<std::mutex> lock(generator.mutex());
    return generator.get_state();
  }();
  torch::nn::MultiheadAttention builtin(
      torch::nn::MultiheadAttentionOptions(drawn.options.embed_dim(), drawn.options.num_heads())
          .dropout(drawn.options.dropout()));
  {
    const std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(state);
  }
  attn::copy_weights(drawn, *builtin);
  return builtin;
}

// On CUDA, waits for the kernels queued so far, so that a time taken next
// covers them rather than their launch.
void wait_for_device(const torch::Tensor& tensor) {
  if (tensor.is_cuda()) {
    torch::cuda::synchronize(tensor.device().index());
  }
}

} // namespace

const char* attention_name(AttentionKind kind) {
  return kind == AttentionKind::kBuiltin ? "builtin" : "attn";
}

const char* score_modifier_name(ScoreModifier modifier) {
  switch (modifier) {
    case ScoreModifier::kNone: return "none";
    case ScoreModifier::kAlibi: return "alibi";
    case ScoreModifier::kSoftcap: return "softcap";
    case ScoreModifier::kRelativeBias: return "t5";
    case ScoreModifier::kSinks: return "sinks";
  }
  return "unknown";
}

namespace {

// Every attention layer's options: the width, heads, dropout and score
// modifier of `config`.
attn::MultiHeadAttentionOptions attention_options(const TransformerConfig& config) {
  auto options = attn::MultiHeadAttentionOptions(config.d_model, config.heads)
                     .dropout(config.attention_dropout);
  switch (config.score_modifier) {
    case ScoreModifier::kNone: break;
    case ScoreModifier::kAlibi: options.alibi(true); break;
    case ScoreModifier::kSoftcap: options.softcap(5.0); break;
    case ScoreModifier::kRelativeBias:
      options.position_buckets(attn::PositionBuckets()
                                   .bucketing(attn::PositionBucketing::t5_causal)
                                   .num_buckets(32)
                                   .max_distance(128));
      break;
    case ScoreModifier::kSinks: options.sinks(true); break;
  }
  return options;
}

} // namespace

DecoderBlockImpl::DecoderBlockImpl(
    const TransformerConfig& config,
    const Parallelism& parallelism) {
  using torch::nn::LayerNormOptions;
  const auto d_model = config.d_model;
  attention_norm_ = register_module(
      "attention_norm", torch::nn::LayerNorm(LayerNormOptions({d_model})));
  if (config.attention == AttentionKind::kBuiltin) {
    // Drawn as the attn block draws it, so that every layer starts alike.
    const attn::MultiHeadAttention drawn(attention_options(config));
    builtin_attention_ = register_module("attention", builtin_copy(*drawn));
  } else {
    attention_ = parallelism.attention(attention_options(config));
    register_module("attention", attention_.ptr());
  }
  feed_forward_norm_ = register_module(
      "feed_forward_norm", torch::nn::LayerNorm(LayerNormOptions({d_model})));
  feed_forward_ = register_module(
      "feed_forward",
      torch::nn::Sequential(
          torch::nn::Linear(d_model, config.feed_forward_width), torch::nn::GELU(),
          torch::nn::Linear(config.feed_forward_width, d_model)));
}

torch::Tensor DecoderBlockImpl::forward(
    const torch::Tensor& x,
    attn::KVCache* cache,
    const torch::Tensor& document_ids) {
  const auto h = x + attend(attention_norm_(x), cache, document_ids);
  return h + feed_forward_->forward(feed_forward_norm_(h));
}

torch::Tensor DecoderBlockImpl::attend(
    const torch::Tensor& normed,
    attn::KVCache* cache,
    const torch::Tensor& document_ids) {
  wait_for_device(normed);
  const auto started = std::chrono::steady_clock::now();
  TORCH_CHECK(
      !builtin_attention_ || !document_ids.defined(),
      "DecoderBlock: torch::nn::MultiheadAttention takes no packed documents");
  auto attended = builtin_attention_ ? attend_with_builtin(normed, cache)
                                     : attend_with_attn(normed, cache, document_ids);
  wait_for_device(attended);
  attention_forward_seconds_ +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return attended;
}

torch::Tensor DecoderBlockImpl::attend_with_attn(
    const torch::Tensor& normed,
    attn::KVCache* cache,
    const torch::Tensor& document_ids) {
  // No weights (the default): the fused kernel never materialises (T, T).
  return std::get<0>(attention_.forward<std::tuple<torch::Tensor, torch::Tensor>>(
      normed, normed, normed,
      attn::MultiHeadAttentionForwardOptions().is_causal(true).kv_cache(cache).document_ids(
          document_ids)));
}

torch::Tensor DecoderBlockImpl::attend_with_builtin(
    const torch::Tensor& normed,
    const attn::KVCache* cache) {
  TORCH_CHECK(!cache, "DecoderBlock: torch::nn::MultiheadAttention keeps no KV cache");
  const auto T = normed.size(1);
  // -inf above the diagonal: position t sees positions 0..t only.
  const auto causal_mask =
      torch::full({T, T}, -std::numeric_limits<double>::infinity(), normed.options()).triu(1);
  const auto sequence_first = normed.transpose(0, 1); // (T, B, E)
  const auto attended = std::get<0>(builtin_attention_->forward(
      sequence_first, sequence_first, sequence_first, /*key_padding_mask=*/{},
      /*need_weights=*/false, causal_mask));
  return attended.transpose(0, 1); // (B, T, E)
}

TransformerImpl::TransformerImpl(const TransformerConfig& config, const Parallelism& parallelism)
    : config_(config) {
  token_embedding_ = register_module(
      "token_embedding", torch::nn::Embedding(config.vocabulary_size, config.d_model));
  position_embedding_ = register_module(
      "position_embedding", torch::nn::Embedding(config.max_length, config.d_model));
  blocks_ = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < config.layers; ++i) {
    blocks_->push_back(DecoderBlock(config, parallelism));
  }
  final_norm_ = register_module(
      "final_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({config.d_model})));
  head_ = register_module("head", torch::nn::Linear(config.d_model, config.vocabulary_size));
}

torch::Tensor TransformerImpl::embed(const torch::Tensor& tokens, int64_t first) {
  const auto T = tokens.size(1);
  TORCH_CHECK(
      first + T <= config_.max_length, "Transformer: inputs of at most ", config_.max_length,
      " tokens, got ", first + T);
  const auto positions = torch::arange(first, first + T, tokens.options()); // (T)
  return token_embedding_(tokens) + position_embedding_(positions);         // (B, T, E)
}

torch::Tensor TransformerImpl::forward(const torch::Tensor& tokens) {
  auto x = embed(tokens, 0);
  for (const auto& block : *blocks_) {
    x = block->as<DecoderBlock>()->forward(x);
  }
  return head_(final_norm_(x)); // (B, T, V)
}

torch::Tensor TransformerImpl::forward_rows(
    const torch::Tensor& tokens,
    const torch::Tensor& positions,
    const torch::Tensor& document_ids) {
  TORCH_CHECK(
      positions.numel() == 0 || positions.max().item<int64_t>() < config_.max_length,
      "Transformer: positions below ", config_.max_length, " expected");
  auto x = token_embedding_(tokens) + position_embedding_(positions);
  for (const auto& block : *blocks_) {
    x = block->as<DecoderBlock>()->forward(x, nullptr, document_ids);
  }
  return head_(final_norm_(x)); // (R, T, V)
}

double TransformerImpl::attention_forward_seconds() const {
  double seconds = 0.0;
  for (const auto& block : *blocks_) {
    seconds += block->as<DecoderBlock>()->attention_forward_seconds();
  }
  return seconds;
}

torch::Tensor TransformerImpl::decode(
    const torch::Tensor& tokens,
    std::vector<attn::KVCache>& caches) {
  if (caches.empty()) {
    for (size_t i = 0; i < blocks_->size(); ++i) {
      caches.emplace_back(config_.max_length);
    }
  }
  TORCH_CHECK(
      caches.size() == blocks_->size(), "Transformer: one KV cache per block (", blocks_->size(),
      ") expected, got ", caches.size());
  auto x = embed(tokens, caches.front().length());
  for (size_t i = 0; i < blocks_->size(); ++i) {
    x = blocks_[i]->as<DecoderBlock>()->forward(x, &caches[i]);
  }
  return head_(final_norm_(x)); // (B, T, V)
}

} // namespace train
