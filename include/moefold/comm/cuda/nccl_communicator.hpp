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
//!   host once per layer, docs/dispatch-semantics.md section 5.2.3). The collectives satisfy the
//!   communicator concept and enqueue on the communicator's stream; overloads take a stream.
//! - V-collectives execute the schedules of comm/schedule.hpp: all_to_all_v as grouped
//!   ncclSend/ncclRecv, all_gather_v as grouped ncclBroadcast (one per root), reduce_scatter_v as
//!   grouped ncclReduce (one per root), except the 16-bit sums below.
//! - NCCL does not check that peers agree: a mismatch is a hang or garbage in NCCL itself.
//!   synchronize() turns the hang into errc::comm_timeout (after ncclCommAbort; the communicator
//!   is broken). nccl_options::verify_counts (a debugging aid, off by default) exchanges the
//!   collective headers of comm/schedule.hpp before every collective and turns a mismatch into
//!   errc::comm_mismatch on every rank, as the thread world and MPI always do.
//! - Sums of bf16/fp16 (reduce_scatter_v, all_reduce) accumulate in fp32 and round once per
//!   element, as on the other backends: NCCL only moves the 16-bit chunks (grouped send/recv or
//!   ncclAllGather into a [P, n] staging buffer) and cuBLAS reduces the P rows (a GEMM against a
//!   vector of ones, fp32 compute). The summation order is cuBLAS's, not rank order, so a sum
//!   whose fp32 partial sums are inexact may differ from the other backends in the last bit; for
//!   bit-exact rank order use reduce_scatter_v_fp32 of comm/cuda/nccl_reduce_fp32.cuh (nvcc).
//!   Max of any type, and every reduction of fp32/fp64/integers, is NCCL's own (exact, or the
//!   type's own arithmetic). This header needs cudart, cuBLAS and NCCL, not nvcc.
//!
//! This header holds the communicator class and includes its pieces: nccl_options.hpp (options,
//! nccl_unique_id), nccl_status.hpp (ncclResult_t as a status), nccl_dtype.hpp (element types as
//! ncclDataType_t), nccl_group.hpp (the ncclGroupStart/End guard), core/cuda/cublas_status.hpp and
//! cublas_row_sum.hpp (the fp32 sum of 16-bit rows).
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../core/cuda/cuda_check.hpp"
#include "../../core/dtype.hpp"
#include "../../core/expected.hpp"
#include "../../core/row_view.hpp"
#include "../../exec/cuda/cuda_copy_exec.hpp"
#include "../communicator.hpp"
#include "../schedule.hpp"
#include "../span_collectives.hpp"
#include "cublas_row_sum.hpp"
#include "cuda_types.hpp"
#include "nccl_dtype.hpp"
#include "nccl_group.hpp"
#include "nccl_options.hpp"
#include "nccl_status.hpp"

