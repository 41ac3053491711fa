#include <moefold/mesh/order.hpp>

#include <doctest/doctest.h>

using namespace moefold;

TEST_CASE("orders parse into five tokens, missing ones appended in Megatron's order") {
  auto o = megatron_order::parse("tp-cp-ep-dp-pp").value();
  CHECK(o == default_order);
  CHECK(o.given == 5);
  CHECK(o.pp_last());
  auto p = megatron_order::parse("tp-cp-ep-pp-dp").value();
  CHECK_FALSE(p.pp_last());
  CHECK(p.position(order_token::dp) == 4);
  CHECK(p == tp_pp_dp_order);
  // "tp-dp-pp": ep and cp are appended, ep first (Megatron checks tp, pp, dp, ep, cp).
  auto q = megatron_order::parse("tp-dp-pp").value();
  CHECK(q.given == 3);
  CHECK(q.tokens[3] == order_token::ep);
  CHECK(q.tokens[4] == order_token::cp);
  CHECK_FALSE(q.written(order_token::cp));
  CHECK(q.str() == "tp-dp-pp");
  // "dp": tp, pp, ep, cp appended.
  auto r = megatron_order::parse("dp").value();
  CHECK(r.tokens == std::array{order_token::dp, order_token::tp, order_token::pp, order_token::ep,
                               order_token::cp});
}

TEST_CASE("orders are case-insensitive (Megatron lowercases tokens but not its pp-last test)") {
  auto o = megatron_order::parse("TP-CP-EP-DP-PP").value();
  CHECK(o == default_order);
  CHECK(o.pp_last());
  CHECK(o.str() == "tp-cp-ep-dp-pp");
  CHECK(megatron_order::parse("Tp-cP-ep-PP-dp").value() == tp_pp_dp_order);
}

TEST_CASE("bad orders: unknown tokens (compared whole, not as substrings), duplicates, empties") {
  for (const char* bad : {"tp-cp-xx-dp-pp", "tp-cp-ep-dp-pp-xx", "gtp_remat-cp-ep-dp-pp", "tpp", "",
                          "-", "tp--pp", "tp-cp-ep-dp-pp-", " tp-pp", "tp_cp"}) {
    CAPTURE(bad);
    auto o = megatron_order::parse(bad);
    REQUIRE_FALSE(o);
    CHECK(o.error().code == errc::order_unknown_token);
    CHECK(o.error().message.find("unknown token") != std::string::npos);
  }
  auto d = megatron_order::parse("tp-cp-tp-dp-pp");
  CHECK(d.error().code == errc::order_duplicate_token);
  CHECK(d.error().message.find("'tp' appears twice") != std::string::npos);
  CHECK(megatron_order::parse("tp-cp-ep-dp-pp-PP").error().code == errc::order_duplicate_token);
}

TEST_CASE("an order literal is checked at compile time") {
  constexpr megatron_order o{"cp-tp-ep-dp-pp"};
  static_assert(o.position(order_token::cp) == 0 && o.position(order_token::tp) == 1);
  static_assert(dynamic_order.is_dynamic && !default_order.is_dynamic);
}
