// exchange_communicator over a backend of two byte collectives (here the thread world's, moving
// std::byte): every collective equals the direct references of collective_reference.hpp and the
// thread world's own result bit for bit (random floats, where the order of a sum shows); the
// padded all-gather, the chunked all-reduce and the broadcast root's copy at the edges (fewer
// elements than ranks, none, one rank); every fault a rank can cause becomes the same error on
// every rank before data moves (counts, collective, element type, a rejected argument, fail()),
// and a backend that fails breaks the communicator (later calls: comm_broken, never a hang).
#include <moefold/comm/exchange_communicator.hpp>
#include <moefold/comm/thread_exchange.hpp>
#include <moefold/comm/thread_world.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "collective_reference.hpp"

using namespace moefold;
using namespace moefold::test;

namespace {

// An exchange communicator over a duplicate of the rank's world communicator.
exchange_communicator over(thread_communicator& world, int fail_at = -1) {
  auto dup = world.split(0, world.rank());
  REQUIRE(dup);
  auto c = exchange_communicator::make(std::make_unique<thread_exchange>(std::move(*dup), fail_at));
  REQUIRE(c);
  return std::move(*c);
}

template <class T>
std::vector<T> random_values(std::uint64_t seed, std::size_t n) {
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<double> d(-1.0, 1.0);
  std::vector<T> v(n);
  for (auto& x : v) x = T(static_cast<float>(d(g) * (1 + (g() % 1000))));
  return v;
}

// The errors of every rank of a world, for the fault cases.
struct outcomes {
  explicit outcomes(int n) : by_rank(static_cast<std::size_t>(n)) {}
  std::mutex m;
  std::vector<status> by_rank;
  void put(int r, status st) {
    std::lock_guard lk(m);
    by_rank[static_cast<std::size_t>(r)] = std::move(st);
  }
};

}  // namespace

static_assert(communicator<exchange_communicator>);
static_assert(communicator_for<exchange_communicator, host_exec, bfloat16>);

TEST_CASE("a group of one rank (single_rank_exchange): every collective returns its input") {
  auto c = exchange_communicator::make(std::make_unique<single_rank_exchange>());
  REQUIRE(c);
  CHECK(c->rank() == 0);
  CHECK(c->size() == 1);
  host_exec ex;
  const auto v = random_values<float>(7, 12);
  std::vector<float> recv(12, -1.0f);
  const row_view<const float> send(v.data(), 4, 3);
  REQUIRE(c->all_to_all_v(ex, send, std::vector<int>{4}, row_view<float>(recv.data(), 4, 3),
                          std::vector<int>{4}));
  CHECK(recv == v);
  std::fill(recv.begin(), recv.end(), -1.0f);
  REQUIRE(c->all_gather_v(ex, send, row_view<float>(recv.data(), 4, 3), std::vector<int>{4}));
  CHECK(recv == v);
  std::fill(recv.begin(), recv.end(), -1.0f);
  REQUIRE(c->reduce_scatter_v(ex, send, std::vector<int>{4}, row_view<float>(recv.data(), 4, 3),
                              reduce_op::sum));
  CHECK(recv == v);
  std::vector<float> buf = v;
  REQUIRE(c->all_reduce(ex, row_view<float>(buf.data(), 4, 3), reduce_op::sum));
  CHECK(buf == v);
  // Counts for a second peer are refused, as on any group.
  CHECK_FALSE(c->all_to_all_v(ex, send, std::vector<int>{2, 2}, row_view<float>(recv.data(), 4, 3),
                              std::vector<int>{2, 2}));
}

TEST_CASE("make refuses a null backend") {
  auto c = exchange_communicator::make(nullptr);
  REQUIRE_FALSE(c);
  CHECK(c.error().code == errc::invalid_argument);
}

