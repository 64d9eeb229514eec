#include <attn/interop.h>

#include "serialization/torch_save_reader.h"

#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace attn {
namespace {

using NamedTensors = std::map<std::string, torch::Tensor>;

// One entry of the built-in's state_dict and the parameters of ours that it
// holds, concatenated along dim 0 (the packed in_proj_weight holds three).
struct Entry {
  std::string name;
  std::vector<torch::Tensor> parts;

  std::vector<int64_t> shape() const {
    auto sizes = parts.front().sizes().vec();
    for (size_t i = 1; i < parts.size(); ++i) {
      sizes[0] += parts[i].size(0);
    }
    return sizes;
  }
};

// Our module's parameters under the names torch::nn::MultiheadAttention
// (C++ and Python alike) gives them.
std::vector<Entry> builtin_entries(const MultiHeadAttentionImpl& ours, const char* caller) {
  const auto& options = ours.options;
  const auto kv_heads = options.num_kv_heads().value_or(options.num_heads());
  TORCH_CHECK(
      kv_heads == options.num_heads(), caller,
      ": torch.nn.MultiheadAttention has no grouped-query form; the ",
      "attn::MultiHeadAttention must have num_kv_heads == num_heads, got ",
      "num_kv_heads=", kv_heads, " and num_heads=", options.num_heads());
  TORCH_CHECK(
      !options.rotary(), caller,
      ": torch.nn.MultiheadAttention has no rotary embeddings; with the same ",
      "weights the attn::MultiHeadAttention (rotary dim ",
      options.rotary() ? options.rotary()->dim() : 0,
      ") would compute something else, so it must not have rotary set");
  const bool packed = options.kdim() == options.embed_dim() &&
      options.vdim() == options.embed_dim();
  std::vector<Entry> entries;
  if (packed) {
    entries.push_back(
        {"in_proj_weight", {ours.q_proj->weight, ours.k_proj->weight, ours.v_proj->weight}});
  } else {
    entries.push_back({"q_proj_weight", {ours.q_proj->weight}});
    entries.push_back({"k_proj_weight", {ours.k_proj->weight}});
    entries.push_back({"v_proj_weight", {ours.v_proj->weight}});
  }
  if (options.bias()) {
    entries.push_back({"in_proj_bias", {ours.q_proj->bias, ours.k_proj->bias, ours.v_proj->bias}});
  }
  if (options.add_bias_kv()) {
    entries.push_back({"bias_k", {ours.bias_k}});
    entries.push_back({"bias_v", {ours.bias_v}});
  }
  entries.push_back({"out_proj.weight", {ours.out_proj->weight}});
  if (options.bias()) {
    entries.push_back({"out_proj.bias", {ours.out_proj->bias}});
  }
  return entries;
}

// Every entry `entries` names must be in `source` (built-in names) with its
// shape, and no other entry may be.
void check_entries(
    const std::vector<Entry>& entries,
    const NamedTensors& source,
    const char* caller,
    const std::string& where) {
  std::vector<std::string> expected;
  expected.reserve(entries.size());
  for (const auto& entry : entries) {
    expected.push_back(entry.name);
  }
  for (const auto& [name, tensor] : source) {
    if (std::find(expected.begin(), expected.end(), name) != expected.end()) {
      continue;
    }
    // "encoder.attn.in_proj_weight": the attention sits under a prefix.
    std::string hint;
    for (const std::string known :
         {"in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias",
          "bias_k", "bias_v", "out_proj.weight", "out_proj.bias"}) {
      const auto stem = name.size() - std::min(name.size(), known.size());
      if (stem > 0 && name.compare(stem, std::string::npos, known) == 0 && name[stem - 1] == '.') {
        hint = " (is the attention under the prefix '" + name.substr(0, stem) + "'?)";
        break;
      }
    }
    TORCH_CHECK(
        false, caller, ": unexpected entry '", name, "'", where, hint,
        "; an attn::MultiHeadAttention with these options takes exactly ",
        c10::Join(", ", expected), " (bias_k and bias_v come with add_bias_kv, ",
        "in_proj_weight with kdim == vdim == embed_dim)");
  }
  for (const auto& entry : entries) {
    const auto found = source.find(entry.name);
    TORCH_CHECK(
        found != source.end(), caller, ": missing entry '", entry.name, "'", where,
        "; an attn::MultiHeadAttention with these options takes ", c10::Join(", ", expected));
    const auto& tensor = found->second;
    TORCH_CHECK(
        tensor.sizes() == torch::IntArrayRef(entry.shape()), caller, ": entry '", entry.name, "'",
        where, " must be ", torch::IntArrayRef(entry.shape()), ", got ", tensor.sizes());
  }
}

// Copies `source` (built-in names) into `target`'s parameters, cast to
// their dtype and device. All entries are checked before the first copy,
// so that a failed load leaves the target as it was.
void load_entries(
    MultiHeadAttentionImpl& target,
    const NamedTensors& source,
    const char* caller,
    const std::string& where) {
  const auto entries = builtin_entries(target, caller);
  check_entries(entries, source, caller, where);
  torch::NoGradGuard no_grad;
  for (const auto& entry : entries) {
    const auto& tensor = source.at(entry.name);
    int64_t row = 0;
    for (const auto& part : entry.parts) {
      // A view sharing the parameter's storage: copy_ writes through it.
      part.copy_(tensor.narrow(0, row, part.size(0)));
      row += part.size(0);
    }
  }
}

void check_same_options(
    const torch::nn::MultiheadAttentionImpl& builtin,
    const MultiHeadAttentionImpl& ours) {
  const auto& theirs = builtin.options;
  const auto& mine = ours.options;
  TORCH_CHECK(
      theirs.embed_dim() == mine.embed_dim() && theirs.num_heads() == mine.num_heads() &&
          theirs.kdim() == mine.kdim() && theirs.vdim() == mine.vdim() &&
          theirs.bias() == mine.bias() && theirs.add_bias_kv() == mine.add_bias_kv() &&
          theirs.add_zero_attn() == mine.add_zero_attn(),
      "copy_weights: modules differ; torch::nn::MultiheadAttention has ",
      "embed_dim=", theirs.embed_dim(), ", num_heads=", theirs.num_heads(),
      ", kdim=", theirs.kdim(), ", vdim=", theirs.vdim(), ", bias=", theirs.bias(),
      ", add_bias_kv=", theirs.add_bias_kv(), ", add_zero_attn=", theirs.add_zero_attn(),
      " but attn::MultiHeadAttention has ", "embed_dim=", mine.embed_dim(),
      ", num_heads=", mine.num_heads(), ", kdim=", mine.kdim(), ", vdim=", mine.vdim(),
      ", bias=", mine.bias(), ", add_bias_kv=", mine.add_bias_kv(),
      ", add_zero_attn=", mine.add_zero_attn());
}

} // namespace

