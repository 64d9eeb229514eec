#pragma once

// The state_dict reader's fuzz input: how the bytes that libFuzzer mutates
// become a file for attn::detail::read_saved_tensor_dict. Shared by the
// fuzz target (fuzz/state_dict_fuzzer.cpp) and the GoogleTest that replays
// the seeds and regressions in the ordinary build
// (tests/test_fuzz_regressions.cpp).
//
// Two kinds of input:
//
//   a file:    an input that starts with "PK", as zip archives do, is a
//              whole file as read from disk (so any torch.save file is an
//              input as it is). Mostly exercises the zip directory check
//              and LibTorch's zip reader, which fails most mutations on
//              their CRC.
//   records:   any other input is a flags byte, then records separated by
//              kRecordSeparator: data.pkl, then the storages data/0,
//              data/1, ... They are written into a valid zip archive in
//              memory (with a byteorder record "little" when bit 0 of the
//              flags is set), so that every mutation of the pickle or a
//              storage reaches attn's own unpickler.

#include <cstddef>
#include <cstdint>
#include <string>

namespace attn::fuzz {

// Between the records of a records input (also in fuzz/state_dict.dict).
inline constexpr const char* kRecordSeparator = "\n--record--\n";

// The file that `data` stands for: itself, or the zip archive its records
// make.
std::string state_dict_file_of(const uint8_t* data, size_t size);

// Reads the file that `data` stands for from memory and checks that every
// tensor it returns lies inside memory that attn may read. Throws the
// reader's c10::Error for a file it refuses.
void read_state_dict_input(const uint8_t* data, size_t size);

} // namespace attn::fuzz
