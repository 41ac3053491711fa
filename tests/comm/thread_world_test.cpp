// The thread world: every collective against the direct references of collective_reference.hpp
// (random counts with zeros, empty ranks, one rank, prime world sizes, up to 16 ranks), bitwise
// determinism, split and group communicators over a fold, and the faults (a rank that throws,
// returns early, never arrives, disagrees on counts, calls another collective, rejects its
// arguments): each must fail every rank within the timeout, never hang.
#include <moefold/comm/thread_world.hpp>
#include <moefold/mesh/fold.hpp>
#include <moefold/mesh/groups.hpp>

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "collective_reference.hpp"

using namespace moefold;
using namespace moefold::test;
using namespace std::chrono_literals;

static_assert(communicator<thread_communicator>);
static_assert(splittable_communicator<thread_communicator>);
static_assert(!std::is_copy_constructible_v<thread_communicator>);

namespace {

const int world_sizes[] = {1, 2, 3, 4, 5, 7, 8, 11, 13, 16};

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

void require_all_ok(const std::vector<status>& st) {
  for (std::size_t r = 0; r < st.size(); ++r) {
    CAPTURE(r);
    if (!st[r]) CAPTURE(st[r].error().message);
    CHECK(st[r].has_value());
  }
}

// A check inside a rank thread: doctest's assertions are not thread-safe, so ranks record what
// they found and the test checks it afterwards on the main thread.
struct per_rank {
  std::vector<int> ok;
  explicit per_rank(int n) : ok(static_cast<std::size_t>(n), 0) {}
  void set(int r, bool v) { ok[static_cast<std::size_t>(r)] = v ? 1 : 0; }
  void check() const {
    for (std::size_t r = 0; r < ok.size(); ++r) {
      CAPTURE(r);
      CHECK(ok[r] == 1);
    }
  }
};

}  // namespace

TEST_CASE_TEMPLATE("all_to_all_v equals the reference", T, float, double, int, std::int64_t,
                   bfloat16, float16) {
  std::mt19937 g(11);
  for (int n : world_sizes) {
    CAPTURE(n);
    for (int trial = 0; trial < 3; ++trial) {
      const auto C = random_matrix(g, n, 6);
      per_rank res(n);
      auto st = run_thread_world(n, [&](thread_communicator& c) -> status {
        const int me = c.rank();
        const auto send = a2a_send<T>(C, me);
        const auto want = a2a_want<T>(C, me);
        std::vector<T> recv(want.size() + 2, value_of<T>(99, 99, 0));  // 2 spare: untouched
        const auto sc = row(C, me), rc = column(C, me);
        if (auto ok = c.all_to_all_v<T>(send, sc, recv, rc); !ok) return ok;
        const std::vector<T> got(recv.begin(), recv.begin() + static_cast<long>(want.size()));
        res.set(me, same_bits(got, want) && same_bits(std::vector<T>(recv.end() - 2, recv.end()),
                                                      std::vector<T>(2, value_of<T>(99, 99, 0))));
        return {};
      });
      require_all_ok(st);
      res.check();
    }
  }
}

TEST_CASE_TEMPLATE("all_gather_v and all_gather equal the reference", T, float, int, std::int64_t,
                   bfloat16) {
  std::mt19937 g(12);
  for (int n : world_sizes) {
    CAPTURE(n);
    const auto counts = random_counts(g, n, 5);
    per_rank res(n);
    auto st = run_thread_world(n, [&](thread_communicator& c) -> status {
      const int me = c.rank();
      const auto send = agv_send<T>(counts, me);
      const auto want = agv_want<T>(counts);
      std::vector<T> recv(want.size());
      if (auto ok = c.all_gather_v<T>(send, recv, counts); !ok) return ok;
      bool good = same_bits(recv, want);
      // all_gather: 3 elements each.
      std::vector<T> mine{value_of<T>(me, 1, 0), value_of<T>(me, 1, 1), value_of<T>(me, 1, 2)};
      std::vector<T> all(static_cast<std::size_t>(3 * n));
      if (auto ok = c.all_gather<T>(mine, all); !ok) return ok;
      std::vector<T> want_all;
      for (int i = 0; i < n; ++i)
        for (int k = 0; k < 3; ++k) want_all.push_back(value_of<T>(i, 1, k));
      res.set(me, good && same_bits(all, want_all));
      return {};
    });
    require_all_ok(st);
    res.check();
  }
}

