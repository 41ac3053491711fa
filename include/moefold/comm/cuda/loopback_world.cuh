//! @file loopback_world.cuh
//! @brief The device loopback: N ranks in one process on one GPU, one thread and one stream per
//! rank, executing the same collective schedules as every backend. It exists because NCCL
//! refuses two ranks on one GPU ("Duplicate GPU detected"), so multi-rank GPU code is tested here.
//!
//! The ranks meet on the host through the thread world's rendezvous (so a rank that throws,
//! returns early, never arrives, or disagrees on counts or collectives is an error on every rank
//! within the timeout, exactly as in the thread world) and move data on the device: each rank's
//! stream waits for its peers' "ready" events, pulls what it receives from their device buffers
//! (cudaMemcpyAsync, or the fp32 rank-order reduction kernel), and records "done"; after the
//! rendezvous every stream waits for its peers' "done" before it may touch its buffers again.
//! The host never waits for the GPU inside a collective (synchronize() does).
//!
//! Results equal the thread world's bit for bit (the reductions run in rank order, 16-bit floats
//! in fp32). Reductions take at most 64 ranks.
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <moefold/kernels/comm/reduce_sources.cuh>
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
#include "../thread_world.hpp"
#include "cuda_types.hpp"

namespace moefold {
inline namespace v0_1 {

//! Options of a loopback world.
struct loopback_options {
  //! The host rendezvous timeout (as in the thread world) and synchronize()'s limit.
  std::chrono::milliseconds timeout{10000};
  //! The GPU all ranks run on.
  int device = 0;
};

namespace detail {

// A rank's stream; shared by the communicators split from it.
struct loopback_stream {
  cudaStream_t s = nullptr;
  loopback_stream() = default;
  loopback_stream(const loopback_stream&) = delete;
  loopback_stream& operator=(const loopback_stream&) = delete;
  ~loopback_stream() {
    if (s) cudaStreamDestroy(s);
  }
};

// One communicator rank's events, published to its peers during a collective. Peers hold them
// by shared_ptr, so they outlive the rank that made them while waits on them are enqueued.
struct loopback_events {
  cudaEvent_t ready = nullptr;  // my inputs are ready: peers may read my buffers
  cudaEvent_t done = nullptr;   // I have finished reading my peers' buffers
  loopback_events() = default;
  loopback_events(const loopback_events&) = delete;
  loopback_events& operator=(const loopback_events&) = delete;
  ~loopback_events() {
    if (ready) cudaEventDestroy(ready);
    if (done) cudaEventDestroy(done);
  }
  static expected<std::shared_ptr<loopback_events>> make() {
    auto e = std::make_shared<loopback_events>();
    if (auto ok = cuda_check(cudaEventCreateWithFlags(&e->ready, cudaEventDisableTiming),
                             "cudaEventCreate");
        !ok)
      return unexpected<error>(ok.error());
    if (auto ok = cuda_check(cudaEventCreateWithFlags(&e->done, cudaEventDisableTiming),
                             "cudaEventCreate");
        !ok)
      return unexpected<error>(ok.error());
    return e;
  }
};

}  // namespace detail

//! One rank of a loopback world. Buffers are device memory of the world's GPU, counts host
//! values; the row-view collectives enqueue on the context's stream, the span forms on stream()
//! (this rank's). Move-only.
class loopback_communicator : public span_collectives<loopback_communicator, device_space> {
  using spans = span_collectives<loopback_communicator, device_space>;

 public:
  using memory_space = device_space;

  loopback_communicator(thread_communicator tc, std::shared_ptr<detail::loopback_stream> stream,
                        std::shared_ptr<detail::loopback_events> ev,
                        std::chrono::milliseconds timeout)
      : tc_(std::move(tc)), stream_(std::move(stream)), ev_(std::move(ev)), timeout_(timeout) {}

  [[nodiscard]] int rank() const noexcept { return tc_.rank(); }
  [[nodiscard]] int size() const noexcept { return tc_.size(); }
  [[nodiscard]] cudaStream_t stream() const noexcept { return stream_->s; }

  //! The context of the span forms: this rank's stream.
  [[nodiscard]] cuda_copy_exec default_exec() const noexcept { return cuda_copy_exec(stream()); }

  using spans::all_gather;
  using spans::all_gather_v;
  using spans::all_to_all_v;
  using spans::reduce_scatter_v;

  template <reducible T>
  [[nodiscard]] status all_reduce(std::span<T> buf, reduce_op op) {
    return all_reduce_on(buf, op, stream());
  }
  template <transferable T>
  [[nodiscard]] status broadcast(std::span<T> buf, int root) {
    return broadcast_on(buf, root, stream());
  }

  // --- row views on the context's stream (counts in rows) -------------------------------------

  template <reducible T>
  [[nodiscard]] status all_reduce(cuda_copy_exec& x, row_view<T, device_space> buf, reduce_op op) {
    return all_reduce_on(detail::flat(buf), op, x.stream());
  }
  template <transferable T>
  [[nodiscard]] status broadcast(cuda_copy_exec& x, row_view<T, device_space> buf, int root) {
    return broadcast_on(detail::flat(buf), root, x.stream());
  }
  [[nodiscard]] status barrier(cuda_copy_exec& x) { return barrier_on(x.stream()); }

  template <transferable T>
  [[nodiscard]] status all_gather(cuda_copy_exec& x, row_view<const T, device_space> send,
                                  row_view<T, device_space> recv) {
    auto s = detail::rows_schedule("all_gather", send, recv, [&](int w) {
      return schedule_builder::all_gather(rank(), size(), detail::uz(send.rows()),
                                          detail::uz(recv.rows()), w);
    });
    return run(collective::all_gather, s, call_info_of<T>(), send.data(), recv.data(), x.stream(),
               pull<T>(recv.data(), x.stream()));
  }

  template <transferable T>
  [[nodiscard]] status all_gather_v(cuda_copy_exec& x, row_view<const T, device_space> send,
                                    row_view<T, device_space> recv, std::span<const int> counts) {
    auto s = detail::rows_schedule("all_gather_v", send, recv, [&](int w) {
      return schedule_builder::all_gather_v(rank(), size(), counts, detail::uz(send.rows()),
                                            detail::uz(recv.rows()), w);
    });
    return run(collective::all_gather_v, s, call_info_of<T>(), send.data(), recv.data(), x.stream(),
               pull<T>(recv.data(), x.stream()));
  }

  template <transferable T>
  [[nodiscard]] status all_to_all_v(cuda_copy_exec& x, row_view<const T, device_space> send,
                                    std::span<const int> send_counts,
                                    row_view<T, device_space> recv,
                                    std::span<const int> recv_counts) {
    auto s = detail::rows_schedule("all_to_all_v", send, recv, [&](int w) {
      return schedule_builder::all_to_all_v(rank(), size(), send_counts, recv_counts,
                                            detail::uz(send.rows()), detail::uz(recv.rows()), w);
    });
    return run(collective::all_to_all_v, s, call_info_of<T>(), send.data(), recv.data(), x.stream(),
               pull<T>(recv.data(), x.stream()));
  }

  template <reducible T>
  [[nodiscard]] status reduce_scatter_v(cuda_copy_exec& x, row_view<const T, device_space> send,
                                        std::span<const int> counts, row_view<T, device_space> recv,
                                        reduce_op op) {
    using D = device_type_t<T>;
    const cudaStream_t cs = x.stream();
    auto s = reducing(detail::rows_schedule("reduce_scatter_v", send, recv, [&](int w) {
      return schedule_builder::reduce_scatter_v(rank(), size(), counts, detail::uz(send.rows()),
                                                detail::uz(recv.rows()), w);
    }));
    T* out = recv.data();
    return run(
        collective::reduce_scatter_v, s, call_info_of<T>(static_cast<int>(op)), send.data(), out,
        cs, [&](const std::vector<detail::tw_slot>& slots, status& err) {
          const int me = rank();
          kernels::reduce_sources<D> in{};
          for (std::size_t p = 0; p < slots.size(); ++p)  // peer p's chunk for me
            in.src[p] = static_cast<const D*>(slots[p].send) + slots[p].sched.send_offset(me);
          const auto n = slots[static_cast<std::size_t>(me)].sched.result_count();
          keep(err,
               cuda_check(kernels::launch_reduce_sources<D>(
                              in, size(), n, reinterpret_cast<D*>(out), op == reduce_op::max, cs),
                          "reduce_sources_kernel"));
        });
  }

  //! Orders every rank's stream after every other's work so far (the host does not wait).
  [[nodiscard]] status barrier() { return barrier_on(stream()); }

  //! Ranks of a color form a new loopback communicator on the same streams.
  [[nodiscard]] expected<loopback_communicator> split(int color, int key) {
    auto ev = detail::loopback_events::make();
    auto sub = tc_.split(color, key);  // takes part even if the events failed
    if (!sub) return unexpected<error>(sub.error());
    if (!ev) return unexpected<error>(ev.error());
    return loopback_communicator(std::move(*sub), stream_, std::move(*ev), timeout_);
  }

  //! Waits for this rank's stream, at most the timeout (errc::comm_timeout).
  [[nodiscard]] status synchronize() {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    for (;;) {
      const cudaError_t q = cudaStreamQuery(stream());
      if (q == cudaSuccess) return {};
      if (q != cudaErrorNotReady) return detail::cuda_check(q, "cudaStreamQuery");
      if (std::chrono::steady_clock::now() >= deadline)
        return make_error(errc::comm_timeout, "loopback rank " + std::to_string(rank()) +
                                                  ": the stream did not drain within " +
                                                  std::to_string(timeout_.count()) + " ms");
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

 private:
  static status cuda_check(cudaError_t rc, const char* what) {
    return detail::cuda_check(rc, what);
  }

  template <class T>
  status all_reduce_on(std::span<T> buf, reduce_op op, cudaStream_t cs) {
    using D = device_type_t<T>;
    auto s = reducing(schedule_builder::all_reduce(rank(), size(), buf.size()));
    D* tmp = nullptr;
    const auto n = buf.size();
    auto st =
        run(collective::all_reduce, s, call_info_of<T>(static_cast<int>(op)), buf.data(),
            buf.data(), cs, [&](const std::vector<detail::tw_slot>& slots, status& err) {
              if (n == 0) return;
              keep(err, cuda_check(cudaMallocAsync(&tmp, n * sizeof(D), cs), "cudaMallocAsync"));
              if (!err) return;
              kernels::reduce_sources<D> in{};
              for (std::size_t p = 0; p < slots.size(); ++p)
                in.src[p] = static_cast<const D*>(slots[p].send);
              keep(err, cuda_check(kernels::launch_reduce_sources<D>(in, size(),
                                                                     static_cast<std::int64_t>(n),
                                                                     tmp, op == reduce_op::max, cs),
                                   "reduce_sources_kernel"));
            });
    // After every peer has read this buffer: write the result into it.
    if (tmp) {
      if (st)
        keep(st, cuda_check(
                     cudaMemcpyAsync(buf.data(), tmp, n * sizeof(D), cudaMemcpyDeviceToDevice, cs),
                     "cudaMemcpyAsync"));
      keep(st, cuda_check(cudaFreeAsync(tmp, cs), "cudaFreeAsync"));
    }
    return st;
  }

  template <class T>
  status broadcast_on(std::span<T> buf, int root, cudaStream_t cs) {
    auto s = schedule_builder::broadcast(rank(), size(), buf.size(), root);
    return run(collective::broadcast, s, call_info_of<T>(), buf.data(), buf.data(), cs,
               [&](const std::vector<detail::tw_slot>& slots, status& err) {
                 if (rank() == root || buf.empty()) return;
                 keep(err, cuda_check(cudaMemcpyAsync(
                                          buf.data(), slots[static_cast<std::size_t>(root)].send,
                                          buf.size() * sizeof(T), cudaMemcpyDeviceToDevice, cs),
                                      "cudaMemcpyAsync"));
               });
  }

  status barrier_on(cudaStream_t cs) {
    return run(collective::barrier, schedule_builder::barrier(rank(), size()), call_info{}, nullptr,
               nullptr, cs, [](const std::vector<detail::tw_slot>&, status&) {});
  }
  // The first error wins.
  static void keep(status& into, const status& s) {
    if (into && !s) static_cast<void>(into = s);
  }

  // Reductions read every rank in one kernel launch: at most max_reduce_sources ranks.
  expected<collective_schedule> reducing(expected<collective_schedule> s) const {
    if (s && size() > kernels::max_reduce_sources)
      return make_error(errc::not_supported, "loopback reductions take at most " +
                                                 std::to_string(kernels::max_reduce_sources) +
                                                 " ranks (got " + std::to_string(size()) + ")");
    return s;
  }

  // The data phase of the gathers and all_to_all_v: copy what peer p sends me, from p's send
  // offset for me to my receive offset for p, on my stream.
  template <class T>
  auto pull(T* recv, cudaStream_t cs) {
    return [this, recv, cs](const std::vector<detail::tw_slot>& slots, status& err) {
      const auto& mine = slots[static_cast<std::size_t>(rank())].sched;
      for (int i = 0; i < mine.num_steps(); ++i) {
        const schedule_step st = mine.step(i);
        if (st.recv_count == 0) continue;
        const auto& peer = slots[static_cast<std::size_t>(st.recv_peer)];
        const T* src = static_cast<const T*>(peer.send) + peer.sched.send_offset(rank());
        keep(err, cuda_check(cudaMemcpyAsync(recv + st.recv_offset, src,
                                             static_cast<std::size_t>(st.recv_count) * sizeof(T),
                                             cudaMemcpyDeviceToDevice, cs),
                             "cudaMemcpyAsync"));
      }
    };
  }

  // One collective: record "ready", meet the peers, enqueue the data phase after their "ready",
  // record "done", and after the rendezvous make my stream wait for their "done".
  template <class F>
  status run(collective op, expected<collective_schedule> s, const call_info& info,
             const void* send, void* recv, cudaStream_t cs, F&& data) {
    if (s) {
      if (auto ok = cuda_check(cudaEventRecord(ev_->ready, cs), "cudaEventRecord"); !ok)
        static_cast<void>(s = unexpected<error>(ok.error()));  // take part: peers fail at once
    }
    std::vector<std::shared_ptr<detail::loopback_events>> peers;
    status err;
    auto st =
        tc_.exchange(op, s, info, send, recv, &ev_, [&](const std::vector<detail::tw_slot>& slots) {
          for (const auto& sl : slots)
            peers.push_back(*static_cast<const std::shared_ptr<detail::loopback_events>*>(sl.ext));
          for (const auto& p : peers)
            keep(err, cuda_check(cudaStreamWaitEvent(cs, p->ready, 0), "cudaStreamWaitEvent"));
          data(slots, err);
          keep(err, cuda_check(cudaEventRecord(ev_->done, cs), "cudaEventRecord"));
        });
    if (!st) return st;
    for (std::size_t p = 0; p < peers.size(); ++p)
      if (static_cast<int>(p) != rank())
        keep(err, cuda_check(cudaStreamWaitEvent(cs, peers[p]->done, 0), "cudaStreamWaitEvent"));
    return err;
  }

  thread_communicator tc_;
  std::shared_ptr<detail::loopback_stream> stream_;
  std::shared_ptr<detail::loopback_events> ev_;
  std::chrono::milliseconds timeout_;
};

static_assert(splittable_communicator<loopback_communicator>);
static_assert(communicator_for<loopback_communicator, cuda_copy_exec>);

//! Runs fn(loopback_communicator&) for n ranks, each on its own host thread and its own stream
//! of GPU `opt.device`, and returns each rank's status (as run_thread_world). Each rank's stream
//! is drained before its thread ends.
template <class F>
[[nodiscard]] std::vector<status> run_loopback_world(int n, F&& fn, loopback_options opt = {}) {
  return run_thread_world(
      n,
      [&](thread_communicator& tc) -> status {
        if (auto ok = detail::cuda_check(cudaSetDevice(opt.device), "cudaSetDevice"); !ok)
          return ok;
        auto stream = std::make_shared<detail::loopback_stream>();
        if (auto ok = detail::cuda_check(
                cudaStreamCreateWithFlags(&stream->s, cudaStreamNonBlocking), "cudaStreamCreate");
            !ok)
          return ok;
        auto ev = detail::loopback_events::make();
        if (!ev) return unexpected<error>(ev.error());
        loopback_communicator comm(std::move(tc), stream, std::move(*ev), opt.timeout);
        status result;
        if constexpr (std::is_same_v<std::invoke_result_t<F&, loopback_communicator&>, void>)
          fn(comm);
        else
          static_cast<void>(result = fn(comm));
        auto drained = comm.synchronize();
        if (result && !drained) return drained;
        return result;
      },
      {.timeout = opt.timeout});
}

}  // namespace v0_1
}  // namespace moefold
