//! @file order.hpp
//! @brief Megatron-Core's order string ("tp-cp-ep-dp-pp"), parsed and checked.
//!
//! One order string lays out both meshes of a fold: the attention generator reads the tokens as
//! tp/cp/ep/dp/pp with ep of size 1, the MoE generator as etp/cp/ep/edp/pp with cp of size 1. The
//! leftmost token varies fastest. Tokens of size-1 axes may be left out; Megatron appends them at
//! the end in the order tp, pp, dp, ep, cp, where they change nothing.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "../core/error.hpp"
#include "../core/expected.hpp"

namespace moefold {
inline namespace v0_1 {

//! The five tokens of an order string.
enum class order_token : std::uint8_t { tp, cp, ep, dp, pp };

[[nodiscard]] constexpr std::string_view to_string(order_token t) noexcept {
  constexpr std::array<std::string_view, 5> names{"tp", "cp", "ep", "dp", "pp"};
  return names[static_cast<std::size_t>(t)];
}

namespace detail {

[[nodiscard]] constexpr char ascii_lower(char c) noexcept {
  return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c;
}

//! What scan_order found: the tokens in order (the missing ones appended), or the rule broken and
//! the token, as written, that broke it.
struct order_scan {
  std::array<order_token, 5> tokens{};
  int given = 0;
  errc code = errc::success;
  std::string_view token;  //!< the offending token, a view into the text scanned
};

//! The order parser itself, on string_views and arrays only (no std::string), so that the
//! consteval literal constructor is a constant expression with every compiler and standard
//! library; megatron_order::parse words the errors.
[[nodiscard]] constexpr order_scan scan_order(std::string_view text) noexcept {
  order_scan r;
  std::array<bool, 5> seen{};
  std::size_t start = 0;
  while (true) {
    const std::size_t dash = text.find('-', start);
    const std::string_view raw =
        text.substr(start, dash == std::string_view::npos ? std::string_view::npos : dash - start);
    int id = -1;
    for (int t = 0; t < 5; ++t) {
      const std::string_view name = to_string(static_cast<order_token>(t));
      bool same = raw.size() == name.size();
      for (std::size_t i = 0; same && i < raw.size(); ++i) same = ascii_lower(raw[i]) == name[i];
      if (same) id = t;
    }
    if (id < 0 || seen[static_cast<std::size_t>(id)]) {
      r.code = id < 0 ? errc::order_unknown_token : errc::order_duplicate_token;
      r.token = raw;
      return r;
    }
    seen[static_cast<std::size_t>(id)] = true;
    r.tokens[static_cast<std::size_t>(r.given++)] = static_cast<order_token>(id);
    if (dash == std::string_view::npos) break;
    start = dash + 1;
  }
  // Megatron appends the missing tokens in this order; they must have size 1 (checked by the
  // fold, which knows the sizes).
  int next = r.given;
  for (order_token t :
       {order_token::tp, order_token::pp, order_token::dp, order_token::ep, order_token::cp})
    if (!seen[static_cast<std::size_t>(t)]) r.tokens[static_cast<std::size_t>(next++)] = t;
  return r;
}

}  // namespace detail

//! A parsed order string. Structural, so a fold can take it as a template argument:
//! `folded_mesh<A, M, megatron_order{"tp-cp-ep-pp-dp"}>`.
struct megatron_order {
  //! All five tokens: the ones the user wrote, then the missing ones in Megatron's order.
  std::array<order_token, 5> tokens{order_token::tp, order_token::cp, order_token::ep,
                                    order_token::dp, order_token::pp};
  //! How many tokens the user wrote (the rest were appended and must have size 1).
  int given = 5;
  //! True for the placeholder `dynamic_order` (the order is then a run-time value of the fold).
  bool is_dynamic = false;

  //! The default order "tp-cp-ep-dp-pp".
  constexpr megatron_order() = default;

  //! A compile-time order from a literal; an invalid literal does not compile.
  consteval megatron_order(const char* text) {  // NOLINT: implicit on purpose, like a literal
    const detail::order_scan r = detail::scan_order(text);
    if (r.code != errc::success) invalid_order_string_literal();
    tokens = r.tokens;
    given = r.given;
  }

  //! Parses an order string. Case-insensitive (Megatron lowercases the tokens but not its
  //! pp-last test; we apply one rule to one spelling). Tokens are compared whole, not as
  //! substrings (Megatron's substring test lets "gtp_remat" stand for "tp").
  [[nodiscard]] static constexpr expected<megatron_order> parse(std::string_view text) {
    const detail::order_scan r = detail::scan_order(text);
    if (r.code == errc::order_unknown_token)
      return make_error(r.code, "order '" + std::string(text) + "': unknown token '" +
                                    std::string(r.token) +
                                    "' (rule: tokens are tp, cp, ep, dp, pp joined by '-')");
    if (r.code != errc::success) {
      std::string tok(r.token);
      for (char& c : tok) c = detail::ascii_lower(c);
      return make_error(r.code, "order '" + std::string(text) + "': token '" + tok +
                                    "' appears twice (rule: each axis at most once)");
    }
    megatron_order o;
    o.tokens = r.tokens;
    o.given = r.given;
    return o;
  }

  //! Position of a token in the normalized order (0 = fastest).
  [[nodiscard]] constexpr int position(order_token t) const noexcept {
    for (int i = 0; i < 5; ++i)
      if (tokens[static_cast<std::size_t>(i)] == t) return i;
    return -1;
  }
  //! True when the user wrote the token.
  [[nodiscard]] constexpr bool written(order_token t) const noexcept { return position(t) < given; }
  //! True when the written order ends with pp (Megatron rule 7's `order.endswith("pp")`).
  [[nodiscard]] constexpr bool pp_last() const noexcept {
    return given > 0 && tokens[static_cast<std::size_t>(given - 1)] == order_token::pp;
  }
  //! The order as the user wrote it, lower case ("tp-cp-ep-dp-pp").
  [[nodiscard]] constexpr std::string str() const {
    std::string s;
    for (int i = 0; i < given; ++i) {
      if (i) s += '-';
      s += to_string(tokens[static_cast<std::size_t>(i)]);
    }
    return s;
  }

  friend constexpr bool operator==(const megatron_order&, const megatron_order&) = default;

 private:
  static void invalid_order_string_literal() {}  // not constexpr: calling it fails compilation
};

//! Placeholder template argument: the fold's order is a run-time value.
inline constexpr megatron_order dynamic_order = [] {
  megatron_order o;
  o.is_dynamic = true;
  return o;
}();

//! The two orders Megatron-Core's trainer uses.
inline constexpr megatron_order default_order{};
inline constexpr megatron_order tp_pp_dp_order = megatron_order{"tp-cp-ep-pp-dp"};

}  // namespace v0_1
}  // namespace moefold
