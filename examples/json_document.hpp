// A JSON document read strictly with nlohmann/json, shared by the tools' file readers
// (moefold-plan's model and cluster files, safetensors headers): malformed text is an error at a
// line and column, a member name given twice in one object is an error (nlohmann would keep the
// last), and nesting is bounded.
#pragma once

#include <moefold/core/expected.hpp>

#include <nlohmann/json.hpp>

#include <cstddef>
#include <iterator>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace moefold::examples {

using ordered_json = nlohmann::ordered_json;

//! Deepest nesting of arrays and objects a file may have.
inline constexpr int max_json_depth = 64;

namespace detail {
// A member name as it appears in a message: JSON-quoted, so that control characters and invalid
// UTF-8 cannot split or garble the one error line.
inline std::string quoted(const std::string& key) {
  return ordered_json(key).dump(-1, ' ', false, ordered_json::error_handler_t::replace);
}

// An iterator over the text that records how far the JSON reader has read, so that what the
// parse callback finds (a member name given twice, nesting too deep) has a line and a column too.
// nlohmann/json reads its input one character at a time and not ahead, except one character after
// a number, which the callback never sees last.
class tracked_iterator {
 public:
  using iterator_category = std::forward_iterator_tag;
  using value_type = char;
  using difference_type = std::ptrdiff_t;
  using pointer = const char*;
  using reference = const char&;

  tracked_iterator() = default;
  tracked_iterator(const char* p, const char** read) : p_(p), read_(read) {}
  reference operator*() const { return *p_; }
  tracked_iterator& operator++() {
    *read_ = ++p_;
    return *this;
  }
  tracked_iterator operator++(int) {
    tracked_iterator old = *this;
    ++*this;
    return old;
  }
  friend bool operator==(const tracked_iterator& a, const tracked_iterator& b) {
    return a.p_ == b.p_;
  }

 private:
  const char* p_ = nullptr;
  const char** read_ = nullptr;
};

// "at line L, column C" of the byte at `offset`, counted as nlohmann/json counts in its own
// messages (lines end at '\n'; columns count bytes from 1).
inline std::string position_of(std::string_view text, std::size_t offset) {
  const std::string_view before = text.substr(0, offset);
  std::size_t line = 1;
  for (char ch : before) line += ch == '\n' ? 1 : 0;
  const std::size_t nl = before.rfind('\n');
  const std::size_t column = nl == std::string_view::npos ? offset + 1 : offset - nl;
  return "at line " + std::to_string(line) + ", column " + std::to_string(column);
}

// Thrown from the parse callback to stop at the first problem found.
struct stop_parsing {};

// Where the member name that the reader has just read begins: `end` is one past its closing
// quote; its opening quote is the last quote before that with an even run of backslashes before
// it (a quote inside the name is escaped by an odd run).
inline std::size_t name_start(std::string_view text, std::size_t end) {
  if (end < 2) return 0;
  for (std::size_t i = end - 1; i-- > 0;) {
    if (text[i] != '"') continue;
    std::size_t slashes = 0;
    while (slashes < i && text[i - 1 - slashes] == '\\') ++slashes;
    if (slashes % 2 == 0) return i;
  }
  return 0;
}

}  // namespace detail

//! The document in `text`, members in file order.
[[nodiscard]] inline expected<ordered_json> parse_json_document(std::string_view text) {
  std::vector<std::set<std::string>> open;  // the member names of each open object
  std::string problem;
  const char* read = text.data();  // one past the last character the reader has read
  const ordered_json::parser_callback_t check = [&](int depth, ordered_json::parse_event_t event,
                                                    ordered_json& parsed) {
    using ev = ordered_json::parse_event_t;
    const auto at = [&](std::size_t offset) { return detail::position_of(text, offset) + ": "; };
    const auto done = static_cast<std::size_t>(read - text.data());
    if ((event == ev::object_start || event == ev::array_start) && depth >= max_json_depth &&
        problem.empty())
      problem = at(done - 1) + "nesting deeper than " + std::to_string(max_json_depth) + " levels";
    if (event == ev::object_start) open.emplace_back();
    if (event == ev::object_end && !open.empty()) open.pop_back();
    if (event == ev::key && !open.empty() &&
        !open.back().insert(parsed.get<std::string>()).second && problem.empty())
      problem = at(detail::name_start(text, done)) + "duplicate member name " +
                detail::quoted(parsed.get<std::string>()) +
                " (rule: each member at most once per object)";
    // Stop at the first problem: reading on would let a deeply nested text of many megabytes
    // build its whole tree before the error.
    if (!problem.empty()) throw detail::stop_parsing{};
    return true;
  };
  try {
    auto doc =
        ordered_json::parse(detail::tracked_iterator(text.data(), &read),
                            detail::tracked_iterator(text.data() + text.size(), &read), check);
    if (!problem.empty()) return make_error(errc::invalid_argument, "malformed JSON " + problem);
    return doc;
  } catch (const detail::stop_parsing&) {
    return make_error(errc::invalid_argument, "malformed JSON " + problem);
  } catch (const ordered_json::parse_error& e) {
    // "[json.exception.parse_error.101] parse error at line 1, column 5: syntax error ..."
    std::string what = e.what();
    const auto at = what.find(" at line ");
    what = at == std::string::npos ? what : what.substr(at + 1);
    return make_error(errc::invalid_argument, "malformed JSON " + what);
  } catch (const ordered_json::exception& e) {
    // "[json.exception.out_of_range.406] number overflow parsing '1e999'"
    std::string what = e.what();
    const auto end = what.find("] ");
    return make_error(
        errc::invalid_argument,
        "malformed JSON: " + (end == std::string::npos ? what : what.substr(end + 2)));
  }
}

}  // namespace moefold::examples
