#include "progress.h"

#include <fmt/format.h>

#include <cstdio>

#include <unistd.h>

namespace train {
namespace {

// Carriage return, then erase to the end of the line: the new text may be
// shorter than the one it replaces.
constexpr const char* kRedraw = "\r\033[K";

constexpr auto kRedrawInterval = std::chrono::milliseconds(100);

} // namespace

Progress::Progress(bool shown) : shown_(shown), terminal_(isatty(fileno(stdout)) != 0) {}

void Progress::update(const std::string& text) {
  if (shown_ && terminal_ && std::chrono::steady_clock::now() - last_redraw_ >= kRedrawInterval) {
    redraw(text);
  }
}

void Progress::milestone(const std::string& text) {
  if (terminal_) {
    redraw(text);
  } else {
    line(text);
  }
}

void Progress::line(const std::string& text) {
  if (!shown_) {
    return;
  }
  // The status line, if any, stays as it was; this one goes below it.
  fmt::print("{}{}\n", status_shown_ ? "\n" : "", text);
  std::fflush(stdout);
  status_shown_ = false;
}

void Progress::redraw(const std::string& text) {
  if (!shown_) {
    return;
  }
  fmt::print("{}{}", kRedraw, text);
  std::fflush(stdout);
  status_shown_ = true;
  last_redraw_ = std::chrono::steady_clock::now();
}

} // namespace train
