//! @file cublas_status.hpp
//! @brief A cuBLAS status as a moefold status: errc::backend_error naming the call and the status,
//! error::native = the cublasStatus_t.
#pragma once

#include <cublas_v2.h>

#include <string>

#include "../expected.hpp"

namespace moefold {
inline namespace v0_1 {
namespace detail {

//! A cuBLAS status as errc::backend_error naming the call and the status (error::native = the
//! cublasStatus_t).
inline status cublas_check(cublasStatus_t rc, const char* call) {
  if (rc == CUBLAS_STATUS_SUCCESS) return {};
  const char* name = cublasGetStatusName(rc);
  error e{errc::backend_error,
          std::string(call) + " failed: " + (name ? name : "unknown cuBLAS status") +
              " (cublasStatus " + std::to_string(static_cast<int>(rc)) + ")",
          static_cast<int>(rc)};
  return unexpected<error>(e);
}

}  // namespace detail
}  // namespace v0_1
}  // namespace moefold
