// The strict JSON reader: what it accepts, what each value becomes, and that every kind of
// malformed text is an error naming the line and column.
#include <moefold/plan/json.hpp>

#include <doctest/doctest.h>

#include <string>

using namespace moefold;
using namespace moefold::plan;

TEST_CASE("valid documents parse to the values written") {
  auto v = parse_json(
      R"( {"a": [1, -2.5e3, 0, true, false, null], "b": {"c": "x\"\\\/\n\u00e9\ud83d\ude00"},
      "d": []} )");
  REQUIRE(v.has_value());
  REQUIRE(v->type == json_value::kind::object);
  REQUIRE(v->members.size() == 3);
  const auto* a = v->find("a");
  REQUIRE(a != nullptr);
  REQUIRE(a->items.size() == 6);
  CHECK(a->items[0].number == 1.0);
  CHECK(a->items[0].integral);
  CHECK(a->items[1].number == -2500.0);
  CHECK_FALSE(a->items[1].integral);
  CHECK(a->items[2].number == 0.0);
  CHECK(a->items[3].boolean);
  CHECK(a->items[4].type == json_value::kind::boolean);
  CHECK_FALSE(a->items[4].boolean);
  CHECK(a->items[5].type == json_value::kind::null);
  const auto* c = v->find("b")->find("c");
  REQUIRE(c != nullptr);
  // x, quote, backslash, slash, newline, e-acute (2 bytes), U+1F600 (4 bytes).
  CHECK(c->text == std::string("x\"\\/\n\xC3\xA9\xF0\x9F\x98\x80"));
  CHECK(v->find("d")->items.empty());
  CHECK(v->find("missing") == nullptr);
  CHECK(parse_json("7")->number == 7.0);
  CHECK(parse_json("\"\"")->text.empty());
}

TEST_CASE("malformed documents are errors with line and column") {
  struct bad_case {
    const char* text;
    const char* says;
  };
  const bad_case cases[] = {
      {"", "line 1, column 1: unexpected end of input"},
      {"{\"a\": 1,}", "expected a member name"},
      {"[1, 2,]", "unexpected character ']'"},
      {"{\"a\": 01}", "leading zeros"},
      {"{\"a\": 1, \"a\": 2}", "duplicate member name \"a\""},
      {"{\"a\": \"abc", "unterminated string"},
      {"{\"a\": \"a\tb\"}", "control character"},
      {"{\"a\": NaN}", "unexpected character 'N'"},
      {"{\"a\": 1} x", "unexpected text after the JSON value"},
      {"{\"a\" 1}", "expected ':'"},
      {"[1 2]", "expected ',' or ']'"},
      {"{\"a\": 1 \"b\": 2}", "expected ',' or '}'"},
      {"-", "a digit must follow '-'"},
      {"1.", "a digit must follow the decimal point"},
      {"1e+", "a digit must follow the exponent"},
      {"\"\\x\"", "invalid escape"},
      {"\"\\u12g4\"", "four hexadecimal digits"},
      {"\"\\ud800\"", "low one"},
      {"\"\\udc00\"", "unpaired low surrogate"},
      {"tru", "unexpected character 't'"},
      {"1e999", "out of range"},
      {"// comment\n{}", "unexpected character '/'"},
      {"{\n  \"a\": 1,\n  \"b\": [1,,2]\n}", "line 3, column 11"},
  };
  for (const auto& c : cases) {
    auto v = parse_json(c.text);
    INFO(c.text);
    REQUIRE_FALSE(v.has_value());
    CHECK(v.error().code == errc::invalid_argument);
    CHECK(v.error().message.find("malformed JSON at line ") == 0);
    CHECK(v.error().message.find(c.says) != std::string::npos);
  }
}

TEST_CASE("nesting is bounded instead of exhausting the stack") {
  std::string deep(65, '['), ok(64, '[');
  deep += std::string(65, ']');
  ok += std::string(64, ']');
  CHECK(parse_json(ok).has_value());
  auto v = parse_json(deep);
  REQUIRE_FALSE(v.has_value());
  CHECK(v.error().message.find("nesting deeper than 64") != std::string::npos);
  std::string huge(100000, '[');
  CHECK_FALSE(parse_json(huge).has_value());
}
