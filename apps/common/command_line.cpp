#include "command_line.h"

#include "failure.h"

#include <fmt/format.h>

#include <charconv>
#include <cstdlib>
#include <memory>

namespace apps {
namespace {

// Wide enough for "  --checkpoint FILE", the longest option with its value.
constexpr size_t kHelpColumn = 21;

// "--batch N    sequences per batch B (default 4)": the default where a
// reader of the text looks for it, rather than CLI11's "--batch N=4".
class HelpFormatter : public CLI::Formatter {
 public:
  std::string make_option_opts(const CLI::Option* option) const override {
    return option->get_type_size() == 0 ? "" : " " + option->get_type_name();
  }

  std::string make_option_desc(const CLI::Option* option) const override {
    const auto& fallback = option->get_default_str();
    if (fallback.empty()) {
      return option->get_description();
    }
    return fmt::format("{} (default {})", option->get_description(), fallback);
  }
};

// CLI11 lists what it could not place from the last to the first
// ("5 --step"); the first is the one to name.
std::string describe_unexpected(const CLI::App& app) {
  const auto unexpected = app.remaining().front();
  const bool is_option = unexpected.rfind('-', 0) == 0;
  return fmt::format(
      "{} '{}': see {} --help for the accepted options",
      is_option ? "unknown option" : "unexpected argument", unexpected, app.get_name());
}

} // namespace

void use_app_conventions(CLI::App& app) {
  app.set_help_flag("--help", "show this help and exit");
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  auto formatter = std::make_shared<HelpFormatter>();
  formatter->column_width(kHelpColumn);
  app.formatter(formatter);
}

bool parse_into_options(CLI::App& app, int argc, const char* const* argv) {
  try {
    app.parse(argc, argv);
    return true;
  } catch (const CLI::CallForHelp&) {
    fmt::print("{}", app.help());
    return false;
  } catch (const CLI::ExtrasError&) {
    throw UsageError(describe_unexpected(app));
  } catch (const CLI::ParseError& error) {
    // CLI11's own report would add a second line, "Run with --help ...".
    throw UsageError(one_line(error.what()));
  }
}

CLI::Validator decimal_integer(uint64_t maximum) {
  const auto check = [maximum](std::string& text) -> std::string {
    uint64_t value = 0;
    const auto* end = text.data() + text.size();
    const auto [stop, error] = std::from_chars(text.data(), end, value);
    // from_chars takes digits only, but stops at the first other character.
    if (text.empty() || stop != end || error == std::errc::invalid_argument) {
      return fmt::format("expected digits 0-9 only, got '{}'", text);
    }
    if (error == std::errc::result_out_of_range || value > maximum) {
      return fmt::format("expected at most {}, got '{}'", maximum, text);
    }
    text = std::to_string(value);
    return {};
  };
  return CLI::Validator(check, /*validator_desc=*/"");
}

CLI::Option* add_fraction_option(
    CLI::App& app,
    const std::string& name,
    double& value,
    const std::string& help) {
  const auto check = [](std::string& text) -> std::string {
    char* end = nullptr;
    const double fraction = std::strtod(text.c_str(), &end);
    const bool whole_text = !text.empty() && end == text.c_str() + text.size();
    return whole_text && fraction >= 0.0 && fraction < 1.0
        ? ""
        : fmt::format("expected a number at least 0 and below 1, got '{}'", text);
  };
  return app.add_option(name, value, help)
      ->type_name("P")
      ->capture_default_str()
      ->check(CLI::Validator(check, /*validator_desc=*/""));
}

CLI::Option* add_device_option(CLI::App& app, std::string& device) {
  return app.add_option("--device", device, "auto (CUDA when available), cpu, cuda\nor cuda:N")
      ->type_name("D")
      ->capture_default_str();
}

} // namespace apps
