//! @file expected.hpp
//! @brief A small `expected<T, E>` (std::expected is C++23; g++ 12 lacks it), usable in constant
//! expressions, so that a checked factory can run at compile time as well as at run time.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <memory>
#include <type_traits>
#include <utility>

#include "error.hpp"

#if defined(__cpp_exceptions)
#include <stdexcept>
#endif

namespace moefold {
inline namespace v0_1 {

//! Wraps an error value to construct an `expected` in its error state.
template <class E>
class unexpected {
 public:
  // Errors are copied, never moved: g++ 12 rejects destroying a moved-from std::string in a
  // constant expression, and errors are off the hot path.
  constexpr explicit unexpected(const E& e) : e_(e) {}
  [[nodiscard]] constexpr const E& error() const& noexcept { return e_; }
  [[nodiscard]] constexpr E&& error() && noexcept { return std::move(e_); }

 private:
  E e_;
};

//! Shorthand: `return make_error(errc::invalid_size, "tp must be >= 1 (got 0)");`
[[nodiscard]] inline constexpr unexpected<error> make_error(errc code, std::string message) {
  return unexpected<error>(error{code, message});
}

namespace detail {
// Reading the value of an expected that holds an error is a caller bug. With exceptions it throws
// (so tests can see it); without, it reports and aborts: never silent garbage. In a constant
// expression the call is not constant, so the bug becomes a compile error.
template <class E>
[[noreturn]] void bad_expected_access(const E& e) {
  const char* what = "(error of a user type)";
  if constexpr (std::is_same_v<E, error>) what = e.message.c_str();
#if defined(__cpp_exceptions)
  throw std::logic_error(std::string("moefold: value() on an error: ") + what);
#else
  std::fprintf(stderr, "moefold: value() on an error: %s\n", what);
  std::abort();
#endif
}
}  // namespace detail

//! Either a value of type T or an error of type E (by default moefold::error).
template <class T, class E = error>
class [[nodiscard]] expected {
  static_assert(!std::is_reference_v<T> && !std::is_void_v<T>);

 public:
  using value_type = T;
  using error_type = E;

  constexpr expected(const T& v) : has_(true) { std::construct_at(&val_, v); }
  constexpr expected(T&& v) : has_(true) { std::construct_at(&val_, std::move(v)); }
  template <class G>
  requires std::is_constructible_v<E, G>
  constexpr expected(const unexpected<G>& u) : has_(false) { std::construct_at(&err_, u.error()); }
  constexpr expected(const expected& o) : has_(o.has_) {
    if (has_)
      std::construct_at(&val_, o.val_);
    else
      std::construct_at(&err_, o.err_);
  }
  constexpr expected(expected&& o) noexcept(
      std::is_nothrow_move_constructible_v<T>&& std::is_nothrow_move_constructible_v<E>)
      : has_(o.has_) {
    if (has_)
      std::construct_at(&val_, std::move(o.val_));
    else
      std::construct_at(&err_, o.err_);
  }
  constexpr expected& operator=(expected o) {
    destroy();
    has_ = o.has_;
    if (has_)
      std::construct_at(&val_, std::move(o.val_));
    else
      std::construct_at(&err_, o.err_);
    return *this;
  }
  constexpr ~expected() { destroy(); }

  [[nodiscard]] constexpr bool has_value() const noexcept { return has_; }
  constexpr explicit operator bool() const noexcept { return has_; }

  [[nodiscard]] constexpr T& value() & {
    if (!has_) detail::bad_expected_access(err_);
    return val_;
  }
  [[nodiscard]] constexpr const T& value() const& {
    if (!has_) detail::bad_expected_access(err_);
    return val_;
  }
  [[nodiscard]] constexpr T&& value() && {
    if (!has_) detail::bad_expected_access(err_);
    return std::move(val_);
  }
  [[nodiscard]] constexpr const E& error() const& noexcept { return err_; }
  [[nodiscard]] constexpr E&& error() && noexcept { return std::move(err_); }

  constexpr T& operator*() & noexcept { return val_; }
  constexpr const T& operator*() const& noexcept { return val_; }
  constexpr T* operator->() noexcept { return &val_; }
  constexpr const T* operator->() const noexcept { return &val_; }

 private:
  constexpr void destroy() {
    if (has_)
      std::destroy_at(&val_);
    else
      std::destroy_at(&err_);
  }

  union {
    T val_;
    E err_;
  };
  bool has_;
};

//! Success or an error: what a checking function without a result returns.
template <class E>
class [[nodiscard]] expected<void, E> {
 public:
  using value_type = void;
  using error_type = E;

  constexpr expected() = default;
  template <class G>
  requires std::is_constructible_v<E, G>
  constexpr expected(const unexpected<G>& u) : has_(false), err_(u.error()) {}

  [[nodiscard]] constexpr bool has_value() const noexcept { return has_; }
  constexpr explicit operator bool() const noexcept { return has_; }
  constexpr void value() const {
    if (!has_) detail::bad_expected_access(err_);
  }
  [[nodiscard]] constexpr const E& error() const& noexcept { return err_; }
  [[nodiscard]] constexpr E&& error() && noexcept { return std::move(err_); }

 private:
  bool has_ = true;
  E err_{};
};

//! The result of an operation that produces no value.
using status = expected<void, error>;

//! The first failure among statuses already computed (each step ran), or success: for a short
//! list of independent steps, such as allocations, whose first error is the one to report.
[[nodiscard]] inline status first_error(std::initializer_list<status> steps) {
  for (const status& st : steps)
    if (!st) return st;
  return {};
}

}  // namespace v0_1
}  // namespace moefold
