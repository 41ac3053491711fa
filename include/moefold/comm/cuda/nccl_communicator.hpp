//! @file nccl_communicator.hpp
//! @brief The NCCL backend: moefold's collectives on device buffers, enqueued on a CUDA stream,
//! never blocking the host.
//!
//! - Adopt a ncclComm_t you made (moefold does not destroy it), or let moefold create one from a
//!   unique id you broadcast (from_unique_id) or from MPI (comm/cuda/nccl_mpi.hpp). Created
//!   communicators are non-blocking (ncclConfig_t::blocking = 0): creation, split and every
//!   enqueue are polled against the timeout, and a stuck or failed peer becomes an error
//!   (ncclCommGetAsyncError; at the timeout ncclCommAbort), not a hang.
//! - Buffers are device memory; counts are host values (the dispatcher copies its splits to the
//!   host once per layer, dispatch-semantics.md section 5.2.3). The collectives satisfy the
//!   communicator concept and enqueue on the communicator's stream; overloads take a stream.
//! - V-collectives execute the schedules of comm/schedule.hpp: all_to_all_v as grouped
//!   ncclSend/ncclRecv, all_gather_v as grouped ncclBroadcast (one per root), reduce_scatter_v as
//!   grouped ncclReduce (one per root).
//! - NCCL does not check that peers agree: a mismatch is a hang or garbage in NCCL itself.
//!   synchronize() turns the hang into errc::comm_timeout (after ncclCommAbort; the communicator
//!   is broken); the thread world and MPI catch the same mistakes with headers, so test there.
//! - Reductions of bf16/fp16 accumulate as NCCL does (its reduction kernels). For fp32
//!   accumulation in rank order (the other backends' numerics) use reduce_scatter_v_fp32 of
//!   comm/cuda/nccl_reduce_fp32.cuh (nvcc), which stages the chunks and reduces them with a kernel.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>

#include "../../core/expected.hpp"
#include "../communicator.hpp"
#include "../dtype.hpp"
#include "../schedule.hpp"
#include "cuda_types.hpp"

namespace moefold {

//! Options of an NCCL communicator.
struct nccl_options {
  //! How long creation, split or synchronize() may wait for the peers.
  std::chrono::milliseconds timeout{60000};
  //! The stream the concept's collectives enqueue on (the stream overloads take their own).
  cudaStream_t stream = nullptr;
};

namespace detail {

inline status cuda_check(cudaError_t rc, const char* call) {
  if (rc == cudaSuccess) return {};
  error e{errc::backend_error,
          std::string(call) + " failed: " + cudaGetErrorString(rc) + " (cudaError " +
              std::to_string(static_cast<int>(rc)) + ")",
          static_cast<int>(rc)};
  return unexpected<error>(e);
}

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

template <class T>
constexpr ncclDataType_t nccl_type() noexcept {
  switch (dtype_of<T>) {
    case dtype::i8: return ncclInt8;
    case dtype::u8: return ncclUint8;
    case dtype::i32: return ncclInt32;
    case dtype::u32: return ncclUint32;
    case dtype::i64: return ncclInt64;
    case dtype::u64: return ncclUint64;
    case dtype::f32: return ncclFloat32;
    case dtype::f64: return ncclFloat64;
    case dtype::bf16: return ncclBfloat16;
    case dtype::f16: return ncclFloat16;
    case dtype::other: return ncclUint8;  // moved as bytes
  }
  return ncclUint8;
}
template <class T>
constexpr std::size_t nccl_scale() noexcept {
  return dtype_of<T> == dtype::other ? sizeof(T) : 1;
}

//! Brackets grouped NCCL calls; ncclGroupEnd's result is what counts.
class nccl_group {
 public:
  nccl_group() { ncclGroupStart(); }
  nccl_group(const nccl_group&) = delete;
  nccl_group& operator=(const nccl_group&) = delete;
  ~nccl_group() {
    if (open_) ncclGroupEnd();
  }
  [[nodiscard]] ncclResult_t end() {
    open_ = false;
    return ncclGroupEnd();
  }

