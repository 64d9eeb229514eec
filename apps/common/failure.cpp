#include "failure.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <algorithm>
#include <exception>

namespace apps {

std::string one_line(std::string message) {
  std::replace(message.begin(), message.end(), '\n', ' ');
  return message;
}

int run_reporting_failures(const char* program, const std::function<int()>& run) {
  try {
    return run();
  } catch (const c10::Error& error) {
    // what() would add the C++ backtrace, which tells a user nothing.
    fmt::print(stderr, "{}: {}\n", program, one_line(error.what_without_backtrace()));
  } catch (const std::exception& error) {
    fmt::print(stderr, "{}: {}\n", program, one_line(error.what()));
  }
  return kFailureExitCode;
}

} // namespace apps
