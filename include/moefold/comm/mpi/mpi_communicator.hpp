//! @file mpi_communicator.hpp
//! @brief The MPI backend: moefold's collectives over a communicator the user gives, with host
//! buffers, on CPU processes (`mpirun -np 8`).
//!
//! - It wraps the user's MPI_Comm by duplicating it (MPI_Comm_dup): moefold's traffic never mixes
//!   with the user's, and the duplicate's error handler is set to MPI_ERRORS_RETURN so MPI errors
//!   come back as moefold errors (errc::backend_error, error::native = the MPI error class)
//!   instead of aborting. It does not own MPI: MPI_Init and MPI_Finalize stay the user's; destroy
//!   moefold communicators before MPI_Finalize (a communicator destroyed after it is not freed).
//! - MPI cannot cancel a collective, so a mismatch must be caught before data moves: every call
//!   first exchanges a 40-byte header with every peer (operation, call number, element type,
//!   counts; comm/schedule.hpp) and agrees on a verdict (one small all-reduce). A rank calling a
//!   different collective, counts that disagree between sender and receiver, or a rank that
//!   rejected its own arguments become an error on every rank.
//! - Every MPI operation is non-blocking and polled against the timeout. A stall (a peer that is
//!   dead, stuck, or never calls) becomes errc::comm_timeout and marks the communicator broken:
//!   the operation is still pending inside MPI, which may write the receive buffer later, so the
//!   caller MUST abort the job (MPI_Abort); the communicator is not freed and its staging memory
//!   is deliberately kept alive.
//! - A rank that fails outside moefold (say an exception in an expert) can call fail(why) in place
//!   of its next collective: its peers then get errc::comm_peer_failed at once instead of waiting
//!   for the timeout.
//!
//! Row-view collectives count rows (in a row datatype), so only rows must fit MPI's int: rows
//! below 2^31 always do. The span forms count elements, which must fit MPI's int (checked).
//! Reductions of bf16/fp16 run in fp32; reduce_scatter_v reduces locally in rank order (the same
//! bits as the thread world).
#pragma once

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../core/dtype.hpp"
#include "../../core/expected.hpp"
#include "../../core/row_view.hpp"
#include "../../core/size.hpp"
#include "../../exec/host_exec.hpp"
#include "../communicator.hpp"
#include "../schedule.hpp"
#include "../span_collectives.hpp"

