// An execution context for the stream-order check of code written against an execution context
// (the dispatchers): it runs everything as cpu_exec does (the same kernel bodies on the CPU
// executor, the same memory), but takes cuda_exec's code path (no host-addressable memory:
// the plan builders launch kernels and read results only through copies; row operations count bad
// indices into a device word that device_status() reads) and tells a stream_order_fake what each
// operation reads and writes, as cuda_exec enqueues it on its one stream:
//   - a copy from host memory does not wait; from memory the caller declared pinned (pin()), the
//     source must stay unchanged until the stream has run the copy (cuda_copy_exec.hpp's contract);
//   - a copy to host memory waits for the stream, and so does synchronize() and device_status();
//   - kernels and device-to-device copies are ordered by the stream.
// The host's own writes are not calls, so they are found by content: a copy from pinned memory
// keeps a snapshot of its source rows until the next wait, and every later call (and check())
// first compares them; a changed source is a host write, which the fake reports unless a wait
// ordered it after the copy. (A write of the same bytes goes unseen, and is harmless on a GPU.)
//
// The collectives of the thread world run on the host through the cpu_exec this context converts
// to: on a GPU they run on the same stream, between device buffers, so they order nothing the
// check looks at.
#pragma once

#include <moefold/exec/cpu_exec.hpp>
#include <moefold/exec/exec.hpp>
#include <moefold/exec/simt_memory_ops.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "stream_order_fake.hpp"