 private:
  bool open_ = true;
};

}  // namespace detail

//! A ncclUniqueId by name (nvcc 13 fails on the unnamed struct inside moefold::expected).
struct nccl_unique_id {
  ncclUniqueId value;
};

//! One rank's NCCL communicator. Move-only.
class nccl_communicator {
 public:
  //! Adopts a communicator the caller made and keeps owning (moefold never destroys it).
  [[nodiscard]] static expected<nccl_communicator> adopt(ncclComm_t comm, nccl_options opt = {}) {
    if (!comm)
      return make_error(errc::invalid_argument, "nccl_communicator::adopt: null ncclComm_t");
    nccl_communicator c;
    c.comm_ = comm;
    c.owned_ = false;
    c.opt_ = opt;
    if (auto ok = c.query(); !ok) return unexpected<error>(ok.error());
    return c;
  }

  //! A new unique id (on one rank; broadcast it to the others yourself, or use nccl_mpi.hpp).
  [[nodiscard]] static expected<nccl_unique_id> make_unique_id() {
    nccl_unique_id id{};
    if (auto ok = detail::nccl_check(ncclGetUniqueId(&id.value), "ncclGetUniqueId"); !ok)
      return unexpected<error>(ok.error());
    return id;
  }

  //! Creates (and owns) rank `rank` of `nranks` from a unique id, non-blocking, waiting at most
  //! the timeout for the peers. Uses the current CUDA device.
  [[nodiscard]] static expected<nccl_communicator> from_unique_id(const ncclUniqueId& id,
                                                                  int nranks, int rank,
                                                                  nccl_options opt = {}) {
    if (nranks < 1 || rank < 0 || rank >= nranks)
      return make_error(errc::rank_out_of_range, "nccl_communicator: rank " + std::to_string(rank) +
                                                     " of " + std::to_string(nranks) + " ranks");
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    nccl_communicator c;
    c.opt_ = opt;
    c.owned_ = true;
    ncclUniqueId copy = id;
    const auto rc = ncclCommInitRankConfig(&c.comm_, nranks, copy, rank, &cfg);
    if (auto ok = detail::nccl_check(rc, "ncclCommInitRankConfig"); !ok) {
      if (c.comm_) ncclCommAbort(std::exchange(c.comm_, nullptr));
      return unexpected<error>(ok.error());
    }
    if (auto ok = c.settle("ncclCommInitRankConfig"); !ok) return unexpected<error>(ok.error());
    if (auto ok = c.query(); !ok) return unexpected<error>(ok.error());
    return c;
  }

  [[nodiscard]] static expected<nccl_communicator> from_unique_id(const nccl_unique_id& id,
                                                                  int nranks, int rank,
                                                                  nccl_options opt = {}) {
    return from_unique_id(id.value, nranks, rank, opt);
  }

  nccl_communicator(nccl_communicator&& o) noexcept { *this = std::move(o); }
  nccl_communicator& operator=(nccl_communicator&& o) noexcept {
    if (this != &o) {
      release();
      comm_ = std::exchange(o.comm_, nullptr);
      owned_ = o.owned_;
      rank_ = o.rank_;
      size_ = o.size_;
      opt_ = o.opt_;
      broken_ = o.broken_;
      aborted_ = o.aborted_;
      why_ = std::move(o.why_);
      barrier_buf_ = std::exchange(o.barrier_buf_, nullptr);
    }
    return *this;
  }
  nccl_communicator(const nccl_communicator&) = delete;
  nccl_communicator& operator=(const nccl_communicator&) = delete;
  ~nccl_communicator() { release(); }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] ncclComm_t native() const noexcept { return comm_; }
  [[nodiscard]] bool broken() const noexcept { return broken_; }
  [[nodiscard]] cudaStream_t stream() const noexcept { return opt_.stream; }
  [[nodiscard]] const nccl_options& options() const noexcept { return opt_; }
  void set_stream(cudaStream_t s) noexcept { opt_.stream = s; }

