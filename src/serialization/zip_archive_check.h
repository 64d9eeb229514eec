#pragma once

// The zip archive of a torch.save file, checked before LibTorch's reader
// (caffe2::serialize::PyTorchStreamReader, over miniz) opens it.
//
// That reader trusts the archive more than a downloaded file deserves:
//
// - miniz allocates each record's claimed uncompressed size before
//   extracting it, and an array entry per claimed directory entry before
//   reading the directory: a few hundred bytes may claim 2^64 bytes (a
//   deflated record, which torch.save never writes) or 2^32 entries;
// - the reader's constructor opens the directory and then reads the
//   version record (and, from PyTorch 2.x, .data/serialization_id); when
//   one of them is missing, damaged or not a number, it throws without
//   closing the directory, and miniz's state (a few KB) is never freed.
//
// So the directory is found and read here exactly as miniz finds it, and
// the archive is refused unless every record claims at most the file's
// size, no two records share a name (miniz looks names up ignoring case),
// and the records the constructor reads are there, stored, intact (their
// CRC) and, for the version, a supported number.

#include <caffe2/serialize/read_adapter_interface.h>

#include <string>

namespace attn::detail {

// What is wrong with the zip archive that `source` reads, for the reader's
// error message; empty when LibTorch's reader may open it.
std::string zip_archive_problem(const caffe2::serialize::ReadAdapterInterface& source);

} // namespace attn::detail
