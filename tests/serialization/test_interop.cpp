// Weights in and out of attn::MultiHeadAttention (src/serialization/interop.cpp,
// src/serialization/torch_save_reader.cpp): exchange with
// torch::nn::MultiheadAttention, state_dicts written by Python PyTorch
// (fixtures/python, with the outputs Python computed, and the same files
// written at build time by ATTN_TEST_PYTHON's torch), and torch::save /
// torch::load of our own modules.

#include "bad_input_catalogue.h"
#include "serialization/torch_save_reader.h"
#include "test_support.h"

#include <attn/interop.h>
#include <attn/modules/multi_head_attention.h>

#include <caffe2/serialize/inline_container.h>
#include <torch/serialize.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <string>
#include <tuple>

namespace {

using attn::MultiHeadAttention;
using attn::MultiHeadAttentionForwardOptions;
using attn::MultiHeadAttentionOptions;
using attn::testing::Tolerance;

std::string fixture(const std::string& name) {
  return std::string(ATTN_TEST_FIXTURES) + "/python/" + name;
}

// A folder of the files generate.py writes: the committed ones, or those
// written at build time by the torch of ATTN_TEST_PYTHON (none: "").
struct FixtureFolder {
  const char* name;
  const char* path;
};
const FixtureFolder kCommittedFixtures{"committed", ATTN_TEST_FIXTURES "/python"};
const FixtureFolder kGeneratedFixtures{"generated", ATTN_TEST_GENERATED_FIXTURES};

// The torch.__version__ that wrote a folder's files.
std::string torch_version_of(const std::string& folder) {
  std::ifstream file(folder + "/version.txt");
  std::string version;
  std::getline(file, version);
  return version.empty() ? "(no readable version.txt)" : version;
}

// A dict of tensors written by torch.save in Python.
c10::Dict<c10::IValue, c10::IValue> load_python_dict(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  const std::vector<char> bytes(
      (std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  return torch::pickle_load(bytes).toGenericDict();
}

// A file removed when the test ends.
class TemporaryFile {
 public:
  explicit TemporaryFile(const std::string& name) : path_(::testing::TempDir() + "attn_" + name) {}
  ~TemporaryFile() { std::remove(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A torch.save archive taken apart, to be changed and written back: its
// pickle and the records beside it (data/<key> storages, byteorder, ...).
struct Archive {
  std::string pickle;
  std::map<std::string, std::string> records;

  // data.pkl and the storages, the records that every version writes.
  static Archive read(const std::string& path) {
    caffe2::serialize::PyTorchStreamReader reader(path);
    Archive archive;
    for (const auto& name : reader.getAllRecords()) {
      const auto [data, size] = reader.getRecord(name);
      std::string bytes(static_cast<const char*>(data.get()), size);
      if (name == "data.pkl") {
        archive.pickle = std::move(bytes);
      } else if (name.rfind("data/", 0) == 0) {
        archive.records[name] = std::move(bytes);
      }
    }
    return archive;
  }

  void write(const std::string& path) const {
    caffe2::serialize::PyTorchStreamWriter writer(path);
    writer.writeRecord("data.pkl", pickle.data(), pickle.size());
    for (const auto& [name, bytes] : records) {
      writer.writeRecord(name, bytes.data(), bytes.size());
    }
    writer.writeEndOfFile();
  }
};

// `text` with its only occurrence of `from` replaced by `to`.
std::string replace_once(std::string text, const std::string& from, const std::string& to) {
  const auto at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  EXPECT_EQ(text.find(from, at + 1), std::string::npos) << from;
  return at == std::string::npos ? text : text.replace(at, from.size(), to);
}

// Pieces of a protocol-2 pickle, as Python's pickle module writes them.
std::string pickle_global(const std::string& module, const std::string& name) {
  return "c" + module + "\n" + name + "\n"; // GLOBAL
}
std::string pickle_string(const std::string& text) {
  std::string length(4, '\0'); // BINUNICODE: a little-endian uint32 length
  for (size_t i = 0; i < 4; ++i) {
    length[i] = static_cast<char>((text.size() >> (8 * i)) & 0xff);
  }
  return "X" + length + text;
}
std::string pickle_small_int(uint8_t value) {
  return std::string("K") + static_cast<char>(value); // BININT1
}

// The archive that PyTorch 2.x's torch.save writes for {name: tensor}, a
// 1-D tensor whose dtype has no storage class: _rebuild_tensor_v3 over an
// UntypedStorage of the tensor's bytes, naming `dtype` (such as
// torch.float8_e4m3fn). At most 255 bytes.
Archive archive_naming_dtype(
    const std::string& name,
    const torch::Tensor& tensor,
    const std::string& dtype) {
  const auto numel = static_cast<uint8_t>(tensor.numel());
  const auto bytes = static_cast<uint8_t>(tensor.numel() * tensor.element_size());
  const auto dot = dtype.find('.');
  Archive archive;
  archive.pickle = "\x80\x02}" + pickle_string(name) +
      pickle_global("torch._utils", "_rebuild_tensor_v3") + "((" + pickle_string("storage") +
      pickle_global("torch.storage", "UntypedStorage") + pickle_string("0") + pickle_string("cpu") +
      pickle_small_int(bytes) + "tQ" + pickle_small_int(0) + pickle_small_int(numel) + "\x85" +
      pickle_small_int(1) + "\x85" + "\x89" + pickle_global("collections", "OrderedDict") + ")R" +
      pickle_global(dtype.substr(0, dot), dtype.substr(dot + 1)) + "tRs.";
  archive.records["data/0"] = std::string(static_cast<const char*>(tensor.data_ptr()), bytes);
  return archive;
}

// Every parameter, copied: what a failed load must leave as it was.
std::map<std::string, torch::Tensor> parameters_of(const torch::nn::Module& module) {
  std::map<std::string, torch::Tensor> copies;
  for (const auto& p : module.named_parameters()) {
    copies[p.key()] = p.value().clone();
  }
  return copies;
}

void expect_parameters(
    const torch::nn::Module& module,
    const std::map<std::string, torch::Tensor>& expected) {
  for (const auto& p : module.named_parameters()) {
    EXPECT_TRUE(torch::equal(p.value(), expected.at(p.key()))) << p.key() << " changed";
  }
}

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

class PythonStateDict : public ::testing::TestWithParam<std::tuple<FixtureFolder, PythonCase>> {};

TEST_P(PythonStateDict, ReproducesTheOutputsPythonComputed) {
  const auto& [folder, c] = GetParam();
  if (std::string(folder.path).empty()) {
    GTEST_SKIP() << "ATTN_TEST_PYTHON is not set: configure with -DATTN_TEST_PYTHON=<a Python "
                    "that can import torch> to test the files that its torch.save writes";
  }
  const auto version = torch_version_of(folder.path);
  RecordProperty("torch_version", version);
  SCOPED_TRACE("files written by PyTorch " + version + " in " + folder.path);
  const auto file = std::string(folder.path) + "/" + c.name;
  MultiHeadAttention mha(c.options);
  attn::load_pytorch_state_dict(*mha, file + ".pt", c.prefix);
  mha->eval();
  const auto expected = load_python_dict(file + "_expected.pt");
  const auto tensor = [&](const char* key) { return expected.at(key).toTensor(); };
  const auto query = tensor("query");
  // Python passed one tensor as query, key and value for self-attention.
  const bool self = torch::equal(query, tensor("key")) && torch::equal(query, tensor("value"));
  const auto key = self ? query : tensor("key");
  const auto value = self ? query : tensor("value");
  for (const bool need_weights : {true, false}) {
    torch::NoGradGuard no_grad;
    const auto [out, w] = mha(
        query, key, value, MultiHeadAttentionForwardOptions().need_weights(need_weights));
    EXPECT_CLOSE(out, tensor("output"), Tolerance{1e-6}) << "need_weights=" << need_weights;
    if (need_weights) {
      EXPECT_CLOSE(w, tensor("weights"), Tolerance{1e-6});
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Fixtures,
    PythonStateDict,
    ::testing::Combine(
        ::testing::Values(kCommittedFixtures, kGeneratedFixtures),
        ::testing::Values(
            PythonCase{"packed", "", MultiHeadAttentionOptions(16, 4)},
            PythonCase{"separate", "", MultiHeadAttentionOptions(16, 2).kdim(12).vdim(10)},
            PythonCase{
                "block_with_bias_kv", "attention",
                MultiHeadAttentionOptions(16, 4).add_bias_kv(true).add_zero_attn(true)})),
    [](const ::testing::TestParamInfo<PythonStateDict::ParamType>& info) {
      return std::string(std::get<0>(info.param).name) + "_" + std::get<1>(info.param).name;
    });

TEST(PythonStateDict, RejectsMissingUnexpectedAndMisshapedEntries) {
  MultiHeadAttention packed(MultiHeadAttentionOptions(16, 4));
  const auto path = fixture("packed.pt");
  const auto before = packed->q_proj->weight.clone();
  MultiHeadAttention wider(MultiHeadAttentionOptions(32, 4));
  EXPECT_ATTN_ERROR(
      attn::load_pytorch_state_dict(*wider, path),
      "load_pytorch_state_dict: entry 'in_proj_weight' in '" + path +
          "' must be [96, 32], got [48, 16]");
  MultiHeadAttention separate(MultiHeadAttentionOptions(16, 4).kdim(12).vdim(12));
  EXPECT_ATTN_ERROR(
      attn::load_pytorch_state_dict(*separate, path),
      "load_pytorch_state_dict: unexpected entry 'in_proj_weight' in '" + path +
          "'; an attn::MultiHeadAttention with these options takes exactly q_proj_weight, "
          "k_proj_weight, v_proj_weight, in_proj_bias, out_proj.weight, out_proj.bias");
  MultiHeadAttention with_bias_kv(MultiHeadAttentionOptions(16, 4).add_bias_kv(true));
  EXPECT_ATTN_ERROR(
      attn::load_pytorch_state_dict(*with_bias_kv, path),
      "load_pytorch_state_dict: missing entry 'bias_k' in '" + path + "'");
  MultiHeadAttention no_bias_kv(MultiHeadAttentionOptions(16, 4));
  const auto block = fixture("block_with_bias_kv.pt");
  EXPECT_ATTN_ERROR(
      attn::load_pytorch_state_dict(*no_bias_kv, block, "attention."),
      "unexpected entry 'bias_k' in '" + block + "' (after the prefix 'attention.')");
  EXPECT_ATTN_ERROR(
      attn::load_pytorch_state_dict(*no_bias_kv, block),
      "unexpected entry 'attention.bias_k' in '" + block +
          "' (is the attention under the prefix 'attention.'?)");
  EXPECT_ATTN_ERROR(
      attn::load_pytorch_state_dict(*no_bias_kv, block, "decoder."),
      "load_pytorch_state_dict: '" + block +
          "' has no tensor whose name starts with the prefix 'decoder.'");
  EXPECT_ATTN_ERROR(
      attn::load_pytorch_state_dict(*packed, fixture("missing.pt")),
      "load_pytorch_state_dict: cannot open '" + fixture("missing.pt") + "' for reading");
  EXPECT_ATTN_ERROR(
      attn::load_pytorch_state_dict(*packed, fixture("generate.py")),
      "load_pytorch_state_dict: '" + fixture("generate.py") +
          "' is not a file written by Python's torch.save (zip format, PyTorch >= 1.6)");
  MultiHeadAttention grouped(MultiHeadAttentionOptions(16, 4).num_kv_heads(2));
  EXPECT_ATTN_ERROR(
      attn::load_pytorch_state_dict(*grouped, path),
      "load_pytorch_state_dict: torch.nn.MultiheadAttention has no grouped-query form");
  MultiHeadAttention rotary(
      MultiHeadAttentionOptions(16, 4).rotary(attn::RotaryEmbeddingOptions(4)));
  EXPECT_ATTN_ERROR(
      attn::load_pytorch_state_dict(*rotary, path),
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
  EXPECT_ATTN_ERROR(
      attn::load_pytorch_state_dict(*mha, file.path()),
      "load_pytorch_state_dict: '" + file.path() +
          "' must hold a state_dict (a dict of tensors), got a tensor");
}

struct DamagedCase {
  const char* name;
  std::function<Archive()> original;
};

class DamagedStateDict : public ::testing::TestWithParam<DamagedCase> {};

TEST_P(DamagedStateDict, GivesErrorsNotCrashes) {
  // The pickle cut short at every byte, and with every byte changed,
  // written back into an archive with its storages: each load either fails
  // with a c10::Error or (for a harmless change) loads. Under the sanitizer
  // build this also checks every read stays in bounds.
  const auto original = GetParam().original();
  const auto& pickle = original.pickle;
  TemporaryFile file("damaged.pt");
  const auto write_with_pickle = [&](const std::string& bytes) {
    auto damaged = original;
    damaged.pickle = bytes;
    damaged.write(file.path());
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

INSTANTIATE_TEST_SUITE_P(
    Files,
    DamagedStateDict,
    ::testing::Values(
        DamagedCase{"packed", [] { return Archive::read(fixture("packed.pt")); }},
        DamagedCase{
            "tensor_naming_its_dtype",
            [] {
              return archive_naming_dtype("w", torch::arange(6, torch::kFloat), "torch.float32");
            }}),
    [](const ::testing::TestParamInfo<DamagedCase>& info) { return std::string(info.param.name); });

TEST(PythonStateDict, AFailedLoadLeavesEveryParameterAsItWas) {
  // The file's in_proj_weight and in_proj_bias fit this module; the
  // bias_k that follows them is missing.
  MultiHeadAttention mha(MultiHeadAttentionOptions(16, 4).add_bias_kv(true));
  const auto before = parameters_of(*mha);
  EXPECT_ATTN_ERROR(
      attn::load_pytorch_state_dict(*mha, fixture("packed.pt")), "missing entry 'bias_k'");
  expect_parameters(*mha, before);
}

TEST(PythonStateDict, ReadsTheRecordsThatPyTorch2Adds) {
  // PyTorch 2.x's archive holds the same pickle and storages as 1.13's,
  // and these records besides.
  auto archive = Archive::read(fixture("packed.pt"));
  archive.records[".format_version"] = "1";
  archive.records[".storage_alignment"] = "64";
  archive.records["byteorder"] = "little";
  TemporaryFile file("pytorch2.pt");
  archive.write(file.path());
  MultiHeadAttention expected(MultiHeadAttentionOptions(16, 4));
  attn::load_pytorch_state_dict(*expected, fixture("packed.pt"));
  MultiHeadAttention mha(MultiHeadAttentionOptions(16, 4));
  attn::load_pytorch_state_dict(*mha, file.path());
  expect_parameters(*mha, parameters_of(*expected));
}

TEST(PythonStateDict, ReadsTensorsThatNameTheirDtype) {
  // PyTorch 2.x writes a tensor of a dtype without a storage class with
  // _rebuild_tensor_v3 over the storage's bytes; a later PyTorch may write
  // every tensor so.
  const auto values = torch::tensor({1.5, -2.0, 3.25}, torch::kDouble);
  TemporaryFile file("v3.pt");
  for (const auto& [dtype, name] :
       {std::pair{torch::kFloat, "torch.float32"}, std::pair{torch::kDouble, "torch.float64"},
        std::pair{torch::kShort, "torch.int16"}}) {
    SCOPED_TRACE(name);
    const auto tensor = values.to(dtype);
    archive_naming_dtype("w", tensor, name).write(file.path());
    const auto read = attn::detail::read_saved_tensor_dict(file.path(), "test");
    EXPECT_TRUE(torch::equal(read.at("w"), tensor));
  }
}

TEST(PythonStateDict, NamesTheFileAndWhatItHoldsThatTheReaderDoesNotKnow) {
  // packed.pt as a newer PyTorch might write it: each load fails, naming
  // the file and the unknown, before the module changes.
  struct Case {
    const char* change;
    std::function<void(Archive&)> apply;
    std::string error; // after "load_pytorch_state_dict: '<file>' "
  };
  const std::vector<Case> cases = {
      {"an opcode of pickle protocol 4 (EMPTY_SET) after PROTO",
       [](Archive& a) { a.pickle.insert(a.pickle.begin() + 2, '\x8f'); },
       "uses pickle opcode 0x8f at byte 2 of data.pkl, which this reader does not know; "
       "expected the opcodes torch.save writes for a state_dict of tensors"},
      {"pickle protocol 6", [](Archive& a) { a.pickle[1] = 6; },
       "uses pickle protocol 6, which this reader does not know; expected protocol 2 to 5"},
      {"a storage class for float8",
       [](Archive& a) {
         a.pickle = replace_once(
             a.pickle, "torch\nFloatStorage\n", "torch\nFloat8_e4m3fnStorage\n");
       },
       "uses storage type torch.Float8_e4m3fnStorage, which this reader does not know; expected "
       "torch.BFloat16Storage, torch.BoolStorage, torch.ByteStorage, torch.CharStorage, "
       "torch.ComplexDoubleStorage, torch.ComplexFloatStorage, torch.DoubleStorage, "
       "torch.FloatStorage, torch.HalfStorage, torch.IntStorage, torch.LongStorage, "
       "torch.ShortStorage or torch.storage.UntypedStorage"},
      {"another rebuild function",
       [](Archive& a) {
         a.pickle = replace_once(a.pickle, "_rebuild_tensor_v2\n", "_rebuild_wrapper_subclass\n");
       },
       "uses torch._utils._rebuild_wrapper_subclass, which this reader does not know; expected a "
       "call of collections.OrderedDict, torch._utils._rebuild_parameter, "
       "torch._utils._rebuild_tensor, torch._utils._rebuild_tensor_v2 or "
       "torch._utils._rebuild_tensor_v3"},
      {"a tensor of a dtype LibTorch 1.13 lacks",
       [](Archive& a) {
         a = archive_naming_dtype(
             "in_proj_weight", torch::zeros({4}, torch::kByte), "torch.float8_e4m3fn");
       },
       "uses dtype torch.float8_e4m3fn, which this reader does not know; expected "
       "torch.bfloat16, torch.bool, torch.complex128, torch.complex64, torch.float16, "
       "torch.float32, torch.float64, torch.int16, torch.int32, torch.int64, torch.int8 or "
       "torch.uint8"},
      {"storages saved on a big-endian machine", [](Archive& a) { a.records["byteorder"] = "big"; },
       "holds storages in byte order 'big' (its byteorder record); this reader expected 'little'"},
  };
  const auto original = Archive::read(fixture("packed.pt"));
  MultiHeadAttention mha(MultiHeadAttentionOptions(16, 4));
  const auto before = parameters_of(*mha);
  TemporaryFile file("unknown.pt");
  for (const auto& c : cases) {
    SCOPED_TRACE(c.change);
    auto changed = original;
    c.apply(changed);
    changed.write(file.path());
    EXPECT_ATTN_ERROR(
        attn::load_pytorch_state_dict(*mha, file.path()),
        "load_pytorch_state_dict: '" + file.path() + "' " + c.error);
    expect_parameters(*mha, before);
  }
}

TEST(Serialization, TorchSaveAndLoadRoundTripEveryParameterExactly) {
  torch::manual_seed(5);
  const auto options = MultiHeadAttentionOptions(32, 4).num_kv_heads(2).add_bias_kv(true).rotary(
      attn::RotaryEmbeddingOptions(4));
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
    torch::nn::MultiheadAttention builtin(
        torch::nn::MultiheadAttentionOptions(16, 2).kdim(kdim).vdim(kdim));
    MultiHeadAttention back(MultiHeadAttentionOptions(16, 2).kdim(kdim).vdim(kdim));
    randomise(*ours);
    attn::copy_weights(*ours, *builtin);
    attn::copy_weights(*builtin, *back);
    const auto expected = ours->named_parameters();
    for (const auto& p : back->named_parameters()) {
      EXPECT_TRUE(torch::equal(p.value(), expected[p.key()])) << p.key();
    }
  }
}

TEST(Interop, RejectsModulesOfDifferentShape) {
  attn::testing::expect_catalogued_outcomes(attn::testing::copy_weights_cases());
}

TEST(Interop, BiasKvAndZeroAttnRoundTripThroughTheBuiltin) {
  const auto ours_options = MultiHeadAttentionOptions(16, 2).add_bias_kv(true).add_zero_attn(true);
  MultiHeadAttention ours(ours_options);
  randomise(*ours);
  torch::nn::MultiheadAttention builtin(
      torch::nn::MultiheadAttentionOptions(16, 2).add_bias_kv(true).add_zero_attn(true));
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
