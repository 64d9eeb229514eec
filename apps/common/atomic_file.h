#pragma once

// Files written whole or not at all.

#include <functional>
#include <string>

namespace apps {

/// Replaces `path` with the file that `write` writes at the temporary path
/// it is handed (`path` + ".partial"), by a rename once `write` returns, so
/// that a failed or interrupted write leaves neither a partial file nor a
/// damaged old one. The temporary file is removed when `write` throws (the
/// exception passes on) or the rename fails, which throws `UsageError`:
/// "cannot write <what> '<path>': <reason>".
void replace_file_atomically(
    const std::string& path,
    const std::string& what,
    const std::function<void(const std::string& temporary)>& write);

/// `content` as the whole of `path`, through `replace_file_atomically`.
void write_file_atomically(
    const std::string& path,
    const std::string& what,
    const std::string& content);

} // namespace apps
