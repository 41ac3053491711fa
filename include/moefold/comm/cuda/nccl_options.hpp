//! @file nccl_options.hpp
//! @brief What creating an NCCL communicator takes besides the ncclComm_t or the rank: its
//! options (timeout, default stream, verify_counts) and the unique id by name.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>

namespace moefold {
inline namespace v0_1 {

//! Options of an NCCL communicator.
struct nccl_options {
  //! How long creation, split or synchronize() may wait for the peers.
  std::chrono::milliseconds timeout{60000};
  //! The stream the span forms without a stream enqueue on, fixed at creation (the row-view forms
  //! take a cuda_copy_exec, the stream overloads a stream).
  cudaStream_t stream = nullptr;
  //! A debugging aid for counts that disagree, which NCCL cannot detect (it hangs until the
  //! timeout, or moves garbage). Before every collective (and split) the ranks all-gather their
  //! collective headers (comm/schedule.hpp: operation, call number, element type, reduction,
  //! root, and the count each rank sends to and expects from every peer) and check every pair,
  //! so a mismatch is errc::comm_mismatch with the same message on every rank, naming the two
  //! ranks and both values, and nothing hangs. A rank whose own arguments are rejected still
  //! takes part, so its peers get errc::comm_peer_failed at once. Costs one small ncclAllGather
  //! (40 * size() bytes per rank) and one host synchronization of the stream per collective,
  //! bounded by the timeout. Every rank must set it alike (a rank that does not exchange headers
  //! pairs its data with its peers' header exchange: a hang, then comm_timeout).
  bool verify_counts = false;
};

//! A ncclUniqueId by name (nvcc 13 fails on the unnamed struct inside moefold::expected).
struct nccl_unique_id {
  ncclUniqueId value;
};

}  // namespace v0_1
}  // namespace moefold