  // --- the concept's collectives, on stream() -------------------------------------------------
  template <reducible T>
  [[nodiscard]] status all_reduce(std::span<T> buf, reduce_op op) {
    return all_reduce(buf, op, opt_.stream);
  }
  template <transferable T>
  [[nodiscard]] status all_gather(std::span<const std::type_identity_t<T>> send,
                                  std::span<T> recv) {
    return all_gather<T>(send, recv, opt_.stream);
  }
  template <transferable T>
  [[nodiscard]] status all_gather_v(std::span<const std::type_identity_t<T>> send,
                                    std::span<T> recv, std::span<const int> counts) {
    return all_gather_v<T>(send, recv, counts, opt_.stream);
  }
  template <transferable T>
  [[nodiscard]] status all_to_all_v(std::span<const std::type_identity_t<T>> send,
                                    std::span<const int> send_counts, std::span<T> recv,
                                    std::span<const int> recv_counts) {
    return all_to_all_v<T>(send, send_counts, recv, recv_counts, opt_.stream);
  }
  template <reducible T>
  [[nodiscard]] status reduce_scatter_v(std::span<const std::type_identity_t<T>> send,
                                        std::span<const int> counts, std::span<T> recv,
                                        reduce_op op) {
    return reduce_scatter_v<T>(send, counts, recv, op, opt_.stream);
  }
  template <transferable T>
  [[nodiscard]] status broadcast(std::span<T> buf, int root) {
    return broadcast(buf, root, opt_.stream);
  }
  [[nodiscard]] status barrier() { return barrier(opt_.stream); }

  // --- the same on an explicit stream ---------------------------------------------------------
  template <reducible T>
  [[nodiscard]] status all_reduce(std::span<T> buf, reduce_op op, cudaStream_t s) {
    if (auto ok = usable(); !ok) return ok;
    return enqueue(ncclAllReduce(buf.data(), buf.data(), buf.size(), detail::nccl_type<T>(),
                                 op == reduce_op::sum ? ncclSum : ncclMax, comm_, s),
                   "ncclAllReduce");
  }

  template <transferable T>
  [[nodiscard]] status all_gather(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                                  cudaStream_t s) {
    auto sch = schedule_builder::all_gather(rank_, size_, send.size(), recv.size());
    if (!sch) return unexpected<error>(sch.error());
    if (auto ok = usable(); !ok) return ok;
    return enqueue(ncclAllGather(send.data(), recv.data(), send.size() * detail::nccl_scale<T>(),
                                 detail::nccl_type<T>(), comm_, s),
                   "ncclAllGather");
  }

  template <transferable T>
  [[nodiscard]] status all_gather_v(std::span<const std::type_identity_t<T>> send,
                                    std::span<T> recv, std::span<const int> counts,
                                    cudaStream_t s) {
    auto sch = schedule_builder::all_gather_v(rank_, size_, counts, send.size(), recv.size());
    if (!sch) return unexpected<error>(sch.error());
    if (auto ok = usable(); !ok) return ok;
    constexpr auto k = detail::nccl_scale<T>();
    detail::nccl_group g;
    for (int p = 0; p < size_; ++p) {
      const auto n = static_cast<std::size_t>(sch->recv_count(p));
      if (n == 0) continue;  // every rank skips the same roots: counts agree
      T* dst = recv.data() + sch->recv_offset(p);
      const void* src = p == rank_ ? static_cast<const void*>(send.data()) : dst;
      if (auto ok = detail::nccl_check(
              ncclBroadcast(src, dst, n * k, detail::nccl_type<T>(), p, comm_, s), "ncclBroadcast",
              comm_);
          !ok)
        return fail(ok);
    }
    return enqueue(g.end(), "ncclGroupEnd (all_gather_v)");
  }

  template <transferable T>
  [[nodiscard]] status all_to_all_v(std::span<const std::type_identity_t<T>> send,
                                    std::span<const int> send_counts, std::span<T> recv,
                                    std::span<const int> recv_counts, cudaStream_t s) {
    auto sch = schedule_builder::all_to_all_v(rank_, size_, send_counts, recv_counts, send.size(),
                                              recv.size());
    if (!sch) return unexpected<error>(sch.error());
    if (auto ok = usable(); !ok) return ok;
    constexpr auto k = detail::nccl_scale<T>();
    detail::nccl_group g;
    for (int i = 0; i < sch->num_steps(); ++i) {
      const schedule_step st = sch->step(i);
      if (st.send_count > 0)
        if (auto ok = detail::nccl_check(
                ncclSend(send.data() + st.send_offset, static_cast<std::size_t>(st.send_count) * k,
                         detail::nccl_type<T>(), st.send_peer, comm_, s),
                "ncclSend", comm_);
            !ok)
          return fail(ok);
      if (st.recv_count > 0)
        if (auto ok = detail::nccl_check(
                ncclRecv(recv.data() + st.recv_offset, static_cast<std::size_t>(st.recv_count) * k,
                         detail::nccl_type<T>(), st.recv_peer, comm_, s),
                "ncclRecv", comm_);
            !ok)
          return fail(ok);
    }
    return enqueue(g.end(), "ncclGroupEnd (all_to_all_v)");
  }

