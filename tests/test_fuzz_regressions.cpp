// The fuzz targets' inputs in the ordinary build: every seed and every
// input that once made a target fail (fuzz/*/seeds, fuzz/*/regressions)
// goes through the same entry function as in the fuzzer, and must return
// normally or throw a c10::Error with a message. Each regression also has
// its expected outcome here. scripts/fuzz.sh runs the same inputs, and new
// ones, under AddressSanitizer and UBSan.

#include "entry_points_input.h"
#include "serialization/torch_save_reader.h"
#include "state_dict_input.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;

const fs::path kFuzzFolder = ATTN_FUZZ_FOLDER;

std::vector<fs::path> files_in(const fs::path& folder) {
  std::vector<fs::path> files;
  if (fs::is_directory(folder)) {
    for (const auto& entry : fs::directory_iterator(folder)) {
      if (entry.is_regular_file()) {
        files.push_back(entry.path());
      }
    }
  }
  std::sort(files.begin(), files.end());
  return files;
}

std::string contents_of(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// The message of the c10::Error that `run` throws ("" when it returns);
// any other exception fails the test.
template <typename Run>
std::string refusal_of(const Run& run) {
  try {
    run();
  } catch (const c10::Error& error) {
    const std::string message = error.what_without_backtrace();
    EXPECT_FALSE(message.empty()) << "a c10::Error without a message";
    return message.empty() ? "(empty message)" : message;
  } catch (const std::exception& error) {
    ADD_FAILURE() << "an exception that is not a c10::Error: " << error.what();
    return error.what();
  }
  return "";
}

std::string read_state_dict(const std::string& input) {
  return refusal_of([&] {
    attn::fuzz::read_state_dict_input(reinterpret_cast<const uint8_t*>(input.data()), input.size());
  });
}

std::string run_entry_points(const std::string& input) {
  return refusal_of([&] {
    attn::fuzz::run_entry_points_input(
        reinterpret_cast<const uint8_t*>(input.data()), input.size());
  });
}

// One test per input file: "<target>/<folder>/<name>".
struct Input {
  std::string target; // state_dict or entry_points
  fs::path path;
};

std::vector<Input> inputs_of(const std::string& target) {
  std::vector<Input> inputs;
  for (const char* folder : {"seeds", "regressions"}) {
    for (const auto& path : files_in(kFuzzFolder / target / folder)) {
      inputs.push_back({target, path});
    }
  }
  return inputs;
}

std::string test_name(const ::testing::TestParamInfo<Input>& info) {
  auto name = info.param.path.parent_path().filename().string() + "_" +
      info.param.path.filename().string();
  std::replace_if(
      name.begin(), name.end(), [](unsigned char c) { return !std::isalnum(c); }, '_');
  return name;
}

class StateDictFuzzInput : public ::testing::TestWithParam<Input> {};

TEST_P(StateDictFuzzInput, ReturnsOrThrowsATorchErrorWithAMessage) {
  read_state_dict(contents_of(GetParam().path));
}

INSTANTIATE_TEST_SUITE_P(
    Files,
    StateDictFuzzInput,
    ::testing::ValuesIn(inputs_of("state_dict")),
    test_name);

class EntryPointsFuzzInput : public ::testing::TestWithParam<Input> {};

TEST_P(EntryPointsFuzzInput, ReturnsOrThrowsATorchErrorWithAMessage) {
  run_entry_points(contents_of(GetParam().path));
}

INSTANTIATE_TEST_SUITE_P(
    Files,
    EntryPointsFuzzInput,
    ::testing::ValuesIn(inputs_of("entry_points")),
    test_name);

// What each regression input does since its fix: "" loads or returns,
// anything else is part of the c10::Error's message.
const std::map<std::string, std::string> kExpectedOutcomes = {
    // state_dict
    {"empty_storage_copied_from_null", ""},
    {"reader_constructor_fails_after_opening_the_zip", "no version record"},
    {"list_holding_itself", "must hold a state_dict (a dict of tensors), got a list"},
    {"lists_nested_100000_deep", "must hold a state_dict (a dict of tensors), got a list"},
    {"deflated_record_claiming_4_gb", "claims 4294967280 bytes, more than the whole file's"},
    {"version_record_not_a_number", "its version record holds 'x"},
    {"version_record_out_of_range", "its version record holds '99999999999999999999999"},
    {"stored_record_read_into_a_null_buffer", ""},
    // entry_points
    {"values_of_width_zero_offset_a_null_pointer", ""},
    {"rotary_offset_near_2_62_overflows_table_length", "positions must stay within 2^53"},
    {"grouped_heads_of_empty_sequences_index_every_head", ""},
    {"half_gradients_in_the_subnormal_range", ""},    // the oracle's tolerance, not attn
    {"no_query_heads_against_grouped_key_heads", ""}, // the math path's group of 0 heads
    {"kv_cache_empty_batch_length", ""}, // a cache of 0 sequences still counts its tokens
    // no keys, values 33 wide: offset by AVX2's vectors, a null pointer
    {"no_keys_and_values_33_wide_offset_a_null_pointer_on_avx2", ""},
};

TEST(FuzzInputs, EveryFolderHoldsInputs) {
  // An empty or missing folder would leave the suites above with nothing
  // to run, and passing.
  for (const std::string target : {"state_dict", "entry_points"}) {
    for (const char* folder : {"seeds", "regressions"}) {
      const auto path = kFuzzFolder / target / folder;
      EXPECT_FALSE(files_in(path).empty()) << path << " holds no fuzz inputs";
    }
  }
}

TEST(FuzzRegressions, EachHasItsExpectedOutcome) {
  size_t regressions = 0;
  for (const std::string target : {"state_dict", "entry_points"}) {
    for (const auto& path : files_in(kFuzzFolder / target / "regressions")) {
      ++regressions;
      const auto name = path.filename().string();
      SCOPED_TRACE(target + "/" + name);
      const auto expected = kExpectedOutcomes.find(name);
      ASSERT_NE(expected, kExpectedOutcomes.end())
          << "a regression input without an expected outcome in kExpectedOutcomes";
      const auto input = contents_of(path);
      const auto refusal = target == "state_dict" ? read_state_dict(input)
                                                  : run_entry_points(input);
      if (expected->second.empty()) {
        EXPECT_EQ(refusal, "");
      } else {
        EXPECT_NE(refusal.find(expected->second), std::string::npos) << refusal;
      }
    }
  }
  EXPECT_EQ(regressions, kExpectedOutcomes.size())
      << "an expected outcome in kExpectedOutcomes without its input file";
}

TEST(FuzzSeeds, EveryFileThatTorchSaveWroteLoadsAsItsRecordsDo) {
  // Each seed NAME.pt was written by Python's torch.save, and
  // NAME-protocol2.records holds its pickle and storages, which the fuzz
  // input writes into an archive of its own: both must load, to the same
  // tensors, but for float8 (a dtype LibTorch 1.13 lacks).
  int files = 0;
  for (const auto& path : files_in(kFuzzFolder / "state_dict" / "seeds")) {
    if (path.extension() != ".pt") {
      continue;
    }
    const auto stem = path.stem().string();
    SCOPED_TRACE(stem);
    ++files;
    const auto file = contents_of(path);
    const auto records = contents_of(path.parent_path() / (stem + "-protocol2.records"));
    const auto read = [](const std::string& input) {
      const auto bytes = attn::fuzz::state_dict_file_of(
          reinterpret_cast<const uint8_t*>(input.data()), input.size());
      return attn::detail::read_saved_tensor_dict(bytes.data(), bytes.size(), "seed", "test");
    };
    if (stem.find("without_storage_class") != std::string::npos) {
      EXPECT_THROW(read(file), c10::Error);
      continue;
    }
    const auto from_file = read(file), from_records = read(records);
    EXPECT_FALSE(from_file.empty());
    ASSERT_EQ(from_file.size(), from_records.size());
    for (const auto& [name, tensor] : from_file) {
      EXPECT_TRUE(torch::equal(tensor, from_records.at(name))) << name;
    }
  }
  EXPECT_GE(files, 10) << "the seeds of fuzz/state_dict/seeds are missing";
}

} // namespace
