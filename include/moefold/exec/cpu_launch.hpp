//! @file cpu_launch.hpp
//! @brief What launch(cpu_exec, grid, kernel) (exec/cpu_exec.hpp) does: a kernel body run on the
//! CPU the way a GPU runs it, so that ThreadSanitizer and AddressSanitizer can check it.
//!
//! - The threads of a block are fibers of one OS thread (exec/cpu_fibers.hpp; config.hpp,
//!   MOEFOLD_CPU_EXEC_THREADS), resumed in an order drawn from the seed and the block at every
//!   barrier, a barrier costing two stack switches per thread instead of a kernel wake-up per
//!   thread. Under ThreadSanitizer each is a TSan fiber of its own and only the barriers order
//!   memory between them (each arrival a release, each departure an acquire of the same phase),
//!   so a missing `sync()` between a shared-memory write and another thread's read is a data
//!   race TSan reports with the body's file and line. With MOEFOLD_CPU_EXEC_THREADS=1 every CUDA
//!   thread is a std::thread instead, the barriers condition variables.
//! - Two blocks run at once (when the grid has two), each on its own OS thread(s), and blocks
//!   start in an order drawn from the executor's seed: a body that depends on block order or on
//!   one block running alone gives different results for different seeds.
//! - Shared memory is poisoned (every byte 0xFF: NaN as a float) at each block's start, so a read
//!   of an element no thread of this block wrote shows in the result. It is its own heap
//!   allocation of exactly `smem_bytes`, so ASan reports an access past its end.
//! - `sync()` is a barrier of the block, warp operations a barrier of the warp with a 32-slot
//!   exchange. A barrier knows which operation each thread arrived with: threads that meet at
//!   different ones (a `sync()` in one branch only, a lane that returned while the others shuffle)
//!   end the launch with errc::kernel_fault naming the block, warp and operations, where a GPU
//!   would hang or compute garbage.
//!
//! Cost: OS threads (2, or 2 x block_threads with MOEFOLD_CPU_EXEC_THREADS=1) created once per
//! host thread and reused (exec/cpu_workers.hpp); fiber stacks kept per OS thread. This is a
//! checker, not a fast path: host_exec is the fast CPU path.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "../core/config.hpp"
#include "../core/counter_rng.hpp"
#include "../core/simt_launch.hpp"
#include "cpu_fibers.hpp"
#include "cpu_workers.hpp"
#include "host_bytes16.hpp"

