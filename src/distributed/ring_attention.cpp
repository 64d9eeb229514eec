// Ring attention: each rank keeps its query rows and passes its keys and
// values around the ring of ranks, W-1 times, receiving the next block
// while it attends to the one it holds. Every (query segment, key segment)
// pair that the masks leave visible runs attn's fused CPU kernel, whose
// output and row log-sum-exp merge into the rank's running result. The
// backward passes the keys and values around again, with the gradients of
// each block travelling behind it: after W passes they are home.

#include "distributed/collectives.h"
#include "distributed/context_parallel_inputs.h"
#include "sdpa/partial_attention.h"

#include <torch/torch.h>

#include <algorithm>
#include <limits>
#include <vector>

namespace attn::distributed::detail {
namespace {

using attn::detail::AttentionPart;
using attn::detail::PartResult;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The tensors that travel around the ring: a rank's keys and values (and
// which of them may be attended) in the forward; their gradients in the
// backward.
struct Block {
  std::vector<torch::Tensor> tensors;

  // A block of keys and values: (B, H_kv, N, D), (B, H_kv, N, Dv) and, where
  // keys are masked, (B, N) bytes (1: may be attended).
  const torch::Tensor& key() const { return tensors[0]; }
  const torch::Tensor& value() const { return tensors[1]; }
  torch::Tensor allowed() const { return tensors.size() > 2 ? tensors[2] : torch::Tensor(); }
};

// A block on its way from each rank to the next: `wait()` returns once this
// rank's has been sent and the previous rank's received into `incoming`.
struct Exchange {
  Block incoming;
  std::vector<PendingMessage> messages;

