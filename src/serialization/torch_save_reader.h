#pragma once

// Reading the files Python's torch.save writes (the zip format of
// PyTorch >= 1.6), without Python: the archive's data.pkl is a pickle whose
// tensors point to raw storages stored next to it. LibTorch's own
// torch::pickle_load turns the OrderedDict of a state_dict into None, so
// this reader interprets the pickle itself: the protocol-2 opcodes that
// torch.save emits for dicts, tuples, lists, numbers, strings and tensors.
//
// PyTorch 1.6 to 2.x write the same pickle for a state_dict; 2.x adds
// records that this reader needs not (.format_version, .storage_alignment,
// .data/serialization_id: it finds records by name), one it checks
// (byteorder), and writes tensors of dtypes without a storage class (float8,
// uint16) with _rebuild_tensor_v3 over an UntypedStorage. Anything else
// (an opcode, a called global, a storage class or a dtype it does not
// know) is an error that names it: nothing is guessed.

#include <torch/types.h>

#include <cstddef>
#include <map>
#include <string>

namespace attn::detail {

// The tensors of the dict saved in `path` (a state_dict), by name, on the
// CPU. Non-tensor values are skipped. Errors are c10::Errors that start
// with `caller` and name the file; they come before anything is returned.
//
// The file is untrusted: every size it claims (a zip record's, a string's,
// a storage's) is checked against the bytes it holds before anything of
// that size is allocated, so a damaged or hostile file costs memory and
// time proportional to its size: its storages once more, and up to about
// 200 bytes per byte of pickle (each opcode may make an object), which for
// a state_dict is a few hundred bytes per tensor.
std::map<std::string, torch::Tensor> read_saved_tensor_dict(
    const std::string& path,
    const char* caller);

// The same from the `size` bytes of such a file at `data`, which stay
// owned by the caller; `name` stands for the file in errors.
std::map<std::string, torch::Tensor> read_saved_tensor_dict(
    const void* data,
    size_t size,
    const std::string& name,
    const char* caller);

} // namespace attn::detail
