#include "atomic_file.h"

#include "failure.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <system_error>

namespace apps {
namespace {

namespace fs = std::filesystem;

UsageError cannot_write(
    const std::string& path,
    const std::string& what,
    const std::string& reason) {
  return UsageError(
      fmt::format("cannot write {} '{}': {}; expected a writable file path", what, path, reason));
}

} // namespace

void replace_file_atomically(
    const std::string& path,
    const std::string& what,
    const std::function<void(const std::string& temporary)>& write) {
  const auto temporary = path + ".partial";
  const auto remove_temporary = [&] {
    std::error_code ignored;
    fs::remove(temporary, ignored);
  };
  try {
    write(temporary);
  } catch (...) {
    remove_temporary();
    throw;
  }
  std::error_code error;
  fs::rename(temporary, path, error);
  if (error) {
    remove_temporary();
    throw cannot_write(path, what, error.message());
  }
}

void write_file_atomically(
    const std::string& path,
    const std::string& what,
    const std::string& content) {
  replace_file_atomically(path, what, [&](const std::string& temporary) {
    std::ofstream file(temporary, std::ios::binary);
    if (file) {
      file << content;
      file.close();
    }
    if (!file) {
      throw cannot_write(path, what, std::strerror(errno));
    }
  });
}

} // namespace apps