void copy_weights(const torch::nn::MultiheadAttentionImpl& source, MultiHeadAttentionImpl& target) {
  check_same_options(source, target);
  NamedTensors named;
  for (const auto& parameter : source.named_parameters()) {
    named[parameter.key()] = parameter.value();
  }
  load_entries(target, named, "copy_weights", "");
}

void copy_weights(const MultiHeadAttentionImpl& source, torch::nn::MultiheadAttentionImpl& target) {
  check_same_options(target, source);
  torch::NoGradGuard no_grad;
  const auto parameters = target.named_parameters();
  for (const auto& entry : builtin_entries(source, "copy_weights")) {
    parameters[entry.name].copy_(torch::cat(entry.parts));
  }
}

void load_pytorch_state_dict(
    MultiHeadAttentionImpl& target,
    const std::string& path,
    const std::string& prefix) {
  constexpr const char* caller = "load_pytorch_state_dict";
  // The entries under `prefix`, with it removed; "layers.1" means
  // "layers.1." and not "layers.10.".
  const auto dotted = prefix.empty() || prefix.back() == '.' ? prefix : prefix + ".";
  NamedTensors named;
  for (const auto& [name, tensor] : detail::read_saved_tensor_dict(path, caller)) {
    if (name.compare(0, dotted.size(), dotted) == 0) {
      named[name.substr(dotted.size())] = tensor;
    }
  }
  TORCH_CHECK(
      !named.empty(), caller, ": '", path, "' has no tensor whose name starts with the prefix '",
      dotted, "'");
  const auto where = " in '" + path + "'" +
      (dotted.empty() ? std::string() : " (after the prefix '" + dotted + "')");
  load_entries(target, named, caller, where);
}

} // namespace attn