TEST_CASE_TEMPLATE("moves: all_to_all_v, all_gather_v, all_gather, broadcast equal the reference",
                   T, float, int, std::int64_t, bfloat16) {
  for (int n : {1, 3, 4, 8}) {
    CAPTURE(n);
    std::mt19937 g(static_cast<unsigned>(n) * 31u);
    const auto C = random_matrix(g, n, 9);
    const auto counts = random_counts(g, n, 7);
    const auto st = run_thread_world(n, [&](thread_communicator& world) -> status {
      const int me = world.rank();
      auto x = over(world);
      host_exec ex;
      // all_to_all_v in rows of 3: row k of the block for rank j is value_of(me, j, k) thrice.
      {
        const auto flat = a2a_send<T>(C, me);
        std::vector<T> send, want_rows;
        for (const T& v : flat) send.insert(send.end(), 3, v);
        for (const T& v : a2a_want<T>(C, me)) want_rows.insert(want_rows.end(), 3, v);
        std::vector<T> recv(want_rows.size() + 3, T(99));  // one spare row, left untouched
        const auto sc = row(C, me), rc = column(C, me);
        const int srows = static_cast<int>(flat.size()), rrows = static_cast<int>(recv.size() / 3);
        if (auto s = x.all_to_all_v(ex, row_view<const T>(send.data(), srows, 3), sc,
                                    row_view<T>(recv.data(), rrows, 3), rc);
            !s)
          return s;
        CHECK(same_bits(std::vector<T>(recv.begin(), recv.end() - 3), want_rows));
        CHECK(same_bits(std::vector<T>(recv.end() - 3, recv.end()), std::vector<T>(3, T(99))));
      }
      // all_gather_v (unequal parts: padded underneath) and all_gather.
      {
        const auto send = agv_send<T>(counts, me);
        const auto want = agv_want<T>(counts);
        std::vector<T> recv(want.size());
        if (auto s = x.all_gather_v<T>(send, recv, counts); !s) return s;
        CHECK(same_bits(recv, want));
        std::vector<T> one{value_of<T>(me, 1, 0), value_of<T>(me, 1, 1)}, all(2 * n);
        if (auto s = x.all_gather<T>(one, all); !s) return s;
        for (int r = 0; r < n; ++r) {
          CHECK(same_bits(std::vector<T>(all.begin() + 2 * r, all.begin() + 2 * r + 2),
                          std::vector<T>{value_of<T>(r, 1, 0), value_of<T>(r, 1, 1)}));
        }
      }
      // broadcast from the last rank, and of nothing.
      {
        std::vector<T> buf(5);
        for (int k = 0; k < 5; ++k) buf[static_cast<std::size_t>(k)] = value_of<T>(me, 2, k);
        if (auto s = x.broadcast<T>(buf, n - 1); !s) return s;
        std::vector<T> want(5);
        for (int k = 0; k < 5; ++k) want[static_cast<std::size_t>(k)] = value_of<T>(n - 1, 2, k);
        CHECK(same_bits(buf, want));
        std::vector<T> none;
        if (auto s = x.broadcast<T>(none, 0); !s) return s;
      }
      return x.barrier();
    });
    for (const auto& s : st) CHECK_MESSAGE(s.has_value(), (s ? "" : s.error().message));
  }
}

