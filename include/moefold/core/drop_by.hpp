//! @file drop_by.hpp
//! @brief Which routed tokens an expert keeps when it has more than its capacity: the one enum
//! the drop policies (dispatch/drop_policy_local.hpp, drop_policy_full_sequence.hpp) and the keep
//! kernels (kernels/capacity.hpp) share, in core because the kernels sit below dispatch.
#pragma once

namespace moefold {
inline namespace v0_1 {

//! Which routed tokens an expert keeps when it has more than its capacity.
enum class drop_by : int {
  probs = 0,     //!< the highest probabilities (ties: earlier token first)
  position = 1,  //!< the earliest tokens in sequence order (later positions are dropped first)
};

}  // namespace v0_1
}  // namespace moefold