  template <reducible T>
  [[nodiscard]] status reduce_scatter_v(std::span<const std::type_identity_t<T>> send,
                                        std::span<const int> counts, std::span<T> recv,
                                        reduce_op op, cudaStream_t s) {
    auto sch = schedule_builder::reduce_scatter_v(rank_, size_, counts, send.size(), recv.size());
    if (!sch) return unexpected<error>(sch.error());
    if (auto ok = usable(); !ok) return ok;
    detail::nccl_group g;
    for (int p = 0; p < size_; ++p) {
      const auto n = static_cast<std::size_t>(sch->send_count(p));
      if (n == 0) continue;
      if (auto ok = detail::nccl_check(
              ncclReduce(send.data() + sch->send_offset(p), recv.data(), n, detail::nccl_type<T>(),
                         op == reduce_op::sum ? ncclSum : ncclMax, p, comm_, s),
              "ncclReduce", comm_);
          !ok)
        return fail(ok);
    }
    return enqueue(g.end(), "ncclGroupEnd (reduce_scatter_v)");
  }

  template <transferable T>
  [[nodiscard]] status broadcast(std::span<T> buf, int root, cudaStream_t s) {
    auto sch = schedule_builder::broadcast(rank_, size_, buf.size(), root);
    if (!sch) return unexpected<error>(sch.error());
    if (auto ok = usable(); !ok) return ok;
    return enqueue(ncclBroadcast(buf.data(), buf.data(), buf.size() * detail::nccl_scale<T>(),
                                 detail::nccl_type<T>(), root, comm_, s),
                   "ncclBroadcast");
  }

  //! A device-side barrier: a one-element all-reduce enqueued on the stream (the host does not
  //! wait; synchronize() does).
  [[nodiscard]] status barrier(cudaStream_t s) {
    if (auto ok = usable(); !ok) return ok;
    if (!barrier_buf_)
      if (auto ok = detail::cuda_check(cudaMalloc(&barrier_buf_, sizeof(int)), "cudaMalloc"); !ok)
        return ok;
    return enqueue(ncclAllReduce(barrier_buf_, barrier_buf_, 1, ncclInt32, ncclSum, comm_, s),
                   "ncclAllReduce (barrier)");
  }