TEST_CASE_TEMPLATE("reductions: the thread world's bits (rank order, fp32 for 16-bit)", T, float,
                   double, bfloat16, float16) {
  for (int n : {1, 2, 3, 8}) {
    CAPTURE(n);
    std::mt19937 g(static_cast<unsigned>(n) * 7u + 1u);
    const auto counts = random_counts(g, n, 6);
    const auto st = run_thread_world(n, [&](thread_communicator& world) -> status {
      const int me = world.rank();
      auto x = over(world);
      // reduce_scatter_v of small integers: the reference; of random values: the thread world.
      for (reduce_op op : {reduce_op::sum, reduce_op::max}) {
        const auto send = rsv_send<T>(counts, me);
        std::vector<T> recv(static_cast<std::size_t>(counts[static_cast<std::size_t>(me)]));
        if (auto s = x.reduce_scatter_v<T>(send, counts, recv, op); !s) return s;
        CHECK(same_bits(recv, rsv_want<T>(counts, me, op == reduce_op::max)));
      }
      long long total = 0;
      for (int c : counts) total += c;
      const auto values =
          random_values<T>(100 + static_cast<std::uint64_t>(me), static_cast<std::size_t>(total));
      std::vector<T> a(static_cast<std::size_t>(counts[static_cast<std::size_t>(me)])), b(a);
      if (auto s = x.reduce_scatter_v<T>(values, counts, a, reduce_op::sum); !s) return s;
      if (auto s = world.reduce_scatter_v<T>(values, counts, b, reduce_op::sum); !s) return s;
      CHECK(same_bits(a, b));
      // all_reduce of random values at lengths around the rank count (parts of n / size
      // elements, some empty) and of nothing.
      for (std::size_t len :
           {std::size_t{0}, std::size_t{1}, static_cast<std::size_t>(n) + 1, std::size_t{37}}) {
        CAPTURE(len);
        auto mine = random_values<T>(7 * len + static_cast<std::uint64_t>(me), len), theirs = mine;
        for (reduce_op op : {reduce_op::sum, reduce_op::max}) {
          if (auto s = x.all_reduce<T>(mine, op); !s) return s;
          if (auto s = world.all_reduce<T>(theirs, op); !s) return s;
          CHECK(same_bits(mine, theirs));
        }
      }
      // The row form (the layer's gradient sums) takes the same path.
      auto rows = random_values<T>(55 + static_cast<std::uint64_t>(me), 12), rows_tw = rows;
      host_exec ex;
      if (auto s = x.all_reduce(ex, row_view<T>(rows.data(), 4, 3), reduce_op::sum); !s) return s;
      if (auto s = world.all_reduce(ex, row_view<T>(rows_tw.data(), 4, 3), reduce_op::sum); !s)
        return s;
      CHECK(same_bits(rows, rows_tw));
      return {};
    });
    for (const auto& s : st) CHECK_MESSAGE(s.has_value(), (s ? "" : s.error().message));
  }
}

TEST_CASE("fault: counts that disagree fail every rank alike, before data moves; then broken") {
  constexpr int n = 4;
  outcomes o(n);
  std::vector<std::string> messages(n);
  const auto st = run_thread_world(n, [&](thread_communicator& world) -> status {
    const int me = world.rank();
    auto x = over(world);
    // Rank 2 expects 3 elements from rank 1, which sends 2.
    std::vector<int> sc(n, 1), rc(n, 1);
    if (me == 1) sc[2] = 2;
    if (me == 2) rc[1] = 3;
    std::vector<float> send(8, 1.0f), recv(8, -1.0f);
    auto s = x.all_to_all_v<float>(send, sc, recv, rc);
    CHECK(std::all_of(recv.begin(), recv.end(), [](float v) { return v == -1.0f; }));
    if (!s) messages[static_cast<std::size_t>(me)] = s.error().message;
    o.put(me, s);
    CHECK(x.broken());
    auto later = x.barrier();
    CHECK_FALSE(later);
    if (!later) CHECK(later.error().code == errc::comm_broken);
    return {};
  });
  for (const auto& s : st) CHECK(s.has_value());
  for (int r = 0; r < n; ++r) {
    const auto& s = o.by_rank[static_cast<std::size_t>(r)];
    REQUIRE_FALSE(s);
    CHECK(s.error().code == errc::comm_mismatch);
    CHECK(messages[static_cast<std::size_t>(r)] == messages[0]);  // one verdict, every rank
  }
  CHECK(messages[0].find("count mismatch") != std::string::npos);
  CHECK(messages[0].find("rank 1") != std::string::npos);
  CHECK(messages[0].find("rank 2") != std::string::npos);
}

