//! @file thread_world.hpp
//! @brief The thread world: N ranks as threads of one process, for unit tests of any mapping on a
//! laptop CPU. Results are deterministic (reductions run in rank order in the accumulator type).
//!
//! Each collective runs in three phases: every rank posts its schedule and buffers (entry), the
//! posts are checked pairwise with the same header check as the MPI backend (so every rank sees
//! the same verdict), then every rank pulls what it receives straight from its peers' buffers and
//! waits until all have done so (exit). A rank that calls a different collective, disagrees on
//! counts or rejects its own arguments makes the collective fail on every rank; a rank that throws
//! or returns from its function while its peers wait for it fails them at once; a rank that does
//! not arrive within the timeout fails them after it. After a failure the communicator is broken:
//! later calls on any rank return errc::comm_broken with the first failure's message.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "../core/dtype.hpp"
#include "../core/expected.hpp"
#include "../core/row_view.hpp"
#include "../core/size.hpp"
#include "../exec/cpu_exec.hpp"
#include "../exec/host_exec.hpp"
#include "communicator.hpp"
#include "group_communicator.hpp"
#include "schedule.hpp"
#include "span_collectives.hpp"

namespace moefold {
inline namespace v0_1 {

//! Options of a thread world.
struct thread_world_options {
  //! How long a rank waits for its peers in one collective before it reports comm_timeout.
  std::chrono::milliseconds timeout{10000};
};

namespace detail {

// One run_thread_world: what all its communicators share. One mutex for all of them: the thread
// world is a test engine, simplicity beats contention.
struct tw_job {
  std::mutex m;
  std::condition_variable cv;
  std::chrono::milliseconds timeout{};
  std::vector<int> departed;  // per world rank: 0 running, 1 returned, 2 threw
  std::vector<std::string> why;
};

// What one rank posted for its current collective.
struct tw_slot {
  std::uint64_t posted = 0;  // call number + 1 of the last collective posted
  std::uint64_t left = 0;    // call number + 1 of the last collective this rank finished
  collective op = collective::none;
  std::uint8_t flag = header_ok;
  collective_schedule sched;
  call_info info;
  const void* send = nullptr;
  void* recv = nullptr;
  int color = 0, key = 0;     // split
  std::string why;            // why this rank rejected its arguments
  const void* ext = nullptr;  // what a backend built on this rendezvous publishes to its peers
};

struct tw_state {
  std::shared_ptr<tw_job> job;
  std::vector<int> world_rank;  // world rank of each member
  std::vector<tw_slot> slots;
  bool broken = false;
  error reason;                   // the first failure
  std::uint64_t broken_call = 0;  // the call it happened in
  std::vector<char> late;         // members that had not arrived when it timed out
  // Results of the last split: each member's new communicator state and rank (null: no color).
  std::vector<std::shared_ptr<tw_state>> split_state;
  std::vector<int> split_rank;
  std::uint64_t split_call = 0;

  int size() const noexcept { return static_cast<int>(world_rank.size()); }
};

inline std::string rank_list(const std::vector<int>& r) {
  std::string s;
  for (std::size_t i = 0; i < r.size(); ++i) s += (i ? ", " : "") + std::to_string(r[i]);
  return s;
}

}  // namespace detail

template <memory_space Space>
class basic_thread_communicator;

//! The thread world over host memory (host_exec): what tests and the CPU layer use.
using thread_communicator = basic_thread_communicator<host_space>;
//! The thread world over the CPU executor's device memory (cpu_exec): the GPU code path of the
//! dispatcher, run multi-rank in CI. Get one from a thread_communicator with
//! `std::move(world).in_space<cpu_device_space>()`.
using thread_device_communicator = basic_thread_communicator<cpu_device_space>;

namespace detail {
template <class Space>
struct thread_exec {
  using type = host_exec;
};
template <>
struct thread_exec<cpu_device_space> {
  using type = cpu_exec;
};
}  // namespace detail

//! One rank's handle on a thread world (or on a communicator split from one). Move-only: the
//! call counter that keeps ranks in step lives in it. Its buffers are in memory space `Space`
//! (host memory, or the CPU executor's, which is host memory too: the thread world moves both
//! the same way).
template <memory_space Space>
class basic_thread_communicator : public span_collectives<basic_thread_communicator<Space>, Space> {
  using spans = span_collectives<basic_thread_communicator<Space>, Space>;

 public:
  using memory_space = Space;
  //! The execution context of the row-view collectives: host_exec or cpu_exec.
  using exec_type = typename detail::thread_exec<Space>::type;

  basic_thread_communicator(basic_thread_communicator&&) noexcept = default;
  basic_thread_communicator& operator=(basic_thread_communicator&&) noexcept = default;
  basic_thread_communicator(const basic_thread_communicator&) = delete;
  basic_thread_communicator& operator=(const basic_thread_communicator&) = delete;
  ~basic_thread_communicator() = default;

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return st_ ? st_->size() : 0; }
  //! The rank of this thread in the world it was started in.
  [[nodiscard]] int world_rank() const noexcept {
    return st_->world_rank[static_cast<std::size_t>(rank_)];
  }
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept { return st_->job->timeout; }
  //! The context the span forms run on.
  [[nodiscard]] exec_type default_exec() const noexcept { return exec_type{}; }

  //! The same rank, with buffers in another memory space (this handle is consumed: the call
  //! sequence continues in the new one).
  template <moefold::memory_space S2>
  [[nodiscard]] basic_thread_communicator<S2> in_space() && {
    basic_thread_communicator<S2> c(std::move(st_), rank_);
    c.seq_ = seq_;
    return c;
  }

  using spans::all_gather;
  using spans::all_gather_v;
  using spans::all_to_all_v;
  using spans::reduce_scatter_v;

  template <reducible T>
  [[nodiscard]] status all_reduce(std::span<T> buf, reduce_op op) {
    auto s = schedule_builder::all_reduce(rank_, size(), buf.size(), std::move(spare_));
    // The sums go to this rank's scratch (kept between calls) and into buf after the exit
    // barrier: until then peers read buf.
    if (reduce_scratch_.size() < buf.size() * sizeof(T))
      reduce_scratch_.resize(buf.size() * sizeof(T));
    const std::span<T> out(reinterpret_cast<T*>(reduce_scratch_.data()), buf.size());
    auto st =
        run(collective::all_reduce, std::move(s), call_info_of<T>(static_cast<int>(op)), buf.data(),
            buf.data(), [&](const std::vector<detail::tw_slot>& slots) {
              for (std::size_t i = 0; i < buf.size(); ++i) {
                auto acc = detail::widen(static_cast<const T*>(slots[0].send)[i]);
                for (std::size_t p = 1; p < slots.size(); ++p)
                  acc = combine(acc, detail::widen(static_cast<const T*>(slots[p].send)[i]), op);
                out[i] = detail::narrow<T>(acc);
              }
            });
    if (st) std::copy(out.begin(), out.end(), buf.begin());
    return st;
  }

  template <transferable T>
  [[nodiscard]] status broadcast(std::span<T> buf, int root) {
    auto s = schedule_builder::broadcast(rank_, size(), buf.size(), root, std::move(spare_));
    return run(collective::broadcast, std::move(s), call_info_of<T>(), buf.data(), buf.data(),
               [&](const std::vector<detail::tw_slot>& slots) {
                 if (rank_ != root)
                   std::memcpy(buf.data(), slots[static_cast<std::size_t>(root)].send,
                               buf.size() * sizeof(T));
               });
  }

  [[nodiscard]] status barrier() {
    return run(collective::barrier, schedule_builder::barrier(rank_, size(), std::move(spare_)),
               call_info{}, nullptr, nullptr, [](const std::vector<detail::tw_slot>&) {});
  }

  // --- row views (counts in rows), on this communicator's memory space ----------------------

  template <reducible T>
  [[nodiscard]] status all_reduce(exec_type&, row_view<T, Space> buf, reduce_op op) {
    return all_reduce(detail::flat(buf), op);
  }

  template <transferable T>
  [[nodiscard]] status all_gather(exec_type&, row_view<const T, Space> send,
                                  row_view<T, Space> recv) {
    auto s = detail::rows_schedule("all_gather", send, recv, [&](int w) {
      return schedule_builder::all_gather(rank_, size(), detail::uz(send.rows()),
                                          detail::uz(recv.rows()), w, std::move(spare_));
    });
    return run(collective::all_gather, std::move(s), call_info_of<T>(), send.data(), recv.data(),
               pull<T>(recv.data()));
  }

  template <transferable T>
  [[nodiscard]] status all_gather_v(exec_type&, row_view<const T, Space> send,
                                    row_view<T, Space> recv, std::span<const int> counts) {
    auto s = detail::rows_schedule("all_gather_v", send, recv, [&](int w) {
      return schedule_builder::all_gather_v(rank_, size(), counts, detail::uz(send.rows()),
                                            detail::uz(recv.rows()), w, std::move(spare_));
    });
    return run(collective::all_gather_v, std::move(s), call_info_of<T>(), send.data(), recv.data(),
               pull<T>(recv.data()));
  }

  template <transferable T>
  [[nodiscard]] status all_to_all_v(exec_type&, row_view<const T, Space> send,
                                    std::span<const int> send_counts, row_view<T, Space> recv,
                                    std::span<const int> recv_counts) {
    auto s = detail::rows_schedule("all_to_all_v", send, recv, [&](int w) {
      return schedule_builder::all_to_all_v(rank_, size(), send_counts, recv_counts,
                                            detail::uz(send.rows()), detail::uz(recv.rows()), w,
                                            std::move(spare_));
    });
    return run(collective::all_to_all_v, std::move(s), call_info_of<T>(), send.data(), recv.data(),
               pull<T>(recv.data()));
  }

  template <reducible T>
  [[nodiscard]] status reduce_scatter_v(exec_type&, row_view<const T, Space> send,
                                        std::span<const int> counts, row_view<T, Space> recv,
                                        reduce_op op) {
    auto s = detail::rows_schedule("reduce_scatter_v", send, recv, [&](int w) {
      return schedule_builder::reduce_scatter_v(rank_, size(), counts, detail::uz(send.rows()),
                                                detail::uz(recv.rows()), w, std::move(spare_));
    });
    T* out = recv.data();
    return run(collective::reduce_scatter_v, std::move(s), call_info_of<T>(static_cast<int>(op)),
               send.data(), out, [&](const std::vector<detail::tw_slot>& slots) {
                 const auto me = rank_;
                 const std::int64_t n = slots[static_cast<std::size_t>(me)].sched.result_count();
                 // Peer p's chunk for me starts at p's own send offset for me.
                 auto chunk = [&](std::size_t p) {
                   return static_cast<const T*>(slots[p].send) + slots[p].sched.send_offset(me);
                 };
                 for (std::int64_t i = 0; i < n; ++i) {
                   auto acc = detail::widen(chunk(0)[i]);
                   for (std::size_t p = 1; p < slots.size(); ++p)
                     acc = combine(acc, detail::widen(chunk(p)[i]), op);
                   out[i] = detail::narrow<T>(acc);
                 }
               });
  }

  template <transferable T>
  [[nodiscard]] status broadcast(exec_type&, row_view<T, Space> buf, int root) {
    return broadcast(detail::flat(buf), root);
  }

  [[nodiscard]] status barrier(exec_type&) { return barrier(); }

  //! Ranks with the same color form a new communicator, ordered by (key, rank). Collective. A rank
  //! passing split_no_color takes part and gets errc::rank_out_of_range back.
  [[nodiscard]] expected<basic_thread_communicator> split(int color, int key) {
    if (color < 0 && color != split_no_color)
      return fail_local(
          collective::split,
          make_error(errc::invalid_argument, "split: color must be >= 0 or split_no_color (got " +
                                                 std::to_string(color) + ")"));
    auto st = run(
        collective::split, schedule_builder::split(rank_, size()), call_info{}, nullptr, nullptr,
        [](const std::vector<detail::tw_slot>&) {}, color, key);
    if (!st) return unexpected<error>(st.error());
    std::lock_guard lk(st_->job->m);
    auto sub = st_->split_state[static_cast<std::size_t>(rank_)];
    if (!sub)
      return make_error(errc::rank_out_of_range,
                        "split: rank " + std::to_string(rank_) +
                            " passed split_no_color and joins no new communicator");
    return basic_thread_communicator(std::move(sub),
                                     st_->split_rank[static_cast<std::size_t>(rank_)]);
  }

  //! For backends built on this rendezvous (the device loopback): one collective of schedule `s`
  //! whose data phase is `data(slots)`, called once every rank has posted and the posts agree,
  //! while every peer waits (its buffers and its `ext`, published in slots[p].ext, stay valid).
  template <class F>
  [[nodiscard]] status exchange(collective op, const expected<collective_schedule>& s,
                                const call_info& info, const void* send, void* recv,
                                const void* ext, F&& data) {
    ext_ = ext;
    auto st = run(op, s, info, send, recv, std::forward<F>(data));
    ext_ = nullptr;
    return st;
  }

  //! Used by run_thread_world and split; not for users.
  basic_thread_communicator(std::shared_ptr<detail::tw_state> st, int rank)
      : st_(std::move(st)), rank_(rank) {}

 private:
  template <moefold::memory_space>
  friend class basic_thread_communicator;

  template <class A>
  static A combine(A a, A b, reduce_op op) {
    if (op == reduce_op::sum) return static_cast<A>(a + b);
    return a < b ? b : a;
  }

  // The data phase of the gathers and all_to_all_v: for every step, copy what peer p sends me
  // (at p's send offset for me) to my receive offset for p.
  template <class T>
  auto pull(T* recv) {
    return [this, recv](const std::vector<detail::tw_slot>& slots) {
      const auto& mine = slots[static_cast<std::size_t>(rank_)].sched;
      for (int i = 0; i < mine.num_steps(); ++i) {
        const schedule_step st = mine.step(i);
        const auto& peer = slots[static_cast<std::size_t>(st.recv_peer)];
        const T* src = static_cast<const T*>(peer.send) + peer.sched.send_offset(rank_);
        if (st.recv_count > 0)
          std::memcpy(recv + st.recv_offset, src,
                      static_cast<std::size_t>(st.recv_count) * sizeof(T));
      }
    };
  }

  // A locally rejected call that has not got as far as a schedule: still posted, so that peers
  // fail at once instead of waiting for the timeout.
  expected<basic_thread_communicator> fail_local(collective op, const unexpected<error>& e) {
    auto st = post_rejected(op, e.error());
    return unexpected<error>(st.error());
  }
  status post_rejected(collective op, const error& e) {
    if (!st_) return make_error(errc::comm_broken, "a moved-from thread_communicator");
    return run_impl(
        op, nullptr, e, call_info{}, nullptr, nullptr, [](const std::vector<detail::tw_slot>&) {},
        0, 0);
  }

  // The collectives' form: the schedule's arrays are kept for the next call (spare_).
  template <class F>
  status run(collective op, expected<collective_schedule>&& s, const call_info& info,
             const void* send, void* recv, F&& data) {
    const expected<collective_schedule>& cs = s;
    auto st = run(op, cs, info, send, recv, std::forward<F>(data));
    if (s) spare_ = std::move(*s);
    return st;
  }
  template <class F>
  status run(collective op, const expected<collective_schedule>& s, const call_info& info,
             const void* send, void* recv, F&& data, int color = 0, int key = 0) {
    if (!st_) return make_error(errc::comm_broken, "a moved-from thread_communicator");
    if (!s) return run_impl(op, nullptr, s.error(), info, send, recv, std::forward<F>(data), 0, 0);
    return run_impl(op, &*s, error{}, info, send, recv, std::forward<F>(data), color, key);
  }

  void mark_broken(const error& e, std::uint64_t call) {
    if (st_->late.empty()) st_->late.assign(st_->slots.size(), 0);
    if (!st_->broken) {
      st_->broken = true;
      st_->reason = e;
      st_->broken_call = call;
    }
  }
  // A rank inside call `call` when the communicator broke gets the first failure itself (same
  // kind and message on every rank); later calls get comm_broken.
  status broken_error(std::uint64_t call) const {
    if (st_->broken_call == call) return unexpected<error>(st_->reason);
    return make_error(errc::comm_broken,
                      "the communicator is broken by an earlier failure: " + st_->reason.message);
  }

  // Waits until every member has posted call `target - 1`. Fails when a member left the world
  // (returned or threw) without posting it, or at the timeout.
  status wait_all(std::unique_lock<std::mutex>& lk, std::uint64_t target, const char* what) {
    auto& job = *st_->job;
    const auto deadline = std::chrono::steady_clock::now() + job.timeout;
    // The members that have not posted call `target` yet (listed only for an error: a wait that
    // succeeds allocates nothing).
    const auto is_missing = [&](int p) {
      return st_->slots[static_cast<std::size_t>(p)].posted < target;
    };
    const auto missing = [&] {
      std::vector<int> m;
      for (int p = 0; p < st_->size(); ++p)
        if (is_missing(p)) m.push_back(p);
      return m;
    };
    for (;;) {
      bool any = false;
      for (int p = 0; p < st_->size(); ++p) any = any || is_missing(p);
      if (!any) return {};
      if (st_->broken) return broken_error(target - 1);
      for (int p = 0; p < st_->size(); ++p) {
        if (!is_missing(p)) continue;
        const int w = st_->world_rank[static_cast<std::size_t>(p)];
        const int d = job.departed[static_cast<std::size_t>(w)];
        if (d != 0) {
          auto e = make_error(
              errc::comm_peer_failed,
              "rank " + std::to_string(p) + " (world rank " + std::to_string(w) + ") " +
                  (d == 2 ? "threw (" + job.why[static_cast<std::size_t>(w)] + ")"
                          : std::string("returned from its function")) +
                  " without joining " + what + " (call #" + std::to_string(target - 1) + ")");
          mark_broken(e.error(), target - 1);
          return e;
        }
      }
      if (job.cv.wait_until(lk, deadline) == std::cv_status::timeout &&
          std::chrono::steady_clock::now() >= deadline) {
        // Re-check once: the last peer may have arrived with the timeout.
        const std::vector<int> late = missing();
        if (late.empty()) continue;
        if (st_->broken) return broken_error(target - 1);
        auto e = make_error(errc::comm_timeout, "rank(s) " + detail::rank_list(late) +
                                                    " did not arrive at " + what + " (call #" +
                                                    std::to_string(target - 1) + ") within " +
                                                    std::to_string(job.timeout.count()) + " ms");
        if (!st_->broken) {
          mark_broken(e.error(), target - 1);
          for (int p : late) st_->late[static_cast<std::size_t>(p)] = 1;
        }
        return e;
      }
    }
  }

  // The verdict on everyone's posts: the same on every rank (it depends on the posts only).
  status verdict(std::uint64_t call) const {
    const auto& slots = st_->slots;
    const int n = st_->size();
    auto header = [&](int a, int b) {
      const auto& s = slots[static_cast<std::size_t>(a)];
      if (s.flag != header_ok) return make_failure_header(s.op, call, s.flag);
      auto h = make_header(s.sched, b, call, s.info);
      return h;
    };
    for (int a = 0; a < n; ++a)
      if (slots[static_cast<std::size_t>(a)].flag != header_ok) return rejected(a, call);
    for (int a = 0; a < n; ++a)
      for (int b = a; b < n; ++b)
        if (auto ok = check_headers(header(a, b), header(b, a), a, b); !ok) return ok;
    return {};
  }

  // What every rank reports when rank a rejected its own arguments.
  status rejected(int a, std::uint64_t call) const {
    const auto& s = st_->slots[static_cast<std::size_t>(a)];
    return make_error(errc::comm_peer_failed, "rank " + std::to_string(a) +
                                                  " rejected its arguments to " + to_string(s.op) +
                                                  " (call #" + std::to_string(call) +
                                                  "), so the collective was not run: " + s.why);
  }

  // Under the lock, by whichever rank gets there first: the new communicators of a split.
  void make_split(std::uint64_t call) {
    if (st_->split_call == call + 1) return;
    const int n = st_->size();
    st_->split_state.assign(static_cast<std::size_t>(n), nullptr);
    st_->split_rank.assign(static_cast<std::size_t>(n), -1);
    std::map<int, std::vector<std::pair<int, int>>> by_color;  // color -> (key, rank)
    for (int p = 0; p < n; ++p) {
      const auto& s = st_->slots[static_cast<std::size_t>(p)];
      if (s.color != split_no_color) by_color[s.color].push_back({s.key, p});
    }
    for (auto& [color, members] : by_color) {
      std::sort(members.begin(), members.end());
      auto sub = std::make_shared<detail::tw_state>();
      sub->job = st_->job;
      sub->slots.resize(members.size());
      for (std::size_t i = 0; i < members.size(); ++i) {
        const auto p = static_cast<std::size_t>(members[i].second);
        sub->world_rank.push_back(st_->world_rank[p]);
        st_->split_state[p] = sub;
        st_->split_rank[p] = static_cast<int>(i);
      }
    }
    st_->split_call = call + 1;
  }

  template <class F>
  status run_impl(collective op, const collective_schedule* s, const error& local,
                  const call_info& info, const void* send, void* recv, F&& data, int color,
                  int key) {
    const std::uint64_t call = seq_++;
    auto& job = *st_->job;
    std::unique_lock lk(job.m);
    if (st_->broken) {
      // A rank that arrives in the call that failed gets that failure, unless it is the rank
      // whose lateness caused it: for it the communicator is simply broken.
      if (st_->broken_call == call && !st_->late[static_cast<std::size_t>(rank_)])
        return unexpected<error>(st_->reason);
      return make_error(errc::comm_broken,
                        "the communicator is broken by an earlier failure: " + st_->reason.message);
    }
    auto& me = st_->slots[static_cast<std::size_t>(rank_)];
    me.op = s ? s->op() : op;
    me.flag = s ? header_ok : header_rejected_arguments;
    me.why = s ? std::string() : local.message;
    if (s) me.sched = *s;
    me.info = info;
    me.send = send;
    me.recv = recv;
    me.color = color;
    me.key = key;
    me.ext = ext_;
    me.posted = call + 1;
    job.cv.notify_all();
    const char* what = to_string(me.op);
    if (auto ok = wait_all(lk, call + 1, what); !ok) return ok;
    // Everyone has posted. A failure recorded before the last one arrived (a timeout) fails all
    // of them alike; none can be recorded now for this call, so every rank decides the same.
    if (!s) {
      mark_broken(rejected(rank_, call).error(), call);
      return unexpected<error>(local);
    }
    if (st_->broken) return broken_error(call);
    if (auto ok = verdict(call); !ok) {
      mark_broken(ok.error(), call);
      return ok;
    }
    if (op == collective::split) make_split(call);
    lk.unlock();
    // Peers' posts and buffers stay put until everyone has left. Whatever happens in the data
    // phase, this rank reaches the exit: its peers may still be reading its buffers.
#if defined(__cpp_exceptions)
    std::exception_ptr thrown;
    try {
      data(st_->slots);
    } catch (...) {
      thrown = std::current_exception();
    }
#else
    data(st_->slots);
#endif
    lk.lock();
    me.left = call + 1;
    job.cv.notify_all();
    // Every peer has passed the entry and is inside the library copying; none can hang or leave
    // early now, and returning before they finish would free buffers they read. No timeout here.
    job.cv.wait(lk, [&] {
      for (const auto& sl : st_->slots)
        if (sl.left < call + 1) return false;
      return true;
    });
#if defined(__cpp_exceptions)
    if (thrown) {
      lk.unlock();
      std::rethrow_exception(thrown);
    }
#endif
    return {};
  }

  std::shared_ptr<detail::tw_state> st_;
  int rank_ = 0;
  std::uint64_t seq_ = 0;                  // collectives called so far on this communicator
  std::vector<std::byte> reduce_scratch_;  // all_reduce's results before the exit barrier
  collective_schedule spare_;              // the last schedule, whose arrays the next reuses
  const void* ext_ = nullptr;
};

static_assert(splittable_communicator<thread_communicator>);
static_assert(communicator_for<thread_communicator, host_exec>);
static_assert(communicator_for<thread_device_communicator, cpu_exec>);

//! Runs fn(thread_communicator& world) on n threads (ranks 0..n-1) and returns each rank's status.
//! fn may return void or status. An exception thrown by fn becomes that rank's error
//! (errc::comm_peer_failed, with the exception's message); ranks waiting for it in a collective
//! get errc::comm_peer_failed at once. n < 1 gives one errc::invalid_size status.
template <class F>
[[nodiscard]] std::vector<status> run_thread_world(int n, F&& fn, thread_world_options opt = {}) {
  if (n < 1)
    return {make_error(errc::invalid_size, "run_thread_world: the world needs >= 1 rank (got " +
                                               std::to_string(n) + ")")};
  auto job = std::make_shared<detail::tw_job>();
  job->timeout = opt.timeout;
  job->departed.assign(static_cast<std::size_t>(n), 0);
  job->why.assign(static_cast<std::size_t>(n), {});
  auto world = std::make_shared<detail::tw_state>();
  world->job = job;
  world->slots.resize(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) world->world_rank.push_back(r);

  std::vector<status> result(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      thread_communicator comm(world, r);
      int how = 1;
      std::string why;
#if defined(__cpp_exceptions)
      try {
#endif
        if constexpr (std::is_same_v<std::invoke_result_t<F&, thread_communicator&>, void>)
          fn(comm);
        else
          static_cast<void>(result[static_cast<std::size_t>(r)] = fn(comm));
#if defined(__cpp_exceptions)
      } catch (const std::exception& e) {
        how = 2;
        why = e.what();
      } catch (...) {
        how = 2;
        why = "an exception not derived from std::exception";
      }
#endif
      if (how == 2)
        static_cast<void>(
            result[static_cast<std::size_t>(r)] =
                make_error(errc::comm_peer_failed, "rank " + std::to_string(r) + " threw: " + why));
      std::lock_guard lk(job->m);
      job->departed[static_cast<std::size_t>(r)] = how;
      job->why[static_cast<std::size_t>(r)] = why;
      job->cv.notify_all();
    });
  for (auto& t : threads) t.join();
  return result;
}

}  // namespace v0_1
}  // namespace moefold
