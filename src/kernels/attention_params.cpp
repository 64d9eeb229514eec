#include "kernels/attention_params.h"

#include <torch/torch.h>

namespace attn::detail {
namespace {

// A user's score function as an autograd context keeps it.
struct UserScoreFunctionHolder : torch::CustomClassHolder {
  explicit UserScoreFunctionHolder(std::shared_ptr<const UserScoreFunction> function)
      : function(std::move(function)) {}
  std::shared_ptr<const UserScoreFunction> function;
};

} // namespace

QkvHeads heads_of_projection(const torch::Tensor& qkv) {
  const auto parts = qkv.unbind(2); // differentiable: its backward stacks the three gradients
  return {parts[0].transpose(1, 2), parts[1].transpose(1, 2), parts[2].transpose(1, 2)};
}

void AttentionParams::save_settings_to(torch::autograd::AutogradContext& ctx) const {
  ctx.saved_data["mask"] = mask;
  ctx.saved_data["block_kinds"] = blocks.kinds;
  ctx.saved_data["block_tile_of"] = blocks.tile_of;
  ctx.saved_data["block_tiles"] = blocks.tiles;
  ctx.saved_data["block_key_bounds"] = blocks.key_bounds;
  ctx.saved_data["scale"] = scale;
  ctx.saved_data["causal"] = causal;
  ctx.saved_data["query_offset"] = query_offset;
  ctx.saved_data["window"] = window;
  ctx.saved_data["dropout_p"] = dropout.p;
  ctx.saved_data["dropout_seed"] = static_cast<int64_t>(dropout.seed); // the same 64 bits
  ctx.saved_data["softcap"] = modifiers.softcap;
  if (modifiers.user != nullptr) {
    ctx.saved_data["score_function"] = c10::IValue::make_capsule(
        c10::make_intrusive<UserScoreFunctionHolder>(modifiers.user));
  }
}

AttentionParams AttentionParams::restore_settings_from(torch::autograd::AutogradContext& ctx) {
  AttentionParams params;
  params.mask = ctx.saved_data.at("mask").toTensor();
  params.blocks.kinds = ctx.saved_data.at("block_kinds").toTensor();
  params.blocks.tile_of = ctx.saved_data.at("block_tile_of").toTensor();
  params.blocks.tiles = ctx.saved_data.at("block_tiles").toTensor();
  params.blocks.key_bounds = ctx.saved_data.at("block_key_bounds").toTensor();
  params.scale = ctx.saved_data.at("scale").toDouble();
  params.causal = ctx.saved_data.at("causal").toBool();
  params.query_offset = ctx.saved_data.at("query_offset").toInt();
  params.window = ctx.saved_data.at("window").toInt();
  params.dropout.p = ctx.saved_data.at("dropout_p").toDouble();
  params.dropout.seed = static_cast<uint64_t>(ctx.saved_data.at("dropout_seed").toInt());
  params.modifiers.softcap = ctx.saved_data.at("softcap").toDouble();
  const auto user = ctx.saved_data.find("score_function");
  if (user != ctx.saved_data.end()) {
    params.modifiers.user = c10::static_intrusive_pointer_cast<UserScoreFunctionHolder>(
                                user->second.toCapsule())
                                ->function;
  }
  return params;
}

} // namespace attn::detail
