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

#include "../core/expected.hpp"

namespace moefold {

//! The five tokens of an order string.
enum class order_token : std::uint8_t { tp, cp, ep, dp, pp };

[[nodiscard]] constexpr std::string_view to_string(order_token t) noexcept {
  constexpr std::array<std::string_view, 5> names{"tp", "cp", "ep", "dp", "pp"};
  return names[static_cast<std::size_t>(t)];
}

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
    auto p = parse(text);
    if (!p) invalid_order_string_literal();
    *this = *p;
  }

  //! Parses an order string. Case-insensitive (Megatron lowercases the tokens but not its
  //! pp-last test; we apply one rule to one spelling). Tokens are compared whole, not as
  //! substrings (Megatron's substring test lets "gtp_remat" stand for "tp").
  [[nodiscard]] static constexpr expected<megatron_order> parse(std::string_view text) {
    megatron_order o;
    o.given = 0;
    std::array<bool, 5> seen{};
    std::size_t start = 0;
    while (true) {
      const std::size_t dash = text.find('-', start);
      const std::string_view raw = text.substr(
          start, dash == std::string_view::npos ? std::string_view::npos : dash - start);
      std::string tok(raw);
      for (char& c : tok)
        if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
      int id = -1;
      for (int t = 0; t < 5; ++t)
        if (tok == to_string(static_cast<order_token>(t))) id = t;
      if (id < 0)
        return make_error(errc::order_unknown_token,
                          "order '" + std::string(text) + "': unknown token '" + std::string(raw) +
                              "' (rule: tokens are tp, cp, ep, dp, pp joined by '-')");
      if (seen[static_cast<std::size_t>(id)])
        return make_error(errc::order_duplicate_token,
                          "order '" + std::string(text) + "': token '" + tok +
                              "' appears twice (rule: each axis at most once)");
      seen[static_cast<std::size_t>(id)] = true;
      o.tokens[static_cast<std::size_t>(o.given++)] = static_cast<order_token>(id);
      if (dash == std::string_view::npos) break;
      start = dash + 1;
    }
    // Megatron appends the missing tokens in this order; they must have size 1 (checked by the
    // fold, which knows the sizes).
    int next = o.given;
    for (order_token t :
         {order_token::tp, order_token::pp, order_token::dp, order_token::ep, order_token::cp})
      if (!seen[static_cast<std::size_t>(t)]) o.tokens[static_cast<std::size_t>(next++)] = t;
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

}  // namespace moefold
