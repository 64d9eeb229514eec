#pragma once

// Reading the files Python's torch.save writes (the zip format of
// PyTorch >= 1.6), without Python: the archive's data.pkl is a pickle whose
// tensors point to raw storages stored next to it. LibTorch's own
// torch::pickle_load turns the OrderedDict of a state_dict into None, so
// this reader interprets the pickle itself: the protocol-2 opcodes that
// torch.save emits for dicts, tuples, lists, numbers, strings and tensors.

#include <torch/types.h>

#include <map>
#include <string>

namespace attn::detail {

// The tensors of the dict saved in `path` (a state_dict), by name, on the
// CPU. Non-tensor values are skipped. Errors are c10::Errors that start
// with `caller` and name the file.
std::map<std::string, torch::Tensor> read_saved_tensor_dict(
    const std::string& path, const char* caller);

} // namespace attn::detail
