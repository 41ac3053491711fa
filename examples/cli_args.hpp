// Command-line helpers shared by the example programs: strict number parsing and one way to
// report a usage error (exit 2, one "error:" line on stderr, nothing on stdout) or --help.
#pragma once

#include <cmath>
#include <cstdlib>
#include <iostream>
#include <string>
#include <string_view>

namespace moefold::examples {

//! Thrown by argument parsing; message "help" asks for the usage text.
struct usage_error {
  std::string message;
};

//! A decimal integer that fits in int: no sign games, no trailing junk, no overflow.
inline int parse_int(std::string_view flag, std::string_view s) {
  if (s.empty()) throw usage_error{std::string(flag) + " needs an integer value"};
  std::size_t i = 0;
  bool neg = false;
  if (s[0] == '-' || s[0] == '+') {
    neg = s[0] == '-';
    i = 1;
  }
  if (i == s.size())
    throw usage_error{std::string(flag) + ": '" + std::string(s) + "' is not an integer"};
  long long v = 0;
  for (; i < s.size(); ++i) {
    if (s[i] < '0' || s[i] > '9')
      throw usage_error{std::string(flag) + ": '" + std::string(s) + "' is not an integer"};
    v = v * 10 + (s[i] - '0');
    if (v > 2147483648LL)
      throw usage_error{std::string(flag) + ": " + std::string(s) + " does not fit in 32 bits"};
  }
  if (neg) v = -v;
  if (v > 2147483647LL)
    throw usage_error{std::string(flag) + ": " + std::string(s) + " does not fit in 32 bits"};
  return static_cast<int>(v);
}

//! A finite decimal number, nothing after it.
inline double parse_double(std::string_view flag, std::string_view s) {
  const std::string text(s);
  char* end = nullptr;
  const double v = text.empty() ? 0.0 : std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size() || !std::isfinite(v))
    throw usage_error{std::string(flag) + ": '" + text + "' is not a finite number"};
  return v;
}

//! What main returns for a usage error: the usage text on stdout and 0 for --help, otherwise
//! one "error:" line on stderr and 2.
inline int report(const usage_error& e, std::string_view usage) {
  if (e.message == "help") {
    std::cout << usage;
    return 0;
  }
  std::cerr << "error: " << e.message << "\n";
  return 2;
}

}  // namespace moefold::examples
