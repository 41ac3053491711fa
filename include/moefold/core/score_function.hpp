//! @file score_function.hpp
//! @brief The router's score functions by name: the one enum the router (routing/) and the router
//! kernels (kernels/router.hpp) share, in core because the kernels sit below routing.
#pragma once

#include <string_view>

namespace moefold {
inline namespace v0_1 {

//! How logits become scores (Megatron-Core `moe_router_score_function`).
enum class score_function {
  softmax,        //!< softmax over the experts (before or after top-k, see pre_softmax)
  sigmoid,        //!< sigmoid per expert; the k selected scores are renormalised when k > 1
  sqrt_softplus,  //!< sqrt(softplus(x)) per expert; renormalised like sigmoid
};

[[nodiscard]] constexpr std::string_view to_string(score_function f) noexcept {
  switch (f) {
    case score_function::softmax: return "softmax";
    case score_function::sigmoid: return "sigmoid";
    case score_function::sqrt_softplus: return "sqrt_softplus";
  }
  return "unknown";
}

}  // namespace v0_1
}  // namespace moefold