namespace moefold {
inline namespace v0_1 {

//! One rank's NCCL communicator. Move-only.
//!
//! Besides the ncclComm_t it owns, created lazily on first need and released by the destructor:
//! a cuBLAS handle and a device buffer for 16-bit sums (ones, then the [P, n] staging area,
//! grown to the largest request), a device buffer for verify_counts' headers and its pinned host
//! twin (no copy ever reads or writes pageable memory, which may wait for a stuck stream with no
//! timeout), a zeroed 16-byte barrier buffer, and one CUDA event
//! that orders every use of those buffers after the previous one, whatever stream each ran on.
class nccl_communicator : public span_collectives<nccl_communicator, device_space> {
  using spans = span_collectives<nccl_communicator, device_space>;

 public:
  using memory_space = device_space;

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
      seq_ = o.seq_;
      barrier_buf_ = std::exchange(o.barrier_buf_, nullptr);
      sum_buf_ = std::exchange(o.sum_buf_, device_buffer{});
      verify_buf_ = std::exchange(o.verify_buf_, device_buffer{});
      verify_host_ = std::exchange(o.verify_host_, nullptr);
      buffers_done_ = std::exchange(o.buffers_done_, nullptr);
      buffers_device_ = o.buffers_device_;
      row_sum_ = std::move(o.row_sum_);
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
  //! The context of the span forms without a stream: cuda_copy_exec{options().stream}.
  [[nodiscard]] cuda_copy_exec default_exec() const noexcept { return cuda_copy_exec(opt_.stream); }

  // --- the concept's collectives, on options().stream (fixed at creation) ----------------------
  using spans::all_gather;
  using spans::all_gather_v;
  using spans::all_to_all_v;
  using spans::reduce_scatter_v;

  template <reducible T>
  [[nodiscard]] status all_reduce(std::span<T> buf, reduce_op op) {
    return all_reduce(buf, op, opt_.stream);
  }
  template <transferable T>
  [[nodiscard]] status broadcast(std::span<T> buf, int root) {
    return broadcast(buf, root, opt_.stream);
  }
  [[nodiscard]] status barrier() { return barrier(opt_.stream); }

  // --- row views on the context's stream (counts in rows; elements in 64-bit) -----------------

  template <reducible T>
  [[nodiscard]] status all_reduce(cuda_copy_exec& x, row_view<T, device_space> buf, reduce_op op) {
    return all_reduce(detail::flat(buf), op, x.stream());
  }
  template <transferable T>
  [[nodiscard]] status broadcast(cuda_copy_exec& x, row_view<T, device_space> buf, int root) {
    return broadcast(detail::flat(buf), root, x.stream());
  }
  [[nodiscard]] status barrier(cuda_copy_exec& x) { return barrier(x.stream()); }

  template <transferable T>
  [[nodiscard]] status all_gather(cuda_copy_exec& x, row_view<const T, device_space> send,
                                  row_view<T, device_space> recv) {
    const auto sch = detail::rows_schedule("all_gather", send, recv, [&](int w) {
      return schedule_builder::all_gather(rank_, size_, detail::uz(send.rows()),
                                          detail::uz(recv.rows()), w);
    });
    const cudaStream_t s = x.stream();
    if (auto ok = begin(collective::all_gather, sch, call_info_of<T>(), s); !ok) return ok;
    return enqueue(ncclAllGather(send.data(), recv.data(),
                                 detail::uz(sch->send_extent()) * detail::nccl_scale<T>(),
                                 detail::nccl_type<T>(), comm_, s),
                   "ncclAllGather");
  }

  template <transferable T>
  [[nodiscard]] status all_gather_v(cuda_copy_exec& x, row_view<const T, device_space> send,
                                    row_view<T, device_space> recv, std::span<const int> counts) {
    const auto sch = detail::rows_schedule("all_gather_v", send, recv, [&](int w) {
      return schedule_builder::all_gather_v(rank_, size_, counts, detail::uz(send.rows()),
                                            detail::uz(recv.rows()), w);
    });
    const cudaStream_t s = x.stream();
    if (auto ok = begin(collective::all_gather_v, sch, call_info_of<T>(), s); !ok) return ok;
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
        return fail_in_group(g, ok);
    }
    return enqueue(g.end(), "ncclGroupEnd (all_gather_v)");
  }

  template <transferable T>
  [[nodiscard]] status all_to_all_v(cuda_copy_exec& x, row_view<const T, device_space> send,
                                    std::span<const int> send_counts,
                                    row_view<T, device_space> recv,
                                    std::span<const int> recv_counts) {
    const auto sch = detail::rows_schedule("all_to_all_v", send, recv, [&](int w) {
      return schedule_builder::all_to_all_v(rank_, size_, send_counts, recv_counts,
                                            detail::uz(send.rows()), detail::uz(recv.rows()), w);
    });
    const cudaStream_t s = x.stream();
    if (auto ok = begin(collective::all_to_all_v, sch, call_info_of<T>(), s); !ok) return ok;
    return exchange_steps<T>(*sch, send.data(), recv.data(), s, "ncclGroupEnd (all_to_all_v)");
  }

  //! bf16/fp16 sums: every rank's chunk for this rank lands in a [P, n] staging buffer (grouped
  //! ncclSend/ncclRecv, the schedule's staging layout) and cuBLAS reduces it in fp32, one
  //! rounding per element; everything else is one ncclReduce per root.
  template <reducible T>
  [[nodiscard]] status reduce_scatter_v(cuda_copy_exec& x, row_view<const T, device_space> send,
                                        std::span<const int> counts, row_view<T, device_space> recv,
                                        reduce_op op) {
    const auto sch = detail::rows_schedule("reduce_scatter_v", send, recv, [&](int w) {
      return schedule_builder::reduce_scatter_v(rank_, size_, counts, detail::uz(send.rows()),
                                                detail::uz(recv.rows()), w);
    });
    const cudaStream_t s = x.stream();
    if (auto ok =
            begin(collective::reduce_scatter_v, sch, call_info_of<T>(static_cast<int>(op)), s);
        !ok)
      return ok;
    if constexpr (detail::is_16bit_float<T>) {
      if (op == reduce_op::sum) return reduce_scatter_v_sum16<T>(*sch, send.data(), recv.data(), s);
    }
    detail::nccl_group g;
    for (int p = 0; p < size_; ++p) {
      const auto n = static_cast<std::size_t>(sch->send_count(p));
      if (n == 0) continue;
      if (auto ok = detail::nccl_check(
              ncclReduce(send.data() + sch->send_offset(p), recv.data(), n, detail::nccl_type<T>(),
                         op == reduce_op::sum ? ncclSum : ncclMax, p, comm_, s),
              "ncclReduce", comm_);
          !ok)
        return fail_in_group(g, ok);
    }
    return enqueue(g.end(), "ncclGroupEnd (reduce_scatter_v)");
  }

  // --- spans on an explicit stream --------------------------------------------------------------

  //! In place. bf16/fp16 sums: every rank gathers all P copies (ncclAllGather into [P, n]
  //! staging) and reduces them with cuBLAS in fp32, one rounding per element; everything else is
  //! ncclAllReduce.
  template <reducible T>
  [[nodiscard]] status all_reduce(std::span<T> buf, reduce_op op, cudaStream_t s) {
    const auto sch = schedule_builder::all_reduce(rank_, size_, buf.size());
    if (auto ok = begin(collective::all_reduce, sch, call_info_of<T>(static_cast<int>(op)), s); !ok)
      return ok;
    if constexpr (detail::is_16bit_float<T>) {
      if (op == reduce_op::sum) return all_reduce_sum16<T>(buf, s);
    }
    return enqueue(ncclAllReduce(buf.data(), buf.data(), buf.size(), detail::nccl_type<T>(),
                                 op == reduce_op::sum ? ncclSum : ncclMax, comm_, s),
                   "ncclAllReduce");
  }

  template <transferable T>
  [[nodiscard]] status all_gather(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                                  cudaStream_t s) {
    cuda_copy_exec x(s);
    return all_gather(x, column(send), column(recv));
  }

  template <transferable T>
  [[nodiscard]] status all_gather_v(std::span<const std::type_identity_t<T>> send,
                                    std::span<T> recv, std::span<const int> counts,
                                    cudaStream_t s) {
    cuda_copy_exec x(s);
    return all_gather_v(x, column(send), column(recv), counts);
  }

  template <transferable T>
  [[nodiscard]] status all_to_all_v(std::span<const std::type_identity_t<T>> send,
                                    std::span<const int> send_counts, std::span<T> recv,
                                    std::span<const int> recv_counts, cudaStream_t s) {
    cuda_copy_exec x(s);
    return all_to_all_v(x, column(send), send_counts, column(recv), recv_counts);
  }

  template <reducible T>
  [[nodiscard]] status reduce_scatter_v(std::span<const std::type_identity_t<T>> send,
                                        std::span<const int> counts, std::span<T> recv,
                                        reduce_op op, cudaStream_t s) {
    cuda_copy_exec x(s);
    return reduce_scatter_v(x, column(send), counts, column(recv), op);
  }

  template <transferable T>
  [[nodiscard]] status broadcast(std::span<T> buf, int root, cudaStream_t s) {
    const auto sch = schedule_builder::broadcast(rank_, size_, buf.size(), root);
    if (auto ok = begin(collective::broadcast, sch, call_info_of<T>(), s); !ok) return ok;
    return enqueue(ncclBroadcast(buf.data(), buf.data(), buf.size() * detail::nccl_scale<T>(),
                                 detail::nccl_type<T>(), root, comm_, s),
                   "ncclBroadcast");
  }

  //! A device-side barrier: a one-element all-reduce enqueued on the stream (the host does not
  //! wait; synchronize() does, and so does verify_counts' header exchange).
  [[nodiscard]] status barrier(cudaStream_t s) {
    const auto sch = schedule_builder::barrier(rank_, size_);
    if (auto ok = begin(collective::barrier, sch, call_info{}, s); !ok) return ok;
    // 16 bytes, zeroed on the stream before first use: NCCL may read whole 16-byte units, and
    // compute-sanitizer's initcheck flags a read of memory nothing wrote. Zeros sum to zeros, so
    // the buffer stays initialized.
    if (!barrier_buf_) {
      if (auto ok = detail::cuda_check(cudaMalloc(&barrier_buf_, barrier_bytes), "cudaMalloc"); !ok)
        return fail(ok);  // this rank cannot take part: its peers must not wait
      if (auto ok = detail::cuda_check(cudaMemsetAsync(barrier_buf_, 0, barrier_bytes, s),
                                       "cudaMemsetAsync (barrier)");
          !ok)
        return fail(ok);
    }
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
  //! (errc::rank_out_of_range). With verify_counts the ranks first exchange headers on stream()
  //! (so a rank calling split while a peer calls a collective is an error, not a hang), and the
  //! new communicator inherits the options.
  [[nodiscard]] expected<nccl_communicator> split(int color, int key) {
    const bool bad_color = color < 0 && color != split_no_color;
    const expected<collective_schedule> sch =
        bad_color
            ? expected<collective_schedule>(make_error(
                  errc::invalid_argument, "split: color must be >= 0 or split_no_color (got " +
                                              std::to_string(color) + ")"))
            : schedule_builder::split(rank_, size_);
    if (auto ok = begin(collective::split, sch, call_info{}, opt_.stream); !ok)
      return unexpected<error>(ok.error());
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
  // Device memory the communicator owns. Stream-ordered (cudaMallocAsync / cudaFreeAsync on the
  // calling stream): growing never blocks the host, whereas cudaFree would synchronize the whole
  // device, without a timeout, while a collective may be stuck.
  struct device_buffer {
    void* p = nullptr;
    std::size_t bytes = 0;
  };

  nccl_communicator() = default;

  status query() {
    if (auto ok = detail::nccl_check(ncclCommUserRank(comm_, &rank_), "ncclCommUserRank", comm_);
        !ok)
      return ok;
    return detail::nccl_check(ncclCommCount(comm_, &size_), "ncclCommCount", comm_);
  }

  void release() noexcept {
    if (comm_) {
      if (owned_ && !aborted_) {
        // Flush, then free; if that fails there is nobody left to tell: abort instead.
        if (!broken_ && (ncclCommFinalize(comm_) == ncclSuccess || settle_comm(comm_, "finalize")))
          ncclCommDestroy(comm_);
        else
          ncclCommAbort(comm_);
      }
      comm_ = nullptr;
    }
    // Memory last: the communicator is finalized or aborted by now, so no NCCL work that uses it
    // can be stuck (cudaFree and cublasDestroy wait for the device).
    if (barrier_buf_) cudaFree(std::exchange(barrier_buf_, nullptr));
    if (verify_host_) cudaFreeHost(std::exchange(verify_host_, nullptr));
    release_buffers();
  }

  // Frees the stream-ordered buffers after their last use without waiting for it: on a private
  // stream that waits for the last-use event (the caller's streams may be destroyed already).
  void release_buffers() noexcept {
    if (!sum_buf_.p && !verify_buf_.p && !buffers_done_ && !row_sum_.has_handle()) return;
    int current = -1;
    const bool switch_device = buffers_device_ >= 0 && cudaGetDevice(&current) == cudaSuccess &&
                               current != buffers_device_ &&
                               cudaSetDevice(buffers_device_) == cudaSuccess;
    cudaStream_t s = nullptr;
    const bool have_stream = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess;
    if (!have_stream && buffers_done_) cudaEventSynchronize(buffers_done_);  // no stream: wait
    if (have_stream && buffers_done_) cudaStreamWaitEvent(s, buffers_done_, 0);
    for (device_buffer* b : {&sum_buf_, &verify_buf_})
      if (b->p) {
        if (have_stream)
          cudaFreeAsync(std::exchange(b->p, nullptr), s);
        else
          cudaFree(std::exchange(b->p, nullptr));
        b->bytes = 0;
      }
    if (have_stream) cudaStreamDestroy(s);  // returns at once; the frees run when due
    if (buffers_done_) cudaEventDestroy(std::exchange(buffers_done_, nullptr));
    row_sum_ = detail::cublas_row_sum{};
    if (switch_device) cudaSetDevice(current);
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
  // A failure inside an open ncclGroupStart/End: the group is closed first (its result no longer
  // matters), because ncclCommAbort must not run inside an open group.
  status fail_in_group(detail::nccl_group& g, const status& s) {
    static_cast<void>(g.end());
    return fail(s);
  }

  // A collective every rank agreed not to run (verify_counts found a mismatch or rejected
  // arguments): nothing is pending, but the program is wrong, so the communicator is broken, as
  // on MPI. An owned communicator is aborted when it is destroyed.
  status break_with(const error& e) {
    broken_ = true;
    why_ = e.message;
    return unexpected<error>(e);
  }

  // Every collective's entry: without verify_counts, the local argument check, then usable();
  // with it, usable(), then the header exchange, which also reports this rank's own rejected
  // arguments after its peers have learned of them.
  status begin(collective op, const expected<collective_schedule>& sch, const call_info& info,
               cudaStream_t s) {
    if (!opt_.verify_counts) {
      if (!sch) return unexpected<error>(sch.error());
      return usable();
    }
    if (auto ok = usable(); !ok) return ok;
    return verify(op, sch, info, s);
  }

  // verify_counts: every rank all-gathers its P headers (what it tells each peer) and checks every
  // pair (a, b) in the same order, so every rank reports the same first disagreement. One small
  // ncclAllGather on `s`, then the host waits for `s` (polled against the timeout, like
  // synchronize()) and copies the P x P headers back.
  status verify(collective op, const expected<collective_schedule>& sch, const call_info& info,
                cudaStream_t s) {
    const std::uint64_t call = seq_++;
    const auto P = static_cast<std::size_t>(size_);
    constexpr std::size_t hb = sizeof(collective_header);
    // The headers go through pinned memory the communicator owns: a copy from pageable memory
    // may wait for the stream, and behind a stuck collective the host would block with no
    // timeout. The previous call's copies are done (it waited for its stream before returning).
    if (!verify_host_) {
      void* h = nullptr;
      if (auto ok = detail::cuda_check(cudaMallocHost(&h, hb * P * (P + 1)),
                                       "cudaMallocHost (verify_counts headers)");
          !ok)
        return fail(ok);
      verify_host_ = static_cast<collective_header*>(h);
    }
    collective_header* mine = verify_host_;  // [P]
    collective_header* all = mine + P;       // [P, P]
    for (std::size_t p = 0; p < P; ++p)
      mine[p] = sch ? make_header(*sch, static_cast<int>(p), call, info)
                    : make_failure_header(op, call, header_rejected_arguments);
    bool fresh = false;
    if (auto ok = reserve(verify_buf_, hb * P * (P + 1), s, fresh); !ok) return fail(ok);
    auto* dev = static_cast<std::byte*>(verify_buf_.p);
    if (auto ok = detail::cuda_check(cudaMemcpyAsync(dev, mine, hb * P, cudaMemcpyHostToDevice, s),
                                     "cudaMemcpyAsync (verify_counts headers)");
        !ok)
      return fail(ok);
    const auto ok = enqueue(ncclAllGather(dev, dev + hb * P, hb * P, ncclUint8, comm_, s),
                            "ncclAllGather (verify_counts headers)");
    const auto done = mark_used(s);
    if (!ok) return ok;
    if (!done) return fail(done);
    // Wait with the timeout first, so that the host never blocks behind the collective. After
    // the wait the copy is all that is left.
    if (auto w = synchronize(s); !w) return w;
    if (auto c = detail::cuda_check(
            cudaMemcpyAsync(all, dev + hb * P, hb * P * P, cudaMemcpyDeviceToHost, s),
            "cudaMemcpyAsync (verify_counts headers)");
        !c)
      return fail(c);
    if (auto c = detail::cuda_check(cudaStreamSynchronize(s), "cudaStreamSynchronize"); !c)
      return fail(c);
    for (int a = 0; a < size_; ++a)
      for (int b = 0; b < size_; ++b) {
        const auto ab = static_cast<std::size_t>(a) * P + static_cast<std::size_t>(b);
        const auto ba = static_cast<std::size_t>(b) * P + static_cast<std::size_t>(a);
        if (auto v = check_headers(all[ab], all[ba], a, b); !v)
          return break_with(sch ? v.error() : sch.error());  // a rejecting rank: its own error
      }
    if (!sch) return break_with(sch.error());  // unreachable: its own header fails the check
    return {};
  }

  // Makes `b` hold at least `bytes`, usable on `s` after every earlier use of the communicator's
  // buffers (on any stream). fresh: the memory is new (its contents are undefined).
  status reserve(device_buffer& b, std::size_t bytes, cudaStream_t s, bool& fresh) {
    fresh = false;
    if (!buffers_done_) {
      if (auto ok = detail::cuda_check(cudaGetDevice(&buffers_device_), "cudaGetDevice"); !ok)
        return ok;
      if (auto ok =
              detail::cuda_check(cudaEventCreateWithFlags(&buffers_done_, cudaEventDisableTiming),
                                 "cudaEventCreateWithFlags");
          !ok)
        return ok;
    }
    if (auto ok =
            detail::cuda_check(cudaStreamWaitEvent(s, buffers_done_, 0), "cudaStreamWaitEvent");
        !ok)
      return ok;
    if (b.p && b.bytes >= bytes) return {};
    if (b.p) {
      if (auto ok = detail::cuda_check(cudaFreeAsync(b.p, s), "cudaFreeAsync"); !ok) return ok;
      b = device_buffer{};
    }
    const std::size_t want = std::max<std::size_t>(bytes, 256);
    void* p = nullptr;
    if (auto ok = detail::cuda_check(cudaMallocAsync(&p, want, s), "cudaMallocAsync"); !ok)
      return ok;
    b.p = p;
    b.bytes = want;
    fresh = true;
    return {};
  }
  // Records the last use of the buffers (after the work just enqueued on s).
  status mark_used(cudaStream_t s) {
    return detail::cuda_check(cudaEventRecord(buffers_done_, s), "cudaEventRecord");
  }

  // The 16-bit sums' memory: P ones of each 16-bit type (bf16 first), then `elems` elements of
  // staging, 256-byte aligned.
  template <class T>
  status sum_buffers(std::size_t elems, cudaStream_t s, T*& staging, const T*& ones) {
    const auto P = static_cast<std::size_t>(size_);
    const std::size_t ones_bytes = (2 * P * sizeof(std::uint16_t) + 255) / 256 * 256;
    bool fresh = false;
    if (auto ok = reserve(sum_buf_, ones_bytes + elems * sizeof(T), s, fresh); !ok) return ok;
    auto* base = static_cast<std::byte*>(sum_buf_.p);
    if (fresh) {
      // The ones are written on the device, byte by byte: a copy from pageable host memory may
      // wait for the stream, and behind a stuck collective the host would then block with no
      // timeout. A 2D memset of one byte per 2-byte row writes every low (then high) byte of
      // the P 16-bit values (little-endian).
      const auto fill = [&](std::size_t at, std::uint16_t one) -> status {
        for (int hi = 0; hi < 2; ++hi)
          if (auto ok = detail::cuda_check(
                  cudaMemset2DAsync(base + at + static_cast<std::size_t>(hi), 2,
                                    static_cast<int>(hi ? one >> 8 : one & 0xffu), 1, P, s),
                  "cudaMemset2DAsync (ones)");
              !ok)
            return ok;
        return {};
      };
      if (auto ok = fill(0, bfloat16(1.0f).bits); !ok) return ok;
      if (auto ok = fill(P * sizeof(std::uint16_t), float16(1.0f).bits); !ok) return ok;
    }
    const std::size_t ones_at = dtype_of<T> == dtype::bf16 ? 0 : P * sizeof(std::uint16_t);
    ones = reinterpret_cast<const T*>(base + ones_at);
    staging = reinterpret_cast<T*>(base + ones_bytes);
    return {};
  }

  // The P rows of staging (row p at p * n) summed into out by cuBLAS, then the last-use mark.
  template <class T>
  status sum_rows(const T* staging, const T* ones, std::int64_t n, T* out, cudaStream_t s) {
    const auto ok = row_sum_.sum<T>(staging, size_, n, ones, out, s);
    const auto done = mark_used(s);  // recorded even after a failure: release() waits for it
    if (!ok) return fail(ok);
    if (!done) return fail(done);
    return {};
  }

  // The steps of a schedule as one group of ncclSend/ncclRecv (all_to_all_v, and the 16-bit
  // reduce_scatter_v into its staging area).
  template <class T>
  status exchange_steps(const collective_schedule& sch, const T* send, T* recv, cudaStream_t s,
                        const char* what) {
    constexpr auto k = detail::nccl_scale<T>();
    detail::nccl_group g;
    for (int i = 0; i < sch.num_steps(); ++i) {
      const schedule_step st = sch.step(i);
      if (st.send_count > 0)
        if (auto ok = detail::nccl_check(
                ncclSend(send + st.send_offset, static_cast<std::size_t>(st.send_count) * k,
                         detail::nccl_type<T>(), st.send_peer, comm_, s),
                "ncclSend", comm_);
            !ok)
          return fail_in_group(g, ok);
      if (st.recv_count > 0)
        if (auto ok = detail::nccl_check(
                ncclRecv(recv + st.recv_offset, static_cast<std::size_t>(st.recv_count) * k,
                         detail::nccl_type<T>(), st.recv_peer, comm_, s),
                "ncclRecv", comm_);
            !ok)
          return fail_in_group(g, ok);
    }
    return enqueue(g.end(), what);
  }

  template <class T>
  status reduce_scatter_v_sum16(const collective_schedule& sch, const T* send, T* recv,
                                cudaStream_t s) {
    T* staging = nullptr;
    const T* ones = nullptr;
    if (auto ok = sum_buffers<T>(static_cast<std::size_t>(sch.recv_extent()), s, staging, ones);
        !ok) {
      static_cast<void>(mark_used(s));  // the ones may be in flight to the new memory
      return fail(ok);                  // this rank cannot take part: its peers must not wait
    }
    auto ok = exchange_steps<T>(sch, send, staging, s, "ncclGroupEnd (reduce_scatter_v, fp32 sum)");
    if (!ok) {
      static_cast<void>(mark_used(s));  // the communicator is aborted; keep the order anyway
      return ok;
    }
    return sum_rows<T>(staging, ones, sch.result_count(), recv, s);
  }

  template <class T>
  status all_reduce_sum16(std::span<T> buf, cudaStream_t s) {
    const auto n = static_cast<std::int64_t>(buf.size());
    if (n == 0) return {};  // every rank that agrees on the count skips it
    T* staging = nullptr;
    const T* ones = nullptr;
    if (auto ok = sum_buffers<T>(buf.size() * static_cast<std::size_t>(size_), s, staging, ones);
        !ok) {
      static_cast<void>(mark_used(s));
      return fail(ok);
    }
    auto ok =
        enqueue(ncclAllGather(buf.data(), staging, buf.size(), detail::nccl_type<T>(), comm_, s),
                "ncclAllGather (all_reduce, fp32 sum)");
    if (!ok) {
      static_cast<void>(mark_used(s));
      return ok;
    }
    // The gather has read buf before the GEMM (same stream) overwrites it.
    return sum_rows<T>(staging, ones, n, buf.data(), s);
  }

  ncclComm_t comm_ = nullptr;
  bool owned_ = false;
  int rank_ = 0;
  int size_ = 0;
  nccl_options opt_{};
  bool broken_ = false;
  bool aborted_ = false;
  std::string why_;
  std::uint64_t seq_ = 0;  // verify_counts: collectives called before this one
  static constexpr std::size_t barrier_bytes = 16;
  int* barrier_buf_ = nullptr;  // barrier_bytes, zeroed
  device_buffer sum_buf_;       // 16-bit sums: ones, then the [P, n] staging area
  device_buffer verify_buf_;    // verify_counts: 40 * P (mine) + 40 * P * P (all) bytes
  collective_header* verify_host_ = nullptr;  // pinned: the same P + P * P headers on the host
  cudaEvent_t buffers_done_ = nullptr;        // the last use of sum_buf_ / verify_buf_
  int buffers_device_ = -1;                   // the device they live on
  detail::cublas_row_sum row_sum_;
};

static_assert(splittable_communicator<nccl_communicator>);
static_assert(communicator_for<nccl_communicator, cuda_copy_exec>);

}  // namespace v0_1
}  // namespace moefold
