// All-to-all attention (DeepSpeed-Ulysses, Jacobs et al. 2023): one
// all-to-all over heads per input turns this rank's rows of every head into
// the whole sequence of H/W heads (H_kv/W key/value heads), which the rank
// attends with attn's fused kernel as if it were alone; one more all-to-all
// sends each rank its rows of the output back. Each tensor crosses the
// group once each way, whatever W, but the heads must divide among the
// ranks.

#include "distributed/collectives.h"
#include "distributed/context_parallel_inputs.h"

#include <attn/block_mask.h>
#include <attn/sdpa.h>

#include <torch/torch.h>

#include <vector>

namespace attn::distributed::detail {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// A function of sizes that check_ranks_agree has compared: every rank
// fails here alike, before any of the strategy's collectives.
void check_heads_divide(const ContextParallelInputs& inputs, int64_t world_size) {
  const int64_t H = inputs.query.size(1), H_kv = inputs.key.size(1);
  TORCH_CHECK(
      H % world_size == 0 && H_kv % world_size == 0, kContextParallelAttentionCaller,
      ": the all_to_all strategy needs the group's ", world_size,
      " ranks to divide the query heads H and the key/value heads H_kv (the ring strategy takes "
      "any head count), got H = ",
      H, " and H_kv = ", H_kv);
}

// The all-to-all as an autograd function: chunk r came from rank r, so its
// gradient goes back there, by the same exchange.
struct AllToAll : torch::autograd::Function<AllToAll> {
  static torch::Tensor forward(
      AutogradContext* ctx,
      const torch::Tensor& input,
      const Group& group) {
    save_group(ctx, group);
    return all_to_all(input, group);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {all_to_all(grads[0], saved_group(ctx)), torch::Tensor()};
  }
};

// (W, ...) chunks exchanged; a group of one exchanges nothing.
torch::Tensor exchanged(const torch::Tensor& chunks, const Group& group) {
  return group.size() == 1 ? chunks : AllToAll::apply(chunks, group);
}

// This rank's rows (B, H, N, F) of every head as W chunks (W, B, H/W, N, F),
// chunk r holding the heads that rank r attends.
torch::Tensor heads_by_rank(const torch::Tensor& rows, int64_t world_size) {
  const int64_t B = rows.size(0), H = rows.size(1), N = rows.size(2), F = rows.size(3);
  return rows.reshape({B, world_size, H / world_size, N, F}).transpose(0, 1);
}

// The mirror of heads_by_rank: chunk r (W, B, H/W, N, F) holds heads
// [r·H/W, (r+1)·H/W) of the same rows; all heads (B, H, N, F).
torch::Tensor all_heads(const torch::Tensor& chunks) {
  const int64_t W = chunks.size(0), B = chunks.size(1), H_local = chunks.size(2);
  return chunks.transpose(0, 1).reshape({B, W * H_local, chunks.size(3), chunks.size(4)});
}

// This rank's heads of the whole sequence, (B, H/W, T, F) in sequence order
// without padding, from this rank's rows of every head (B, H, N, F).
torch::Tensor whole_sequence(
    const torch::Tensor& rows,
    const SequenceSharding& sharding,
    const Group& group) {
  // Chunk r of the result is rank r's rows: the sequence in layout order.
  const auto by_rank = exchanged(heads_by_rank(rows, group.size()), group);
  return sharding.unshard(by_rank.unbind(0), 2);
}

// The mirror of whole_sequence: each rank's rows of this rank's heads of
// the whole sequence (B, H/W, T, F), padded with zeros, back to the rank
// that holds those rows; this rank's rows of every head, (B, H, N, F).
torch::Tensor rows_of_every_head(
    const torch::Tensor& whole,
    const SequenceSharding& sharding,
    const Group& group) {
  return all_heads(exchanged(torch::stack(sharding.shard_all(whole, 2)), group));
}

// The keys of the whole sequence that may be attended, as an attention mask
// (B, 1, 1, T); undefined when every key may be.
torch::Tensor whole_sequence_mask(
    const torch::Tensor& allowed_keys,
    const SequenceSharding& sharding,
    const Group& group) {
  if (!allowed_keys.defined()) {
    return {};
  }
  const auto parts = group.size() == 1 ? std::vector<torch::Tensor>{allowed_keys}
                                       : all_gather(allowed_keys, group);
  const auto allowed = sharding.unshard(parts, 1).to(torch::kBool);
  return allowed.view({allowed.size(0), 1, 1, allowed.size(1)});
}

// attn's fused kernel over the whole sequence, with the options in the
// whole sequence's positions; grouped key/value heads are not copied.
torch::Tensor attend_whole_sequence(
    const ContextParallelInputs& inputs,
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const torch::Tensor& mask) {
  auto options = SDPAOptions()
                     .attn_mask(mask)
                     .is_causal(inputs.causal)
                     .query_offset(inputs.query_offset)
                     .scale(inputs.scale)
                     .enable_gqa(true)
                     .need_weights(false)
                     .backend(AttentionBackend::fused_cpu);
  if (inputs.window > 0) {
    options.window(inputs.window);
  }
  if (const auto& ids = inputs.document_ids; ids.defined()) {
    options.block_mask(block_mask(document_mask(ids), ids.size(0), 1, query.size(2), key.size(2)));
  }
  return std::get<0>(scaled_dot_product_attention(query, key, value, options));
}

} // namespace

torch::Tensor all_to_all_attention_of(const ContextParallelInputs& inputs, const Group& group) {
  check_heads_divide(inputs, group.size());
  const auto& sharding = inputs.sharding;
  const auto mask = whole_sequence_mask(inputs.allowed_keys, sharding, group);
  const auto query = whole_sequence(inputs.query, sharding, group);
  const auto key = whole_sequence(inputs.key, sharding, group);
  const auto value = whole_sequence(inputs.value, sharding, group);
  const auto out = attend_whole_sequence(inputs, query, key, value, mask);
  return rows_of_every_head(out, sharding, group);
}

} // namespace attn::distributed::detail
