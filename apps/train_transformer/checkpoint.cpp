#include "checkpoint.h"

#include "common/atomic_file.h"

#include <torch/torch.h>

#include <fstream>

namespace train {
namespace {

// Scalars are stored as one-element int64 tensors; the seed's bits are kept
// as they are.
torch::Tensor scalar(int64_t value) {
  return torch::tensor(value, torch::kLong);
}

int64_t read_scalar(torch::serialize::InputArchive& archive, const char* key) {
  torch::Tensor value;
  archive.read(key, value);
  return value.item<int64_t>();
}

// Checkpoints written before the trainer offered the built-in hold no
// "attention" entry: theirs is attn's.
AttentionKind read_attention(torch::serialize::InputArchive& archive) {
  torch::Tensor value;
  if (!archive.try_read("attention", value)) {
    return AttentionKind::kAttn;
  }
  return static_cast<AttentionKind>(value.item<int64_t>());
}

} // namespace

void save_checkpoint(
    const std::string& path,
    const RunIdentity& identity,
    int64_t step,
    const Transformer& model,
    const torch::optim::Optimizer& optimizer) {
  torch::serialize::OutputArchive archive;
  archive.write("step", scalar(step));
  archive.write("seed", scalar(static_cast<int64_t>(identity.seed)));
  archive.write("digits", scalar(identity.digits));
  archive.write("attention", scalar(static_cast<int64_t>(identity.attention)));
  torch::serialize::OutputArchive model_archive;
  model->save(model_archive);
  archive.write("model", model_archive);
  torch::serialize::OutputArchive optimizer_archive;
  optimizer.save(optimizer_archive);
  archive.write("optimizer", optimizer_archive);

  apps::replace_file_atomically(
      path, "the checkpoint", [&](const std::string& temporary) { archive.save_to(temporary); });
}

int64_t load_checkpoint(
    const std::string& path,
    const RunIdentity& identity,
    const torch::Device& device,
    Transformer& model,
    torch::optim::Optimizer& optimizer) {
  TORCH_CHECK(std::ifstream(path).good(), "cannot resume: no readable checkpoint '", path, "'");
  torch::serialize::InputArchive archive;
  try {
    archive.load_from(path, device);
  } catch (const c10::Error&) {
    TORCH_CHECK(false, "cannot resume: '", path, "' is not a checkpoint");
  }
  const auto seed = static_cast<uint64_t>(read_scalar(archive, "seed"));
  const auto digits = read_scalar(archive, "digits");
  TORCH_CHECK(
      seed == identity.seed && digits == identity.digits, "cannot resume: '", path,
      "' holds a run with --seed ", seed, " --digits ", digits, ", not --seed ", identity.seed,
      " --digits ", identity.digits);
  const auto attention = read_attention(archive);
  TORCH_CHECK(
      attention == identity.attention, "cannot resume: '", path, "' holds a run with --attention ",
      attention_name(attention), ", not --attention ", attention_name(identity.attention));
  torch::serialize::InputArchive model_archive;
  archive.read("model", model_archive);
  model->load(model_archive);
  torch::serialize::InputArchive optimizer_archive;
  archive.read("optimizer", optimizer_archive);
  optimizer.load(optimizer_archive);
  return read_scalar(archive, "step");
}

} // namespace train
