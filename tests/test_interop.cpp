// Weights in and out of attn::MultiHeadAttention: exchange with
// torch::nn::MultiheadAttention, state_dicts written by Python PyTorch
// (fixtures/python, with the outputs Python computed), and torch::save /
// torch::load of our own modules.

#include "test_support.h"

#include <attn/interop.h>
#include <attn/modules/multi_head_attention.h>

#include <caffe2/serialize/inline_container.h>
#include <torch/serialize.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>

namespace {

using attn::MultiHeadAttention;
using attn::MultiHeadAttentionForwardOptions;
using attn::MultiHeadAttentionOptions;
using attn::testing::max_abs_diff;

std::string fixture(const std::string& name) {
  return std::string(ATTN_TEST_FIXTURES) + "/python/" + name;
}

// A dict of tensors written by torch.save in Python.
c10::Dict<c10::IValue, c10::IValue> load_python_dict(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  return torch::pickle_load(bytes).toGenericDict();
}

// A file removed when the test ends.
class TemporaryFile {
 public:
  explicit TemporaryFile(const std::string& name)
      : path_(::testing::TempDir() + "attn_" + name) {}
  ~TemporaryFile() { std::remove(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

void randomise(torch::nn::Module& module) {
  torch::NoGradGuard no_grad;
  for (auto& p : module.parameters()) {
    p.normal_();
  }
}

struct PythonCase {
  const char* name;
  const char* prefix;
  MultiHeadAttentionOptions options;
};

class PythonStateDict : public ::testing::TestWithParam<PythonCase> {};

TEST_P(PythonStateDict, ReproducesTheOutputsPythonComputed) {
  const auto& c = GetParam();
  MultiHeadAttention mha(c.options);
  attn::load_pytorch_state_dict(*mha, fixture(std::string(c.name) + ".pt"), c.prefix);
  mha->eval();
  const auto expected = load_python_dict(fixture(std::string(c.name) + "_expected.pt"));
  const auto tensor = [&](const char* key) { return expected.at(key).toTensor(); };
  const auto query = tensor("query");
  // Python passed one tensor as query, key and value for self-attention.
  const bool self = torch::equal(query, tensor("key")) && torch::equal(query, tensor("value"));
  const auto key = self ? query : tensor("key");
  const auto value = self ? query : tensor("value");
  for (const bool need_weights : {true, false}) {
    torch::NoGradGuard no_grad;
    const auto [out, w] = mha(query, key, value, MultiHeadAttentionForwardOptions().need_weights(need_weights));
    EXPECT_LE(max_abs_diff(out, tensor("output")), 1e-6) << "need_weights=" << need_weights;
    if (need_weights) {
      EXPECT_LE(max_abs_diff(w, tensor("weights")), 1e-6);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Fixtures, PythonStateDict,
    ::testing::Values(
        PythonCase{"packed", "", MultiHeadAttentionOptions(16, 4)},
        PythonCase{"separate", "", MultiHeadAttentionOptions(16, 2).kdim(12).vdim(10)},
        PythonCase{"block_with_bias_kv", "attention",
                   MultiHeadAttentionOptions(16, 4).add_bias_kv(true).add_zero_attn(true)}),
    [](const ::testing::TestParamInfo<PythonCase>& info) { return std::string(info.param.name); });

TEST(PythonStateDict, RejectsMissingUnexpectedAndMisshapedEntries) {
  MultiHeadAttention packed(MultiHeadAttentionOptions(16, 4));
  const auto path = fixture("packed.pt");
  const auto before = packed->q_proj->weight.clone();
  MultiHeadAttention wider(MultiHeadAttentionOptions(32, 4));
  EXPECT_ATTN_ERROR(attn::load_pytorch_state_dict(*wider, path),
                    "load_pytorch_state_dict: entry 'in_proj_weight' in '" + path + "' must be [96, 32], got [48, 16]");
  MultiHeadAttention separate(MultiHeadAttentionOptions(16, 4).kdim(12).vdim(12));
  EXPECT_ATTN_ERROR(attn::load_pytorch_state_dict(*separate, path),
                    "load_pytorch_state_dict: unexpected entry 'in_proj_weight' in '" + path +
                        "'; an attn::MultiHeadAttention with these options takes exactly q_proj_weight, "
                        "k_proj_weight, v_proj_weight, in_proj_bias, out_proj.weight, out_proj.bias");
  MultiHeadAttention with_bias_kv(MultiHeadAttentionOptions(16, 4).add_bias_kv(true));
  EXPECT_ATTN_ERROR(attn::load_pytorch_state_dict(*with_bias_kv, path),
                    "load_pytorch_state_dict: missing entry 'bias_k' in '" + path + "'");
  MultiHeadAttention no_bias_kv(MultiHeadAttentionOptions(16, 4));
  const auto block = fixture("block_with_bias_kv.pt");
  EXPECT_ATTN_ERROR(attn::load_pytorch_state_dict(*no_bias_kv, block, "attention."),
                    "unexpected entry 'bias_k' in '" + block + "' (after the prefix 'attention.')");
  EXPECT_ATTN_ERROR(attn::load_pytorch_state_dict(*no_bias_kv, block),
                    "unexpected entry 'attention.bias_k' in '" + block +
                        "' (is the attention under the prefix 'attention.'?)");
  EXPECT_ATTN_ERROR(attn::load_pytorch_state_dict(*no_bias_kv, block, "decoder."),
                    "load_pytorch_state_dict: '" + block + "' has no tensor whose name starts with the prefix 'decoder.'");
  EXPECT_ATTN_ERROR(attn::load_pytorch_state_dict(*packed, fixture("missing.pt")),
                    "load_pytorch_state_dict: cannot open '" + fixture("missing.pt") + "' for reading");
  EXPECT_ATTN_ERROR(attn::load_pytorch_state_dict(*packed, fixture("generate.py")),
                    "load_pytorch_state_dict: '" + fixture("generate.py") +
                        "' is not a file written by Python's torch.save (zip format, PyTorch >= 1.6)");
  MultiHeadAttention grouped(MultiHeadAttentionOptions(16, 4).num_kv_heads(2));
  EXPECT_ATTN_ERROR(attn::load_pytorch_state_dict(*grouped, path),
                    "load_pytorch_state_dict: torch.nn.MultiheadAttention has no grouped-query form");
  MultiHeadAttention rotary(MultiHeadAttentionOptions(16, 4).rotary(attn::RotaryEmbeddingOptions(4)));
  EXPECT_ATTN_ERROR(attn::load_pytorch_state_dict(*rotary, path),
                    "load_pytorch_state_dict: torch.nn.MultiheadAttention has no rotary embeddings");
  EXPECT_TRUE(torch::equal(packed->q_proj->weight, before)); // failed loads change nothing
}

TEST(PythonStateDict, NamesAFileThatHoldsNoDict) {
  TemporaryFile file("tensor.pt");
  {
    const auto bytes = torch::pickle_save(torch::ones({2}));
    std::ofstream out(file.path(), std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  MultiHeadAttention mha(MultiHeadAttentionOptions(16, 4));
  EXPECT_ATTN_ERROR(attn::load_pytorch_state_dict(*mha, file.path()),
                    "load_pytorch_state_dict: '" + file.path() + "' must hold a state_dict (a dict of tensors), got a tensor");
}

TEST(PythonStateDict, DamagedFilesGiveErrorsNotCrashes) {
  // The fixture's pickle cut short at every byte, and with every byte
  // changed, written back into an archive with its storages: each load
  // either fails with a c10::Error or (for a harmless change) loads. Under
  // the sanitizer build this also checks every read stays in bounds.
  caffe2::serialize::PyTorchStreamReader original(fixture("packed.pt"));
  const auto [pickle_data, pickle_size] = original.getRecord("data.pkl");
  const std::string pickle(static_cast<const char*>(pickle_data.get()), pickle_size);
  TemporaryFile file("damaged.pt");
  const auto write_with_pickle = [&](const std::string& bytes) {
    caffe2::serialize::PyTorchStreamWriter writer(file.path());
    writer.writeRecord("data.pkl", bytes.data(), bytes.size());
    for (const auto& name : original.getAllRecords()) {
      if (name.rfind("data/", 0) == 0) {
        const auto [data, size] = original.getRecord(name);
        writer.writeRecord(name, data.get(), size);
      }
    }
    writer.writeEndOfFile();
  };
  MultiHeadAttention mha(MultiHeadAttentionOptions(16, 4));
  for (size_t n = 0; n < pickle.size(); ++n) {
    write_with_pickle(pickle.substr(0, n));
    EXPECT_THROW(attn::load_pytorch_state_dict(*mha, file.path()), c10::Error) << "cut at " << n;
  }
  for (size_t i = 0; i < pickle.size(); ++i) {
    auto changed = pickle;
    changed[i] = static_cast<char>(changed[i] ^ 0x5a);
    write_with_pickle(changed);
    try {
      attn::load_pytorch_state_dict(*mha, file.path());
    } catch (const c10::Error&) {
      // the expected outcome for most bytes
    }
  }
}

TEST(Serialization, TorchSaveAndLoadRoundTripEveryParameterExactly) {
  torch::manual_seed(5);
  const auto options = MultiHeadAttentionOptions(32, 4)
                           .num_kv_heads(2)
                           .add_bias_kv(true)
                           .rotary(attn::RotaryEmbeddingOptions(4));
  MultiHeadAttention saved(options);
  randomise(*saved);
  TemporaryFile file("mha.pt");
  torch::save(saved, file.path());
  MultiHeadAttention loaded(options);
  torch::load(loaded, file.path());
  const auto expected = saved->named_parameters();
  ASSERT_EQ(loaded->named_parameters().size(), expected.size());
  for (const auto& p : loaded->named_parameters()) {
    EXPECT_TRUE(torch::equal(p.value(), expected[p.key()])) << p.key();
  }
  torch::NoGradGuard no_grad;
  const auto x = torch::randn({2, 5, 32});
  EXPECT_TRUE(torch::equal(std::get<0>(saved(x, x, x)), std::get<0>(loaded(x, x, x))));
}

TEST(Interop, WeightsRoundTripThroughTheBuiltin) {
  for (const int64_t kdim : {16, 12}) {
    SCOPED_TRACE(kdim);
    MultiHeadAttention ours(MultiHeadAttentionOptions(16, 2).kdim(kdim).vdim(kdim));
    torch::nn::MultiheadAttention builtin(torch::nn::MultiheadAttentionOptions(16, 2).kdim(kdim).vdim(kdim));
    MultiHeadAttention back(MultiHeadAttentionOptions(16, 2).kdim(kdim).vdim(kdim));
    {
      torch::NoGradGuard no_grad;
      for (auto& p : ours->parameters()) {
        p.normal_();
      }
    }
    attn::copy_weights(*ours, *builtin);
    attn::copy_weights(*builtin, *back);
    const auto expected = ours->named_parameters();
    for (const auto& p : back->named_parameters()) {
      EXPECT_TRUE(torch::equal(p.value(), expected[p.key()])) << p.key();
    }
  }
}

TEST(Interop, RejectsModulesOfDifferentShape) {
  MultiHeadAttention ours(MultiHeadAttentionOptions(16, 2));
  torch::nn::MultiheadAttention other_heads(torch::nn::MultiheadAttentionOptions(16, 4));
  EXPECT_ATTN_ERROR(attn::copy_weights(*other_heads, *ours),
      "copy_weights: modules differ; torch::nn::MultiheadAttention has embed_dim=16, num_heads=4");
  torch::nn::MultiheadAttention no_bias(torch::nn::MultiheadAttentionOptions(16, 2).bias(false));
  EXPECT_ATTN_ERROR(attn::copy_weights(*ours, *no_bias), "bias=0, add_bias_kv=0, add_zero_attn=0 but attn::MultiHeadAttention has");
  torch::nn::MultiheadAttention bias_kv(torch::nn::MultiheadAttentionOptions(16, 2).add_bias_kv(true));
  EXPECT_ATTN_ERROR(attn::copy_weights(*bias_kv, *ours), "add_bias_kv=1, add_zero_attn=0 but attn::MultiHeadAttention has");
}

TEST(Interop, BiasKvAndZeroAttnRoundTripThroughTheBuiltin) {
  const auto ours_options = MultiHeadAttentionOptions(16, 2).add_bias_kv(true).add_zero_attn(true);
  MultiHeadAttention ours(ours_options);
  randomise(*ours);
  torch::nn::MultiheadAttention builtin(torch::nn::MultiheadAttentionOptions(16, 2).add_bias_kv(true).add_zero_attn(true));
  MultiHeadAttention back(ours_options);
  attn::copy_weights(*ours, *builtin);
  EXPECT_TRUE(torch::equal(builtin->bias_k, ours->bias_k));
  attn::copy_weights(*builtin, *back);
  const auto expected = ours->named_parameters();
  for (const auto& p : back->named_parameters()) {
    EXPECT_TRUE(torch::equal(p.value(), expected[p.key()])) << p.key();
  }
}

} // namespace