  void wait() {
    for (auto& message : messages) {
      message.wait();
    }
  }
};

Exchange start_exchange(const Block& block, int tag_base, const Group& group) {
  const int64_t next = (group.rank() + 1) % group.size();
  const int64_t previous = (group.rank() + group.size() - 1) % group.size();
  Exchange exchange;
  for (size_t i = 0; i < block.tensors.size(); ++i) {
    const int tag = tag_base + static_cast<int>(i);
    exchange.incoming.tensors.push_back(torch::empty_like(block.tensors[i]));
    exchange.messages.push_back(start_send(block.tensors[i], next, tag, group));
    exchange.messages.push_back(start_recv(exchange.incoming.tensors[i], previous, tag, group));
  }
  return exchange;
}

// Message tags: each pass around the ring numbers its steps, the keys'
// and values' passes (forward and backward alike) from 0, the gradients'
// after them, so that the two passes of the backward never share a tag.
constexpr int kTagsPerStep = 4;
int key_value_tag(int64_t step) {
  return static_cast<int>(step) * kTagsPerStep;
}
int gradient_tag(int64_t step, int64_t world_size) {
  return static_cast<int>(world_size + step) * kTagsPerStep;
}

// The keys and values of the rank that holds them, and which of them may be
// attended.
Block key_value_block(const ContextParallelInputs& inputs) {
  Block block{{inputs.key.contiguous(), inputs.value.contiguous()}};
  if (inputs.allowed_keys.defined()) {
    block.tensors.push_back(inputs.allowed_keys);
  }
  return block;
}

// One kernel call: query rows [q_row, q_row + q_rows) against key rows
// [k_row, k_row + k_rows) of the block held, with the key at local row
// k_row standing `query_offset` positions before the query at q_row; the
// rows start at q_start and k_start in the whole sequence.
struct SegmentPair {
  int64_t q_row, q_rows, k_row, k_rows, query_offset, q_start, k_start;
};

// Whether some row of the batch has a document among the queries
// [q_start, q_start + q_rows) that is also among the keys [k_start,
// k_start + k_rows): ids nondecreasing, each range is [first, last].
bool documents_meet(
    const torch::Tensor& document_ids,
    int64_t q_start,
    int64_t q_rows,
    int64_t k_start,
    int64_t k_rows) {
  const auto ids = document_ids.accessor<int64_t, 2>();
  for (int64_t b = 0; b < document_ids.size(0); ++b) {
    const int64_t q_first = ids[b][q_start], q_last = ids[b][q_start + q_rows - 1];
    const int64_t k_first = ids[b][k_start], k_last = ids[b][k_start + k_rows - 1];
    if (q_first <= k_last && k_first <= q_last) {
      return true;
    }
  }
  return false;
}

// The pairs of this rank's query segments and `key_rank`'s key segments in
// which some query sees some key, padding (neither attending nor attended
// to) left out.
std::vector<SegmentPair> visible_pairs(
    const ContextParallelInputs& inputs,
    int64_t query_rank,
    int64_t key_rank) {
  std::vector<SegmentPair> pairs;
  const auto& sharding = inputs.sharding;
  int64_t q_row = 0;
  for (const auto& q_segment : sharding.segments(query_rank)) {
    const int64_t q_rows = sharding.rows_inside(q_segment);
    int64_t k_row = 0;
    for (const auto& k_segment : sharding.segments(key_rank)) {
      const int64_t k_rows = sharding.rows_inside(k_segment);
      const int64_t offset = q_segment.start + inputs.query_offset - k_segment.start;
      const bool visible = attn::detail::band_leaves_pairs(
          inputs.causal, inputs.window, offset, q_rows, k_rows);
      if (visible &&
          (!inputs.document_ids.defined() ||
           documents_meet(inputs.document_ids, q_segment.start, q_rows, k_segment.start, k_rows))) {
        pairs.push_back({q_row, q_rows, k_row, k_rows, offset, q_segment.start, k_segment.start});
      }
      k_row += k_segment.length;
    }
    q_row += q_segment.length;
  }
  return pairs;
}

// Rows [row, row + rows) of a (B, H, N, ·) or (B, H, N) tensor.
torch::Tensor rows_of(const torch::Tensor& tensor, int64_t row, int64_t rows) {
  return tensor.narrow(2, row, rows);
}

// The part of the request that `pair` of `block` computes, whose allowed
// keys are its `allowed()` (B, N) bytes, or undefined.
AttentionPart pair_part(
    const ContextParallelInputs& inputs,
    const SegmentPair& pair,
    const Block& block) {
  AttentionPart part;
  part.q = rows_of(inputs.query, pair.q_row, pair.q_rows);
  part.k = rows_of(block.key(), pair.k_row, pair.k_rows);
  part.v = rows_of(block.value(), pair.k_row, pair.k_rows);
  part.scale = inputs.scale;
  part.causal = inputs.causal;
  part.window = inputs.window;
  part.query_offset = pair.query_offset;
  if (const auto& allowed = block.allowed(); allowed.defined()) {
    part.allowed_keys = allowed.narrow(1, pair.k_row, pair.k_rows);
  }
  if (const auto& ids = inputs.document_ids; ids.defined()) {
    part.query_documents = ids.narrow(1, pair.q_start, pair.q_rows);
    part.key_documents = ids.narrow(1, pair.k_start, pair.k_rows);
  }
  return part;
}

// The rows of `pair`'s queries in this rank's result (out, lse).
PartResult rows_of_pair(const PartResult& result, const SegmentPair& pair) {
  return {
      rows_of(result.out, pair.q_row, pair.q_rows), rows_of(result.lse, pair.q_row, pair.q_rows)};
}

// Attends this rank's queries to `block`, the keys and values of
// `key_rank`, merging into `result`.
void attend_block(
    const ContextParallelInputs& inputs,
    const Block& block,
    int64_t key_rank,
    int64_t rank,
    const PartResult& result) {
  for (const auto& pair : visible_pairs(inputs, rank, key_rank)) {
    attn::detail::merge_part(
        rows_of_pair(result, pair), attn::detail::attend_part(pair_part(inputs, pair, block)));
  }
}

// The gradients of this rank's queries (added to `dq`) and of `block`'s
// keys and values (added to `grads`) for the pairs of `key_rank`, given the
// rank's merged `result`.
void backward_block(
    const ContextParallelInputs& inputs,
    const Block& block,
    int64_t key_rank,
    int64_t rank,
    const PartResult& result,
    const torch::Tensor& grad_out,
    const torch::Tensor& dq,
    const Block& grads) {
  for (const auto& pair : visible_pairs(inputs, rank, key_rank)) {
    const auto part = attn::detail::attend_part_backward(
        pair_part(inputs, pair, block), rows_of_pair(result, pair),
        rows_of(grad_out, pair.q_row, pair.q_rows));
    rows_of(dq, pair.q_row, pair.q_rows).add_(part.dq);
    rows_of(grads.tensors[0], pair.k_row, pair.k_rows).add_(part.dk);
    rows_of(grads.tensors[1], pair.k_row, pair.k_rows).add_(part.dv);
  }
}

// Zero gradients for a block of keys and values, contiguous whatever the
// inputs' strides (views of projections split into heads): they travel as
// messages.
Block zero_gradients(const ContextParallelInputs& inputs) {
  return {
      {torch::zeros(inputs.key.sizes(), inputs.key.options()),
       torch::zeros(inputs.value.sizes(), inputs.value.options())}};
}

void add_into(const Block& sum, const Block& addend) {
  for (size_t i = 0; i < sum.tensors.size(); ++i) {
    sum.tensors[i].add_(addend.tensors[i]);
  }
}

// The rank whose keys a rank holds at `step` of the ring.
int64_t key_rank_at(int64_t step, const Group& group) {
  return (group.rank() + group.size() - step) % group.size();
}

class RingAttentionFunction : public torch::autograd::Function<RingAttentionFunction> {
 public:
  static torch::Tensor forward(
      AutogradContext* ctx,
      const torch::Tensor& query,
      const torch::Tensor& key,
      const torch::Tensor& value,
      const ContextParallelInputs& inputs,
      const Group& group) {
    const auto& q = inputs.query;
    const int64_t B = q.size(0), H = q.size(1), N = q.size(2), Dv = inputs.value.size(3);
    auto out = torch::zeros({B, H, N, Dv}, q.options());
    auto lse = torch::full({B, H, N}, -std::numeric_limits<double>::infinity(), q.options());
    auto block = key_value_block(inputs);
    for (int64_t step = 0; step < group.size(); ++step) {
      const bool last = step + 1 == group.size();
      auto exchange = last ? Exchange{} : start_exchange(block, key_value_tag(step), group);
      attend_block(inputs, block, key_rank_at(step, group), group.rank(), {out, lse});
      exchange.wait();
      block = std::move(exchange.incoming);
    }
    ctx->save_for_backward({query, key, value, out, lse});
    ctx->saved_data["allowed_keys"] = inputs.allowed_keys;
    ctx->saved_data["document_ids"] = inputs.document_ids;
    save_settings(ctx, inputs);
    save_group(ctx, group);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto inputs = restore_inputs(ctx, saved);
    const auto& out = saved[3];
    const auto& lse = saved[4];
    const Group group = saved_group(ctx);
    // Every rank takes part in the backward's ring, also one whose output
    // did not reach the loss (its gradient undefined: zero).
    const auto grad_out = grad_outputs[0].defined() ? grad_outputs[0].contiguous()
                                                    : torch::zeros_like(out);

    const auto dq = torch::zeros_like(inputs.query);
    auto block = key_value_block(inputs);
    // The gradients of the block held travel one step behind it: each rank
    // adds its share to the partial sum the previous rank sent, which
    // arrives while the share is computed, and sends the sum on. After the
    // last step each rank receives its own block's.
    c10::optional<Exchange> gradients_in_flight;
    for (int64_t step = 0; step < group.size(); ++step) {
      const bool last = step + 1 == group.size();
      auto exchange = last ? Exchange{} : start_exchange(block, key_value_tag(step), group);
      auto share = zero_gradients(inputs);
      backward_block(
          inputs, block, key_rank_at(step, group), group.rank(), {out, lse}, grad_out, dq, share);
      if (gradients_in_flight) {
        gradients_in_flight->wait();
        add_into(share, gradients_in_flight->incoming);
      }
      if (group.size() == 1) {
        return {dq, share.tensors[0], share.tensors[1], torch::Tensor(), torch::Tensor()};
      }
      gradients_in_flight = start_exchange(share, gradient_tag(step, group.size()), group);
      exchange.wait();
      block = std::move(exchange.incoming);
    }
    gradients_in_flight->wait();
    const auto& grads = gradients_in_flight->incoming;
    return {dq, grads.tensors[0], grads.tensors[1], torch::Tensor(), torch::Tensor()};
  }

