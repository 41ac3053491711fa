//! @file record_pair.hpp
//! @brief The one rule a routing record's pair obeys, for every builder on every executor: pair
//! s of a contiguous [N, k] record names -1 (dropped) or an expert in [0, E), and no expert its
//! token named in an earlier slot. The host plan builder, the host and kernel histograms and the
//! plan's tile-count kernel all ask this function, so their verdicts cannot drift apart.
#pragma once

#include <moefold/core/config.hpp>

namespace moefold::kernels {

//! True when pair s of ids [N, k] breaks the rule above. Reads slots s - s % k .. s only.
MOEFOLD_HOST_DEVICE inline bool bad_record_pair(const int* ids, long long s, int k,
                                                int num_experts) noexcept {
  const int e = ids[s];
  if (e < -1 || e >= num_experts) return true;
  if (e < 0) return false;
  for (long long q = s - s % k; q < s; ++q)
    if (ids[q] == e) return true;
  return false;
}

}  // namespace moefold::kernels
