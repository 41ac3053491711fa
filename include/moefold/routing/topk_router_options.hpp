//! @file topk_router_options.hpp
//! @brief What a top-k router does (Megatron-Core's `moe_router_*` settings) and the rules its
//! options keep: one set of options and one validation for every router of the library.
#pragma once

#include <cmath>
#include <optional>
#include <string>

#include "../core/error.hpp"
#include "../core/expected.hpp"
#include "../core/score_function.hpp"

namespace moefold {
inline namespace v0_1 {

//! What a top-k router does; the fields follow Megatron-Core's `moe_router_*` settings.
struct topk_router_options {
  int num_experts = 0;                             //!< E
  int topk = 0;                                    //!< k, 1 <= k <= E
  score_function score = score_function::softmax;  //!< moe_router_score_function
  bool pre_softmax = false;                        //!< softmax over E before top-k (softmax only)
  int num_groups = 0;                              //!< expert groups; 0 = no group limit
  int group_topk = 0;                              //!< groups kept per token (with num_groups)
  std::optional<double> scaling_factor = std::nullopt;  //!< moe_router_topk_scaling_factor
  bool expert_bias = false;                             //!< selection uses scores + expert bias
};

//! Checks the options against the rules Megatron-Core's config enforces (and two it leaves to
//! chance: group limits that cannot supply k experts, group_topk > k).
[[nodiscard]] inline status validate(const topk_router_options& o) {
  using detail::to_decimal;
  if (o.num_experts < 1)
    return make_error(errc::invalid_size,
                      "router: num_experts must be >= 1 (got " + to_decimal(o.num_experts) + ")");
  if (o.topk < 1 || o.topk > o.num_experts)
    return make_error(errc::invalid_argument,
                      "router: topk must be in [1, num_experts=" + to_decimal(o.num_experts) +
                          "] (got " + to_decimal(o.topk) + ")");
  if (o.score == score_function::softmax && !o.pre_softmax && o.topk == 1)
    return make_error(errc::invalid_argument,
                      "router: topk == 1 with softmax needs pre_softmax (a softmax over one "
                      "selected logit is constant 1 and has no gradient)");
  if (o.pre_softmax && o.score != score_function::softmax)
    return make_error(errc::invalid_argument,
                      "router: pre_softmax applies only to the softmax score function");
  if (o.expert_bias && o.score == score_function::softmax)
    return make_error(errc::invalid_argument,
                      "router: the expert bias needs the sigmoid or sqrt_softplus score function");
  if (o.scaling_factor && !(std::isfinite(*o.scaling_factor) && *o.scaling_factor > 0))
    return make_error(errc::invalid_argument,
                      "router: scaling_factor must be finite and > 0 when given");
  if (o.num_groups != 0 || o.group_topk != 0) {
    if (o.num_groups < 1 || o.num_experts % o.num_groups != 0)
      return make_error(errc::invalid_argument,
                        "router: num_groups must be >= 1 and divide num_experts (num_experts=" +
                            to_decimal(o.num_experts) + ", num_groups=" + to_decimal(o.num_groups) +
                            ")");
    if (o.group_topk < 1 || o.group_topk > o.num_groups)
      return make_error(errc::invalid_argument,
                        "router: group_topk must be in [1, num_groups=" + to_decimal(o.num_groups) +
                            "] (got " + to_decimal(o.group_topk) + ")");
    // A group scores with its top-(k / group_topk) experts: k < group_topk would score every
    // group 0, and the kept groups must hold at least k experts.
    const int per = o.num_experts / o.num_groups;
    if (o.topk < o.group_topk || o.topk > o.group_topk * per)
      return make_error(errc::invalid_argument,
                        "router: group-limited routing needs group_topk <= topk <= group_topk * "
                        "experts_per_group (topk=" +
                            to_decimal(o.topk) + ", group_topk=" + to_decimal(o.group_topk) +
                            ", experts_per_group=" + to_decimal(per) + ")");
  }
  return {};
}

}  // namespace v0_1
}  // namespace moefold
