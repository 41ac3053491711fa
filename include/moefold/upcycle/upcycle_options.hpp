//! @file upcycle_options.hpp
//! @brief What an upcycling is asked for: the dense FFN it starts from, the MoE it becomes
//! (experts, top-k, granularity, activation, where softmax sits, router initialisation), and the
//! checks every part of the upcycling shares (docs/upcycling.md).
#pragma once

#include <cstdint>
#include <string>

#include "../core/expected.hpp"
#include "../core/score_function.hpp"
#include "../experts/activation.hpp"

namespace moefold {
inline namespace v0_1 {

//! The dense FFN: hidden size H, width F_d, gated (gate, up, down) or not (up, down).
struct dense_ffn_shape {
  int hidden = 0;     //!< H
  int ffn = 0;        //!< F_d
  bool gated = true;  //!< gate_proj present
};

//! How the router starts: normal(0, 0.02) from moefold's own generator (rows repeated within each
//! virtual group), or every row zero, so every expert gets the same logit ("uniform").
enum class router_init : std::uint8_t { random, uniform };

struct upcycle_options {
  int num_experts = 0;                  //!< E = expansion * G
  int topk = 1;                         //!< k
  int granularity = 1;                  //!< G: each expert is a 1/G slice of the dense FFN
  activation act = activation::swiglu;  //!< the dense FFN's (and the experts') activation
  score_function score = score_function::softmax;
  bool pre_softmax = false;  //!< softmax before top-k (moe_router_pre_softmax)
  router_init init = router_init::random;
  std::uint64_t seed = 0;  //!< the router generator's seed
};

namespace detail {
//! The rules an upcycling obeys, each a named error: sizes >= 1, k <= E, G divides F_d and E,
//! the activation matches the dense FFN's gating, and a score function whose weight scale is
//! derived (softmax; the sigmoid router is refused: its probabilities do not sum to 1, so no
//! scale makes the experts add up to the dense FFN).
[[nodiscard]] inline status check_upcycle(const dense_ffn_shape& d, const upcycle_options& o) {
  using detail::to_decimal;
  if (d.hidden < 1 || d.ffn < 1 || o.num_experts < 1 || o.topk < 1 || o.granularity < 1)
    return make_error(errc::invalid_size,
                      "upcycle: hidden, ffn, num_experts, topk and granularity must be >= 1");
  if (o.topk > o.num_experts)
    return make_error(errc::invalid_argument,
                      "upcycle: topk = " + to_decimal(o.topk) +
                          " exceeds num_experts = " + to_decimal(o.num_experts));
  if (d.ffn % o.granularity != 0)
    return make_error(errc::invalid_argument,
                      "upcycle: granularity G = " + to_decimal(o.granularity) +
                          " does not divide the dense FFN width " + to_decimal(d.ffn) +
                          " (each expert is a 1/G slice of it)");
  if (o.num_experts % o.granularity != 0)
    return make_error(errc::invalid_argument,
                      "upcycle: granularity G = " + to_decimal(o.granularity) +
                          " does not divide num_experts = " + to_decimal(o.num_experts) +
                          " (E = expansion * G)");
  if (is_gated(o.act) != d.gated)
    return make_error(errc::invalid_argument,
                      std::string("upcycle: activation ") + std::string(to_string(o.act)) +
                          (d.gated ? " is not gated, but the dense FFN has a gate projection"
                                   : " is gated, but the dense FFN has no gate projection"));
  if (o.score != score_function::softmax)
    return make_error(errc::invalid_argument,
                      std::string("upcycle: the ") + std::string(to_string(o.score)) +
                          " router has no derived weight scale (its probabilities need not "
                          "sum to 1); upcycle with the softmax router");
  if (!o.pre_softmax && o.topk == 1 && o.num_experts > 1)
    return make_error(errc::invalid_argument,
                      "upcycle: softmax after top-k with k = 1 gives every token probability 1 "
                      "(the router gets no gradient); use k >= 2 or pre_softmax");
  return {};
}
}  // namespace detail

}  // namespace v0_1
}  // namespace moefold
