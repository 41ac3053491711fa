// Command-line conventions shared by the tools, on CLI11 (Debian libcli11-dev): --help prints
// the usage lines and every flag with its default on stdout (exit 0), --version prints the
// package version, and every usage error, CLI11's own (unknown, repeated or missing flags, values
// that are not numbers or out of range) and the tools' checks after parsing alike, is one
// "error:" line on stderr, nothing on stdout, exit 2.
#pragma once

#include <moefold/version.hpp>

#include <CLI/CLI.hpp>

#include <iostream>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

namespace moefold::examples {

//! Thrown by the tools' own checks after parsing (relations between flags, limits).
struct usage_error {
  std::string message;
};

namespace detail {
// How many bytes from m[i] on form a character that must not appear raw in a one-line message: a
// control character, or U+0085, U+2028 or U+2029 in UTF-8 (line breaks to Unicode); 0 if none.
inline std::size_t line_breaking_at(std::string_view m, std::size_t i) {
  const auto ch = static_cast<unsigned char>(m[i]);
  if (ch < 0x20 || ch == 0x7f) return 1;
  const std::string_view rest = m.substr(i);
  if (rest.starts_with("\xC2\x85")) return 2;
  if (rest.starts_with("\xE2\x80\xA8") || rest.starts_with("\xE2\x80\xA9")) return 3;
  return 0;
}
}  // namespace detail

//! A message as one line of text: what could break the line (detail::line_breaking_at), which an
//! argument can carry into a message, is written as \xNN escapes, byte by byte, so that nothing a
//! user types splits the one "error:" line.
inline std::string one_line(std::string_view m) {
  constexpr const char* hex = "0123456789abcdef";
  std::string o;
  o.reserve(m.size());
  for (std::size_t i = 0; i < m.size(); ++i) {
    const std::size_t n = detail::line_breaking_at(m, i);
    if (n == 0) o += m[i];
    for (std::size_t k = 0; k < n; ++k) {
      const auto ch = static_cast<unsigned char>(m[i + k]);
      o += "\\x";
      o += hex[ch >> 4];
      o += hex[ch & 15];
    }
    if (n > 0) i += n - 1;
  }
  return o;
}

//! What parsing a tool's command line came to: go on (`status` -1), or exit with `status` after
//! printing `out` on stdout (--help, --version: 0) or the one line "error: " + `error` on stderr
//! (a usage error: 2). Parsing prints nothing itself, so that it can be run on its own (the flag
//! fuzzers in tests/fuzz do).
struct parse_outcome {
  int status = -1;
  std::string out;
  std::string error;
};

//! The outcome of a usage error: exit 2 with one "error:" line.
inline parse_outcome usage_failure(std::string_view message) { return {2, "", one_line(message)}; }

//! Prints what `p` says to print and returns the status to exit with (-1: go on).
inline int report(const parse_outcome& p) {
  std::cout << p.out;
  if (p.status == 2) std::cerr << "error: " << p.error << "\n";
  return p.status;
}

//! What main returns for an error of any kind: one "error:" line on stderr (one_line) and 2.
inline int fail(std::string_view message) { return report(usage_failure(message)); }

//! What main returns for a usage error: one "error:" line on stderr and 2.
inline int report(const usage_error& e) { return fail(e.message); }

//! CLI11's help layout with the tool's own usage lines first (CLI11's list of the flags, each with
//! its default, follows; the notes come last, as the footer).
class usage_formatter : public CLI::Formatter {
 public:
  explicit usage_formatter(std::string usage) : usage_(std::move(usage)) { column_width(34); }
  std::string make_usage(const CLI::App*, std::string) const override { return usage_ + "\n"; }

 private:
  std::string usage_;
};

//! A CLI11 check: an integer in [lo, hi] (the message says which of the two rules failed;
//! CLI11's own Range calls a value that is no integer, such as 1e3, out of range).
inline CLI::Validator int_in(int lo, int hi, std::string description) {
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        long long v = 0;
        if (!CLI::detail::lexical_cast(text, v)) return "'" + text + "' is not an integer";
        if (v < lo && hi == std::numeric_limits<int>::max())
          return "must be >= " + std::to_string(lo) + " (got " + text + ")";
        if (v < lo || v > hi)
          return "must be between " + std::to_string(lo) + " and " + std::to_string(hi) + " (got " +
                 text + ")";
        return {};
      },
      std::move(description));
}

//! A CLI11 check: an integer >= lo.
inline CLI::Validator at_least(int lo) {
  return int_in(lo, std::numeric_limits<int>::max(), "INT>=" + std::to_string(lo));
}

//! Sets up `app` as every tool does; call it before adding the options.
inline void configure(CLI::App& app, std::string usage, const std::string& notes) {
  app.formatter(std::make_shared<usage_formatter>(std::move(usage)));
  app.footer(notes);
  app.option_defaults()->always_capture_default();
  app.set_help_flag("-h,--help", "print this help and exit");
  app.set_version_flag("--version", app.get_name() + " (moefold) " + moefold::version_string,
                       "print the moefold version and exit");
}

//! Parses the command line with CLI11; prints nothing (see parse_outcome). `app` is the tool's,
//! with every option added; the tool's own checks after parsing may throw usage_error from
//! `then`, which runs only when CLI11 accepted the command line.
template <class Then>
parse_outcome parse(CLI::App& app, int argc, const char* const* argv, Then&& then) {
  try {
    app.parse(argc, argv);
    then();
    return {};
  } catch (const CLI::CallForHelp&) {
    return {0, app.help(), ""};
  } catch (const CLI::CallForVersion& e) {
    return {0, std::string(e.what()) + "\n", ""};
  } catch (const CLI::ParseError& e) {
    return usage_failure(std::string(e.what()) + " (see --help)");
  } catch (const usage_error& e) {
    return usage_failure(e.message);
  }
}

}  // namespace moefold::examples
