// The MPI backend under mpirun (-np 2, 4, 8): every collective against the direct references of
// collective_reference.hpp on the world and on split communicators of prime and unit sizes, group
// communicators over a fold, and the faults (mismatched counts and collectives, rejected
// arguments, a rank that fails, a rank that never arrives), each an error on every rank within the
// timeout. Only rank 0 prints the doctest summary; the exit code is the maximum over ranks.
#define DOCTEST_CONFIG_IMPLEMENT
#include <moefold/comm/group_communicator.hpp>
#include <moefold/comm/mpi/mpi_communicator.hpp>
#include <moefold/mesh/fold.hpp>
#include <moefold/mesh/groups.hpp>

#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <iostream>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "collective_reference.hpp"
#include "row_checks.hpp"

using namespace moefold;
using namespace moefold::test;
using namespace std::chrono_literals;

static_assert(communicator<mpi_communicator>);
static_assert(splittable_communicator<mpi_communicator>);

namespace {

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

mpi_communicator world(std::chrono::milliseconds timeout = 30000ms) {
  return mpi_communicator::wrap(MPI_COMM_WORLD, {.timeout = timeout}).value();
}

// The world, and sub-communicators of sizes 1, 3, 5 and 7 where the world is large enough (ranks
// beyond them take part in the split with no color).
template <class F>
void on_each_communicator(F&& f) {
  auto w = world();
  f(w);
  for (int n : {1, 3, 5, 7}) {
    if (n > w.size() || n == w.size()) continue;
    auto sub = w.split(w.rank() < n ? 0 : split_no_color, w.rank());
    if (w.rank() < n) {
      REQUIRE(sub.has_value());
      REQUIRE(sub->size() == n);
      f(*sub);
    } else {
      REQUIRE(!sub);
      CHECK(sub.error().code == errc::rank_out_of_range);
    }
  }
}

// Every rank must draw the same random counts: one generator per communicator size.
std::mt19937 generator_for(int n, int salt) {
  return std::mt19937(static_cast<unsigned>(n * 131 + salt));
}

}  // namespace

TEST_CASE("wrap: rank and size are MPI's") {
  auto w = world();
  int r = -1, n = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  CHECK(w.rank() == r);
  CHECK(w.size() == n);
  CHECK(w.native() != MPI_COMM_WORLD);  // a duplicate
  auto bad = mpi_communicator::wrap(MPI_COMM_NULL);
  REQUIRE(!bad);
  CHECK(bad.error().code == errc::invalid_argument);
}

TEST_CASE_TEMPLATE("all_to_all_v equals the reference", T, float, double, int, std::int64_t,
                   bfloat16, float16) {
  on_each_communicator([](mpi_communicator& c) {
    auto g = generator_for(c.size(), 1);
    for (int trial = 0; trial < 3; ++trial) {
      const auto C = random_matrix(g, c.size(), 6);
      const int me = c.rank();
      const auto send = a2a_send<T>(C, me);
      const auto want = a2a_want<T>(C, me);
      std::vector<T> recv(want.size());
      const auto ok = c.all_to_all_v<T>(send, row(C, me), recv, column(C, me));
      REQUIRE(ok.has_value());
      CHECK(same_bits(recv, want));
    }
  });
}

