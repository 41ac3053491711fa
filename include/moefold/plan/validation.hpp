//! @file validation.hpp
//! @brief How far the step model has been from published measurements it was not fitted to: the
//! error band every prediction is printed with. The numbers come from the validation table of
//! docs/planner.md ("Accuracy"); tests/plan/accuracy.py recomputes them from the table and
//! fails when they differ, so they cannot drift from the model.
#pragma once

#include <utility>

namespace moefold {
inline namespace v0_1 {
namespace plan {

//! Signed relative errors (predicted - published) / published over the held-out points.
struct error_band {
  int points = 0;       //!< held-out published measurements
  double mean_abs = 0;  //!< mean absolute error
  double low = 0;       //!< 10th percentile of the signed error
  double high = 0;      //!< 90th percentile
};

inline constexpr error_band validation_band{
    .points = 69, .mean_abs = 0.091, .low = -0.114, .high = 0.141};

//! The range a measurement of a predicted value has fallen in for 80% of the held-out points:
//! published = predicted / (1 + error).
[[nodiscard]] constexpr std::pair<double, double> measured_range(
    double predicted, const error_band& b = validation_band) noexcept {
  return {predicted / (1 + b.high), predicted / (1 + b.low)};
}

}  // namespace plan
}  // namespace v0_1
}  // namespace moefold
