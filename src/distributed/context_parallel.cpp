// attn::distributed::context_parallel_attention: the checks every strategy relies on,
// then the strategy the options name.

#include <attn/distributed/context_parallel.h>

#include <attn/block_mask.h>

#include "distributed/collectives.h"
#include "distributed/context_parallel_inputs.h"
#include "sdpa/masks.h"

#include <torch/torch.h>

#include <cmath>
#include <cstring>
#include <exception>
#include <vector>

namespace attn::distributed {
namespace {

using detail::kContextParallelAttentionCaller;

void check_shapes(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const SequenceSharding& sharding) {
  TORCH_CHECK(
      query.defined() && key.defined() && value.defined(), kContextParallelAttentionCaller,
      ": query, key and value must be defined tensors");
  TORCH_CHECK(
      query.dim() == 4 && key.dim() == 4 && value.dim() == 4, kContextParallelAttentionCaller,
      ": query, key and value must be (B, H, N, D), (B, H_kv, N, D) and (B, H_kv, N, Dv), got ",
      query.sizes(), ", ", key.sizes(), " and ", value.sizes());
  const int64_t N = sharding.local_length();
  TORCH_CHECK(
      query.size(2) == N && key.size(2) == N && value.size(2) == N, kContextParallelAttentionCaller,
      ": query, key and value must hold this rank's N = ", N, " rows of the ", sharding.length(),
      "-token sequence (SequenceSharding::local_length) in dimension 2, got ", query.sizes(), ", ",
      key.sizes(), " and ", value.sizes());
  TORCH_CHECK(
      key.size(0) == query.size(0) && value.size(0) == query.size(0),
      kContextParallelAttentionCaller,
      ": query, key and value must have the same batch size B, got ", query.sizes(), ", ",
      key.sizes(), " and ", value.sizes());
  TORCH_CHECK(
      key.size(1) == value.size(1) && key.size(1) > 0 && query.size(1) % key.size(1) == 0,
      kContextParallelAttentionCaller,
      ": key and value must have the same number of heads H_kv, dividing the query's H, got "
      "query ",
      query.sizes(), ", key ", key.sizes(), ", value ", value.sizes());
  TORCH_CHECK(
      key.size(3) == query.size(3), kContextParallelAttentionCaller,
      ": query and key must have the same head width D, got ", query.sizes(), " and ", key.sizes());
}

void check_dtypes_and_devices(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value) {
  TORCH_CHECK(
      query.scalar_type() == key.scalar_type() && query.scalar_type() == value.scalar_type() &&
          torch::isFloatingType(query.scalar_type()),
      kContextParallelAttentionCaller,
      ": query, key and value must have the same floating dtype, got ", query.scalar_type(), ", ",
      key.scalar_type(), " and ", value.scalar_type());
  TORCH_CHECK(
      query.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu(),
      kContextParallelAttentionCaller,
      ": query, key and value must be CPU tensors (a Gloo group), got ", query.device(), ", ",
      key.device(), " and ", value.device());
}

void check_options(const ContextParallelOptions& options, const Group& group) {
  TORCH_CHECK(
      options.sharding().world_size() == group.size(), kContextParallelAttentionCaller,
      ": the sharding is for ", options.sharding().world_size(), " ranks, the group has ",
      group.size());
  TORCH_CHECK(
      !options.scale() || std::isfinite(*options.scale()), kContextParallelAttentionCaller,
      ": scale must be a finite number, got ", *options.scale());
  TORCH_CHECK(
      !options.window() || *options.window() > 0, kContextParallelAttentionCaller,
      ": window must be a positive number of keys, got ", *options.window());
  TORCH_CHECK(
      std::abs(options.query_offset()) <= attn::detail::kMaxQueryOffset,
      kContextParallelAttentionCaller, ": query_offset must be within ±2^60, got ",
      options.query_offset());
}

// The key padding mask as the keys that may be attended, in bytes (the form
// both strategies send: Gloo sends every dtype but bool in all LibTorch
// versions), or undefined.
torch::Tensor allowed_keys(const ContextParallelOptions& options, const torch::Tensor& query) {
  const auto& padding = options.key_padding_mask();
  if (!padding.defined()) {
    return {};
  }
  const int64_t B = query.size(0), N = query.size(2);
  TORCH_CHECK(
      padding.scalar_type() == torch::kBool && padding.device().is_cpu(),
      kContextParallelAttentionCaller,
      ": key_padding_mask must be a bool CPU tensor (true = padding), got ", padding.scalar_type(),
      " on ", padding.device());
  TORCH_CHECK(
      padding.dim() == 2 && padding.size(0) == B && padding.size(1) == N,
      kContextParallelAttentionCaller,
      ": key_padding_mask must be (B, N) = ", torch::IntArrayRef({B, N}),
      ", this rank's keys, got ", padding.sizes());
  return padding.logical_not().to(torch::kByte).contiguous();
}

// This rank's inputs, checked, in the dtype they are computed in.
detail::ContextParallelInputs checked_inputs(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const Group& group,
    const ContextParallelOptions& options) {
  check_options(options, group);
  check_shapes(query, key, value, options.sharding());
  check_dtypes_and_devices(query, key, value);
  // The kernels compute in float32 or float64.
  const auto compute_dtype = query.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
  return {
      query.to(compute_dtype),
      key.to(compute_dtype),
      value.to(compute_dtype),
      allowed_keys(options, query),
      options.sharding(),
      options.scale().value_or(1.0 / std::sqrt(static_cast<double>(query.size(3)))),
      options.is_causal(),
      std::min(options.window().value_or(0), attn::detail::kUnboundedWindow),
      options.query_offset(),
      options.document_ids().defined()
          ? detail::checked_document_ids(
                options.document_ids(), query.size(0), options.sharding().length())
          : torch::Tensor()};
}

constexpr const char* kAgreed =
    "query, key, value, their dtype and the options (a lone 0: a rank that refused its "
    "arguments, whose own error says why)";

// What every rank must agree on, as numbers: a leading 1, the sizes of the
// inputs, their dtype and every option; a lone 0 from a rank whose inputs
// failed its own checks.
std::vector<int64_t> agreement(const c10::optional<detail::ContextParallelInputs>& inputs) {
  if (!inputs) {
    return {0};
  }
  std::vector<int64_t> numbers{1};
  for (const auto* tensor : {&inputs->query, &inputs->key, &inputs->value}) {
    numbers.insert(numbers.end(), tensor->sizes().begin(), tensor->sizes().end());
  }
  int64_t scale_bits = 0;
  static_assert(sizeof(scale_bits) == sizeof(inputs->scale));
  std::memcpy(&scale_bits, &inputs->scale, sizeof(scale_bits));
  const auto& sharding = inputs->sharding;
  numbers.insert(
      numbers.end(),
      {static_cast<int64_t>(inputs->query.scalar_type()), inputs->allowed_keys.defined() ? 1 : 0,
       sharding.length(), static_cast<int64_t>(sharding.layout()), inputs->causal ? 1 : 0,
       inputs->window, inputs->query_offset, scale_bits});
  // The documents: their count of boundaries (-1: none given) and their
  // ids' sum stand for them.
  const auto& ids = inputs->document_ids;
  const int64_t boundaries = !ids.defined() ? -1
      : ids.size(1) > 1 ? (ids.narrow(1, 1, ids.size(1) - 1) != ids.narrow(1, 0, ids.size(1) - 1))
                              .sum()
                              .item<int64_t>()
                        : 0;
  numbers.insert(numbers.end(), {boundaries, ids.defined() ? ids.sum().item<int64_t>() : 0});
  return numbers;
}

} // namespace

ContextParallelOptions::ContextParallelOptions(SequenceSharding sharding) : sharding_(sharding) {}

torch::Tensor detail::checked_document_ids(const torch::Tensor& ids, int64_t B, int64_t T) {
  TORCH_CHECK(
      ids.defined() &&
          ((ids.dim() == 1 && ids.size(0) == T) ||
           (ids.dim() == 2 && ids.size(0) == B && ids.size(1) == T)),
      kContextParallelAttentionCaller, ": document_ids must be the whole sequence's, (T) = (", T,
      ") or (B, T) = (", B, ", ", T, "), got ", ids.defined() ? ids.sizes() : torch::IntArrayRef{});
  (void)document_mask(ids); // checks the values: integers, nondecreasing
  return (ids.dim() == 1 ? ids.unsqueeze(0) : ids).to(torch::kCPU, torch::kLong).contiguous();
}

torch::Tensor context_parallel_attention(
    const torch::Tensor& query,
    const torch::Tensor& key,
    const torch::Tensor& value,
    const Group& group,
    const ContextParallelOptions& options) {
  c10::optional<detail::ContextParallelInputs> inputs;
  std::exception_ptr refused;
  try {
    inputs = checked_inputs(query, key, value, group, options);
  } catch (const c10::Error&) {
    refused = std::current_exception();
  }
  // A rank that refused its arguments still takes part in the comparison,
  // so that the others fail at once with a message rather than wait for it
  // until the timeout; it reports its own error.
  auto numbers = agreement(inputs);
  numbers.push_back(static_cast<int64_t>(options.strategy()));
  try {
    detail::check_same_sizes(numbers, kAgreed, group);
  } catch (const c10::Error&) {
    if (refused) {
      std::rethrow_exception(refused);
    }
    throw;
  }
  if (refused) {
    std::rethrow_exception(refused);
  }
  const auto output = options.strategy() == ContextParallelStrategy::ring
      ? detail::ring_attention_of(*inputs, group)
      : detail::all_to_all_attention_of(*inputs, group);
  return output.to(query.scalar_type());
}

} // namespace attn::distributed
