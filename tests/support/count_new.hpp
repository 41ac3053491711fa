// Counts global operator new across the whole process while `counting` is on, and, while
// `tracking` is on, poisons each new block and keeps a table of the live blocks allocated since
// (for tests that search the heap for copies of a buffer). Include it in exactly one translation
// unit of a test program: it replaces the program's operator new and delete (plain and aligned;
// libstdc++'s array and nothrow forms forward to these) with malloc and free, and GCC's analysis of
// the inlined standard library then sees free() on memory from operator new and warns, hence the
// pragma.
#pragma once
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <new>

namespace moefold::test {
inline std::atomic<long long> news{0};
inline std::atomic<bool> counting{false};
inline void count_new() {
  if (counting.load(std::memory_order_relaxed)) news.fetch_add(1, std::memory_order_relaxed);
}

//! The live blocks allocated while `tracking` was on (a fixed table: the hook cannot allocate).
struct tracked_block {
  const void* p = nullptr;
  std::size_t n = 0;
};
inline std::atomic<bool> tracking{false};
inline std::atomic<bool> tracked_any{false};       // a block was ever tracked (delete's fast path)
inline std::atomic<bool> tracked_overflow{false};  // more live blocks than the table holds
inline std::array<tracked_block, 1 << 15> tracked{};
inline std::atomic_flag tracked_lock = ATOMIC_FLAG_INIT;
//! Poisons the block first: fresh memory may hold bytes a freed block left (a weight tensor
//! freed before tracking began), which a search for copies must not count; what is found was
//! written after the allocation.
inline void track_new(void* p, std::size_t n) {
  if (!tracking.load(std::memory_order_relaxed)) return;
  std::memset(p, 0xa5, n);
  while (tracked_lock.test_and_set(std::memory_order_acquire)) {
  }
  tracked_any.store(true, std::memory_order_relaxed);
  bool put = false;
  for (auto& b : tracked)
    if (b.p == nullptr) {
      b = {p, n};
      put = true;
      break;
    }
  if (!put) tracked_overflow.store(true);
  tracked_lock.clear(std::memory_order_release);
}
inline void track_delete(const void* p) {
  if (p == nullptr || !tracked_any.load(std::memory_order_relaxed)) return;
  while (tracked_lock.test_and_set(std::memory_order_acquire)) {
  }
  for (auto& b : tracked)
    if (b.p == p) {
      b = {};
      break;
    }
  tracked_lock.clear(std::memory_order_release);
}
//! Calls f(pointer, bytes) for every live tracked block (call with the allocating threads idle).
template <class F>
void for_each_tracked(F&& f) {
  for (const auto& b : tracked)
    if (b.p != nullptr) f(static_cast<const std::byte*>(b.p), b.n);
}
inline void clear_tracked() {
  for (auto& b : tracked) b = {};
}
}  // namespace moefold::test

void* operator new(std::size_t n) {
  moefold::test::count_new();
  if (void* p = std::malloc(n == 0 ? 1 : n)) {
    moefold::test::track_new(p, n);
    return p;
  }
  throw std::bad_alloc();
}
void* operator new(std::size_t n, std::align_val_t a) {
  moefold::test::count_new();
  const auto al = static_cast<std::size_t>(a);
  if (void* p = std::aligned_alloc(al, (n + al - 1) / al * al)) {
    moefold::test::track_new(p, n);
    return p;
  }
  throw std::bad_alloc();
}
// The nothrow forms (host contexts allocate with them: exec/host_exec's aligned bytes) must come
// from the same allocator the deletes above free into.
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  moefold::test::count_new();
  void* p = std::malloc(n == 0 ? 1 : n);
  if (p != nullptr) moefold::test::track_new(p, n);
  return p;
}
void* operator new(std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  moefold::test::count_new();
  const auto al = static_cast<std::size_t>(a);
  void* p = std::aligned_alloc(al, (n + al - 1) / al * al);
  if (p != nullptr) moefold::test::track_new(p, n);
  return p;
}
void operator delete(void* p, const std::nothrow_t&) noexcept {
  moefold::test::track_delete(p);
  std::free(p);
}
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept {
  moefold::test::track_delete(p);
  std::free(p);
}
void operator delete(void* p) noexcept {
  moefold::test::track_delete(p);
  std::free(p);
}
void operator delete(void* p, std::size_t) noexcept {
  moefold::test::track_delete(p);
  std::free(p);
}
void operator delete(void* p, std::align_val_t) noexcept {
  moefold::test::track_delete(p);
  std::free(p);
}
void operator delete(void* p, std::size_t, std::align_val_t) noexcept {
  moefold::test::track_delete(p);
  std::free(p);
}
