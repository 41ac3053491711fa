//! @file json.hpp
//! @brief A small, strict JSON reader (RFC 8259) for the planner's model and cluster files: no
//! extensions (no comments, no trailing commas, no NaN), duplicate keys rejected, nesting depth
//! bounded, and every error names the line and column where the text went wrong.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../core/expected.hpp"

namespace moefold::plan {

struct json_member;

//! One JSON value. Objects keep their members in file order.
struct json_value {
  enum class kind : std::uint8_t { null, boolean, number, string, array, object };
  kind type = kind::null;
  bool boolean = false;
  double number = 0.0;
  bool integral = false;  //!< the number was written without fraction or exponent
  std::string text;       //!< the string (type string) or the number as written (type number)
  std::vector<json_value> items;     //!< array elements
  std::vector<json_member> members;  //!< object members

  //! The member named `key`, or nullptr.
  [[nodiscard]] const json_value* find(std::string_view key) const noexcept;
};

//! One member of an object: its key and value (a struct, not a std::pair, so that json_value may
//! hold a vector of them while still incomplete).
struct json_member {
  std::string first;
  json_value second;
};

inline const json_value* json_value::find(std::string_view key) const noexcept {
  for (const auto& m : members)
    if (m.first == key) return &m.second;
  return nullptr;
}

[[nodiscard]] inline std::string_view to_string(json_value::kind k) noexcept {
  switch (k) {
    case json_value::kind::null: return "null";
    case json_value::kind::boolean: return "a boolean";
    case json_value::kind::number: return "a number";
    case json_value::kind::string: return "a string";
    case json_value::kind::array: return "an array";
    case json_value::kind::object: return "an object";
  }
  return "?";
}

namespace detail {

class json_parser {
 public:
  explicit json_parser(std::string_view text) : s_(text) {}

  expected<json_value> document() {
    skip_ws();
    json_value v;
    if (auto ok = value(v, 0); !ok) return unexpected<error>(ok.error());
    skip_ws();
    if (i_ != s_.size()) return fail("unexpected text after the JSON value");
    return v;
  }

 private:
  static constexpr int max_depth = 64;

  unexpected<error> fail(const std::string& what) const {
    int line = 1, col = 1;
    for (std::size_t k = 0; k < i_ && k < s_.size(); ++k) {
      if (s_[k] == '\n') {
        ++line;
        col = 1;
      } else {
        ++col;
      }
    }
    return make_error(errc::invalid_argument, "malformed JSON at line " + std::to_string(line) +
                                                  ", column " + std::to_string(col) + ": " + what);
  }
  void skip_ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r'))
      ++i_;
  }
  bool literal(std::string_view w) {
    if (s_.substr(i_, w.size()) != w) return false;
    i_ += w.size();
    return true;
  }

  status value(json_value& v, int depth) {
    if (depth >= max_depth) return fail("nesting deeper than 64 levels");
    if (i_ >= s_.size()) return fail("unexpected end of input, expected a value");
    const char c = s_[i_];
    if (c == '{') return object(v, depth);
    if (c == '[') return array(v, depth);
    if (c == '"') {
      v.type = json_value::kind::string;
      return string(v.text);
    }
    if (c == '-' || (c >= '0' && c <= '9')) return number(v);
    if (literal("true")) {
      v.type = json_value::kind::boolean;
      v.boolean = true;
      return {};
    }
    if (literal("false")) {
      v.type = json_value::kind::boolean;
      return {};
    }
    if (literal("null")) return {};
    return fail(std::string("unexpected character '") + c + "', expected a value");
  }

  status object(json_value& v, int depth) {
    v.type = json_value::kind::object;
    ++i_;  // '{'
    skip_ws();
    if (i_ < s_.size() && s_[i_] == '}') {
      ++i_;
      return {};
    }
    while (true) {
      skip_ws();
      if (i_ >= s_.size() || s_[i_] != '"') return fail("expected a member name in double quotes");
      std::string key;
      if (auto ok = string(key); !ok) return ok;
      if (v.find(key)) return fail("duplicate member name \"" + key + "\"");
      skip_ws();
      if (i_ >= s_.size() || s_[i_] != ':') return fail("expected ':' after a member name");
      ++i_;
      skip_ws();
      json_value item;
      if (auto ok = value(item, depth + 1); !ok) return ok;
      v.members.push_back({std::move(key), std::move(item)});
      skip_ws();
      if (i_ < s_.size() && s_[i_] == ',') {
        ++i_;
        continue;
      }
      if (i_ < s_.size() && s_[i_] == '}') {
        ++i_;
        return {};
      }
      return fail("expected ',' or '}' in an object");
    }
  }

