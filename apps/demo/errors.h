#pragma once

// How the demo fails: every error is one line on stderr and exit code 2.

#include <algorithm>
#include <stdexcept>
#include <string>

namespace demo {

/// A request the demo cannot carry out: a malformed flag, flags that
/// contradict each other, a dtype the device cannot run, an unwritable file.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A message folded onto one line: LibTorch's can span several.
inline std::string one_line(std::string message) {
  std::replace(message.begin(), message.end(), '\n', ' ');
  return message;
}

} // namespace demo
