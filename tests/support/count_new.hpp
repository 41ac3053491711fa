// Counts global operator new across the whole process while `counting` is on. Include it in
// exactly one translation unit of a test program: it replaces the program's operator new and
// delete (plain and aligned; libstdc++'s array and nothrow forms forward to these) with malloc
// and free, and GCC's analysis of the inlined standard library then sees free() on memory from
// operator new and warns, hence the pragma.
#pragma once
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

#include <atomic>
#include <cstdlib>
#include <new>

namespace moefold::test {
inline std::atomic<long long> news{0};
inline std::atomic<bool> counting{false};
inline void count_new() {
  if (counting.load(std::memory_order_relaxed)) news.fetch_add(1, std::memory_order_relaxed);
}
}  // namespace moefold::test

void* operator new(std::size_t n) {
  moefold::test::count_new();
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new(std::size_t n, std::align_val_t a) {
  moefold::test::count_new();
  const auto al = static_cast<std::size_t>(a);
  if (void* p = std::aligned_alloc(al, (n + al - 1) / al * al)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
