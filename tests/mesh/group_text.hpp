// Test helper: groups written as text, "[0,2] [1,3]", as in the reference's worked examples.
#pragma once

#include <cctype>
#include <string_view>
#include <vector>

namespace moefold::test {

inline std::vector<std::vector<int>> groups_from_text(std::string_view s) {
  std::vector<std::vector<int>> out;
  std::vector<int>* cur = nullptr;
  int value = -1;
  for (char c : s) {
    if (c == '[') {
      out.emplace_back();
      cur = &out.back();
    } else if (std::isdigit(static_cast<unsigned char>(c))) {
      value = (value < 0 ? 0 : value * 10) + (c - '0');
    } else if (c == ',' || c == ']') {
      if (value >= 0 && cur) cur->push_back(value);
      value = -1;
    }
  }
  return out;
}

//! n singleton groups [first], [first+1], ...
inline std::vector<std::vector<int>> singletons(int n, int first = 0) {
  std::vector<std::vector<int>> out;
  for (int i = 0; i < n; ++i) out.push_back({first + i});
  return out;
}

}  // namespace moefold::test