TEST_CASE_TEMPLATE("reduce_scatter_v equals the reference (rank order, fp32 for 16-bit)", T, float,
                   double, int, std::int64_t, bfloat16, float16) {
  std::mt19937 g(13);
  for (int n : world_sizes) {
    CAPTURE(n);
    for (bool max : {false, true}) {
      const auto counts = random_counts(g, n, 7);
      per_rank res(n);
      auto st = run_thread_world(n, [&](thread_communicator& c) -> status {
        const int me = c.rank();
        const auto send = rsv_send<T>(counts, me);
        const auto want = rsv_want<T>(counts, me, max);
        std::vector<T> recv(want.size());
        if (auto ok =
                c.reduce_scatter_v<T>(send, counts, recv, max ? reduce_op::max : reduce_op::sum);
            !ok)
          return ok;
        res.set(me, same_bits(recv, want));
        return {};
      });
      require_all_ok(st);
      res.check();
    }
  }
}

TEST_CASE("bf16 sums accumulate in fp32: 256 + 1 + ... + 1 keeps every 1") {
  // In bf16 arithmetic 256 + 1 rounds back to 256; accumulated in fp32 the 15 ones survive and
  // 271 rounds to 272 once, at the end.
  per_rank res(16);
  auto st = run_thread_world(16, [&](thread_communicator& c) -> status {
    std::vector<bfloat16> v{bfloat16(c.rank() == 0 ? 256.f : 1.f)};
    std::vector<bfloat16> out(1);
    const std::vector<int> counts{1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    std::vector<bfloat16> send(v);
    if (c.rank() != 0) send = v;
    if (auto ok = c.reduce_scatter_v<bfloat16>(send, counts, out, reduce_op::sum); !ok) return ok;
    std::vector<bfloat16> ar = v;
    if (auto ok = c.all_reduce<bfloat16>(ar, reduce_op::sum); !ok) return ok;
    res.set(c.rank(), static_cast<float>(ar[0]) == 272.f &&
                          (c.rank() != 0 || static_cast<float>(out[0]) == 272.f));
    return {};
  });
  require_all_ok(st);
  res.check();
}

TEST_CASE_TEMPLATE("all_reduce and broadcast equal the reference", T, float, double, int,
                   std::int64_t, bfloat16) {
  for (int n : world_sizes) {
    CAPTURE(n);
    per_rank res(n);
    auto st = run_thread_world(n, [&](thread_communicator& c) -> status {
      const int me = c.rank();
      bool good = true;
      for (bool max : {false, true}) {
        std::vector<T> v;
        for (int k = 0; k < 5; ++k) v.push_back(value_of<T>(me, 2, k));
        if (auto ok = c.all_reduce<T>(v, max ? reduce_op::max : reduce_op::sum); !ok) return ok;
        const std::vector<int> counts(static_cast<std::size_t>(n), 5);
        // The reference of reduce_scatter_v for chunk "2" is the same sum.
        std::vector<T> want;
        for (int k = 0; k < 5; ++k) {
          double acc = as_double(value_of<T>(0, 2, k));
          for (int i = 1; i < n; ++i) {
            const double x = as_double(value_of<T>(i, 2, k));
            acc = max ? (acc < x ? x : acc) : acc + x;
          }
          if constexpr (std::is_same_v<T, bfloat16>)
            want.push_back(T(static_cast<float>(acc)));
          else
            want.push_back(static_cast<T>(acc));
        }
        good = good && same_bits(v, want);
      }
      for (int root = 0; root < n; root += 3) {
        std::vector<T> b(4);
        for (int k = 0; k < 4; ++k) b[static_cast<std::size_t>(k)] = value_of<T>(me, 5, k);
        if (auto ok = c.broadcast<T>(b, root); !ok) return ok;
        std::vector<T> want;
        for (int k = 0; k < 4; ++k) want.push_back(value_of<T>(root, 5, k));
        good = good && same_bits(b, want);
      }
      if (auto ok = c.barrier(); !ok) return ok;
      res.set(me, good);
      return {};
    });
    require_all_ok(st);
    res.check();
  }
}

TEST_CASE("results are bitwise deterministic and follow rank order") {
  // Random floats whose sum depends on the order of additions: two runs give the same bits, and
  // they equal a left-to-right sum in rank order.
  const int n = 13, len = 64;
  std::mt19937 g(5);
  std::uniform_real_distribution<float> d(-1e3f, 1e3f);
  std::vector<std::vector<float>> in(n, std::vector<float>(len));
  for (auto& v : in)
    for (auto& x : v) x = d(g) * (g() % 2 ? 1e-3f : 1.f);
  std::vector<float> want(len);
  for (int k = 0; k < len; ++k) {
    float acc = in[0][static_cast<std::size_t>(k)];
    for (int i = 1; i < n; ++i) acc += in[static_cast<std::size_t>(i)][static_cast<std::size_t>(k)];
    want[static_cast<std::size_t>(k)] = acc;
  }
  for (int run = 0; run < 3; ++run) {
    per_rank res(n);
    auto st = run_thread_world(n, [&](thread_communicator& c) -> status {
      auto v = in[static_cast<std::size_t>(c.rank())];
      if (auto ok = c.all_reduce<float>(v, reduce_op::sum); !ok) return ok;
      res.set(c.rank(), same_bits(v, want));
      return {};
    });
    require_all_ok(st);
    res.check();
  }
}

TEST_CASE("split: ranks of a color in (key, rank) order; independent sub-communicators") {
  const int n = 12;
  per_rank res(n);
  auto st = run_thread_world(n, [&](thread_communicator& c) -> status {
    const int me = c.rank();
    // Colors by me % 3; key reverses the order.
    auto sub = c.split(me % 3, -me);
    if (!sub) return unexpected<error>(sub.error());
    bool good = sub->size() == 4 && sub->rank() == (n - 1 - me) / 3;
    std::vector<int> ranks(4);
    const std::vector<int> mine{me};
    if (auto ok = sub->all_gather<int>(mine, ranks); !ok) return ok;
    for (int k = 0; k < 4; ++k)
      good = good && ranks[static_cast<std::size_t>(k)] ==
                         n - 1 - (me % 3 == 2 ? 0 : 0) - (2 - me % 3) - 3 * k;
    // The parent still works after the split, interleaved with the child.
    std::vector<int> one{1};
    if (auto ok = c.all_reduce<int>(one, reduce_op::sum); !ok) return ok;
    good = good && one[0] == n;
    // No color: takes part, gets an error value.
    auto none = c.split(me == 0 ? split_no_color : 0, me);
    if (me == 0)
      good = good && !none && none.error().code == errc::rank_out_of_range;
    else
      good = good && none && none->size() == n - 1 && none->rank() == me - 1;
    res.set(me, good);
    return {};
  });
  require_all_ok(st);
  res.check();
}

TEST_CASE("group_communicator: each rank's group over a fold, in Megatron's order") {
  const auto fold = make_folded({.world = 16, .tp = 2, .pp = 2, .ep = 4, .etp = 1}).value();
  const megatron_groups groups(fold);
  for (int i = 0; i < groups.num_kinds(); ++i) {
    const named_kind kind = groups.kind_at(i);
    CAPTURE(to_string(kind));
    const auto list = groups(kind);
    per_rank res(16);
    auto st = run_thread_world(16, [&](thread_communicator& world) -> status {
      const int me = world.rank();
      auto gc = group_communicator(world, groups, kind);
      const auto at = list.find(me);
      if (at.group < 0) {
        res.set(me, !gc && gc.error().code == errc::rank_out_of_range);
        return {};
      }
      if (!gc) return unexpected<error>(gc.error());
      // Gathering the world ranks over the group communicator gives the group itself.
      std::vector<int> members(static_cast<std::size_t>(gc->size()));
      const std::vector<int> mine{me};
      if (auto ok = gc->all_gather<int>(mine, members); !ok) return ok;
      res.set(me, gc->rank() == at.position && members == list[at.group].to_vector());
      return {};
    });
    require_all_ok(st);
    res.check();
  }
}

TEST_CASE("group_communicator with a rank offset: the fold's world, or a larger job") {
  const auto fold = make_folded({.world = 8, .tp = 2, .ep = 4, .etp = 1}).value();
  const auto groups = megatron_groups::make(fold, {.rank_offset = 4}).value();
  const named_kind ep{group_kind::ep};
  const auto list = groups(ep);  // ranks 4 .. 11
  for (int world_size : {8, 12}) {
    CAPTURE(world_size);
    per_rank res(world_size);
    auto st = run_thread_world(world_size, [&](thread_communicator& world) -> status {
      const int me = world.rank();
      // The fold's own world numbers its ranks from 0: mesh rank = me + 4. A job of 12 ranks
      // uses the mesh ranks themselves; ranks 0..3 are outside the fold.
      const int mesh_rank = world_size == 8 ? me + 4 : me;
      auto gc = group_communicator(world, groups, ep);
      const auto at = list.find(mesh_rank);
      if (at.group < 0) {
        res.set(me, !gc && gc.error().code == errc::rank_out_of_range);
        return {};
      }
      if (!gc) return unexpected<error>(gc.error());
      std::vector<int> members(static_cast<std::size_t>(gc->size()));
      const std::vector<int> mine{mesh_rank};
      if (auto ok = gc->all_gather<int>(mine, members); !ok) return ok;
      res.set(me, gc->rank() == at.position && members == list[at.group].to_vector());
      return {};
    });
    require_all_ok(st);
    res.check();
  }
  // A world that fits neither reading is an error on every rank, without a collective.
  auto st = run_thread_world(10, [&](thread_communicator& world) -> status {
    auto gc = group_communicator(world, groups, ep);
    if (!gc && gc.error().code == errc::shape_mismatch) return {};
    return make_error(errc::invalid_argument, "expected shape_mismatch");
  });
  require_all_ok(st);
}

// ---------------------------------------------------------------------------------------------
// Faults. Every rank must get an error, within the timeout, naming what went wrong.

namespace {

constexpr auto fault_timeout = 300ms;

struct outcome {
  std::vector<status> st;
  std::vector<double> ms;  // how long each rank spent in the failing call
};

template <class F>
outcome run_fault(int n, F&& body) {
  outcome o;
  o.ms.assign(static_cast<std::size_t>(n), -1);
  o.st = run_thread_world(
      n,
      [&](thread_communicator& c) -> status {
        const auto t0 = std::chrono::steady_clock::now();
        auto s = body(c);
        o.ms[static_cast<std::size_t>(c.rank())] =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                .count();
        return s;
      },
      {.timeout = fault_timeout});
  return o;
}

status a2a_ones(thread_communicator& c, int extra_from_rank1 = 0) {
  const int n = c.size();
  std::vector<int> sc(static_cast<std::size_t>(n), 1), rc(sc);
  if (n > 1) rc[1] += extra_from_rank1;
  std::vector<float> send(static_cast<std::size_t>(n), 1.f), recv(static_cast<std::size_t>(n + 1));
  return c.all_to_all_v<float>(send, sc, recv, rc);
}

}  // namespace

TEST_CASE("fault: a rank that throws fails its peers at once") {
  auto o = run_fault(8, [](thread_communicator& c) -> status {
    if (auto ok = a2a_ones(c); !ok) return ok;  // one good collective first
    if (c.rank() == 5) throw std::runtime_error("expert kernel exploded");
    return a2a_ones(c);
  });
  for (int r = 0; r < 8; ++r) {
    CAPTURE(r);
    const auto& s = o.st[static_cast<std::size_t>(r)];
    REQUIRE(!s);
    CHECK(s.error().code == errc::comm_peer_failed);
    CHECK(contains(s.error().message, "rank 5"));
    CHECK(contains(s.error().message, "expert kernel exploded"));
    if (r != 5) CHECK(o.ms[static_cast<std::size_t>(r)] < 250.0);
  }
}

TEST_CASE("fault: a rank that returns early fails its peers at once") {
  auto o = run_fault(4, [](thread_communicator& c) -> status {
    if (c.rank() == 2) return {};  // forgets the collective
    return a2a_ones(c);
  });
  CHECK(o.st[2].has_value());
  for (int r : {0, 1, 3}) {
    CAPTURE(r);
    const auto& s = o.st[static_cast<std::size_t>(r)];
    REQUIRE(!s);
    CHECK(s.error().code == errc::comm_peer_failed);
    CHECK(contains(s.error().message, "rank 2 (world rank 2) returned from its function"));
    CHECK(contains(s.error().message, "all_to_all_v (call #0)"));
    CHECK(o.ms[static_cast<std::size_t>(r)] < 250.0);
  }
}

TEST_CASE("fault: a rank that never arrives: the others time out, it finds the world broken") {
  auto o = run_fault(5, [](thread_communicator& c) -> status {
    if (c.rank() == 3) {
      std::this_thread::sleep_for(fault_timeout * 2);
      return c.barrier();
    }
    return a2a_ones(c);
  });
  for (int r : {0, 1, 2, 4}) {
    CAPTURE(r);
    const auto& s = o.st[static_cast<std::size_t>(r)];
    REQUIRE(!s);
    CHECK(s.error().code == errc::comm_timeout);
    CHECK(contains(s.error().message,
                   "rank(s) 3 did not arrive at all_to_all_v (call #0) within 300 ms"));
    const double ms = o.ms[static_cast<std::size_t>(r)];
    CHECK(ms >= 290.0);
    CHECK(ms < 2000.0);
  }
  REQUIRE(!o.st[3]);
  CHECK(o.st[3].error().code == errc::comm_broken);
  CHECK(contains(o.st[3].error().message, "did not arrive"));
}

TEST_CASE("fault: counts that disagree between sender and receiver fail every rank alike") {
  auto o = run_fault(6, [](thread_communicator& c) -> status {
    return a2a_ones(c, c.rank() == 4 ? 1 : 0);  // rank 4 expects 2 elements from rank 1
  });
  for (int r = 0; r < 6; ++r) {
    CAPTURE(r);
    const auto& s = o.st[static_cast<std::size_t>(r)];
    REQUIRE(!s);
    CHECK(s.error().code == errc::comm_mismatch);
    CHECK(s.error().message == o.st[0].error().message);
    CHECK(o.ms[static_cast<std::size_t>(r)] < 250.0);
  }
  CHECK(contains(o.st[0].error().message,
                 "count mismatch in all_to_all_v (call #0): rank 1 sends 1 elements to rank 4, "
                 "which expects 2"));
}

TEST_CASE("fault: a rank calling another collective fails every rank; later calls are broken") {
  auto o = run_fault(7, [](thread_communicator& c) -> status {
    if (auto ok = c.barrier(); !ok) return ok;
    status s;
    if (c.rank() == 6) {
      std::vector<float> v(7);
      std::vector<float> mine{1.f};
      s = c.all_gather<float>(mine, v);
    } else {
      s = a2a_ones(c);
    }
    if (s) return s;
    auto again = c.barrier();  // the communicator is broken now
    if (again || again.error().code != errc::comm_broken)
      return make_error(errc::invalid_argument, "not broken");
    return s;
  });
  for (int r = 0; r < 7; ++r) {
    CAPTURE(r);
    const auto& s = o.st[static_cast<std::size_t>(r)];
    REQUIRE(!s);
    CHECK(s.error().code == errc::comm_mismatch);
    CHECK(contains(s.error().message, "collective mismatch"));
    CHECK(contains(s.error().message, "called all_to_all_v (call #1)"));
    CHECK(contains(s.error().message, "rank 6 called all_gather (call #1)"));
  }
}

TEST_CASE("fault: mismatched element types, and a rank that rejects its own arguments") {
  auto o = run_fault(3, [](thread_communicator& c) -> status {
    if (c.rank() == 1) {
      std::vector<double> v{1.0};
      return c.all_reduce<double>(v, reduce_op::sum);
    }
    std::vector<float> v{1.f};
    return c.all_reduce<float>(v, reduce_op::sum);
  });
  for (const auto& s : o.st) {
    REQUIRE(!s);
    CHECK(s.error().code == errc::comm_mismatch);
    CHECK(contains(s.error().message, "element type mismatch"));
  }
  auto p = run_fault(4, [](thread_communicator& c) -> status {
    std::vector<int> counts(static_cast<std::size_t>(c.rank() == 2 ? 3 : 4), 0);  // wrong on 2
    std::vector<float> send, recv;
    return c.all_to_all_v<float>(send, counts, recv, counts);
  });
  REQUIRE(!p.st[2]);
  CHECK(p.st[2].error().code == errc::shape_mismatch);
  CHECK(contains(p.st[2].error().message, "send_counts has 3 entries"));
  for (int r : {0, 1, 3}) {
    CAPTURE(r);
    REQUIRE(!p.st[static_cast<std::size_t>(r)]);
    CHECK(p.st[static_cast<std::size_t>(r)].error().code == errc::comm_peer_failed);
    CHECK(contains(p.st[static_cast<std::size_t>(r)].error().message,
                   "rank 2 rejected its arguments to all_to_all_v (call #0), so the collective was "
                   "not run: all_to_all_v: send_counts has 3 entries"));
    CHECK(p.ms[static_cast<std::size_t>(r)] < 250.0);
  }
}

TEST_CASE("fault: a split with an invalid color fails that rank and its peers at once") {
  auto o = run_fault(3, [](thread_communicator& c) -> status {
    auto sub = c.split(c.rank() == 1 ? -5 : 0, 0);
    if (sub) return {};
    return unexpected<error>(sub.error());
  });
  REQUIRE(!o.st[1]);
  CHECK(o.st[1].error().code == errc::invalid_argument);
  CHECK(contains(o.st[1].error().message, "color must be >= 0 or split_no_color (got -5)"));
  for (int r : {0, 2}) {
    CAPTURE(r);
    REQUIRE(!o.st[static_cast<std::size_t>(r)]);
    CHECK(o.st[static_cast<std::size_t>(r)].error().code == errc::comm_peer_failed);
    CHECK(contains(o.st[static_cast<std::size_t>(r)].error().message,
                   "rank 1 rejected its arguments to split"));
    CHECK(o.ms[static_cast<std::size_t>(r)] < 250.0);
  }
}

TEST_CASE("fault inside a group communicator: its members fail, the world survives") {
  const int n = 8;
  per_rank res(n);
  auto st = run_thread_world(n,
                             [&](thread_communicator& c) -> status {
                               auto sub = c.split(c.rank() / 4, c.rank());
                               if (!sub) return unexpected<error>(sub.error());
                               status s;
                               if (c.rank() == 5) {
                                 std::vector<float> v{1.f};
                                 s = sub->broadcast<float>(v, 0);
                               } else {
                                 s = sub->barrier();
                               }
                               const bool want_fail = c.rank() >= 4;
                               bool good = want_fail ? (!s && s.error().code == errc::comm_mismatch)
                                                     : s.has_value();
                               std::vector<int> one{1};
                               if (auto ok = c.all_reduce<int>(one, reduce_op::sum); !ok) return ok;
                               res.set(c.rank(), good && one[0] == n);
                               return {};
                             },
                             {.timeout = fault_timeout});
  require_all_ok(st);
  res.check();
}

TEST_CASE("run_thread_world rejects an empty world") {
  auto st = run_thread_world(0, [](thread_communicator&) {});
  REQUIRE(st.size() == 1);
  REQUIRE(!st[0]);
  CHECK(st[0].error().code == errc::invalid_size);
}

TEST_CASE("stress: hundreds of collectives interleaved on a world and its splits stay exact") {
  // Races between consecutive collectives (a fast rank posting call k+1 while a slow one still
  // reads call k) would show as wrong data here; sizes and communicators change every call.
  const int n = 8, calls = 300;
  per_rank res(n);
  auto st = run_thread_world(n, [&](thread_communicator& world) -> status {
    const int me = world.rank();
    auto half = world.split(me % 2, me);
    if (!half) return unexpected<error>(half.error());
    bool good = true;
    for (int k = 0; k < calls; ++k) {
      std::mt19937 g(static_cast<unsigned>(k));  // the same draws on every rank
      thread_communicator& c = k % 3 == 1 ? *half : world;
      const int cm = c.rank();
      switch (k % 4) {
        case 0: {
          const auto C = random_matrix(g, c.size(), 9);
          const auto send = a2a_send<int>(C, cm);
          std::vector<int> recv(a2a_want<int>(C, cm).size());
          if (auto ok = c.all_to_all_v<int>(send, row(C, cm), recv, column(C, cm)); !ok) return ok;
          good = good && recv == a2a_want<int>(C, cm);
          break;
        }
        case 1: {
          const auto counts = random_counts(g, c.size(), 9);
          std::vector<float> recv(agv_want<float>(counts).size());
          if (auto ok = c.all_gather_v<float>(agv_send<float>(counts, cm), recv, counts); !ok)
            return ok;
          good = good && same_bits(recv, agv_want<float>(counts));
          break;
        }
        case 2: {
          const auto counts = random_counts(g, c.size(), 9);
          std::vector<double> recv(rsv_want<double>(counts, cm, false).size());
          if (auto ok = c.reduce_scatter_v<double>(rsv_send<double>(counts, cm), counts, recv,
                                                   reduce_op::sum);
              !ok)
            return ok;
          good = good && same_bits(recv, rsv_want<double>(counts, cm, false));
          break;
        }
        default: {
          std::vector<std::int64_t> v{cm, k};
          if (auto ok = c.all_reduce<std::int64_t>(v, reduce_op::max); !ok) return ok;
          good = good && v[0] == c.size() - 1 && v[1] == k;
        }
      }
    }
    res.set(me, good);
    return {};
  });
  require_all_ok(st);
  res.check();
}
