#include <moefold/core/expected.hpp>

#include <doctest/doctest.h>

#include <string>

using moefold::errc;
using moefold::expected;
using moefold::make_error;

namespace {
expected<int> half(int v) {
  if (v % 2) return make_error(errc::invalid_argument, "odd: " + std::to_string(v));
  return v / 2;
}
constexpr expected<int> ce_half(int v) {
  // (A message longer than the small-string buffer: g++ 12 cannot move a short std::string in a
  // constant expression.)
  if (v % 2) return make_error(errc::invalid_argument, "odd value, cannot halve it exactly");
  return v / 2;
}
}  // namespace

TEST_CASE("expected holds a value or an error") {
  auto a = half(8);
  REQUIRE(a.has_value());
  CHECK(*a == 4);
  CHECK(a.value() == 4);
  auto b = half(7);
  REQUIRE_FALSE(b);
  CHECK(b.error().code == errc::invalid_argument);
  CHECK(b.error().message == "odd: 7");
}

TEST_CASE("expected copies and assigns across states") {
  auto a = half(8);
  auto b = half(3);
  auto c = a;
  c = b;
  CHECK_FALSE(c);
  CHECK(c.error().message == "odd: 3");
  c = a;
  REQUIRE(c);
  CHECK(*c == 4);
  expected<std::string> s = std::string(100, 'x');
  expected<std::string> t = std::move(s);
  CHECK(t->size() == 100);
}

TEST_CASE("expected works in constant expressions") {
  static_assert(ce_half(10).value() == 5);
  static_assert(!ce_half(3).has_value());
  static_assert(ce_half(3).error().code == errc::invalid_argument);
}

TEST_CASE("value() of an error throws with the message instead of returning garbage") {
  auto b = half(5);
  CHECK_THROWS_WITH((void)b.value(), doctest::Contains("odd: 5"));
  moefold::status st = make_error(errc::overflow, "too big");
  CHECK_THROWS_WITH(st.value(), doctest::Contains("too big"));
  moefold::status ok{};
  CHECK_NOTHROW(ok.value());
}

TEST_CASE("every error kind has a distinct name") {
  for (int i = 0; i <= static_cast<int>(errc::backend_error); ++i)
    for (int j = i + 1; j <= static_cast<int>(errc::backend_error); ++j)
      CHECK(to_string(static_cast<errc>(i)) != to_string(static_cast<errc>(j)));
}
