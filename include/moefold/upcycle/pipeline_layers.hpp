//! @file pipeline_layers.hpp
//! @brief Which dense layers a pipeline stage holds when upcycling, as Megatron-Core splits a
//! model without a custom layout: stage s of PP holds layers [s N / PP, (s + 1) N / PP), every
//! dense layer counted; a count PP does not divide is an error (Megatron-Core then needs an
//! explicit layout, which this does not model). A rank upcycles only its own stage's layers.
#pragma once

#include "../core/expected.hpp"

namespace moefold {
inline namespace v0_1 {

//! Layers [first, first + count) of one pipeline stage.
struct stage_layers {
  int first = 0;
  int count = 0;
  [[nodiscard]] constexpr bool holds(int layer) const noexcept {
    return layer >= first && layer < first + count;
  }
};

//! The layers of stage `stage` of `pp` over a model of `num_layers` layers.
[[nodiscard]] inline expected<stage_layers> pipeline_stage_layers(int num_layers, int pp,
                                                                  int stage) {
  using detail::to_decimal;
  if (num_layers < 1 || pp < 1)
    return make_error(errc::invalid_size, "upcycle: num_layers and pp must be >= 1");
  if (stage < 0 || stage >= pp)
    return make_error(errc::rank_out_of_range, "upcycle: pipeline stage " + to_decimal(stage) +
                                                   " is outside pp = " + to_decimal(pp));
  if (num_layers % pp != 0)
    return make_error(errc::invalid_argument,
                      "upcycle: " + to_decimal(num_layers) +
                          " layers do not split evenly over pp = " + to_decimal(pp) +
                          " (rule: Megatron-Core gives each stage num_layers / pp layers unless a "
                          "layout is given)");
  const int per = num_layers / pp;
  return stage_layers{.first = stage * per, .count = per};
}

//! An error naming the rule unless layer `layer` lies on stage `stage`.
[[nodiscard]] inline status check_layer_on_stage(int num_layers, int pp, int stage, int layer) {
  using detail::to_decimal;
  auto s = pipeline_stage_layers(num_layers, pp, stage);
  if (!s) return unexpected<error>(s.error());
  if (layer < 0 || layer >= num_layers)
    return make_error(errc::rank_out_of_range, "upcycle: layer " + to_decimal(layer) +
                                                   " is out of range (the model has " +
                                                   to_decimal(num_layers) + " layers)");
  if (!s->holds(layer))
    return make_error(errc::invalid_argument,
                      "upcycle: layer " + to_decimal(layer) + " is on pipeline stage " +
                          to_decimal(layer / s->count) + ", not this rank's stage " +
                          to_decimal(stage) +
                          " (rule: a rank upcycles only its own stage's layers)");
  return {};
}

}  // namespace v0_1
}  // namespace moefold