namespace moefold::test {

class stream_order_exec
    : public moefold::detail::simt_memory_ops<stream_order_exec, cpu_device_space> {
 public:
  using memory_space = cpu_device_space;
  static constexpr const char* name = "stream_order_exec";
  static constexpr unsigned char poison = 0xFF;
  static constexpr bool runs_kernels = true;
  static constexpr bool check_indices_first = false;  // cuda_exec's: a device error word
  static constexpr int max_grid_blocks = 8;

  //! Operations go on a new non-blocking stream of `fake` (a CUDA context's own stream).
  stream_order_exec(stream_order_fake& fake, std::uint64_t seed)
      : inner_(seed), fake_(&fake), stream_(fake.create_stream(true)) {}
  stream_order_exec(const stream_order_exec&) = delete;
  stream_order_exec& operator=(const stream_order_exec&) = delete;

  //! Host memory the caller allocated pinned: copies from it are truly asynchronous. `what`
  //! names it in the fake's messages.
  void pin(const void* p, std::size_t bytes, std::string what) {
    pinned_.push_back({p, bytes});
    fake_->name({p, bytes}, std::move(what));
  }
  //! Compares the pending pinned sources with their snapshots now (a caller's last check).
  void check() { check_sources(); }

  [[nodiscard]] std::uint64_t seed() const noexcept { return inner_.seed(); }
  [[nodiscard]] const copy_counts& copies() const noexcept { return counts_; }
  void reset_copies() noexcept {
    counts_ = {};
    pageable_.clear();
    allocations_ = 0;
    synchronizations_ = 0;
  }
  //! What a CUDA graph cannot capture, counted since the last reset_copies() (as are the copies to
  //! the host, each a wait, and synchronize()): allocations through
  //! the context (cudaMallocAsync would be a node of the graph, its address fixed at capture) and
  //! host-to-device copies from memory not pin()ned (a pageable source is staged by the runtime
  //! when the call is made, which capture refuses), each named by its size.
  [[nodiscard]] long long allocations() const noexcept { return allocations_; }
  //! synchronize() calls (a capturing stream refuses cudaStreamSynchronize).
  [[nodiscard]] long long synchronizations() const noexcept { return synchronizations_; }
  [[nodiscard]] const std::vector<std::string>& pageable_copies_to_device() const noexcept {
    return pageable_;
  }
  //! The thread world's collectives take the CPU executor (see the file comment).
  operator cpu_exec&() noexcept { return inner_; }

  //! Host to device: asynchronous.
  template <class U, class T>
  requires std::is_same_v<std::remove_const_t<U>, T>
  [[nodiscard]] status copy(row_view<U, host_space> src, row_view<T, memory_space> dst) {
    const auto st =
        enqueue_copy(src, dst, counts_.to_device, counts_.bytes_to_device, "copy to the device #");
    if (st && is_pinned(range_of(src)))
      snapshot(src, "copy to the device #" + std::to_string(counts_.to_device));
    else if (st && !src.empty())
      pageable_.push_back("[" + std::to_string(src.rows()) + ", " + std::to_string(src.width()) +
                          "] of " + std::to_string(sizeof(T)) + "-byte values");
    return st;
  }
  //! Device to host: waits for the stream.
  template <class U, class T>
  requires std::is_same_v<std::remove_const_t<U>, T>
  [[nodiscard]] status copy(row_view<U, memory_space> src, row_view<T, host_space> dst) {
    const auto st =
        enqueue_copy(src, dst, counts_.to_host, counts_.bytes_to_host, "copy to the host #");
    if (st) wait();
    return st;
  }
  //! Device to device.
  template <class U, class T>
  requires std::is_same_v<std::remove_const_t<U>, T>
  [[nodiscard]] status copy(row_view<U, memory_space> src, row_view<T, memory_space> dst) {
    return enqueue_copy(src, dst, counts_.on_device, counts_.bytes_on_device,
                        "copy on the device #");
  }

  [[nodiscard]] expected<void*> allocate_bytes(std::size_t bytes) const {
    ++allocations_;
    return moefold::detail::aligned_host_bytes(bytes, name, poison);
  }
  void deallocate_bytes(void* p, std::size_t) const noexcept {
    moefold::detail::free_aligned_host_bytes(p);
  }
  [[nodiscard]] static constexpr moefold::detail::host_bytes_deallocator deallocator() noexcept {
    return {};
  }
  [[nodiscard]] status synchronize() {
    ++synchronizations_;
    check_sources();
    wait();
    return {};
  }

  //! The device error word (cuda_exec's) and the host-side status call that reads it.
  [[nodiscard]] int* fault_word() const noexcept { return word_.get(); }
  [[nodiscard]] status device_status() {
    int n = 0;
    if (auto st =
            copy(row_view<const int, memory_space>(word_.get(), 1, 1), row_view<int>(&n, 1, 1));
        !st)
      return st;
    if (n == 0) return {};
    *word_ = 0;
    return make_error(errc::invalid_argument, std::string(name) + ": " + std::to_string(n) +
                                                  " indices outside their range");
  }

  //! A kernel launch: an operation of the stream (what it touches is device memory only). The
  //! fake's state is behind a pointer, so a launch through a const context records too.
  template <class K>
  [[nodiscard]] status launch_kernel(const launch_grid& grid, const K& kernel) const {
    check_sources();
    fake_->enqueue(stream_, {}, {}, std::string("kernel ") + K::name);
    return moefold::detail::cpu_run(name, inner_.seed(), poison, grid, kernel);
  }

 private:
  using range = stream_order_fake::range;
  struct pending {
    range r;
    std::size_t row_bytes, stride_bytes;
    int rows;
    std::vector<std::byte> bytes;  // the source rows at the copy
    std::string what;
  };

  // A copy as the stream runs it: counted, and reported to the fake as "<what><n>".
  template <class U, class S1, class T, class S2>
  status enqueue_copy(const row_view<U, S1>& src, const row_view<T, S2>& dst, long long& calls,
                      long long& bytes, const char* what) {
    check_sources();
    if (auto st = moefold::detail::check_copy(src, dst, name); !st) return st;
    moefold::detail::host_copy_rows(src, dst);
    bytes += bytes_of(src);
    fake_->enqueue(stream_, {range_of(src)}, {range_of(dst)}, what + std::to_string(++calls));
    return {};
  }
  template <class T, class S>
  static range range_of(const row_view<T, S>& v) {
    if (v.rows() == 0 || v.width() == 0) return {v.data(), 0};
    const auto span =
        static_cast<std::size_t>(v.rows() - 1) * static_cast<std::size_t>(v.stride()) +
        static_cast<std::size_t>(v.width());
    return {v.data(), span * sizeof(std::remove_const_t<T>)};
  }
  template <class T, class S>
  static long long bytes_of(const row_view<T, S>& v) {
    return static_cast<long long>(v.rows()) * v.width() *
           static_cast<long long>(sizeof(std::remove_const_t<T>));
  }
  bool is_pinned(range r) const {
    const auto* p = static_cast<const std::byte*>(r.p);
    for (const range& q : pinned_) {
      const auto* b = static_cast<const std::byte*>(q.p);
      if (r.bytes > 0 && p >= b && p + r.bytes <= b + q.bytes) return true;
    }
    return false;
  }
  template <class T>
  void snapshot(const row_view<T, host_space>& v, const std::string& what) {
    pending s{.r = range_of(v),
              .row_bytes = static_cast<std::size_t>(v.width()) * sizeof(std::remove_const_t<T>),
              .stride_bytes = static_cast<std::size_t>(v.stride()) * sizeof(std::remove_const_t<T>),
              .rows = v.rows(),
              .bytes = {},
              .what = what};
    s.bytes.resize(s.row_bytes * static_cast<std::size_t>(s.rows));
    for (int i = 0; i < s.rows; ++i)
      std::memcpy(
          s.bytes.data() + s.row_bytes * static_cast<std::size_t>(i),
          static_cast<const std::byte*>(s.r.p) + s.stride_bytes * static_cast<std::size_t>(i),
          s.row_bytes);
    pending_.push_back(std::move(s));
  }
  // A pending source whose bytes changed was written by the host since its copy was enqueued.
  // (const: simt_memory_ops launches through a const context; the state it updates is the
  // check's, not the context's.)
  void check_sources() const {
    for (auto it = pending_.begin(); it != pending_.end();) {
      bool changed = false;
      for (int i = 0; i < it->rows && !changed; ++i)
        changed = std::memcmp(it->bytes.data() + it->row_bytes * static_cast<std::size_t>(i),
                              static_cast<const std::byte*>(it->r.p) +
                                  it->stride_bytes * static_cast<std::size_t>(i),
                              it->row_bytes) != 0;
      if (changed) {
        fake_->host_access({}, {it->r}, "a write into the pinned source of " + it->what);
        it = pending_.erase(it);
      } else {
        ++it;
      }
    }
  }
  void wait() {
    fake_->synchronize(stream_);
    pending_.clear();  // every copy enqueued so far has run
  }

  cpu_exec inner_;
  stream_order_fake* fake_;
  stream_order_fake::stream stream_;
  std::unique_ptr<int> word_ = std::make_unique<int>(0);
  std::vector<range> pinned_;
  mutable std::vector<pending> pending_;
  copy_counts counts_{};
  std::vector<std::string> pageable_;
  mutable long long allocations_ = 0;
  long long synchronizations_ = 0;
};

template <class K>
requires simt_kernel<K>
[[nodiscard]] status launch(const stream_order_exec& exec, const launch_grid& grid,
                            const K& kernel) {
  return exec.launch_kernel(grid, kernel);
}

static_assert(execution_context<stream_order_exec>);

}  // namespace moefold::test
