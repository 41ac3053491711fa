//! @file error.hpp
//! @brief Error codes and the error value carried by moefold::expected.
#pragma once

#include <string>
#include <string_view>

namespace moefold {
inline namespace v0_1 {

//! Every failure the library reports has one of these kinds. Each validation rule has its own
//! kind, so that callers (and tests) can tell which rule was broken without parsing messages.
enum class errc {
  success = 0,
  invalid_argument,             //!< malformed input that no more specific kind describes
  invalid_size,                 //!< a size below 1, or a static size contradicted at run time
  overflow,                     //!< a product of sizes or a rank does not fit in int
  world_not_divisible,          //!< Megatron rule 2: world % (tp*cp*pp) != 0
  moe_world_not_divisible,      //!< Megatron rule 5: world % (etp*ep*pp) != 0
  order_missing_axis,           //!< Megatron rules 4/6: an axis of size > 1 is not in the order
  order_unknown_token,          //!< Megatron rule 4b: a token that is not tp, cp, ep, dp or pp
  order_duplicate_token,        //!< an axis named twice (Megatron builds garbage groups then)
  fold_data_parallel_mismatch,  //!< Megatron rule 7: pp not last requires edp == dp
  fold_pipeline_mismatch,       //!< Megatron rule 8: both meshes must have the same pp groups
  dist_opt_dp_not_divisible,    //!< Megatron rule 9: (dp*cp) % dist_opt_instances != 0
  hierarchical_cp_mismatch,     //!< Megatron rule 11: product of hierarchical CP sizes != cp
  dist_opt_edp_not_divisible,   //!< Megatron rule 13: edp % dist_opt_instances != 0
  rank_out_of_range,            //!< a rank or coordinate outside the mesh
  shape_mismatch,               //!< tensor shapes or counts that do not fit together
  non_finite_input,             //!< NaN or infinity where a finite number is required
  not_supported,                //!< a valid request this build or backend cannot serve
  workspace_too_small,          //!< the caller's workspace is smaller than workspace_bytes()
  receive_bound_exceeded,       //!< a rank would receive more rows than dispatch_shape's bound
  comm_mismatch,                //!< peers called different collectives, or counts disagree
  comm_timeout,                 //!< a peer did not arrive within the timeout
  comm_peer_failed,             //!< a peer threw, returned early or aborted
  comm_broken,                  //!< the communicator is unusable after an earlier failure
  kernel_fault,                 //!< a kernel broke a rule of the SIMT seam (divergent barrier)
  backend_error,                //!< an MPI, NCCL or CUDA call failed (see error::native)
};

//! The name of an error kind, as used in messages ("world_not_divisible").
[[nodiscard]] constexpr std::string_view to_string(errc e) noexcept {
  switch (e) {
    case errc::success: return "success";
    case errc::invalid_argument: return "invalid_argument";
    case errc::invalid_size: return "invalid_size";
    case errc::overflow: return "overflow";
    case errc::world_not_divisible: return "world_not_divisible";
    case errc::moe_world_not_divisible: return "moe_world_not_divisible";
    case errc::order_missing_axis: return "order_missing_axis";
    case errc::order_unknown_token: return "order_unknown_token";
    case errc::order_duplicate_token: return "order_duplicate_token";
    case errc::fold_data_parallel_mismatch: return "fold_data_parallel_mismatch";
    case errc::fold_pipeline_mismatch: return "fold_pipeline_mismatch";
    case errc::dist_opt_dp_not_divisible: return "dist_opt_dp_not_divisible";
    case errc::hierarchical_cp_mismatch: return "hierarchical_cp_mismatch";
    case errc::dist_opt_edp_not_divisible: return "dist_opt_edp_not_divisible";
    case errc::rank_out_of_range: return "rank_out_of_range";
    case errc::shape_mismatch: return "shape_mismatch";
    case errc::non_finite_input: return "non_finite_input";
    case errc::not_supported: return "not_supported";
    case errc::workspace_too_small: return "workspace_too_small";
    case errc::receive_bound_exceeded: return "receive_bound_exceeded";
    case errc::comm_mismatch: return "comm_mismatch";
    case errc::comm_timeout: return "comm_timeout";
    case errc::comm_peer_failed: return "comm_peer_failed";
    case errc::comm_broken: return "comm_broken";
    case errc::kernel_fault: return "kernel_fault";
    case errc::backend_error: return "backend_error";
  }
  return "unknown";
}

//! An error: its kind, a message for a person that names the rule and the values, and for
//! backend_error the native code (an MPI error class, ncclResult_t or cudaError_t).
struct error {
  errc code = errc::success;
  std::string message;
  int native = 0;

  friend bool operator==(const error& a, const error& b) = default;
};

namespace detail {
//! A decimal number for a message; constexpr (std::to_string is not), so that checks that build
//! messages still run at compile time.
[[nodiscard]] constexpr std::string to_decimal(long long v) {
  const bool neg = v < 0;
  // Work on the magnitude as unsigned so that LLONG_MIN does not overflow.
  unsigned long long m =
      neg ? 0ull - static_cast<unsigned long long>(v) : static_cast<unsigned long long>(v);
  std::string s;
  do {
    s.insert(s.begin(), static_cast<char>('0' + m % 10));
    m /= 10;
  } while (m);
  if (neg) s.insert(s.begin(), '-');
  return s;
}
}  // namespace detail

}  // namespace v0_1
}  // namespace moefold
