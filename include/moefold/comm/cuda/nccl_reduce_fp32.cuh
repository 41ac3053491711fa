//! @file nccl_reduce_fp32.cuh
//! @brief reduce_scatter_v over NCCL with 16-bit floats accumulated in fp32 in rank order (the
//! exact bits of the thread world, MPI and the device loopback), for nvcc translation units.
//!
//! nccl_communicator::reduce_scatter_v itself already sums bf16/fp16 in fp32 with one rounding
//! per element, but in cuBLAS's summation order (a GEMM against a vector of ones), so where the
//! fp32 partial sums are inexact its result can differ from the other backends in the last bit.
//! This variant moves every rank's chunk for this rank into a staging buffer the caller provides
//! (grouped ncclSend/ncclRecv, the schedule's staging layout) and reduces it with
//! kernels/comm/reduce_sources.cuh, adding the ranks' chunks in rank order: deterministic and
//! bit-identical to the other backends, sum or max. It takes at most 64 ranks, needs nvcc, and
//! does not take part in nccl_options::verify_counts (call it on every rank alike; the counts are
//! not exchanged).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <moefold/kernels/comm/reduce_sources.cuh>
#include <span>
#include <string>
#include <thread>

#include "../../core/expected.hpp"
#include "../schedule.hpp"
#include "cuda_types.hpp"
#include "nccl_communicator.hpp"

namespace moefold {
inline namespace v0_1 {

//! Elements of staging reduce_scatter_v_fp32 needs: size() * counts[rank()].
[[nodiscard]] inline std::size_t reduce_scatter_v_fp32_staging(const nccl_communicator& c,
                                                               std::span<const int> counts) {
  const auto r = static_cast<std::size_t>(c.rank());
  return r < counts.size() && counts[r] > 0
             ? static_cast<std::size_t>(c.size()) * static_cast<std::size_t>(counts[r])
             : 0;
}

//! As nccl_communicator::reduce_scatter_v, accumulating in fp32 in rank order (sum or max), with
//! a caller-provided device staging buffer of reduce_scatter_v_fp32_staging() elements. Enqueued
//! on `stream`; no host synchronization. On an NCCL error the communicator is aborted.
template <reducible T>
[[nodiscard]] status reduce_scatter_v_fp32(nccl_communicator& c,
                                           std::span<const std::type_identity_t<T>> send,
                                           std::span<const int> counts, std::span<T> recv,
                                           reduce_op op, std::span<T> staging,
                                           cudaStream_t stream) {
  using D = device_type_t<T>;
  auto s = schedule_builder::reduce_scatter_v(c.rank(), c.size(), counts, send.size(), recv.size());
  if (!s) return unexpected<error>(s.error());
  if (c.broken()) return make_error(errc::comm_broken, "the NCCL communicator is broken");
  if (c.size() > kernels::max_reduce_sources)
    return make_error(errc::not_supported, "reduce_scatter_v_fp32 takes at most " +
                                               std::to_string(kernels::max_reduce_sources) +
                                               " ranks (got " + std::to_string(c.size()) + ")");
  if (staging.size() < static_cast<std::size_t>(s->recv_extent()))
    return make_error(errc::workspace_too_small,
                      "reduce_scatter_v_fp32: staging holds " + std::to_string(staging.size()) +
                          " elements, needs " + std::to_string(s->recv_extent()));
  if (s->result_count() == 0 && s->send_extent() == 0) return {};
  detail::nccl_group g;
  for (int i = 0; i < s->num_steps(); ++i) {
    const schedule_step st = s->step(i);
    if (st.send_count > 0)
      if (auto ok = detail::nccl_check(
              ncclSend(send.data() + st.send_offset, static_cast<std::size_t>(st.send_count),
                       detail::nccl_type<T>(), st.send_peer, c.native(), stream),
              "ncclSend", c.native());
          !ok) {
        c.abort();
        return ok;
      }
    if (st.recv_count > 0)
      if (auto ok = detail::nccl_check(
              ncclRecv(staging.data() + st.recv_offset, static_cast<std::size_t>(st.recv_count),
                       detail::nccl_type<T>(), st.recv_peer, c.native(), stream),
              "ncclRecv", c.native());
          !ok) {
        c.abort();
        return ok;
      }
  }
  const ncclResult_t rc = g.end();
  if (auto ok = detail::nccl_check(rc, "ncclGroupEnd (reduce_scatter_v_fp32)", c.native()); !ok) {
    c.abort();
    return ok;
  }
  if (rc == ncclInProgress) {  // a non-blocking communicator: wait until the group is enqueued
    const auto deadline = std::chrono::steady_clock::now() + c.options().timeout;
    for (ncclResult_t st = ncclInProgress; st != ncclSuccess;) {
      if (ncclCommGetAsyncError(c.native(), &st) != ncclSuccess ||
          (st != ncclSuccess && st != ncclInProgress) ||
          std::chrono::steady_clock::now() >= deadline) {
        c.abort();
        return make_error(st == ncclInProgress ? errc::comm_timeout : errc::backend_error,
                          "reduce_scatter_v_fp32: NCCL did not enqueue the exchange");
      }
      if (st == ncclInProgress) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  kernels::reduce_sources<D> in{};
  const D* base = reinterpret_cast<const D*>(staging.data());
  for (int p = 0; p < c.size(); ++p) in.src[p] = base + s->recv_offset(p);
  return detail::cuda_check(kernels::launch_reduce_sources<D>(in, c.size(), s->result_count(),
                                                              reinterpret_cast<D*>(recv.data()),
                                                              op == reduce_op::max, stream),
                            "reduce_sources_kernel");
}

}  // namespace v0_1
}  // namespace moefold
