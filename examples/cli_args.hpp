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
#include <utility>

namespace moefold::examples {

//! Thrown by the tools' own checks after parsing (relations between flags, limits).
struct usage_error {
  std::string message;
};

//! What main returns for a usage error: one "error:" line on stderr and 2.
inline int report(const usage_error& e) {
  std::cerr << "error: " << e.message << "\n";
  return 2;
}

//! CLI11's help layout with the tool's own usage lines first (CLI11's list of the flags, each with
//! its default, follows; the notes come last, as the footer).
class usage_formatter : public CLI::Formatter {
 public:
  explicit usage_formatter(std::string usage) : usage_(std::move(usage)) { column_width(34); }
  std::string make_usage(const CLI::App*, std::string) const override { return usage_ + "\n"; }

 private:
  std::string usage_;
};

//! A CLI11 check: an integer >= lo (the message states the range).
inline CLI::Validator at_least(int lo) {
  return CLI::Range(lo, std::numeric_limits<int>::max()).description("INT>=" + std::to_string(lo));
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

//! Parses the command line. Returns -1 to go on, or the status to exit with: 0 after --help or
//! --version, 2 after a usage error (reported as one "error:" line).
inline int parse(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
    return -1;
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    return 0;
  } catch (const CLI::CallForVersion& e) {
    std::cout << e.what() << "\n";
    return 0;
  } catch (const CLI::ParseError& e) {
    std::string m = e.what();
    for (char& c : m)
      if (c == '\n' || c == '\r') c = ' ';
    std::cerr << "error: " << m << " (see --help)\n";
    return 2;
  } catch (const usage_error& e) {
    std::cerr << "error: " << e.message << "\n";
    return 2;
  }
}

}  // namespace moefold::examples
