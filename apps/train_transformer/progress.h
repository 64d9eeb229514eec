#pragma once

// Training progress on stdout. On a terminal one status line is redrawn in
// place; through a pipe or into a file, plain lines at the milestones only,
// so that logs hold no carriage returns and no flood of steps.

#include <chrono>
#include <string>

namespace train {

class Progress {
 public:
  /// Whether stdout is a terminal decides the mode. Nothing is shown
  /// unless `shown` (false on every rank but 0 under tensor parallelism).
  explicit Progress(bool shown = true);

  /// The status after any step: redrawn in place on a terminal, at most ten
  /// times a second; nothing otherwise.
  void update(const std::string& text);
  /// The status at a milestone (an evaluation): redrawn in place on a
  /// terminal, a line of its own otherwise.
  void milestone(const std::string& text);
  /// A line that stays in both modes, below the status line.
  void line(const std::string& text);

 private:
  void redraw(const std::string& text);

  bool shown_;
  bool terminal_;
  bool status_shown_ = false;
  std::chrono::steady_clock::time_point last_redraw_;
};

} // namespace train