namespace moefold {
inline namespace v0_1 {
namespace detail {

//! The operation a thread reached a barrier with; two different ones in one phase are a fault.
enum class simt_op : int { sync, block_exit, shfl, ballot, warp_sync, warp_exit };

[[nodiscard]] inline const char* to_string(simt_op op) noexcept {
  switch (op) {
    case simt_op::sync: return "sync()";
    case simt_op::block_exit: return "the end of the kernel";
    case simt_op::shfl: return "a shuffle";
    case simt_op::ballot: return "ballot()";
    case simt_op::warp_sync: return "warp_sync()";
    case simt_op::warp_exit: return "the end of the kernel";
  }
  return "?";
}

//! Thrown through a body to unwind the threads of a block whose barrier a fault broke.
struct simt_abort {};

//! The barriers of one block: barrier 0 is the block's (`sync()`, n = block_threads), barrier
//! 1 + w is warp w's (n = 32). One mutex guards them all (TSan sees the happens-before edge of
//! every phase), so that the block can tell when every one of its threads waits and no barrier
//! can complete: a thread that left the kernel while its warp-mates wait at `sync()` would
//! otherwise hang the launch.
class simt_barriers {
 public:
  explicit simt_barriers(int threads)
      : threads_(threads), bars_(static_cast<std::size_t>(1 + threads / 32)) {
    bars_[0].n = threads;
    for (std::size_t w = 1; w < bars_.size(); ++w) bars_[w].n = 32;
  }

#if !MOEFOLD_CPU_EXEC_THREADS
  //! The block's threads are the fibers of `f` (all on the calling OS thread): a thread that
  //! must wait yields to the next fiber instead of blocking.
  void use_fibers(cpu_fibers* f) {
    fibers_ = f;
    waits_.assign(static_cast<std::size_t>(threads_), wait_point{});
  }
  //! Whether fiber `who`, which yielded at a barrier, can go on (the barrier completed, or the
  //! block failed and it must unwind).
  [[nodiscard]] MOEFOLD_TSAN_UNCHECKED bool ready(int who) const noexcept {
    const auto& w = waits_[static_cast<std::size_t>(who)];
    return broken_ || bars_[static_cast<std::size_t>(w.bar)].phase != w.phase;
  }
#endif

  //! Thread `who` arrives at barrier `b` with `op` and waits for the others. Returns false when
  //! the block has failed (threads met with different operations, all threads wait and none can
  //! go on, or a fault elsewhere in the block); fault() then says why.
  //! Under TSan its own accesses are not checked (the barrier's state is the executor's, shared
  //! by fibers that run one at a time); with OS threads the mutex orders them.
  [[nodiscard]] MOEFOLD_TSAN_UNCHECKED bool arrive_and_wait(int b, simt_op op, int who) {
    std::unique_lock lk(m_, std::defer_lock);
    if (!fibers_) lk.lock();  // fibers of one OS thread never interleave inside this function
    if (broken_) return false;
    auto& B = bars_[static_cast<std::size_t>(b)];
#if MOEFOLD_TSAN && !MOEFOLD_CPU_EXEC_THREADS
    // What this thread did before arriving is ordered before what every thread of the barrier
    // does after it, and nothing else: one sync address per phase parity, since the thread that
    // completes a phase may arrive at the next one before the others have left this one (and
    // the phase after that cannot complete before they have).
    char* const order = &B.order[B.phase & 1];
    __tsan_release(order);
#endif
    if (B.arrived == 0) {
      B.op = op;
      B.first = who;
    } else if (op != B.op) {
      fail_locked(where(b) + "thread " + to_decimal(B.first) + " reached " + to_string(B.op) +
                  " while thread " + to_decimal(who) + " reached " + to_string(op) + rule);
      return false;
    }
    if (++B.arrived == B.n) {
      B.arrived = 0;
      ++B.phase;
      blocked_ -= B.n - 1;
      B.cv.notify_all();
#if MOEFOLD_TSAN && !MOEFOLD_CPU_EXEC_THREADS
      __tsan_acquire(order);
#endif
      return true;
    }
    if (++blocked_ == threads_) {
      std::string waits;
      for (std::size_t i = 0; i < bars_.size(); ++i)
        if (bars_[i].arrived > 0)
          waits += (waits.empty() ? "" : ", ") + to_decimal(bars_[i].arrived) + " at " +
                   to_string(bars_[i].op) + (i == 0 ? "" : " of warp " + to_decimal(int(i) - 1));
      fail_locked("every thread waits and no barrier can complete (" + waits + ")" + rule);
      return false;
    }
    const unsigned long long phase = B.phase;
#if !MOEFOLD_CPU_EXEC_THREADS
    if (fibers_) {
      waits_[static_cast<std::size_t>(who)] = wait_point{b, phase};
      fibers_->yield(who);                 // the scheduler resumes it once ready(who)
      if (B.phase == phase) return false;  // the block failed
#if MOEFOLD_TSAN
      __tsan_acquire(order);
#endif
      return true;
    }
#endif
    B.cv.wait(lk, [&] { return B.phase != phase || broken_; });
    return B.phase != phase;
  }

  [[nodiscard]] std::string fault() {
    std::lock_guard lk(m_);
    return fault_;
  }
  //! Ends the block with `why` (the first fault is the one reported).
  void fail(const std::string& why) {
    std::lock_guard lk(m_);
    fail_locked(why);
  }

 private:
  struct state {
    std::condition_variable cv;
    int n = 0, arrived = 0, first = 0;
    unsigned long long phase = 0;
    simt_op op = simt_op::sync;
    char order[2] = {};  // ThreadSanitizer's sync addresses of the even and odd phases
  };
  static constexpr const char* rule =
      " (every thread of a block must reach each sync(), every lane of a warp each warp "
      "operation)";
  static std::string where(int b) {
    return b == 0 ? std::string() : "in warp " + to_decimal(b - 1) + ", ";
  }
  void fail_locked(const std::string& why) {
    if (!broken_) fault_ = why;
    broken_ = true;
    for (auto& B : bars_) B.cv.notify_all();
  }

#if !MOEFOLD_CPU_EXEC_THREADS
  struct wait_point {
    int bar = 0;
    unsigned long long phase = 0;
  };
  std::vector<wait_point> waits_;  // (threads) where each fiber last yielded
  cpu_fibers* fibers_ = nullptr;   // set: fiber mode (no locking, no condition waits)
#else
  static constexpr bool fibers_ = false;
#endif

  std::mutex m_;
  int threads_, blocked_ = 0;
  std::vector<state> bars_;
  bool broken_ = false;
  std::string fault_;
};

//! One block's worth of threads and what they share: the barriers, 32 exchange slots per warp,
//! the dynamic shared memory.
struct simt_block_slot {
  simt_block_slot(int threads, std::size_t smem)
      : bars(threads),
        exchange(static_cast<std::size_t>(threads)),
        smem_bytes(smem),
        // Exactly smem bytes (16-byte aligned), so ASan reports the first byte past the end.
        smem(static_cast<std::byte*>(::operator new (smem == 0 ? 1 : smem, std::align_val_t{16}))) {
  }
  ~simt_block_slot() { ::operator delete (smem, std::align_val_t{16}); }
  simt_block_slot(const simt_block_slot&) = delete;
  simt_block_slot& operator=(const simt_block_slot&) = delete;

  simt_barriers bars;
  std::vector<std::uint64_t> exchange;  // (block_threads) one slot per lane, read after a barrier
  std::size_t smem_bytes;
  std::byte* smem;
  int block = 0;  // the block now running; written by thread 0 before the start barrier
};

}  // namespace detail

//! The context a body gets on cpu_exec: one per thread.
template <int Threads>
class cpu_ctx : public detail::host_bytes16<cpu_ctx<Threads>> {
 public:
  static constexpr int block_threads = Threads;
  static constexpr int warp_threads = 32;

  cpu_ctx(detail::simt_block_slot& slot, int thread, int grid_blocks) noexcept
      : slot_(&slot), thread_(thread), grid_blocks_(grid_blocks) {}

  // The members are __host__ __device__ under nvcc so that a body (a __host__ __device__
  // template) instantiated with cpu_ctx in a .cu file is not a call of a host function; their
  // host work sits behind MOEFOLD_CPU_ONLY, which nvcc's device pass (where cpu_ctx never runs)
  // compiles away.
  [[nodiscard]] MOEFOLD_HOST_DEVICE int thread() const noexcept { return thread_; }
  [[nodiscard]] MOEFOLD_HOST_DEVICE int block() const noexcept { return slot_->block; }
  [[nodiscard]] MOEFOLD_HOST_DEVICE int grid_blocks() const noexcept { return grid_blocks_; }
  [[nodiscard]] MOEFOLD_HOST_DEVICE int lane() const noexcept { return thread_ % 32; }
  [[nodiscard]] MOEFOLD_HOST_DEVICE int warp() const noexcept { return thread_ / 32; }

  MOEFOLD_HOST_DEVICE void sync() { MOEFOLD_CPU_ONLY(block_barrier(detail::simt_op::sync)); }
  MOEFOLD_HOST_DEVICE void warp_sync() {
    MOEFOLD_CPU_ONLY(warp_barrier(detail::simt_op::warp_sync));
  }

  //! The value of lane (lane() ^ mask), as __shfl_xor_sync(0xffffffff, v, mask).
  template <class T>
  [[nodiscard]] MOEFOLD_HOST_DEVICE T shfl_xor(T v, int mask) {
    MOEFOLD_CPU_ONLY(v = exchange(v, lane() ^ (mask & 31), detail::simt_op::shfl));
    return v;
  }
  //! The value of lane `src` (taken modulo 32, as CUDA does), as __shfl_sync(0xffffffff, v, src).
  template <class T>
  [[nodiscard]] MOEFOLD_HOST_DEVICE T shfl_idx(T v, int src) {
    MOEFOLD_CPU_ONLY(v = exchange(v, src & 31, detail::simt_op::shfl));
    return v;
  }
  //! Bit i set when lane i's predicate holds, as __ballot_sync(0xffffffff, p).
  [[nodiscard]] MOEFOLD_HOST_DEVICE unsigned ballot(bool p) {
    unsigned bits = 0;
    MOEFOLD_CPU_ONLY(bits = ballot_impl(p));
    return bits;
  }

  //! The block's dynamic shared memory (poisoned at block start).
  template <class T>
  [[nodiscard]] MOEFOLD_HOST_DEVICE T* shared() noexcept {
    return reinterpret_cast<T*>(slot_->smem);
  }
  [[nodiscard]] MOEFOLD_HOST_DEVICE std::size_t shared_bytes() const noexcept {
    return slot_->smem_bytes;
  }

  //! atomicAdd on an integer (relaxed, as CUDA's); returns the old value.
  template <class T>
  requires std::is_integral_v<T> MOEFOLD_HOST_DEVICE T atomic_add(T* p, T v)
  noexcept {
    T old{};
    MOEFOLD_CPU_ONLY(old = std::atomic_ref<T>(*p).fetch_add(v, std::memory_order_relaxed));
    return old;
  }
  //! atomicMin on an integer (relaxed); returns the old value.
  template <class T>
  requires std::is_integral_v<T> MOEFOLD_HOST_DEVICE T atomic_min(T* p, T v)
  noexcept {
    T old{};
    MOEFOLD_CPU_ONLY(std::atomic_ref<T> a(*p); old = a.load(std::memory_order_relaxed); while (
                         v < old && !a.compare_exchange_weak(old, v, std::memory_order_relaxed)){});
    return old;
  }

  //! Runs at the end of the body of each thread: every lane and thread must get here together.
  void finish() {
    warp_barrier(detail::simt_op::warp_exit);
    block_barrier(detail::simt_op::block_exit);
  }

 private:
  std::uint64_t* warp_slots() noexcept { return slot_->exchange.data() + warp() * 32; }

  unsigned ballot_impl(bool p) {
    auto* x = warp_slots();
    x[lane()] = p ? 1 : 0;
    warp_barrier(detail::simt_op::ballot);
    unsigned bits = 0;
    for (int i = 0; i < 32; ++i) bits |= static_cast<unsigned>(x[i] != 0) << i;
    warp_barrier(detail::simt_op::ballot);
    return bits;
  }

  template <class T>
  T exchange(T v, int src, detail::simt_op op) {
    static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8,
                  "shuffles move 4- or 8-byte values, as on the GPU");
    auto* x = warp_slots();
    std::uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    x[lane()] = bits;
    warp_barrier(op);
    T out;
    std::memcpy(&out, &x[src], sizeof(T));
    warp_barrier(op);  // nobody overwrites a slot before every lane has read
    return out;
  }

  void block_barrier(detail::simt_op op) {
    if (!slot_->bars.arrive_and_wait(0, op, thread_)) abort_thread();
  }
  void warp_barrier(detail::simt_op op) {
    if (!slot_->bars.arrive_and_wait(1 + warp(), op, thread_)) abort_thread();
  }
  [[noreturn]] void abort_thread() const {
#if defined(__cpp_exceptions)
    throw detail::simt_abort{};
#else
    std::fprintf(stderr, "cpu_exec: block %d: %s\n", slot_->block, slot_->bars.fault().c_str());
    std::abort();
#endif
  }
  // A 16-byte access at a misaligned address (host_bytes16): the GPU faults here too; the block
  // ends and the launch reports it.
  friend class detail::host_bytes16<cpu_ctx>;
  [[noreturn]] void fault_misaligned(const void*, const char* what) const {
    slot_->bars.fail("thread " + detail::to_decimal(thread_) + ": " + what);
    abort_thread();
  }

  detail::simt_block_slot* slot_;
  int thread_, grid_blocks_;
};

static_assert(simt_context<cpu_ctx<32>>);

namespace detail {

//! v = a permutation of [0, v.size()) drawn from `seed` (Fisher-Yates over SplitMix64 draws of
//! (seed, i)).
inline void seeded_permutation(std::vector<int>& v, std::uint64_t seed) {
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<int>(i);
  for (std::size_t i = v.size(); i-- > 1;) {
    const auto r = mix64(seed ^ mix64(static_cast<std::uint64_t>(i)));
    std::swap(v[i], v[static_cast<std::size_t>(r % static_cast<std::uint64_t>(i + 1))]);
  }
}

//! Thread t of the block in `sl`: the body, then the exit barriers; a broken barrier unwinds it.
template <int Threads, class K>
void run_body(simt_block_slot& sl, int t, int grid_blocks, const K& kernel) {
  cpu_ctx<Threads> c(sl, t, grid_blocks);
#if defined(__cpp_exceptions)
  try {
    kernel(c);
    c.finish();
  } catch (const simt_abort&) {
  }
#else
  kernel(c);
  c.finish();
#endif
}

//! The CPU executor's launch (cpu_exec.hpp's launch calls it): runs `kernel` over `grid.blocks`
//! blocks of K::block_threads threads, two blocks at a time in the seed's order; returns when
//! every block is done. Errors: a negative grid or too much shared memory (invalid_argument,
//! before anything runs); a divergent barrier (kernel_fault, naming the block and the operations).
template <class K>
requires simt_kernel<K>
[[nodiscard]] status cpu_run(const char* exec_name, std::uint64_t seed, unsigned char poison,
                             const launch_grid& grid, const K& kernel) {
  constexpr int threads = K::block_threads;
  if (auto st = detail::check_launch(grid, exec_name, detail::kernel_name<K>()); !st) return st;
  if (grid.blocks == 0) return {};

  // Blocks in a seeded random order.
  std::vector<int> order(static_cast<std::size_t>(grid.blocks));
  detail::seeded_permutation(order, seed);

  const int slots = std::min(2, grid.blocks);
  std::vector<std::unique_ptr<detail::simt_block_slot>> slot;
  for (int s = 0; s < slots; ++s)
    slot.push_back(std::make_unique<detail::simt_block_slot>(threads, grid.smem_bytes));

#if MOEFOLD_CPU_EXEC_THREADS
  auto run_thread = [&](int s, int t) {
    auto& sl = *slot[static_cast<std::size_t>(s)];
    for (int i = s; i < grid.blocks; i += slots) {
      if (t == 0) {
        sl.block = order[static_cast<std::size_t>(i)];
        std::memset(sl.smem, poison, sl.smem_bytes);
      }
      if (!sl.bars.arrive_and_wait(0, detail::simt_op::sync, t)) return;  // block start
      run_body<threads>(sl, t, grid.blocks, kernel);
    }
  };

  // Every CUDA thread on its own OS thread: the calling host thread's reusable workers.
  detail::local_workers().run(
      slots * threads,
      [](void* f, int i) { (*static_cast<decltype(run_thread)*>(f))(i / threads, i % threads); },
      &run_thread);
#else
  // A slot's blocks on one OS thread each, their threads as fibers resumed in an order drawn
  // from (seed, block): a body that reads what another thread writes without a barrier between
  // gives different results for different seeds.
  struct slot_run {
    detail::simt_block_slot* sl;
    int grid_blocks;
    const K* kernel;
    static void body(void* p, int t) {
      auto& r = *static_cast<slot_run*>(p);
      run_body<threads>(*r.sl, t, r.grid_blocks, *r.kernel);
    }
    static bool ready(void* p, int t) { return static_cast<slot_run*>(p)->sl->bars.ready(t); }
  };
  auto run_slot = [&](int s) {
    auto& sl = *slot[static_cast<std::size_t>(s)];
    auto& fibers = detail::local_fibers();
    sl.bars.use_fibers(&fibers);
    std::vector<int> thread_order(static_cast<std::size_t>(threads));
    slot_run r{&sl, grid.blocks, &kernel};
    for (int i = s; i < grid.blocks; i += slots) {
      sl.block = order[static_cast<std::size_t>(i)];
      std::memset(sl.smem, poison, sl.smem_bytes);
      detail::seeded_permutation(thread_order,
                                 seed ^ detail::mix64(static_cast<std::uint64_t>(sl.block) + 1));
      if (!fibers.run(threads, thread_order.data(), &slot_run::body, &slot_run::ready, &r))
        sl.bars.fail("fibers remain that wait and none can go on");
      if (!sl.bars.fault().empty()) return;
    }
  };
  detail::local_workers().run(
      slots, [](void* f, int s) { (*static_cast<decltype(run_slot)*>(f))(s); }, &run_slot);
#endif

  for (auto& sl : slot)
    if (auto why = sl->bars.fault(); !why.empty())
      return make_error(errc::kernel_fault, std::string(exec_name) + ": " +
                                                detail::kernel_name<K>() + ", block " +
                                                detail::to_decimal(sl->block) + ": " + why);
  return {};
}
}  // namespace detail

}  // namespace v0_1
}  // namespace moefold