  status array(json_value& v, int depth) {
    v.type = json_value::kind::array;
    ++i_;  // '['
    skip_ws();
    if (i_ < s_.size() && s_[i_] == ']') {
      ++i_;
      return {};
    }
    while (true) {
      skip_ws();
      json_value item;
      if (auto ok = value(item, depth + 1); !ok) return ok;
      v.items.push_back(std::move(item));
      skip_ws();
      if (i_ < s_.size() && s_[i_] == ',') {
        ++i_;
        continue;
      }
      if (i_ < s_.size() && s_[i_] == ']') {
        ++i_;
        return {};
      }
      return fail("expected ',' or ']' in an array");
    }
  }

  static void append_utf8(std::string& out, std::uint32_t cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  status hex4(std::uint32_t& cp) {
    cp = 0;
    for (int k = 0; k < 4; ++k, ++i_) {
      if (i_ >= s_.size()) return fail("unexpected end of input in a \\u escape");
      const char h = s_[i_];
      cp <<= 4;
      if (h >= '0' && h <= '9')
        cp |= static_cast<std::uint32_t>(h - '0');
      else if (h >= 'a' && h <= 'f')
        cp |= static_cast<std::uint32_t>(h - 'a' + 10);
      else if (h >= 'A' && h <= 'F')
        cp |= static_cast<std::uint32_t>(h - 'A' + 10);
      else
        return fail("a \\u escape needs four hexadecimal digits");
    }
    return {};
  }

  status string(std::string& out) {
    ++i_;  // opening quote
    out.clear();
    while (true) {
      if (i_ >= s_.size()) return fail("unterminated string");
      const char c = s_[i_];
      if (c == '"') {
        ++i_;
        return {};
      }
      if (static_cast<unsigned char>(c) < 0x20)
        return fail("control character in a string (escape it)");
      if (c != '\\') {
        out += c;
        ++i_;
        continue;
      }
      ++i_;
      if (i_ >= s_.size()) return fail("unterminated escape in a string");
      const char e = s_[i_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          std::uint32_t cp = 0;
          if (auto ok = hex4(cp); !ok) return ok;
          if (cp >= 0xD800 && cp <= 0xDBFF) {  // a high surrogate needs its low half
            if (!literal("\\u")) return fail("a high surrogate must be followed by a low one");
            std::uint32_t lo = 0;
            if (auto ok = hex4(lo); !ok) return ok;
            if (lo < 0xDC00 || lo > 0xDFFF) return fail("invalid low surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            return fail("unpaired low surrogate");
          }
          append_utf8(out, cp);
          break;
        }
        default: return fail(std::string("invalid escape '\\") + e + "'");
      }
    }
  }

  status number(json_value& v) {
    const std::size_t start = i_;
    bool integral = true;
    if (s_[i_] == '-') ++i_;
    if (i_ >= s_.size() || s_[i_] < '0' || s_[i_] > '9') return fail("a digit must follow '-'");
    if (s_[i_] == '0') {
      ++i_;
      if (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9')
        return fail("numbers may not have leading zeros");
    } else {
      while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') ++i_;
    }
    if (i_ < s_.size() && s_[i_] == '.') {
      integral = false;
      ++i_;
      if (i_ >= s_.size() || s_[i_] < '0' || s_[i_] > '9')
        return fail("a digit must follow the decimal point");
      while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') ++i_;
    }
    if (i_ < s_.size() && (s_[i_] == 'e' || s_[i_] == 'E')) {
      integral = false;
      ++i_;
      if (i_ < s_.size() && (s_[i_] == '+' || s_[i_] == '-')) ++i_;
      if (i_ >= s_.size() || s_[i_] < '0' || s_[i_] > '9')
        return fail("a digit must follow the exponent");
      while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') ++i_;
    }
    v.type = json_value::kind::number;
    v.integral = integral;
    v.text = std::string(s_.substr(start, i_ - start));
    // The grammar above admits only what strtod reads in full; the "C" locale is assumed.
    v.number = std::strtod(v.text.c_str(), nullptr);
    if (v.number > 1.7976931348623157e308 || v.number < -1.7976931348623157e308)
      return fail("number out of range");
    return {};
  }

  std::string_view s_;
  std::size_t i_ = 0;
};

}  // namespace detail

//! Parses a whole JSON document.
[[nodiscard]] inline expected<json_value> parse_json(std::string_view text) {
  return detail::json_parser(text).document();
}

}  // namespace moefold::plan
