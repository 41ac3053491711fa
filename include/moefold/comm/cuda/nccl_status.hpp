//! @file nccl_status.hpp
//! @brief An NCCL result as a moefold status: errc::comm_peer_failed for a remote error,
//! errc::backend_error otherwise, naming the call with NCCL's last error; error::native = the
//! ncclResult_t. ncclInProgress (a non-blocking communicator) is not an error.
#pragma once

#include <nccl.h>

#include <string>

#include "../../core/expected.hpp"

namespace moefold {
inline namespace v0_1 {
namespace detail {

//! ok for ncclSuccess and ncclInProgress; otherwise the error, naming `call` (and the
//! communicator's last error when `comm` is given).
inline status nccl_check(ncclResult_t rc, const char* call, ncclComm_t comm = nullptr) {
  if (rc == ncclSuccess || rc == ncclInProgress) return {};
  std::string msg = std::string(call) + " failed: " + ncclGetErrorString(rc);
  if (comm) {
    const char* last = ncclGetLastError(comm);
    if (last && *last) msg += std::string(" (") + last + ")";
  }
  // A peer that failed shows as a remote error; the rest are this process's problem.
  error e{rc == ncclRemoteError ? errc::comm_peer_failed : errc::backend_error, msg,
          static_cast<int>(rc)};
  return unexpected<error>(e);
}

}  // namespace detail
}  // namespace v0_1
}  // namespace moefold
