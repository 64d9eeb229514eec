// Multi-head self-attention over a sequence split across the ranks: the
// steps of attn::MultiHeadAttention's forward on this rank's tokens, with
// context_parallel_attention in place of attention over the whole sequence.

#include <attn/distributed/context_parallel_multi_head_attention.h>

#include <attn/distributed/mappings.h>

#include "distributed/context_parallel_inputs.h"
#include "distributed/random_state.h"
#include "modules/multi_head_attention_forward.h"
#include "modules/sequence_layout.h"

#include <torch/torch.h>

#include <algorithm>
#include <ostream>
#include <vector>

namespace attn::distributed {

namespace {

constexpr const char* kContextParallelCaller =
    "attn::distributed::ContextParallelMultiHeadAttention";

// What the module cannot split by sequence: an extra key every token
// attends to would have to be added once, not on every rank, and keys of
// another sequence (cross-attention) would need their own sharding.
MultiHeadAttentionOptions checked(const MultiHeadAttentionOptions& options) {
  TORCH_CHECK(
      !options.add_bias_kv(), kContextParallelCaller,
      ": add_bias_kv cannot be split by sequence, expected add_bias_kv=false, got true");
  TORCH_CHECK(
      !options.add_zero_attn(), kContextParallelCaller,
      ": add_zero_attn cannot be split by sequence, expected add_zero_attn=false, got true");
  TORCH_CHECK(
      options.kdim() == options.embed_dim() && options.vdim() == options.embed_dim(),
      kContextParallelCaller,
      ": self-attention only, expected kdim and vdim equal to embed_dim=", options.embed_dim(),
      ", got kdim=", options.kdim(), " and vdim=", options.vdim());
  TORCH_CHECK(
      !attn::detail::has_score_modifiers(options), kContextParallelCaller,
      ": the ring has no score modifiers, expected no alibi, softcap, position_buckets or sinks");
  return options;
}

void check_sharding(const SequenceSharding& sharding, const Group& group) {
  TORCH_CHECK(
      sharding.world_size() == group.size(), kContextParallelCaller,
      ": expected a sharding for the group's ", group.size(), " ranks, got one for ",
      sharding.world_size());
}

void check_input(
    const torch::Tensor& x_local,
    const MultiHeadAttentionOptions& options,
    const SequenceSharding& sharding,
    const torch::Tensor& weight) {
  const int64_t N = sharding.local_length(), E = options.embed_dim();
  const bool batch_first = options.batch_first();
  TORCH_CHECK(
      x_local.defined(), kContextParallelCaller, ": expected x_local to be a defined tensor");
  TORCH_CHECK(
      x_local.dim() == 3 && x_local.size(batch_first ? 1 : 0) == N && x_local.size(2) == E,
      kContextParallelCaller, ": expected x_local ", batch_first ? "(B, N, E)" : "(N, B, E)",
      " with N = ", N, " (this rank's rows of the ", sharding.length(),
      "-token sequence) and E = ", E, ", got ", x_local.sizes());
  TORCH_CHECK(
      x_local.scalar_type() == weight.scalar_type() && x_local.device() == weight.device(),
      kContextParallelCaller, ": expected x_local with the module's dtype ", weight.scalar_type(),
      " on ", weight.device(), ", got ", x_local.scalar_type(), " on ", x_local.device(),
      " (convert one with .to())");
}

// context_parallel_attention has no dropout: it would need a mask drawn for every
// (query, key) pair of the whole sequence, agreed on by the blocks that
// the ranks compute.
void check_dropout(const MultiHeadAttentionOptions& options, bool training) {
  TORCH_CHECK(
      !training || options.dropout() == 0.0, kContextParallelCaller,
      ": attention dropout cannot be split by sequence, expected dropout=0 or eval(), got "
      "dropout=",
      options.dropout(), " while training");
}

// Queries and keys turned by the rotary embeddings at the positions in the
// whole sequence of this rank's rows: segment by segment, since the zigzag
// layout puts two distant stretches of the sequence side by side. With
// packed documents, at their positions within their documents.
::attn::detail::ProjectedHeads rotate(
    ::attn::detail::ProjectedHeads heads,
    RotaryEmbedding rotary,
    const ContextParallelForwardOptions& options,
    int64_t rank) {
  if (!rotary) {
    return heads;
  }
  const auto& sharding = options.sharding();
  if (options.document_ids().defined()) {
    // (1 or B, T) positions of the whole sequence, this rank's columns.
    const auto ids = detail::checked_document_ids(
        options.document_ids(), heads.q.size(0), sharding.length());
    auto positions = sharding.shard(::attn::detail::positions_in_documents(ids), 1, rank);
    if (positions.size(0) == 1) {
      positions = positions[0]; // every row alike
    }
    heads.q = rotary->rotate(heads.q, positions.to(heads.q.device()));
    heads.k = rotary->rotate(heads.k, positions.to(heads.k.device()));
    return heads;
  }
  const auto at_global_positions = [&](const torch::Tensor& x) {
    std::vector<torch::Tensor> segments;
    int64_t row = 0;
    for (const auto& segment : sharding.segments(rank)) {
      segments.push_back(rotary(x.narrow(2, row, segment.length), segment.start));
      row += segment.length;
    }
    return segments.size() == 1 ? segments.front() : torch::cat(segments, 2);
  };
  heads.q = at_global_positions(heads.q);
  heads.k = at_global_positions(heads.k);
  return heads;
}

// The output with its rows past the end of the sequence set to zero
// (context_parallel_attention's are, but out_proj adds its bias): then a loss over
// every local row gives out_proj.bias the whole sequence's gradient.
torch::Tensor zero_padding_rows(
    const torch::Tensor& output,
    const SequenceSharding& sharding,
    int64_t rank,
    int64_t sequence_dim) {
  if (sharding.padded_length() == sharding.length()) {
    return output;
  }
  auto padding = torch::zeros({sharding.local_length()}, torch::kBool);
  int64_t row = 0;
  for (const auto& segment : sharding.segments(rank)) {
    const int64_t inside = sharding.rows_inside(segment);
    padding.narrow(0, row + inside, segment.length - inside).fill_(true);
    row += segment.length;
  }
  std::vector<int64_t> shape{1, 1, 1};
  shape[sequence_dim] = sharding.local_length();
  return output.masked_fill(padding.to(output.device()).view(shape), 0);
}

// context_parallel_attention's options for the module's call.
ContextParallelOptions context_parallel_options(const ContextParallelForwardOptions& options) {
  return ContextParallelOptions(options.sharding())
      .key_padding_mask(options.key_padding_mask())
      .is_causal(options.is_causal())
      .window(options.window())
      .document_ids(options.document_ids())
      .strategy(options.strategy());
}

// The layers' tensors, each passed through copy_to_parallel so that its
// gradient is summed over the ranks.
::attn::MultiHeadAttentionParameters replicated_parameters(
    ContextParallelMultiHeadAttentionImpl& module) {
  const auto& options = module.options;
  const auto H = options.num_heads();
  auto parameters = ::attn::detail::parameters_of(
      module, H, options.num_kv_heads().value_or(H), options.embed_dim() / H);
  for (auto* parameter :
       {&parameters.q_weight, &parameters.q_bias, &parameters.k_weight, &parameters.k_bias,
        &parameters.v_weight, &parameters.v_bias, &parameters.out_weight, &parameters.out_bias}) {
    if (parameter->defined()) {
      *parameter = copy_to_parallel(*parameter, module.group());
    }
  }
  return parameters;
}

} // namespace

ContextParallelForwardOptions::ContextParallelForwardOptions(SequenceSharding sharding)
    : sharding_(sharding) {}

ContextParallelForwardOptions::ContextParallelForwardOptions(
    SequenceSharding sharding,
    const MultiHeadAttentionForwardOptions& attention_options)
    : ContextParallelForwardOptions(sharding) {
  const auto& attn_mask = attention_options.attn_mask();
  TORCH_CHECK(
      !attn_mask.defined(), kContextParallelCaller,
      ": an attn_mask of arbitrary (query, key) pairs cannot be split by sequence, expected none "
      "(is_causal, window and key_padding_mask can be), got one of sizes ",
      attn_mask.sizes());
  TORCH_CHECK(
      attention_options.kv_cache() == nullptr, kContextParallelCaller,
      ": a kv_cache cannot be split by sequence, expected none, got one");
  TORCH_CHECK(
      !attention_options.cu_seqlens().defined(), kContextParallelCaller,
      ": cu_seqlens pack one row, which is split by sequence here: give the whole sequence's ",
      "document_ids instead");
  const auto& padding = attention_options.key_padding_mask();
  TORCH_CHECK(
      !padding.defined() || padding.scalar_type() == torch::kBool, kContextParallelCaller,
      ": key_padding_mask must be bool (true = padding) to be split by sequence, got ",
      padding.scalar_type());
  key_padding_mask_ = padding;
  is_causal_ = attention_options.is_causal();
  window_ = attention_options.window();
  document_ids_ = attention_options.document_ids();
}

ContextParallelMultiHeadAttentionImpl::ContextParallelMultiHeadAttentionImpl(
    const MultiHeadAttentionOptions& options_,
    Group group)
    : ContextParallelMultiHeadAttentionImpl(
          MultiHeadAttention(checked(options_)),
          std::move(group)) {}

ContextParallelMultiHeadAttentionImpl::ContextParallelMultiHeadAttentionImpl(
    const MultiHeadAttention& full,
    Group group)
    : options(checked(full->options)), group_(std::move(group)) {
  reset();
  torch::NoGradGuard no_grad;
  const auto whole = full->named_parameters();
  for (auto& parameter : named_parameters()) {
    parameter.value().set_data(whole[parameter.key()].clone());
  }
  stack_input_projections();
  train(full->is_training());
}

void ContextParallelMultiHeadAttentionImpl::reset() {
  const auto H = options.num_heads();
  const auto D = options.embed_dim() / H;
  // The layers draw initial values that the whole module's replace.
  detail::keeping_random_state(
      [&] { register_layers(*this, options, H * D, options.num_kv_heads().value_or(H) * D); });
}

std::shared_ptr<torch::nn::Module> ContextParallelMultiHeadAttentionImpl::clone(
    const c10::optional<torch::Device>& device) const {
  return with_stacked_input_projections(Cloneable::clone(device));
}

std::tuple<torch::Tensor, torch::Tensor> ContextParallelMultiHeadAttentionImpl::forward(
    const torch::Tensor& x_local,
    const ContextParallelForwardOptions& forward_options) {
  const auto& sharding = forward_options.sharding();
  check_sharding(sharding, group_);
  check_input(x_local, options, sharding, q_proj->weight);
  check_dropout(options, is_training());

  const auto parameters = replicated_parameters(*this);
  const bool batch_first = options.batch_first();
  const auto x = batch_first ? x_local : x_local.transpose(0, 1);
  auto heads = ::attn::detail::project_heads(x, x, x, options, parameters);
  heads = rotate(std::move(heads), rotary, forward_options, group_.rank());
  const auto attended = context_parallel_attention(
      heads.q, heads.k, heads.v, group_, context_parallel_options(forward_options));
  const auto output = torch::nn::functional::linear(
      ::attn::detail::merge_heads(attended, batch_first), parameters.out_weight,
      parameters.out_bias);
  return {zero_padding_rows(output, sharding, group_.rank(), batch_first ? 1 : 0), torch::Tensor()};
}

void ContextParallelMultiHeadAttentionImpl::pretty_print(std::ostream& stream) const {
  stream << "attn::distributed::ContextParallelMultiHeadAttention(embed_dim=" << options.embed_dim()
         << ", num_heads=" << options.num_heads();
  if (options.num_kv_heads()) {
    stream << ", num_kv_heads=" << *options.num_kv_heads();
  }
  if (options.rotary()) {
    stream << ", rotary_dim=" << options.rotary()->dim();
  }
  stream << ", rank=" << group_.rank() << ", world_size=" << group_.size() << ")";
}

} // namespace attn::distributed