TEST_CASE_TEMPLATE("all_gather_v, all_gather, reduce_scatter_v, all_reduce, broadcast", T, float,
                   double, int, std::int64_t, bfloat16, float16) {
  on_each_communicator([](mpi_communicator& c) {
    auto g = generator_for(c.size(), 2);
    const int me = c.rank(), n = c.size();
    const auto counts = random_counts(g, n, 5);
    {
      std::vector<T> recv(agv_want<T>(counts).size());
      REQUIRE(c.all_gather_v<T>(agv_send<T>(counts, me), recv, counts).has_value());
      CHECK(same_bits(recv, agv_want<T>(counts)));
    }
    {
      std::vector<T> mine{value_of<T>(me, 1, 0), value_of<T>(me, 1, 1)},
          all(2 * static_cast<std::size_t>(n));
      REQUIRE(c.all_gather<T>(mine, all).has_value());
      std::vector<T> want;
      for (int i = 0; i < n; ++i)
        for (int k = 0; k < 2; ++k) want.push_back(value_of<T>(i, 1, k));
      CHECK(same_bits(all, want));
    }
    for (bool max : {false, true}) {
      const auto op = max ? reduce_op::max : reduce_op::sum;
      const auto want = rsv_want<T>(counts, me, max);
      std::vector<T> recv(want.size());
      REQUIRE(c.reduce_scatter_v<T>(rsv_send<T>(counts, me), counts, recv, op).has_value());
      CHECK(same_bits(recv, want));
      // all_reduce of chunk "0" everywhere equals reduce_scatter_v's result on rank 0.
      const std::vector<int> c0 = [&] {
        std::vector<int> v(static_cast<std::size_t>(n), 0);
        v[0] = 4;
        return v;
      }();
      std::vector<T> buf = rsv_send<T>(c0, me);
      REQUIRE(c.all_reduce<T>(buf, op).has_value());
      CHECK(same_bits(buf, rsv_want<T>(c0, 0, max)));
    }
    for (int root = 0; root < n; root += 2) {
      std::vector<T> b{value_of<T>(me, 4, 0), value_of<T>(me, 4, 1), value_of<T>(me, 4, 2)};
      REQUIRE(c.broadcast<T>(b, root).has_value());
      CHECK(same_bits(b, std::vector<T>{value_of<T>(root, 4, 0), value_of<T>(root, 4, 1),
                                        value_of<T>(root, 4, 2)}));
    }
    REQUIRE(c.barrier().has_value());
  });
}

// The row-view form: rows of W elements travel in an MPI row datatype, counts in rows.
TEST_CASE_TEMPLATE("row-view collectives equal the element references", T, float, int, bfloat16) {
  static_assert(communicator_for<mpi_communicator, host_exec, T>);
  on_each_communicator([](mpi_communicator& c) {
    host_exec x;
    for (int width : {1, 3, 7}) {
      CAPTURE(width);
      CHECK(check_row_collectives<T>(c, x, width, 11u) == "");
    }
  });
}

TEST_CASE("group_communicator over a fold of the world") {
  auto w = world();
  const int n = w.size();
  const auto fold = n == 8   ? make_folded({.world = 8, .tp = 2, .pp = 2, .ep = 2, .etp = 1})
                    : n == 4 ? make_folded({.world = 4, .tp = 2, .ep = 4, .etp = 1})
                             : make_folded({.world = n, .tp = n > 1 ? 2 : 1});
  REQUIRE(fold.has_value());
  const megatron_groups groups(*fold);
  for (int i = 0; i < groups.num_kinds(); ++i) {
    const auto kind = groups.kind_at(i);
    CAPTURE(to_string(kind));
    auto gc = group_communicator(w, groups, kind);
    const auto at = groups(kind).find(w.rank());
    if (at.group < 0) {
      REQUIRE(!gc);
      CHECK(gc.error().code == errc::rank_out_of_range);
      continue;
    }
    REQUIRE(gc.has_value());
    CHECK(gc->rank() == at.position);
    std::vector<int> members(static_cast<std::size_t>(gc->size()));
    const std::vector<int> mine{w.rank()};
    REQUIRE(gc->all_gather<int>(mine, members).has_value());
    CHECK(members == groups(kind)[at.group].to_vector());
  }
}

// ---------------------------------------------------------------------------------------------
// Faults, each on its own duplicate of the world (a failure breaks the communicator).

