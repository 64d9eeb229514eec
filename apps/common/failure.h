#pragma once

// How the apps fail: every failure is one line on stderr and exit code 2.

#include <functional>
#include <stdexcept>
#include <string>

namespace apps {

/// The exit code of a run that fails, whatever the reason.
constexpr int kFailureExitCode = 2;

/// A request an app cannot carry out: flags that contradict each other, a
/// dtype the device cannot run, a file that cannot be written.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// `message` folded onto one line: LibTorch's messages can span several.
std::string one_line(std::string message);

/// Runs `run`, an app's main, and returns its exit code. Any exception it
/// throws is printed as "<program>: <message>" on one line of stderr, and
/// the run exits with kFailureExitCode.
int run_reporting_failures(const char* program, const std::function<int()>& run);

} // namespace apps
