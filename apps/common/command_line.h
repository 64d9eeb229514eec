#pragma once

// The apps' command lines, read by CLI11 the same way in both: `--help`
// (no `-h`), `--option value` or `--option=value`, the last value of a
// repeated option wins, a switch is on when given (or `--switch=false`),
// and every mistake is a `UsageError` of one line.

#include <CLI/CLI.hpp>

#include <cstdint>
#include <limits>
#include <optional>
#include <string>

namespace apps {

/// Gives `app` the conventions above, and a `--help` that shows each
/// option's default after its text.
void use_app_conventions(CLI::App& app);

/// Parses `argv` into what `app`'s options are bound to. Returns false,
/// having printed the help, where `--help` was given; throws `UsageError`
/// for anything else it cannot take.
bool parse_into_options(CLI::App& app, int argc, const char* const* argv);

/// The command line of `program`: `add_options(app, arguments)` binds each
/// option to a field of `arguments`, whose initial values are the defaults.
/// Returns nothing, having printed the help, where `--help` was given;
/// throws `UsageError` for anything else it cannot take.
template <typename Arguments, typename AddOptions>
std::optional<Arguments> parse_command_line(
    const std::string& program,
    const std::string& description,
    int argc,
    const char* const* argv,
    AddOptions&& add_options) {
  Arguments arguments;
  CLI::App app(description, program);
  use_app_conventions(app);
  add_options(app, arguments);
  if (!parse_into_options(app, argc, argv)) {
    return std::nullopt;
  }
  return arguments;
}

/// Plain decimal digits naming a number no larger than `maximum`: no sign,
/// spaces, suffix or base prefix, which CLI11's own conversion lets through
/// (and it reads a leading zero as octal): the number is handed on without
/// leading zeros.
CLI::Validator decimal_integer(uint64_t maximum);

/// An option whose value is an integer from `minimum` to `maximum`, written
/// in plain decimal digits; `value` holds the default. `Value` is `Integer`
/// or `std::optional` of it.
template <typename Value, typename Integer>
CLI::Option* add_integer_option(
    CLI::App& app,
    const std::string& name,
    Value& value,
    const std::string& help,
    Integer minimum,
    Integer maximum = std::numeric_limits<Integer>::max()) {
  static_assert(std::is_integral_v<Integer>, "an integer option");
  return app.add_option(name, value, help)
      ->type_name("N")
      ->capture_default_str()
      ->transform(decimal_integer(std::numeric_limits<Integer>::max()))
      // No description: the help shows "N", not CLI11's "N:INT in [...]".
      ->check(CLI::Range(minimum, maximum).description(""));
}

/// An option whose value is a number in [0, 1), such as a dropout
/// probability (`0.1`); `value` holds the default.
CLI::Option* add_fraction_option(
    CLI::App& app,
    const std::string& name,
    double& value,
    const std::string& help);

/// `--device D`: auto, cpu, cuda or cuda:N, as `attn::select_device` takes
/// it (and checks it).
CLI::Option* add_device_option(CLI::App& app, std::string& device);

} // namespace apps