  //! Waits for the stream's work, polling NCCL's asynchronous error; at the timeout the
  //! communicator is aborted (ncclCommAbort) and broken: errc::comm_timeout.
  [[nodiscard]] status synchronize(cudaStream_t s) {
    if (auto ok = usable(); !ok) return ok;
    const auto deadline = std::chrono::steady_clock::now() + opt_.timeout;
    for (;;) {
      const cudaError_t q = cudaStreamQuery(s);
      if (q == cudaSuccess) return {};
      if (q != cudaErrorNotReady) return fail(detail::cuda_check(q, "cudaStreamQuery"));
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm_, &async);
      if (async != ncclSuccess && async != ncclInProgress)
        return abort_with(detail::nccl_check(async, "NCCL (asynchronous error)", comm_));
      if (std::chrono::steady_clock::now() >= deadline)
        return abort_with(make_error(
            errc::comm_timeout,
            "rank " + std::to_string(rank_) + ": the stream's NCCL work did not complete within " +
                std::to_string(opt_.timeout.count()) +
                " ms (a peer is dead, stuck, or called a different collective); the communicator "
                "was aborted"));
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  [[nodiscard]] status synchronize() { return synchronize(opt_.stream); }

  //! ncclCommSplit (non-blocking, polled). split_no_color: takes part, joins nothing
  //! (errc::rank_out_of_range).
  [[nodiscard]] expected<nccl_communicator> split(int color, int key) {
    if (auto ok = usable(); !ok) return unexpected<error>(ok.error());
    if (color < 0 && color != split_no_color)
      return make_error(
          errc::invalid_argument,
          "split: color must be >= 0 or split_no_color (got " + std::to_string(color) + ")");
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    nccl_communicator c;
    c.opt_ = opt_;
    c.owned_ = true;
    const auto rc = ncclCommSplit(comm_, color == split_no_color ? NCCL_SPLIT_NOCOLOR : color, key,
                                  &c.comm_, &cfg);
    if (auto ok = detail::nccl_check(rc, "ncclCommSplit", comm_); !ok)
      return unexpected<error>(fail(ok).error());
    // The parent is busy until the split is done; then the child initializes.
    if (auto ok = settle_comm(comm_, "ncclCommSplit"); !ok) {
      if (c.comm_) ncclCommAbort(std::exchange(c.comm_, nullptr));
      return unexpected<error>(fail(ok).error());
    }
    if (!c.comm_)
      return make_error(errc::rank_out_of_range,
                        "split: rank " + std::to_string(rank_) +
                            " passed split_no_color and joins no new communicator");
    if (auto ok = c.settle("ncclCommSplit (child)"); !ok) return unexpected<error>(ok.error());
    if (auto ok = c.query(); !ok) return unexpected<error>(ok.error());
    return c;
  }

  //! Aborts the communicator (pending work is dropped); it is broken afterwards.
  void abort() noexcept {
    if (comm_ && !aborted_) ncclCommAbort(comm_);
    aborted_ = true;
    broken_ = true;
    if (why_.empty()) why_ = "aborted by the caller";
  }

 private:
  nccl_communicator() = default;

  status query() {
    if (auto ok = detail::nccl_check(ncclCommUserRank(comm_, &rank_), "ncclCommUserRank", comm_);
        !ok)
      return ok;
    return detail::nccl_check(ncclCommCount(comm_, &size_), "ncclCommCount", comm_);
  }

  void release() noexcept {
    if (barrier_buf_) cudaFree(std::exchange(barrier_buf_, nullptr));
    if (!comm_) return;
    if (owned_ && !aborted_) {
      // Flush, then free; if that fails there is nobody left to tell: abort instead.
      if (!broken_ && (ncclCommFinalize(comm_) == ncclSuccess || settle_comm(comm_, "finalize")))
        ncclCommDestroy(comm_);
      else
        ncclCommAbort(comm_);
    }
    comm_ = nullptr;
  }

  status usable() const {
    if (!comm_) return make_error(errc::comm_broken, "a moved-from nccl_communicator");
    if (broken_)
      return make_error(errc::comm_broken,
                        "the NCCL communicator is broken by an earlier failure: " + why_);
    return {};
  }

  // Polls a non-blocking communicator until it leaves ncclInProgress.
  status settle_comm(ncclComm_t comm, const char* what) {
    const auto deadline = std::chrono::steady_clock::now() + opt_.timeout;
    for (;;) {
      ncclResult_t st = ncclSuccess;
      if (auto ok = detail::nccl_check(ncclCommGetAsyncError(comm, &st), "ncclCommGetAsyncError");
          !ok)
        return ok;
      if (st == ncclSuccess) return {};
      if (st != ncclInProgress) return detail::nccl_check(st, what, comm);
      if (std::chrono::steady_clock::now() >= deadline)
        return make_error(errc::comm_timeout, std::string(what) + " did not complete within " +
                                                  std::to_string(opt_.timeout.count()) +
                                                  " ms (a peer did not join)");
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
  status settle(const char* what) {
    auto ok = settle_comm(comm_, what);
    if (!ok) ncclCommAbort(std::exchange(comm_, nullptr));  // a communicator being created
    return ok;
  }

  // An enqueue's result: in progress (non-blocking) is polled until the work is enqueued.
  status enqueue(ncclResult_t rc, const char* what) {
    if (auto ok = detail::nccl_check(rc, what, comm_); !ok) return fail(ok);
    if (rc == ncclInProgress)
      if (auto ok = settle_comm(comm_, what); !ok) return fail(ok);
    return {};
  }

  // A failed or stuck operation: an owned communicator is aborted (NCCL's rule: a communicator
  // that saw an error must be aborted); an adopted one is left to its owner, who must abort it.
  status fail(const status& s) {
    if (comm_ && owned_ && !aborted_) {
      ncclCommAbort(comm_);
      aborted_ = true;
    }
    broken_ = true;
    why_ = s.error().message + (owned_ ? "" : "; abort the adopted ncclComm_t (ncclCommAbort)");
    return unexpected<error>(error{s.error().code, why_, s.error().native});
  }
  status abort_with(const status& s) { return fail(s); }

  ncclComm_t comm_ = nullptr;
  bool owned_ = false;
  int rank_ = 0;
  int size_ = 0;
  nccl_options opt_{};
  bool broken_ = false;
  bool aborted_ = false;
  std::string why_;
  int* barrier_buf_ = nullptr;
};

static_assert(splittable_communicator<nccl_communicator>);

}  // namespace moefold
