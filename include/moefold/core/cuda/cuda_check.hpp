//! @file cuda_check.hpp
//! @brief A CUDA runtime status as a moefold status: errc::backend_error naming the call, with
//! error::native = the cudaError_t. Needs the CUDA headers, not nvcc.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "../expected.hpp"

namespace moefold {
inline namespace v0_1 {
namespace detail {

inline status cuda_check(cudaError_t rc, const char* call) {
  if (rc == cudaSuccess) return {};
  error e{errc::backend_error,
          std::string(call) + " failed: " + cudaGetErrorString(rc) + " (cudaError " +
              std::to_string(static_cast<int>(rc)) + ")",
          static_cast<int>(rc)};
  return unexpected<error>(e);
}

}  // namespace detail
}  // namespace v0_1
}  // namespace moefold
