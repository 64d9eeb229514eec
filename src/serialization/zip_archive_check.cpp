#include "serialization/zip_archive_check.h"

#include <c10/util/StringUtil.h>
#include <caffe2/serialize/versions.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <vector>

namespace attn::detail {
namespace {

using caffe2::serialize::ReadAdapterInterface;

// Signatures, sizes and field values of the zip format (PKWARE's
// APPNOTE.TXT) that miniz reads.
constexpr uint64_t kEndSignature = 0x06054b50;
constexpr uint64_t kZip64LocatorSignature = 0x07064b50;
constexpr uint64_t kZip64EndSignature = 0x06064b50;
constexpr uint64_t kEntrySignature = 0x02014b50;
constexpr uint64_t kLocalHeaderSignature = 0x04034b50;
constexpr uint64_t kEndSize = 22, kZip64LocatorSize = 20, kZip64EndSize = 56;
constexpr uint64_t kEntrySize = 46, kLocalHeaderSize = 30;
constexpr uint64_t kLongestComment = 0xffff;
// A 32-bit size or offset of this value is in the entry's zip64 field.
constexpr uint64_t kInZip64Field = 0xffffffff;
constexpr uint64_t kZip64FieldId = 1;
// Encrypted, patched or strongly encrypted: miniz extracts none of them.
constexpr uint64_t kUnextractableFlags = 0x1 | 0x20 | 0x40;
// An MS-DOS directory, which miniz "extracts" without reading its bytes.
constexpr uint64_t kDirectoryAttribute = 0x10;
// The records the reader's constructor reads hold a few characters.
constexpr uint64_t kLongestConstructorRecord = 64;

// `n` bytes at `position` of `source`, or nothing when the file does not
// hold them all.
std::optional<std::string> read_at(
    const ReadAdapterInterface& source,
    uint64_t position,
    uint64_t n) {
  const uint64_t size = source.size();
  if (position > size || n > size - position) {
    return std::nullopt;
  }
  std::string bytes(n, '\0');
  if (n > 0 && source.read(position, bytes.data(), n, "checking the zip archive") != n) {
    return std::nullopt;
  }
  return bytes;
}

// The little-endian unsigned integer of `width` bytes at `at` of `bytes`;
// the caller has checked that they are there.
uint64_t little_endian(const std::string& bytes, uint64_t at, int width) {
  uint64_t value = 0;
  for (int i = 0; i < width; ++i) {
    value |= static_cast<uint64_t>(static_cast<unsigned char>(bytes[at + i])) << (8 * i);
  }
  return value;
}

// The CRC-32 that zip records carry (reflected, polynomial 0xedb88320).
uint64_t crc32(const std::string& bytes) {
  uint32_t crc = 0xffffffff;
  for (const char byte : bytes) {
    crc ^= static_cast<unsigned char>(byte);
    for (int bit = 0; bit < 8; ++bit) {
      crc = (crc >> 1) ^ (0xedb88320 & (0u - (crc & 1)));
    }
  }
  return ~crc;
}

// ASCII letters in lower case, as miniz compares record names.
std::string lowercase(std::string text) {
  for (auto& c : text) {
    if (c >= 'A' && c <= 'Z') {
      c = static_cast<char>(c - 'A' + 'a');
    }
  }
  return text;
}

struct Directory {
  uint64_t offset = 0, size = 0, entries = 0;
};

// The central directory that miniz reads: named by the last end record
// with room for its 22 bytes before the end of the file, or by the zip64
// end record that a locator just before that one points to.
std::optional<Directory> find_directory(const ReadAdapterInterface& source) {
  const uint64_t size = source.size();
  if (size < kEndSize) {
    return std::nullopt;
  }
  const uint64_t tail_start = size - std::min(size, kEndSize + kLongestComment);
  const auto tail = read_at(source, tail_start, size - tail_start);
  if (!tail) {
    return std::nullopt;
  }
  uint64_t at = tail->size() - kEndSize + 1;
  do {
    if (at-- == 0) {
      return std::nullopt;
    }
  } while (little_endian(*tail, at, 4) != kEndSignature);
  Directory directory{
      little_endian(*tail, at + 16, 4), little_endian(*tail, at + 12, 4),
      little_endian(*tail, at + 10, 2)};
  const uint64_t end = tail_start + at;
  if (end < kZip64LocatorSize + kZip64EndSize) {
    return directory;
  }
  const auto locator = read_at(source, end - kZip64LocatorSize, kZip64LocatorSize);
  if (!locator || little_endian(*locator, 0, 4) != kZip64LocatorSignature) {
    return directory;
  }
  const auto record = read_at(source, little_endian(*locator, 8, 8), kZip64EndSize);
  if (!record) {
    return std::nullopt; // miniz refuses a locator that points outside the file
  }
  if (little_endian(*record, 0, 4) == kZip64EndSignature) {
    directory = {
        little_endian(*record, 48, 8), little_endian(*record, 40, 8),
        little_endian(*record, 32, 8)};
  }
  return directory;
}

// A record as its directory entry describes it.
struct Record {
  std::string name;
  uint64_t method = 0, flags = 0, crc = 0, external_attributes = 0;
  uint64_t compressed_size = 0, uncompressed_size = 0, local_header = 0;
};

// Replaces the fields of `record` that hold 0xffffffff by the values of
// the zip64 field among the entry's `extra` fields, in the order miniz
// reads them. False where miniz finds the extra fields damaged.
bool read_zip64_field(const std::string& extra, Record& record) {
  if (std::max({record.uncompressed_size, record.compressed_size, record.local_header}) !=
      kInZip64Field) {
    return true;
  }
  uint64_t at = 0;
  while (at < extra.size()) {
    if (extra.size() - at < 4) {
      return false;
    }
    const uint64_t id = little_endian(extra, at, 2), length = little_endian(extra, at + 2, 2);
    if (length > extra.size() - at - 4) {
      return false;
    }
    if (id == kZip64FieldId) {
      uint64_t value = at + 4;
      for (auto* field :
           {&record.uncompressed_size, &record.compressed_size, &record.local_header}) {
        if (*field == kInZip64Field) {
          if (value + 8 > at + 4 + length) {
            return false;
          }
          *field = little_endian(extra, value, 8);
          value += 8;
        }
      }
      return true;
    }
    at += 4 + length;
  }
  return true;
}

struct Records {
  std::vector<Record> records;
  std::string problem; // empty when the directory was read
};

// The records of the directory that `source` holds.
Records read_directory(const ReadAdapterInterface& source) {
  const uint64_t size = source.size();
  const auto directory = find_directory(source);
  if (!directory) {
    return {{}, "no zip directory found"};
  }
  if (directory->size > size || directory->offset > size - directory->size ||
      directory->entries > directory->size / kEntrySize) {
    return {
        {},
        c10::str(
            "its zip directory (", directory->entries, " entries in ", directory->size,
            " bytes at offset ", directory->offset, ") does not fit in the file's ", size,
            " bytes")};
  }
  const auto bytes = read_at(source, directory->offset, directory->size);
  if (!bytes) {
    return {{}, "its zip directory cannot be read"};
  }
  Records result;
  uint64_t at = 0;
  for (uint64_t entry = 0; entry < directory->entries; ++entry) {
    const auto damaged = c10::str("entry ", entry, " of its zip directory is damaged");
    if (bytes->size() - at < kEntrySize || little_endian(*bytes, at, 4) != kEntrySignature) {
      return {{}, damaged};
    }
    const uint64_t name_length = little_endian(*bytes, at + 28, 2);
    const uint64_t extra_length = little_endian(*bytes, at + 30, 2);
    const uint64_t length = kEntrySize + name_length + extra_length +
        little_endian(*bytes, at + 32, 2);
    if (length > bytes->size() - at) {
      return {{}, damaged};
    }
    Record record;
    record.name = bytes->substr(at + kEntrySize, name_length);
    record.flags = little_endian(*bytes, at + 8, 2);
    record.method = little_endian(*bytes, at + 10, 2);
    record.crc = little_endian(*bytes, at + 16, 4);
    record.compressed_size = little_endian(*bytes, at + 20, 4);
    record.uncompressed_size = little_endian(*bytes, at + 24, 4);
    record.external_attributes = little_endian(*bytes, at + 38, 4);
    record.local_header = little_endian(*bytes, at + 42, 4);
    // A name with a NUL would be cut short where LibTorch looks it up.
    if (record.name.find('\0') != std::string::npos ||
        !read_zip64_field(bytes->substr(at + kEntrySize + name_length, extra_length), record)) {
      return {{}, damaged};
    }
    result.records.push_back(std::move(record));
    at += length;
  }
  return result;
}

// The bytes that miniz extracts for `record` when the reader's constructor
// asks for it, or nothing where it would fail (or, for a directory,
// return bytes it never read). Only small stored records, as torch.save
// writes them, are read.
std::optional<std::string> read_constructor_record(
    const ReadAdapterInterface& source,
    const Record& record) {
  if (record.method != 0 || (record.flags & kUnextractableFlags) != 0 ||
      (record.external_attributes & kDirectoryAttribute) != 0 ||
      record.compressed_size != record.uncompressed_size || record.uncompressed_size == 0 ||
      record.uncompressed_size > kLongestConstructorRecord) {
    return std::nullopt;
  }
  const auto header = read_at(source, record.local_header, kLocalHeaderSize);
  if (!header || little_endian(*header, 0, 4) != kLocalHeaderSignature) {
    return std::nullopt;
  }
  const uint64_t data = record.local_header + kLocalHeaderSize + little_endian(*header, 26, 2) +
      little_endian(*header, 28, 2);
  auto bytes = read_at(source, data, record.uncompressed_size);
  if (!bytes || crc32(*bytes) != record.crc) {
    return std::nullopt;
  }
  return bytes;
}

// Whether the reader's constructor accepts `text` as the archive's format
// version: a number it supports, digits only but for a final newline (as
// torch.save writes it; the constructor's std::stoull accepts more).
bool is_supported_version(std::string text) {
  if (!text.empty() && text.back() == '\n') {
    text.pop_back();
  }
  if (text.empty() || text.size() > 4 ||
      !std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return false;
  }
  const uint64_t version = std::stoull(text);
  return version >= caffe2::serialize::kMinSupportedFileFormatVersion &&
      version <= caffe2::serialize::kMaxSupportedFileFormatVersion;
}

// What would make the reader's constructor fail after it opened the
// directory: it takes the folder of the first record as the archive's
// name, then reads <name>/.data/serialization_id where there is one, and
// <name>/.data/version or else <name>/version.
std::string constructor_problem(
    const ReadAdapterInterface& source,
    const std::map<std::string, const Record*>& by_name,
    const std::string& first_name) {
  const auto slash = first_name.find('/');
  if (slash == std::string::npos) {
    return c10::str("its first record '", first_name, "' is not in a folder");
  }
  const auto folder = first_name.substr(0, slash + 1);
  const auto find = [&](const std::string& name) -> const Record* {
    const auto found = by_name.find(lowercase(folder + name));
    return found == by_name.end() ? nullptr : found->second;
  };
  const auto unreadable = [](const Record& record) {
    return c10::str(
        "its record '", record.name, "' cannot be read (torch.save stores it ",
        "uncompressed, in at most ", kLongestConstructorRecord, " bytes, with its CRC)");
  };
  if (const auto* id = find(".data/serialization_id")) {
    if (!read_constructor_record(source, *id)) {
      return unreadable(*id);
    }
  }
  const auto* version = find(".data/version");
  version = version != nullptr ? version : find("version");
  if (version == nullptr) {
    return c10::str("no version record '", folder, "version'");
  }
  const auto text = read_constructor_record(source, *version);
  if (!text) {
    return unreadable(*version);
  }
  if (!is_supported_version(*text)) {
    return c10::str(
        "its version record holds '", *text, "', not a version from ",
        caffe2::serialize::kMinSupportedFileFormatVersion, " to ",
        caffe2::serialize::kMaxSupportedFileFormatVersion);
  }
  return "";
}

} // namespace

std::string zip_archive_problem(const ReadAdapterInterface& source) {
  const auto directory = read_directory(source);
  if (!directory.problem.empty()) {
    return directory.problem;
  }
  std::map<std::string, const Record*> by_name; // lower case
  for (const auto& record : directory.records) {
    if (record.uncompressed_size > source.size()) {
      return c10::str(
          "zip record '", record.name, "' claims ", record.uncompressed_size,
          " bytes, more than the whole file's ", source.size());
    }
    const auto [existing, added] = by_name.emplace(lowercase(record.name), &record);
    if (!added) {
      return c10::str(
          "zip records '", existing->second->name, "' and '", record.name,
          "' have the same name (LibTorch ignores case)");
    }
  }
  if (directory.records.empty()) {
    return "its zip directory lists no records";
  }
  return constructor_problem(source, by_name, directory.records.front().name);
}

} // namespace attn::detail
