// The layers for f32 and f64 tensors. Two units hold the three element types (this one and
// layer_bf16.cpp, each about as long to compile as binding.cpp's torch headers), so the extension
// builds in about the time of one unit with two jobs; none includes a torch header.
#include "layer_impl.hpp"

namespace moefold_torch {

moefold::expected<std::unique_ptr<layer_api>> make_layer_f32(const layer_spec& spec,
                                                             layer_communicators comms) {
  return layer_impl<float>::make(spec, std::move(comms));
}

moefold::expected<std::unique_ptr<layer_api>> make_layer_f64(const layer_spec& spec,
                                                             layer_communicators comms) {
  return layer_impl<double>::make(spec, std::move(comms));
}

}  // namespace moefold_torch