namespace moefold {
inline namespace v0_1 {

//! Options of an MPI communicator.
struct mpi_options {
  //! How long one collective may take before it is declared stuck (errc::comm_timeout).
  std::chrono::milliseconds timeout{60000};
};

namespace detail {

//! An MPI return code as a moefold error naming the call.
inline status mpi_check(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return {};
  int cls = rc, len = 0;
  MPI_Error_class(rc, &cls);
  char text[MPI_MAX_ERROR_STRING] = {};
  MPI_Error_string(rc, text, &len);
  error e{errc::backend_error,
          std::string(call) + " failed: " + std::string(text, static_cast<std::size_t>(len)) +
              " (MPI error class " + std::to_string(cls) + ")",
          cls};
  return unexpected<error>(e);
}

//! The MPI datatype that moves T; bf16/fp16 move as 16-bit integers (they are reduced locally),
//! other types as bytes (count scaled by sizeof(T)).
template <class T>
MPI_Datatype mpi_type() {
  switch (dtype_of<T>) {
    case dtype::i8: return MPI_INT8_T;
    case dtype::u8: return MPI_UINT8_T;
    case dtype::i32: return MPI_INT32_T;
    case dtype::u32: return MPI_UINT32_T;
    case dtype::i64: return MPI_INT64_T;
    case dtype::u64: return MPI_UINT64_T;
    case dtype::f32: return MPI_FLOAT;
    case dtype::f64: return MPI_DOUBLE;
    case dtype::bf16:
    case dtype::f16: return MPI_UINT16_T;
    case dtype::other: return MPI_BYTE;
  }
  return MPI_BYTE;
}
template <class T>
constexpr int mpi_scale() {
  return dtype_of<T> == dtype::other ? static_cast<int>(sizeof(T)) : 1;
}

//! The MPI datatype of one row of a schedule (width elements of `base`, scaled): the base type
//! itself for rows of one element, else a committed contiguous type, freed with this object
//! (MPI lets a pending operation finish with a freed datatype).
struct mpi_row_type {
  MPI_Datatype type = MPI_DATATYPE_NULL;
  bool derived = false;
  mpi_row_type(const collective_schedule& s, MPI_Datatype base, int scale) {
    const int units = s.width() * scale;  // fits int: checked before the exchange (fits_mpi)
    if (units == 1) {
      type = base;
      return;
    }
    MPI_Type_contiguous(units > 0 ? units : 1, base, &type);
    MPI_Type_commit(&type);
    derived = true;
  }
  mpi_row_type(const mpi_row_type&) = delete;
  mpi_row_type& operator=(const mpi_row_type&) = delete;
  ~mpi_row_type() {
    if (derived) MPI_Type_free(&type);
  }
};

}  // namespace detail

//! One rank's MPI communicator. Move-only; owns its duplicate of the user's communicator.
class mpi_communicator : public span_collectives<mpi_communicator, host_space> {
  using spans = span_collectives<mpi_communicator, host_space>;

 public:
  using memory_space = host_space;

  //! Wraps `comm` (collective over it: MPI_Comm_dup). MPI must be initialized.
  [[nodiscard]] static expected<mpi_communicator> wrap(MPI_Comm comm, mpi_options opt = {}) {
    int init = 0, fin = 0;
    MPI_Initialized(&init);
    MPI_Finalized(&fin);
    if (!init || fin)
      return make_error(errc::invalid_argument,
                        "mpi_communicator::wrap: MPI is not initialized (or already finalized)");
    if (comm == MPI_COMM_NULL)
      return make_error(errc::invalid_argument, "mpi_communicator::wrap: MPI_COMM_NULL");
    MPI_Comm dup = MPI_COMM_NULL;
    if (auto ok = detail::mpi_check(MPI_Comm_dup(comm, &dup), "MPI_Comm_dup"); !ok)
      return unexpected<error>(ok.error());
    return adopt_owned(dup, opt);
  }

  mpi_communicator(mpi_communicator&& o) noexcept { *this = std::move(o); }
  mpi_communicator& operator=(mpi_communicator&& o) noexcept {
    if (this != &o) {
      release();
      comm_ = std::exchange(o.comm_, MPI_COMM_NULL);
      rank_ = o.rank_;
      size_ = o.size_;
      seq_ = o.seq_;
      opt_ = o.opt_;
      broken_ = o.broken_;
      why_ = std::move(o.why_);
      scratch_ = std::move(o.scratch_);
      graveyard_ = std::move(o.graveyard_);
      int_graveyard_ = std::move(o.int_graveyard_);
    }
    return *this;
  }
  mpi_communicator(const mpi_communicator&) = delete;
  mpi_communicator& operator=(const mpi_communicator&) = delete;
  ~mpi_communicator() { release(); }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  //! The duplicate moefold uses (for the user's own calls on the same group, e.g. ncclCommSplit
  //! bootstrapping). Valid while this object lives.
  [[nodiscard]] MPI_Comm native() const noexcept { return comm_; }
  //! True after a timeout or another failure: the job must be aborted.
  [[nodiscard]] bool broken() const noexcept { return broken_; }
  [[nodiscard]] const mpi_options& options() const noexcept { return opt_; }

  template <reducible T>
  [[nodiscard]] status all_reduce(std::span<T> buf, reduce_op op) {
    auto s = schedule_builder::all_reduce(rank_, size_, buf.size());
    return run(collective::all_reduce, s, call_info_of<T>(static_cast<int>(op)), [&]() -> status {
      if (auto ok = fits_int(buf.size(), "all_reduce count"); !ok) return ok;
      const int n = static_cast<int>(buf.size());
      const MPI_Op mop = op == reduce_op::sum ? MPI_SUM : MPI_MAX;
      if constexpr (std::is_same_v<accumulator_t<T>, T>) {
        return wait_op(
            [&](MPI_Request* r) {
              return MPI_Iallreduce(MPI_IN_PLACE, buf.data(), n, detail::mpi_type<T>(), mop, comm_,
                                    r);
            },
            "MPI_Iallreduce");
      } else {  // 16-bit floats: reduce in fp32
        auto* f = scratch<float>(buf.size());
        for (std::size_t i = 0; i < buf.size(); ++i) f[i] = static_cast<float>(buf[i]);
        if (auto ok = wait_op(
                [&](MPI_Request* r) {
                  return MPI_Iallreduce(MPI_IN_PLACE, f, n, MPI_FLOAT, mop, comm_, r);
                },
                "MPI_Iallreduce");
            !ok)
          return ok;
        for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = T(f[i]);
        return {};
      }
    });
  }

  using spans::all_gather;
  using spans::all_gather_v;
  using spans::all_to_all_v;
  using spans::reduce_scatter_v;

  //! The context of the span forms.
  [[nodiscard]] host_exec default_exec() const noexcept { return {}; }

  // --- row views (counts in rows). MPI counts them in a row datatype of `width` elements, so
  // only rows, never elements, must fit MPI's int. --------------------------------------------

  template <reducible T>
  [[nodiscard]] status all_reduce(host_exec&, row_view<T> buf, reduce_op op) {
    return all_reduce(detail::flat(buf), op);
  }

  template <transferable T>
  [[nodiscard]] status all_gather(host_exec&, row_view<const T> send, row_view<T> recv) {
    auto s = detail::rows_schedule("all_gather", send, recv, [&](int w) {
      return schedule_builder::all_gather(rank_, size_, detail::uz(send.rows()),
                                          detail::uz(recv.rows()), w);
    });
    return run(collective::all_gather, s, call_info_of<T>(), [&]() -> status {
      const detail::mpi_row_type rt(*s, detail::mpi_type<T>(), detail::mpi_scale<T>());
      const int n = send.rows();
      return wait_op(
          [&](MPI_Request* r) {
            return MPI_Iallgather(send.data(), n, rt.type, recv.data(), n, rt.type, comm_, r);
          },
          "MPI_Iallgather");
    });
  }

  template <transferable T>
  [[nodiscard]] status all_gather_v(host_exec&, row_view<const T> send, row_view<T> recv,
                                    std::span<const int> counts) {
    auto s = detail::rows_schedule("all_gather_v", send, recv, [&](int w) {
      return schedule_builder::all_gather_v(rank_, size_, counts, detail::uz(send.rows()),
                                            detail::uz(recv.rows()), w);
    });
    return run(collective::all_gather_v, s, call_info_of<T>(), [&]() -> status {
      const detail::mpi_row_type rt(*s, detail::mpi_type<T>(), detail::mpi_scale<T>());
      const int *rc = nullptr, *rd = nullptr;
      if (auto ok = to_rows(*s, s->recv_counts(), s->recv_offsets(), rc, rd); !ok) return ok;
      const int n = rc[rank_];
      return wait_op(
          [&](MPI_Request* r) {
            return MPI_Iallgatherv(send.data(), n, rt.type, recv.data(), rc, rd, rt.type, comm_, r);
          },
          "MPI_Iallgatherv");
    });
  }

  template <transferable T>
  [[nodiscard]] status all_to_all_v(host_exec&, row_view<const T> send,
                                    std::span<const int> send_counts, row_view<T> recv,
                                    std::span<const int> recv_counts) {
    auto s = detail::rows_schedule("all_to_all_v", send, recv, [&](int w) {
      return schedule_builder::all_to_all_v(rank_, size_, send_counts, recv_counts,
                                            detail::uz(send.rows()), detail::uz(recv.rows()), w);
    });
    return run(collective::all_to_all_v, s, call_info_of<T>(),
               [&]() -> status { return alltoallv<T>(*s, send.data(), recv.data()); });
  }

  template <reducible T>
  [[nodiscard]] status reduce_scatter_v(host_exec&, row_view<const T> send,
                                        std::span<const int> counts, row_view<T> recv,
                                        reduce_op op) {
    auto s = detail::rows_schedule("reduce_scatter_v", send, recv, [&](int w) {
      return schedule_builder::reduce_scatter_v(rank_, size_, counts, detail::uz(send.rows()),
                                                detail::uz(recv.rows()), w);
    });
    T* out = recv.data();
    return run(
        collective::reduce_scatter_v, s, call_info_of<T>(static_cast<int>(op)), [&]() -> status {
          // Chunk p of every rank lands in staging slot p; then a rank-order reduction.
          T* stage = scratch<T>(static_cast<std::size_t>(s->recv_extent()));
          if (auto ok = alltoallv<T>(*s, send.data(), stage); !ok) return ok;
          const auto n = static_cast<std::size_t>(s->result_count());
          for (std::size_t i = 0; i < n; ++i) {
            auto acc = detail::widen(stage[static_cast<std::size_t>(s->recv_offset(0)) + i]);
            for (int p = 1; p < size_; ++p) {
              const auto x = detail::widen(stage[static_cast<std::size_t>(s->recv_offset(p)) + i]);
              acc =
                  op == reduce_op::sum ? static_cast<decltype(acc)>(acc + x) : (acc < x ? x : acc);
            }
            out[i] = detail::narrow<T>(acc);
          }
          return {};
        });
  }

  template <transferable T>
  [[nodiscard]] status broadcast(host_exec&, row_view<T> buf, int root) {
    return broadcast(detail::flat(buf), root);
  }

  [[nodiscard]] status barrier(host_exec&) { return barrier(); }

  template <transferable T>
  [[nodiscard]] status broadcast(std::span<T> buf, int root) {
    auto s = schedule_builder::broadcast(rank_, size_, buf.size(), root);
    return run(collective::broadcast, s, call_info_of<T>(), [&]() -> status {
      if (auto ok = fits_int(buf.size() * static_cast<std::size_t>(detail::mpi_scale<T>()),
                             "broadcast count");
          !ok)
        return ok;
      const int n = static_cast<int>(buf.size()) * detail::mpi_scale<T>();
      return wait_op(
          [&](MPI_Request* r) {
            return MPI_Ibcast(buf.data(), n, detail::mpi_type<T>(), root, comm_, r);
          },
          "MPI_Ibcast");
    });
  }

  //! The header exchange is itself a barrier: no rank completes it before all have entered.
  [[nodiscard]] status barrier() {
    return run(collective::barrier, schedule_builder::barrier(rank_, size_), call_info{},
               []() -> status { return {}; });
  }

  //! MPI_Comm_split after the header exchange (which proves every rank is there, so the blocking
  //! split cannot hang). split_no_color joins nothing and gets errc::rank_out_of_range back.
  [[nodiscard]] expected<mpi_communicator> split(int color, int key) {
    if (color < 0 && color != split_no_color) {
      auto st = run(
          collective::split,
          make_error(errc::invalid_argument, "split: color must be >= 0 or split_no_color (got " +
                                                 std::to_string(color) + ")"),
          call_info{}, []() -> status { return {}; });
      return unexpected<error>(st.error());
    }
    MPI_Comm out = MPI_COMM_NULL;
    auto st =
        run(collective::split, schedule_builder::split(rank_, size_), call_info{}, [&]() -> status {
          return detail::mpi_check(
              MPI_Comm_split(comm_, color == split_no_color ? MPI_UNDEFINED : color, key, &out),
              "MPI_Comm_split");
        });
    if (!st) return unexpected<error>(st.error());
    if (out == MPI_COMM_NULL)
      return make_error(errc::rank_out_of_range,
                        "split: rank " + std::to_string(rank_) +
                            " passed split_no_color and joins no new communicator");
    return adopt_owned(out, opt_);
  }

  //! A communicator of the same ranks with its own call sequence (MPI_Comm_dup). Collective.
  [[nodiscard]] expected<mpi_communicator> duplicate() { return split(0, rank_); }

  //! Takes part in the next collective as a failed rank: every peer's collective returns
  //! errc::comm_peer_failed (with `why`) at once. The communicator is broken afterwards.
  [[nodiscard]] status fail(const std::string& why) {
    const std::uint64_t call = seq_++;
    std::vector<collective_header> mine(
        static_cast<std::size_t>(size_),
        make_failure_header(collective::none, call, header_rank_failed));
    std::vector<collective_header> theirs(mine.size());
    const auto deadline = std::chrono::steady_clock::now() + opt_.timeout;
    auto ok = exchange(mine, theirs, call, collective::none, deadline);
    int v[2] = {static_cast<int>(errc::comm_peer_failed), size_ - rank_};
    if (ok) ok = verdict(v, deadline);
    broken_ = true;
    why_ = "rank " + std::to_string(rank_) + " failed: " + why;
    return make_error(errc::comm_peer_failed, why_);
  }

 private:
  mpi_communicator() = default;

  static expected<mpi_communicator> adopt_owned(MPI_Comm c, const mpi_options& opt) {
    mpi_communicator m;
    m.comm_ = c;
    m.opt_ = opt;
    if (auto ok = detail::mpi_check(MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN),
                                    "MPI_Comm_set_errhandler");
        !ok)
      return unexpected<error>(ok.error());
    MPI_Comm_rank(c, &m.rank_);
    MPI_Comm_size(c, &m.size_);
    return m;
  }

  void release() noexcept {
    if (comm_ == MPI_COMM_NULL) return;
    int fin = 0;
    MPI_Finalized(&fin);
    if (broken_) {
      // Operations may still be pending on this communicator and may still write into the
      // staging memory: neither may be freed. The caller aborts the job (see the file comment).
      static_cast<void>(new std::vector<std::vector<std::byte>>(std::move(graveyard_)));
      static_cast<void>(new std::vector<std::byte>(std::move(scratch_)));
      static_cast<void>(new std::vector<std::vector<int>>(std::move(int_graveyard_)));
    } else if (!fin) {
      MPI_Comm_free(&comm_);
    }
    comm_ = MPI_COMM_NULL;
  }

  static status fits_int(std::int64_t v, const char* what) {
    if (v > INT_MAX)
      return make_error(errc::not_supported, std::string("MPI backend: ") + what + " " +
                                                 std::to_string(v) +
                                                 " exceeds MPI's int counts (2^31-1)");
    return {};
  }
  static status fits_int(std::size_t v, const char* what) {
    return fits_int(static_cast<std::int64_t>(std::min<std::size_t>(v, INT64_MAX)), what);
  }

  template <class T>
  T* scratch(std::size_t n) {
    const std::size_t bytes = std::max<std::size_t>(n * sizeof(T), 1);
    if (scratch_.size() < bytes) scratch_.resize(bytes);
    return reinterpret_cast<T*>(scratch_.data());
  }

  template <class T>
  status alltoallv(const collective_schedule& s, const void* send, void* recv) {
    const detail::mpi_row_type rt(s, detail::mpi_type<T>(), detail::mpi_scale<T>());
    const int *sc = nullptr, *sd = nullptr, *rc = nullptr, *rd = nullptr;
    if (auto ok = to_rows(s, s.send_counts(), s.send_offsets(), sc, sd); !ok) return ok;
    if (auto ok = to_rows(s, s.recv_counts(), s.recv_offsets(), rc, rd); !ok) return ok;
    return wait_op(
        [&](MPI_Request* r) {
          return MPI_Ialltoallv(send, sc, sd, rt.type, recv, rc, rd, rt.type, comm_, r);
        },
        "MPI_Ialltoallv");
  }

  // The schedule's element counts and offsets in rows (the unit of its row datatype), as MPI
  // ints; rows are below 2^31 by the schedule's rule. They live in int_graveyard_: MPI may read
  // them until the operation completes, even after a timeout.
  status to_rows(const collective_schedule& s, std::span<const std::int64_t> c,
                 std::span<const std::int64_t> o, const int*& ci, const int*& oi) {
    const std::int64_t w = s.width() > 0 ? s.width() : 1;
    std::vector<int> v(2 * c.size());
    for (std::size_t p = 0; p < c.size(); ++p) {
      if (auto ok = fits_int((o[p] + c[p]) / w, "offset + count in rows"); !ok) return ok;
      v[p] = static_cast<int>(c[p] / w);
      v[c.size() + p] = static_cast<int>(o[p] / w);
    }
    int_graveyard_.push_back(std::move(v));
    ci = int_graveyard_.back().data();
    oi = ci + c.size();
    return {};
  }

  // Polls one request until it completes or the deadline passes. Yields between polls: with more
  // ranks than cores (mpirun --oversubscribe) a spinning rank would starve the peer it waits for.
  status poll(MPI_Request& req, const char* what, std::chrono::steady_clock::time_point deadline) {
    int done = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (;;) {
      if (auto ok = detail::mpi_check(MPI_Test(&req, &done, MPI_STATUS_IGNORE), "MPI_Test"); !ok) {
        broken_ = true;
        why_ = ok.error().message;
        return ok;
      }
      if (done) return {};
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline) {
        broken_ = true;
        why_ = std::string(what) + " did not complete within " +
               std::to_string(opt_.timeout.count()) +
               " ms: a peer is dead, stuck, or not calling this collective. The communicator "
               "is broken; abort the job (MPI_Abort)";
        return make_error(errc::comm_timeout, "rank " + std::to_string(rank_) + ": " + why_);
      }
      // Non-blocking collectives progress only inside MPI_Test: poll hot (yielding) for a while,
      // then back off so that a long wait does not burn a core.
      if (now - t0 < std::chrono::milliseconds(20))
        std::this_thread::yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  template <class Start>
  status wait_op(Start&& start, const char* what) {
    MPI_Request req = MPI_REQUEST_NULL;
    if (auto ok = detail::mpi_check(start(&req), what); !ok) {
      broken_ = true;
      why_ = ok.error().message;
      return ok;
    }
    return poll(req, what, deadline_);
  }

  status exchange(std::vector<collective_header>& mine, std::vector<collective_header>& theirs,
                  std::uint64_t call, collective op,
                  std::chrono::steady_clock::time_point deadline) {
    MPI_Request req = MPI_REQUEST_NULL;
    const std::string what =
        std::string(to_string(op)) + " (call #" + std::to_string(call) + ") header exchange";
    // The headers stay alive until the request completes, even after a timeout.
    graveyard_.emplace_back(sizeof(collective_header) * mine.size() * 2);
    auto* buf = graveyard_.back().data();
    std::memcpy(buf, mine.data(), sizeof(collective_header) * mine.size());
    auto* in = buf + sizeof(collective_header) * mine.size();
    if (auto ok = detail::mpi_check(MPI_Ialltoall(buf, sizeof(collective_header), MPI_BYTE, in,
                                                  sizeof(collective_header), MPI_BYTE, comm_, &req),
                                    "MPI_Ialltoall");
        !ok) {
      broken_ = true;
      return ok;
    }
    auto ok = poll(req, what.c_str(), deadline);
    if (ok) {
      std::memcpy(theirs.data(), in, sizeof(collective_header) * theirs.size());
      graveyard_.pop_back();
    }
    return ok;
  }

  // Agrees on the verdict: v = {error kind or 0, size - lowest reporting rank or 0}, MAX-reduced.
  status verdict(int (&v)[2], std::chrono::steady_clock::time_point deadline) {
    graveyard_.emplace_back(sizeof(int) * 2);
    int* w = reinterpret_cast<int*>(graveyard_.back().data());
    w[0] = v[0];
    w[1] = v[1];
    MPI_Request req = MPI_REQUEST_NULL;
    if (auto ok = detail::mpi_check(
            MPI_Iallreduce(MPI_IN_PLACE, w, 2, MPI_INT, MPI_MAX, comm_, &req), "MPI_Iallreduce");
        !ok) {
      broken_ = true;
      return ok;
    }
    auto ok = poll(req, "the verdict of the header exchange", deadline);
    if (ok) {
      v[0] = w[0];
      v[1] = w[1];
      graveyard_.pop_back();
    }
    return ok;
  }

  // Every count and offset of the schedule, in MPI units (bytes for `other` types), fits int.
  static status fits_mpi(const collective_schedule& s, const call_info& info) {
    // Collectives without data (barrier, split) carry no element type: elem_bytes is 0.
    const std::int64_t k =
        info.type == dtype::other ? std::max<std::int64_t>(info.elem_bytes, 1) : 1;
    const bool in_rows = s.op() == collective::all_to_all_v || s.op() == collective::all_gather_v ||
                         s.op() == collective::reduce_scatter_v || s.op() == collective::all_gather;
    if (in_rows)  // counted in rows of a row datatype: only the row's MPI size must fit int
      return fits_int(static_cast<std::int64_t>(s.width()) * k, "row of width times element size");
    std::int64_t most = s.result_count();
    for (int p = 0; p < s.size(); ++p)
      most =
          std::max({most, s.send_offset(p) + s.send_count(p), s.recv_offset(p) + s.recv_count(p)});
    return fits_int(most > INT_MAX / k ? std::int64_t{INT_MAX} + 1 : most * k, "count or offset");
  }

  // One collective: headers, verdict, then the data (`data`), all against one deadline.
  template <class F>
  status run(collective op, const expected<collective_schedule>& s, const call_info& info,
             F&& data) {
    const std::uint64_t call = seq_++;
    if (comm_ == MPI_COMM_NULL)
      return make_error(errc::comm_broken, "a moved-from mpi_communicator");
    if (broken_)
      return make_error(errc::comm_broken, "the communicator is broken by an earlier failure (" +
                                               why_ + "); abort the job");
    int_graveyard_.clear();  // nothing is pending on a communicator that is not broken
    deadline_ = std::chrono::steady_clock::now() + opt_.timeout;
    std::vector<collective_header> mine(static_cast<std::size_t>(size_)), theirs(mine.size());
    // Arguments MPI cannot take (counts beyond int) are rejected before the exchange, like any
    // other bad argument, so that no rank starts an operation its peers will not join.
    status local = s ? fits_mpi(*s, info) : status(unexpected<error>(s.error()));
    for (int p = 0; p < size_; ++p)
      mine[static_cast<std::size_t>(p)] =
          local ? make_header(*s, p, call, info)
                : make_failure_header(op, call, header_rejected_arguments);
    if (auto ok = exchange(mine, theirs, call, op, deadline_); !ok) return ok;
    // My verdict on my pairs; then everyone's.
    for (int p = 0; local && p < size_; ++p)
      local = check_headers(mine[static_cast<std::size_t>(p)], theirs[static_cast<std::size_t>(p)],
                            rank_, p);
    int v[2] = {local ? 0 : static_cast<int>(local.error().code), local ? 0 : size_ - rank_};
    if (auto ok = verdict(v, deadline_); !ok) return ok;
    if (v[0] != 0) {
      // Not run anywhere; the ranks are still in step, but a mismatch is a program bug: break.
      broken_ = true;
      if (!local) {
        why_ = local.error().message;
        return local;
      }
      const int who = size_ - v[1];
      why_ = "rank " + std::to_string(who) + " reported " +
             std::string(moefold::to_string(static_cast<errc>(v[0]))) + " in " + to_string(op) +
             " (call #" + std::to_string(call) + "); its error names the values";
      const errc code = static_cast<errc>(v[0]) == errc::comm_mismatch ? errc::comm_mismatch
                                                                       : errc::comm_peer_failed;
      return make_error(code, why_);
    }
    return data();
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 0;
  std::uint64_t seq_ = 0;
  mpi_options opt_{};
  bool broken_ = false;
  std::string why_;
  std::chrono::steady_clock::time_point deadline_{};
  std::vector<std::byte> scratch_;                 // staging (reduce_scatter_v, fp32 copies)
  std::vector<std::vector<std::byte>> graveyard_;  // buffers of operations that may be pending
  std::vector<std::vector<int>> int_graveyard_;    // their MPI count and offset arrays
};

static_assert(splittable_communicator<mpi_communicator>);
static_assert(communicator_for<mpi_communicator, host_exec>);

}  // namespace v0_1
}  // namespace moefold
