// Direct reference computations of the collectives, written without the schedule code: what each
// rank must hold afterwards, from every rank's inputs. Shared by the thread-world, MPI and GPU
// tests. Also the deterministic inputs those tests use.
#pragma once

#include <moefold/core/dtype.hpp>

#include <cstdint>
#include <cstring>
#include <random>
#include <type_traits>
#include <vector>

namespace moefold::test {

// The value rank `from` sends to rank `to` as its k-th element: distinct for every (from, to, k)
// and exact in every element type used (small integers).
template <class T>
T value_of(int from, int to, int k) {
  const int v = (from * 7 + to * 3 + k) % 61 - 30;
  if constexpr (std::is_same_v<T, bfloat16> || std::is_same_v<T, float16>)
    return T(static_cast<float>(v));
  else
    return static_cast<T>(v);
}

template <class T>
double as_double(const T& v) {
  if constexpr (std::is_same_v<T, bfloat16> || std::is_same_v<T, float16>)
    return static_cast<double>(static_cast<float>(v));
  else
    return static_cast<double>(v);
}

// C[i][j]: elements rank i sends to rank j; many zeros, some ranks send and receive nothing.
inline std::vector<std::vector<int>> random_matrix(std::mt19937& g, int n, int max) {
  std::uniform_int_distribution<int> d(0, max);
  std::vector<std::vector<int>> C(static_cast<std::size_t>(n),
                                  std::vector<int>(static_cast<std::size_t>(n)));
  const int empty = n > 2 ? static_cast<int>(g() % static_cast<unsigned>(n)) : -1;
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j)
      C[static_cast<std::size_t>(i)][static_cast<std::size_t>(j)] =
          (i == empty || j == empty || d(g) % 3 == 0) ? 0 : d(g);
  return C;
}

inline std::vector<int> random_counts(std::mt19937& g, int n, int max) {
  std::uniform_int_distribution<int> d(0, max);
  std::vector<int> c(static_cast<std::size_t>(n));
  for (auto& x : c) x = d(g) % 3 == 0 ? 0 : d(g);
  return c;
}

inline std::vector<int> row(const std::vector<std::vector<int>>& C, int i) {
  return C[static_cast<std::size_t>(i)];
}
inline std::vector<int> column(const std::vector<std::vector<int>>& C, int j) {
  std::vector<int> c;
  for (const auto& r : C) c.push_back(r[static_cast<std::size_t>(j)]);
  return c;
}

// all_to_all_v: rank me's send buffer (blocks for rank 0, 1, ... in order).
template <class T>
std::vector<T> a2a_send(const std::vector<std::vector<int>>& C, int me) {
  std::vector<T> v;
  for (std::size_t j = 0; j < C.size(); ++j)
    for (int k = 0; k < C[static_cast<std::size_t>(me)][j]; ++k)
      v.push_back(value_of<T>(me, static_cast<int>(j), k));
  return v;
}
// ... and what it must receive.
template <class T>
std::vector<T> a2a_want(const std::vector<std::vector<int>>& C, int me) {
  std::vector<T> v;
  for (std::size_t i = 0; i < C.size(); ++i)
    for (int k = 0; k < C[i][static_cast<std::size_t>(me)]; ++k)
      v.push_back(value_of<T>(static_cast<int>(i), me, k));
  return v;
}

// all_gather_v: rank i contributes counts[i] values value_of(i, 0, k).
template <class T>
std::vector<T> agv_send(const std::vector<int>& counts, int me) {
  std::vector<T> v;
  for (int k = 0; k < counts[static_cast<std::size_t>(me)]; ++k) v.push_back(value_of<T>(me, 0, k));
  return v;
}
template <class T>
std::vector<T> agv_want(const std::vector<int>& counts) {
  std::vector<T> v;
  for (std::size_t i = 0; i < counts.size(); ++i)
    for (int k = 0; k < counts[i]; ++k) v.push_back(value_of<T>(static_cast<int>(i), 0, k));
  return v;
}

// reduce_scatter_v: rank i's input holds chunk j (counts[j] values value_of(i, j, k)) for each j.
template <class T>
std::vector<T> rsv_send(const std::vector<int>& counts, int me) {
  std::vector<T> v;
  for (std::size_t j = 0; j < counts.size(); ++j)
    for (int k = 0; k < counts[j]; ++k) v.push_back(value_of<T>(me, static_cast<int>(j), k));
  return v;
}
// The sum (or max) over ranks in rank order, accumulated in the accumulator type.
template <class T>
std::vector<T> rsv_want(const std::vector<int>& counts, int me, bool max) {
  using A = accumulator_t<T>;
  std::vector<T> v;
  const int n = static_cast<int>(counts.size());
  for (int k = 0; k < counts[static_cast<std::size_t>(me)]; ++k) {
    A acc = static_cast<A>(as_double(value_of<T>(0, me, k)));
    for (int i = 1; i < n; ++i) {
      const A x = static_cast<A>(as_double(value_of<T>(i, me, k)));
      acc = max ? (acc < x ? x : acc) : static_cast<A>(acc + x);
    }
    if constexpr (std::is_same_v<A, T>)
      v.push_back(acc);
    else
      v.push_back(T(acc));
  }
  return v;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) return false;
  return true;
}

}  // namespace moefold::test