namespace {

constexpr auto fault_timeout = 500ms;

status a2a_ones(mpi_communicator& c, int extra = 0) {
  const int n = c.size();
  std::vector<int> sc(static_cast<std::size_t>(n), 1), rc(sc);
  rc[0] += extra;
  std::vector<float> send(static_cast<std::size_t>(n), 1.f), recv(static_cast<std::size_t>(n + 1));
  return c.all_to_all_v<float>(send, sc, recv, rc);
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

TEST_CASE("fault: counts that disagree fail every rank, then the communicator is broken") {
  auto c = world(fault_timeout);
  if (c.size() < 2) return;
  const auto t0 = std::chrono::steady_clock::now();
  auto s = a2a_ones(c, c.rank() == c.size() - 1 ? 1 : 0);  // the last rank expects 2 from rank 0
  REQUIRE(!s);
  CHECK(s.error().code == errc::comm_mismatch);
  if (c.rank() == 0 || c.rank() == c.size() - 1)
    CHECK(contains(s.error().message, "count mismatch in all_to_all_v (call #0)"));
  CHECK(ms_since(t0) < 450.0);
  auto again = c.barrier();
  REQUIRE(!again);
  CHECK(again.error().code == errc::comm_broken);
}

TEST_CASE("fault: a rank calling another collective fails every rank") {
  auto c = world(fault_timeout);
  if (c.size() < 2) return;
  status s;
  if (c.rank() == 1) {
    std::vector<float> v{1.f};
    s = c.all_reduce<float>(v, reduce_op::sum);
  } else {
    s = a2a_ones(c);
  }
  REQUIRE(!s);
  CHECK(s.error().code == errc::comm_mismatch);
  if (c.rank() == 1) CHECK(contains(s.error().message, "collective mismatch"));
}

TEST_CASE("fault: a rank that rejects its arguments fails its peers at once") {
  auto c = world(fault_timeout);
  std::vector<int> counts(static_cast<std::size_t>(c.rank() == 0 ? c.size() + 1 : c.size()), 0);
  std::vector<float> none;
  const auto t0 = std::chrono::steady_clock::now();
  auto s = c.all_to_all_v<float>(none, counts, none, counts);
  REQUIRE(!s);
  CHECK(s.error().code == (c.rank() == 0 ? errc::shape_mismatch : errc::comm_peer_failed));
  CHECK(ms_since(t0) < 450.0);
}

TEST_CASE("fault: a rank that throws announces it; its peers fail at once") {
  auto c = world(fault_timeout);
  const auto t0 = std::chrono::steady_clock::now();
  status s;
  try {
    if (c.rank() == c.size() / 2) throw std::runtime_error("expert kernel exploded");
    s = a2a_ones(c);
  } catch (const std::exception& e) {
    s = c.fail(e.what());
  }
  REQUIRE(!s);
  CHECK(s.error().code == errc::comm_peer_failed);
  CHECK(ms_since(t0) < 450.0);
  CHECK(c.broken());
}

TEST_CASE("fault: mismatched element types; a failure inside a split leaves the world usable") {
  auto w = world(fault_timeout);
  {
    auto c = w.duplicate().value();
    status s;
    if (c.rank() == 0) {
      std::vector<double> v{1.0};
      s = c.all_reduce<double>(v, reduce_op::sum);
    } else {
      std::vector<float> v{1.f};
      s = c.all_reduce<float>(v, reduce_op::sum);
    }
    if (c.size() > 1) {
      REQUIRE(!s);
      CHECK(s.error().code == errc::comm_mismatch);
      if (c.rank() <= 1) CHECK(contains(s.error().message, "element type mismatch"));
    }
  }
  if (w.size() < 4) return;
  auto half = w.split(w.rank() % 2, w.rank()).value();
  status s;
  if (w.rank() == 1) {  // odd half: rank 1 sends one element too many to its peers
    s = a2a_ones(half, 0);
    std::vector<int> bad(static_cast<std::size_t>(half.size()), 2);
    std::vector<float> send(static_cast<std::size_t>(2 * half.size())),
        recv(static_cast<std::size_t>(2 * half.size()));
    s = half.all_to_all_v<float>(send, bad, recv, bad);
  } else {
    s = a2a_ones(half, 0);
    if (s) s = a2a_ones(half, 0);
  }
  if (w.rank() % 2 == 1) {
    REQUIRE(!s);
    CHECK(s.error().code == errc::comm_mismatch);
  } else {
    CHECK(s.has_value());
  }
  // The world is unaffected.
  std::vector<int> one{1};
  REQUIRE(w.all_reduce<int>(one, reduce_op::sum).has_value());
  CHECK(one[0] == w.size());
}

TEST_CASE("fault: a rank that never arrives: every other rank times out") {
  auto c = world(fault_timeout);
  if (c.size() < 2) return;
  const int late = c.size() - 1;
  const auto t0 = std::chrono::steady_clock::now();
  if (c.rank() == late) {
    // Arrives long after the others gave up; it then waits for a verdict nobody sends.
    std::this_thread::sleep_for(fault_timeout * 2);
    auto s = c.barrier();
    REQUIRE(!s);
    CHECK(s.error().code == errc::comm_timeout);
  } else {
    auto s = a2a_ones(c);
    REQUIRE(!s);
    CHECK(s.error().code == errc::comm_timeout);
    CHECK(contains(s.error().message, "did not complete within 500 ms"));
    const double ms = ms_since(t0);
    CHECK(ms >= 490.0);
    CHECK(ms < 1500.0);
  }
  CHECK(c.broken());
  auto again = c.barrier();
  CHECK(again.error().code == errc::comm_broken);
}

#include "../mpi_doctest_main.hpp"
