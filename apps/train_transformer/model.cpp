#include "model.h"

#include <torch/torch.h>

namespace train {

DecoderBlockImpl::DecoderBlockImpl(
    int64_t d_model,
    int64_t heads,
    int64_t feed_forward_width,
    const Parallelism& parallelism) {
  using torch::nn::LayerNormOptions;
  attention_norm_ = register_module(
      "attention_norm", torch::nn::LayerNorm(LayerNormOptions({d_model})));
  attention_ = parallelism.attention(d_model, heads);
  register_module("attention", attention_.ptr());
  feed_forward_norm_ = register_module(
      "feed_forward_norm", torch::nn::LayerNorm(LayerNormOptions({d_model})));
  feed_forward_ = register_module(
      "feed_forward",
      torch::nn::Sequential(
          torch::nn::Linear(d_model, feed_forward_width), torch::nn::GELU(),
          torch::nn::Linear(feed_forward_width, d_model)));
}

torch::Tensor DecoderBlockImpl::forward(const torch::Tensor& x, attn::KVCache* cache) {
  const auto normed = attention_norm_(x);
  // No weights asked for: the fused kernel never materialises (T, T).
  const auto attended = std::get<0>(attention_.forward<std::tuple<torch::Tensor, torch::Tensor>>(
      normed, normed, normed,
      attn::MultiHeadAttentionForwardOptions().is_causal(true).need_weights(false).kv_cache(
          cache)));
  const auto h = x + attended;
  return h + feed_forward_->forward(feed_forward_norm_(h));
}

TransformerImpl::TransformerImpl(const TransformerConfig& config, const Parallelism& parallelism)
    : config_(config) {
  token_embedding_ = register_module(
      "token_embedding", torch::nn::Embedding(config.vocabulary_size, config.d_model));
  position_embedding_ = register_module(
      "position_embedding", torch::nn::Embedding(config.max_length, config.d_model));
  blocks_ = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < config.layers; ++i) {
    blocks_->push_back(
        DecoderBlock(config.d_model, config.heads, config.feed_forward_width, parallelism));
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
