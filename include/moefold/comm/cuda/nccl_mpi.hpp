//! @file nccl_mpi.hpp
//! @brief An NCCL communicator bootstrapped by MPI: rank 0 makes the unique id, MPI broadcasts
//! it (with the MPI communicator's header check and timeout), every rank creates its NCCL rank.
#pragma once

#include <span>

#include "../../core/expected.hpp"
#include "../mpi/mpi_communicator.hpp"
#include "nccl_communicator.hpp"

namespace moefold {
inline namespace v0_1 {

//! Collective over `mpi`: one NCCL rank per MPI rank (same rank numbers), on the current CUDA
//! device (pick it before, e.g. from the node-local rank). The result owns its ncclComm_t.
[[nodiscard]] inline expected<nccl_communicator> nccl_from_mpi(mpi_communicator& mpi,
                                                               nccl_options opt = {}) {
  ncclUniqueId id{};
  error failed{};
  if (mpi.rank() == 0) {
    auto made = nccl_communicator::make_unique_id();
    if (made)
      id = made->value;
    else
      failed = made.error();
  }
  // 128 opaque bytes; a rank-0 failure is broadcast as an all-zero id and reported below.
  std::span<unsigned char> bytes(reinterpret_cast<unsigned char*>(&id), sizeof(id));
  if (auto ok = mpi.broadcast<unsigned char>(bytes, 0); !ok) return unexpected<error>(ok.error());
  if (failed.code != errc::success) return unexpected<error>(failed);
  bool zero = true;
  for (unsigned char b : bytes) zero = zero && b == 0;
  if (zero)
    return make_error(errc::comm_peer_failed, "nccl_from_mpi: rank 0 could not make a unique id");
  return nccl_communicator::from_unique_id(id, mpi.size(), mpi.rank(), opt);
}

}  // namespace v0_1
}  // namespace moefold
