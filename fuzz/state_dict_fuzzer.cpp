// libFuzzer target: attn's reader of Python's torch.save files
// (src/serialization/torch_save_reader.cpp), fed the inputs that state_dict_input.h
// describes. A refusal is a c10::Error with a message; anything else
// (another exception, a crash, a sanitizer report, a leak, a timeout or
// running out of memory) is a finding.

#include "fuzz_support.h"
#include "state_dict_input.h"

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  attn::fuzz::prepare_libtorch();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  attn::fuzz::expect_success_or_torch_error([&] { attn::fuzz::read_state_dict_input(data, size); });
  return 0;
}
