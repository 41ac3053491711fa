// The layer for bf16 tensors (its own unit: see layer_f32_f64.cpp).
#include "layer_impl.hpp"

namespace moefold_torch {

moefold::expected<std::unique_ptr<layer_api>> make_layer_bf16(const layer_spec& spec,
                                                              layer_communicators comms) {
  return layer_impl<moefold::bfloat16>::make(spec, std::move(comms));
}

}  // namespace moefold_torch