TEST_CASE("fault: another collective, another element type, a rejected argument, fail()") {
  constexpr int n = 3;
  SUBCASE("a rank calling another collective") {
    outcomes o(n);
    const auto st = run_thread_world(n, [&](thread_communicator& world) -> status {
      auto x = over(world);
      std::vector<float> buf(4, 1.0f);
      o.put(world.rank(), world.rank() == 0 ? x.broadcast<float>(buf, 0)
                                            : x.all_reduce<float>(buf, reduce_op::sum));
      return {};
    });
    for (const auto& s : st) CHECK(s.has_value());
    for (const auto& s : o.by_rank) {
      REQUIRE_FALSE(s);
      CHECK(s.error().code == errc::comm_mismatch);
      CHECK(s.error().message.find("collective mismatch") != std::string::npos);
    }
  }
  SUBCASE("a rank reducing another element type") {
    outcomes o(n);
    const auto st = run_thread_world(n, [&](thread_communicator& world) -> status {
      auto x = over(world);
      std::vector<float> f(4, 1.0f);
      std::vector<double> d(4, 1.0);
      o.put(world.rank(), world.rank() == 1 ? x.all_reduce<double>(d, reduce_op::sum)
                                            : x.all_reduce<float>(f, reduce_op::sum));
      return {};
    });
    for (const auto& s : st) CHECK(s.has_value());
    for (const auto& s : o.by_rank) {
      REQUIRE_FALSE(s);
      CHECK(s.error().code == errc::comm_mismatch);
      CHECK(s.error().message.find("element type mismatch") != std::string::npos);
    }
  }
  SUBCASE("a rank whose receive buffer is too small: it names its rule, the others name it") {
    outcomes o(n);
    const auto st = run_thread_world(n, [&](thread_communicator& world) -> status {
      auto x = over(world);
      const std::vector<int> counts{2, 2, 2};
      std::vector<float> send(2, 1.0f), recv(world.rank() == 2 ? 5 : 6);
      o.put(world.rank(), x.all_gather_v<float>(send, recv, counts));
      return {};
    });
    for (const auto& s : st) CHECK(s.has_value());
    REQUIRE_FALSE(o.by_rank[2]);
    CHECK(o.by_rank[2].error().code == errc::shape_mismatch);
    for (int r : {0, 1}) {
      const auto& s = o.by_rank[static_cast<std::size_t>(r)];
      REQUIRE_FALSE(s);
      CHECK(s.error().code == errc::comm_peer_failed);
      CHECK(s.error().message.find("rank 2 rejected its arguments") != std::string::npos);
    }
  }
  SUBCASE("fail(): the peers' next collective fails at once") {
    outcomes o(n);
    const auto st = run_thread_world(n, [&](thread_communicator& world) -> status {
      auto x = over(world);
      std::vector<float> buf(4, 1.0f);
      o.put(world.rank(), world.rank() == 1 ? x.fail("an expert threw")
                                            : x.all_reduce<float>(buf, reduce_op::sum));
      CHECK(x.broken());
      return {};
    });
    for (const auto& s : st) CHECK(s.has_value());
    for (const auto& s : o.by_rank) {
      REQUIRE_FALSE(s);
      CHECK(s.error().code == errc::comm_peer_failed);
    }
    CHECK(o.by_rank[1].error().message.find("an expert threw") != std::string::npos);
    CHECK(o.by_rank[0].error().message.find("rank 1 failed") != std::string::npos);
  }
}

TEST_CASE("fault: a transport that fails breaks the communicator; its peers time out, no hang") {
  constexpr int n = 3;
  outcomes o(n);
  std::vector<int> later(n, -1);
  const auto st = run_thread_world(n,
                                   [&](thread_communicator& world) -> status {
                                     const int me = world.rank();
                                     // Rank 1's transport fails on its first data phase (call 1:
                                     // after the headers).
                                     auto x = over(world, me == 1 ? 1 : -1);
                                     std::vector<float> buf(6, 1.0f);
                                     o.put(me, x.all_reduce<float>(buf, reduce_op::sum));
                                     CHECK(x.broken());
                                     auto s = x.barrier();
                                     later[static_cast<std::size_t>(me)] =
                                         s ? 0 : static_cast<int>(s.error().code);
                                     return {};
                                   },
                                   {.timeout = std::chrono::milliseconds(300)});
  for (const auto& s : st) CHECK(s.has_value());
  REQUIRE_FALSE(o.by_rank[1]);
  CHECK(o.by_rank[1].error().code == errc::comm_peer_failed);  // the transport's own report
  for (int r : {0, 2}) {
    const auto& s = o.by_rank[static_cast<std::size_t>(r)];
    REQUIRE_FALSE(s);  // the peers' data phase: rank 1 never joined it
    CHECK((s.error().code == errc::comm_timeout || s.error().code == errc::comm_peer_failed));
  }
  for (int c : later) CHECK(c == static_cast<int>(errc::comm_broken));
}
