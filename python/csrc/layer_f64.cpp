// The layer for f64 tensors (one element type per unit: the units compile in parallel).
#include "layer_impl.hpp"

namespace moefold_torch {

moefold::expected<std::unique_ptr<layer_api>> make_layer_f64(const layer_spec& spec,
                                                             layer_communicators comms) {
  return layer_impl<double>::make(spec, std::move(comms));
}

}  // namespace moefold_torch
