//! @file activation.hpp
//! @brief The expert activations by name: the one enum the experts (experts/activation.hpp, the
//! host reference) and the activation kernels (kernels/activation.hpp) share, in core because the
//! kernels sit below experts. Gated forms (SwiGLU, GeGLU) compute act(gate) * up; plain forms
//! act(x).
#pragma once

#include <cstdint>
#include <string_view>

namespace moefold {
inline namespace v0_1 {

enum class activation : std::uint8_t {
  swiglu,        //!< silu(gate) * up (gated)
  geglu,         //!< gelu(gate) * up (gated)
  gelu,          //!< gelu(x), the exact (erf) form, as torch.nn.functional.gelu
  silu,          //!< x * sigmoid(x)
  relu,          //!< max(x, 0)
  squared_relu,  //!< max(x, 0)^2
};

[[nodiscard]] constexpr bool is_gated(activation a) noexcept {
  return a == activation::swiglu || a == activation::geglu;
}

[[nodiscard]] constexpr std::string_view to_string(activation a) noexcept {
  switch (a) {
    case activation::swiglu: return "swiglu";
    case activation::geglu: return "geglu";
    case activation::gelu: return "gelu";
    case activation::silu: return "silu";
    case activation::relu: return "relu";
    case activation::squared_relu: return "squared_relu";
  }
  return "?";
}

}  // namespace v0_1
}  // namespace moefold