 private:
  static void save_settings(AutogradContext* ctx, const ContextParallelInputs& inputs) {
    const auto& sharding = inputs.sharding;
    ctx->saved_data["length"] = sharding.length();
    ctx->saved_data["world_size"] = sharding.world_size();
    ctx->saved_data["zigzag"] = sharding.layout() == SequenceLayout::zigzag;
    ctx->saved_data["scale"] = inputs.scale;
    ctx->saved_data["causal"] = inputs.causal;
    ctx->saved_data["window"] = inputs.window;
    ctx->saved_data["query_offset"] = inputs.query_offset;
  }

  static ContextParallelInputs restore_inputs(AutogradContext* ctx, const variable_list& saved) {
    const auto& data = ctx->saved_data;
    return {
        saved[0],
        saved[1],
        saved[2],
        data.at("allowed_keys").toTensor(),
        SequenceSharding(
            data.at("length").toInt(), data.at("world_size").toInt(),
            data.at("zigzag").toBool() ? SequenceLayout::zigzag : SequenceLayout::contiguous),
        data.at("scale").toDouble(),
        data.at("causal").toBool(),
        data.at("window").toInt(),
        data.at("query_offset").toInt(),
        data.at("document_ids").toTensor()};
  }
};

} // namespace

torch::Tensor ring_attention_of(const ContextParallelInputs& inputs, const Group& group) {
  return RingAttentionFunction::apply(inputs.query, inputs.key, inputs.value, inputs, group);
}

} // namespace attn::distributed::detail
