// The collective schedule on its own: offsets and counts against sums written out here, the step
// order, every validation rule, the header check, and whole collectives simulated from the
// schedules of all ranks against a direct reference (exhaustively for small worlds).
#include <moefold/comm/schedule.hpp>

#include <doctest/doctest.h>

#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <vector>

using namespace moefold;

namespace {

using counts_t = std::vector<int>;
using sb = schedule_builder;

std::vector<int> random_counts(std::mt19937& g, int n, int max) {
  std::uniform_int_distribution<int> d(0, max);
  std::vector<int> c(static_cast<std::size_t>(n));
  for (auto& x : c) x = d(g) % 3 == 0 ? 0 : d(g);  // plenty of zeros
  return c;
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// Every peer appears exactly once as a send peer and once as a receive peer; step 0 is the
// rank itself; step i sends to rank + i and receives from rank - i.
void check_steps(const collective_schedule& s) {
  std::set<int> to, from;
  for (int i = 0; i < s.num_steps(); ++i) {
    const auto st = s.step(i);
    CHECK(st.send_peer == (s.rank() + i) % s.size());
    CHECK((st.recv_peer + i) % s.size() == s.rank());
    CHECK(st.send_count == s.send_count(st.send_peer));
    CHECK(st.send_offset == s.send_offset(st.send_peer));
    CHECK(st.recv_count == s.recv_count(st.recv_peer));
    CHECK(st.recv_offset == s.recv_offset(st.recv_peer));
    to.insert(st.send_peer);
    from.insert(st.recv_peer);
  }
  CHECK(s.step(0).send_peer == s.rank());
  CHECK(s.step(0).recv_peer == s.rank());
  CHECK(static_cast<int>(to.size()) == s.size());
  CHECK(static_cast<int>(from.size()) == s.size());
}

}  // namespace

TEST_CASE("all_to_all_v: offsets are the running sums of the counts") {
  std::mt19937 g(1);
  for (int n : {1, 2, 3, 5, 7, 8, 13, 16}) {
    for (int trial = 0; trial < 20; ++trial) {
      const int rank = static_cast<int>(g() % static_cast<unsigned>(n));
      const auto sc = random_counts(g, n, 9), rc = random_counts(g, n, 9);
      long long st = 0, rt = 0;
      for (int x : sc) st += x;
      for (int x : rc) rt += x;
      auto s = sb::all_to_all_v(rank, n, sc, rc, static_cast<std::size_t>(st),
                                static_cast<std::size_t>(rt));
      REQUIRE(s.has_value());
      CHECK(s->op() == collective::all_to_all_v);
      long long so = 0, ro = 0;
      for (int p = 0; p < n; ++p) {
        CHECK(s->send_offset(p) == so);
        CHECK(s->recv_offset(p) == ro);
        CHECK(s->send_count(p) == sc[static_cast<std::size_t>(p)]);
        CHECK(s->recv_count(p) == rc[static_cast<std::size_t>(p)]);
        so += sc[static_cast<std::size_t>(p)];
        ro += rc[static_cast<std::size_t>(p)];
      }
      CHECK(s->send_extent() == st);
      CHECK(s->recv_extent() == rt);
      CHECK(s->result_count() == rt);
      check_steps(*s);
    }
  }
}

TEST_CASE("all_gather_v, reduce_scatter_v, all_gather, broadcast: offsets and counts") {
  std::mt19937 g(2);
  for (int n : {1, 2, 4, 7, 11}) {
    const int rank = n - 1;
    const auto c = random_counts(g, n, 6);
    long long total = 0;
    for (int x : c) total += x;
    const long long mine = c[static_cast<std::size_t>(rank)];

    auto agv = sb::all_gather_v(rank, n, c, static_cast<std::size_t>(mine),
                                static_cast<std::size_t>(total));
    REQUIRE(agv.has_value());
    auto rsv = sb::reduce_scatter_v(rank, n, c, static_cast<std::size_t>(total),
                                    static_cast<std::size_t>(mine));
    REQUIRE(rsv.has_value());
    long long off = 0;
    for (int p = 0; p < n; ++p) {
      const long long cp = c[static_cast<std::size_t>(p)];
      // all_gather_v: my block to everyone, block p from p at the running sum.
      CHECK(agv->send_count(p) == mine);
      CHECK(agv->send_offset(p) == 0);
      CHECK(agv->recv_count(p) == cp);
      CHECK(agv->recv_offset(p) == off);
      // reduce_scatter_v: chunk p to p at the running sum; my chunk from everyone, staged.
      CHECK(rsv->send_count(p) == cp);
      CHECK(rsv->send_offset(p) == off);
      CHECK(rsv->recv_count(p) == mine);
      CHECK(rsv->recv_offset(p) == p * mine);
      off += cp;
    }
    CHECK(agv->result_count() == total);
    CHECK(rsv->result_count() == mine);
    CHECK(rsv->recv_extent() == n * mine);
    check_steps(*agv);
    check_steps(*rsv);

    auto ag = sb::all_gather(rank, n, 5, static_cast<std::size_t>(5 * n));
    REQUIRE(ag.has_value());
    for (int p = 0; p < n; ++p) {
      CHECK(ag->send_count(p) == 5);
      CHECK(ag->recv_offset(p) == 5 * p);
    }
    CHECK(ag->result_count() == 5 * n);

    for (int root = 0; root < n; ++root) {
      auto b = sb::broadcast(rank, n, 4, root);
      REQUIRE(b.has_value());
      CHECK(b->root() == root);
      for (int p = 0; p < n; ++p) {
        CHECK(b->send_count(p) == (rank == root ? 4 : 0));
        CHECK(b->recv_count(p) == (p == root ? 4 : 0));
      }
    }
    auto ar = sb::all_reduce(rank, n, 3);
    REQUIRE(ar.has_value());
    CHECK(ar->result_count() == 3);
    auto bar = sb::barrier(rank, n);
    REQUIRE(bar.has_value());
    for (int p = 0; p < n; ++p) CHECK(bar->send_count(p) + bar->recv_count(p) == 0);
  }
}

TEST_CASE("validation: every rule gives its own kind and names the values") {
  const counts_t c3{1, 2, 3};
  SUBCASE("communicator size and rank") {
    auto a = sb::all_to_all_v(0, 0, {}, {}, 0, 0);
    REQUIRE(!a);
    CHECK(a.error().code == errc::invalid_size);
    auto b = sb::all_to_all_v(3, 3, c3, c3, 6, 6);
    REQUIRE(!b);
    CHECK(b.error().code == errc::rank_out_of_range);
    CHECK(contains(b.error().message, "rank 3"));
    CHECK(!sb::all_gather_v(-1, 3, c3, 1, 6));
    CHECK(!sb::barrier(5, 2));
  }
  SUBCASE("one count per rank") {
    auto a = sb::all_to_all_v(0, 4, c3, counts_t{1, 1, 1, 1}, 6, 4);
    REQUIRE(!a);
    CHECK(a.error().code == errc::shape_mismatch);
    CHECK(contains(a.error().message, "send_counts has 3 entries"));
    auto b = sb::all_to_all_v(0, 3, c3, counts_t{1, 1}, 6, 4);
    REQUIRE(!b);
    CHECK(contains(b.error().message, "recv_counts has 2 entries"));
    CHECK(sb::reduce_scatter_v(0, 2, c3, 6, 6).error().code == errc::shape_mismatch);
  }
  SUBCASE("negative counts") {
    auto a = sb::all_to_all_v(1, 3, counts_t{1, -2, 3}, c3, 10, 10);
    REQUIRE(!a);
    CHECK(a.error().code == errc::invalid_size);
    CHECK(contains(a.error().message, "send_counts[1] = -2"));
    CHECK(sb::all_gather_v(0, 3, counts_t{0, 0, -1}, 0, 0).error().code == errc::invalid_size);
  }
  SUBCASE("buffers too small") {
    auto a = sb::all_to_all_v(0, 3, c3, c3, 5, 6);
    REQUIRE(!a);
    CHECK(a.error().code == errc::shape_mismatch);
    CHECK(contains(a.error().message, "send buffer holds 5 elements but the counts need 6"));
    auto b = sb::all_to_all_v(0, 3, c3, c3, 6, 5);
    REQUIRE(!b);
    CHECK(contains(b.error().message, "receive buffer holds 5"));
    // all_gather_v sends counts[rank] elements; reduce_scatter_v writes counts[rank].
    CHECK(sb::all_gather_v(2, 3, c3, 2, 6).error().code == errc::shape_mismatch);
    CHECK(sb::all_gather_v(2, 3, c3, 3, 5).error().code == errc::shape_mismatch);
    CHECK(sb::reduce_scatter_v(2, 3, c3, 6, 2).error().code == errc::shape_mismatch);
    CHECK(sb::reduce_scatter_v(2, 3, c3, 5, 3).error().code == errc::shape_mismatch);
    CHECK(sb::all_gather(0, 3, 2, 5).error().code == errc::shape_mismatch);
    // Larger buffers are fine.
    CHECK(sb::all_to_all_v(0, 3, c3, c3, 60, 60).has_value());
  }
  SUBCASE("broadcast root") {
    auto a = sb::broadcast(0, 3, 1, 3);
    REQUIRE(!a);
    CHECK(a.error().code == errc::rank_out_of_range);
    CHECK(contains(a.error().message, "root 3"));
    CHECK(!sb::broadcast(0, 3, 1, -1));
  }
}

namespace {

// A whole all_to_all_v simulated from every rank's schedule: data sent by rank i to rank j is
// 1000 * i + 10 * j + k (k = 0 .. C[i][j]-1).
void simulate_a2av(const std::vector<std::vector<int>>& C) {
  const int n = static_cast<int>(C.size());
  std::vector<std::vector<int>> send(static_cast<std::size_t>(n)), recv(send.size()),
      want(send.size());
  std::vector<collective_schedule> sched;
  for (int i = 0; i < n; ++i) {
    counts_t sc, rc;
    for (int j = 0; j < n; ++j) {
      sc.push_back(C[static_cast<std::size_t>(i)][static_cast<std::size_t>(j)]);
      rc.push_back(C[static_cast<std::size_t>(j)][static_cast<std::size_t>(i)]);
      for (int k = 0; k < sc.back(); ++k)
        send[static_cast<std::size_t>(i)].push_back(1000 * i + 10 * j + k);
    }
    // The reference: what rank i receives, from rank 0 first.
    for (int j = 0; j < n; ++j)
      for (int k = 0; k < C[static_cast<std::size_t>(j)][static_cast<std::size_t>(i)]; ++k)
        want[static_cast<std::size_t>(i)].push_back(1000 * j + 10 * i + k);
    recv[static_cast<std::size_t>(i)].assign(want[static_cast<std::size_t>(i)].size(), -1);
    auto s = sb::all_to_all_v(i, n, sc, rc, send[static_cast<std::size_t>(i)].size(),
                              recv[static_cast<std::size_t>(i)].size());
    REQUIRE(s.has_value());
    sched.push_back(*s);
  }
  for (int i = 0; i < n; ++i)
    for (int st = 0; st < n; ++st) {
      const auto step = sched[static_cast<std::size_t>(i)].step(st);
      const auto& peer = sched[static_cast<std::size_t>(step.recv_peer)];
      for (std::int64_t k = 0; k < step.recv_count; ++k)
        recv[static_cast<std::size_t>(i)][static_cast<std::size_t>(step.recv_offset + k)] =
            send[static_cast<std::size_t>(step.recv_peer)]
                [static_cast<std::size_t>(peer.send_offset(i) + k)];
    }
  CHECK(recv == want);
}

}  // namespace

TEST_CASE("all_to_all_v simulated from the schedules: every count matrix of small worlds") {
  for (int n = 1; n <= 3; ++n) {
    const int cells = n * n;
    int combos = 1;
    for (int c = 0; c < cells; ++c) combos *= 3;
    for (int code = 0; code < combos; ++code) {
      std::vector<std::vector<int>> C(static_cast<std::size_t>(n),
                                      std::vector<int>(static_cast<std::size_t>(n)));
      int v = code;
      for (int c = 0; c < cells; ++c, v /= 3)
        C[static_cast<std::size_t>(c / n)][static_cast<std::size_t>(c % n)] = v % 3;
      simulate_a2av(C);
    }
  }
  std::mt19937 g(3);
  for (int n : {5, 7, 13, 16})
    for (int t = 0; t < 5; ++t) {
      std::vector<std::vector<int>> C;
      for (int i = 0; i < n; ++i) C.push_back(random_counts(g, n, 4));
      simulate_a2av(C);
    }
}

TEST_CASE("headers: matching headers pass; each disagreement is named") {
  const counts_t a_send{2, 3}, a_recv{4, 5};
  auto s0 = sb::all_to_all_v(0, 2, a_send, a_recv, 5, 9).value();
  // Rank 1 sends 4 to rank 0 and expects 3 from it: consistent with rank 0.
  auto s1 = sb::all_to_all_v(1, 2, counts_t{4, 1}, counts_t{3, 1}, 5, 4).value();
  const auto f = call_info_of<float>();
  const auto h01 = make_header(s0, 1, 7, f), h10 = make_header(s1, 0, 7, f);
  CHECK(h01.send_count == 3);
  CHECK(h01.recv_count == 5);
  CHECK(check_headers(make_header(s0, 1, 7, f), make_header(s1, 0, 7, f), 0, 1).has_value() ==
        false);  // rank 1 sends 4, rank 0 expects 5 from it

  auto s1ok = sb::all_to_all_v(1, 2, counts_t{5, 1}, counts_t{3, 1}, 6, 4).value();
  CHECK(check_headers(h01, make_header(s1ok, 0, 7, f), 0, 1).has_value());
  CHECK(check_headers(make_header(s1ok, 0, 7, f), h01, 1, 0).has_value());

  SUBCASE("counts") {
    auto e = check_headers(h01, h10, 0, 1);
    REQUIRE(!e);
    CHECK(e.error().code == errc::comm_mismatch);
    CHECK(contains(e.error().message, "rank 1 sends 4 elements to rank 0, which expects 5"));
    auto s1b = sb::all_to_all_v(1, 2, counts_t{5, 1}, counts_t{2, 1}, 6, 4).value();
    auto e2 = check_headers(h01, make_header(s1b, 0, 7, f), 0, 1);
    REQUIRE(!e2);
    CHECK(contains(e2.error().message, "rank 0 sends 3 elements to rank 1, which expects 2"));
  }
  SUBCASE("collective and call number") {
    auto ag = sb::all_gather(1, 2, 3, 6).value();
    auto e = check_headers(h01, make_header(ag, 0, 7, f), 0, 1);
    REQUIRE(!e);
    CHECK(e.error().code == errc::comm_mismatch);
    CHECK(contains(e.error().message, "rank 0 called all_to_all_v (call #7)"));
    CHECK(contains(e.error().message, "rank 1 called all_gather (call #7)"));
    auto e2 = check_headers(h01, make_header(s1ok, 0, 8, f), 0, 1);
    REQUIRE(!e2);
    CHECK(contains(e2.error().message, "call #8"));
  }
  SUBCASE("element type, reduction, root") {
    auto e = check_headers(h01, make_header(s1ok, 0, 7, call_info_of<double>()), 0, 1);
    REQUIRE(!e);
    CHECK(contains(e.error().message, "float32 (4 bytes)"));
    CHECK(contains(e.error().message, "float64 (8 bytes)"));
    auto r0 = sb::all_reduce(0, 2, 4).value(), r1 = sb::all_reduce(1, 2, 4).value();
    auto e2 = check_headers(make_header(r0, 1, 0, call_info_of<float>(0)),
                            make_header(r1, 0, 0, call_info_of<float>(1)), 0, 1);
    REQUIRE(!e2);
    CHECK(contains(e2.error().message, "reduces with sum"));
    CHECK(contains(e2.error().message, "with max"));
    auto b0 = sb::broadcast(0, 2, 4, 0).value(), b1 = sb::broadcast(1, 2, 4, 1).value();
    auto e3 = check_headers(make_header(b0, 1, 0, f), make_header(b1, 0, 0, f), 0, 1);
    REQUIRE(!e3);
    CHECK(contains(e3.error().message, "root mismatch"));
    auto b1ok = sb::broadcast(1, 2, 4, 0).value();
    CHECK(check_headers(make_header(b0, 1, 0, f), make_header(b1ok, 0, 0, f), 0, 1).has_value());
  }
  SUBCASE("a peer that rejected its arguments or failed") {
    auto e = check_headers(
        h01, make_failure_header(collective::all_to_all_v, 7, header_rejected_arguments), 0, 1);
    REQUIRE(!e);
    CHECK(e.error().code == errc::comm_peer_failed);
    CHECK(contains(e.error().message, "rank 1 rejected its arguments"));
    auto e2 =
        check_headers(h01, make_failure_header(collective::none, 7, header_rank_failed), 0, 1);
    REQUIRE(!e2);
    CHECK(e2.error().code == errc::comm_peer_failed);
  }
}

TEST_CASE("all_gather_v and reduce_scatter_v: pairwise checks catch count vectors that differ") {
  // Rank 0 believes counts {1, 2}, rank 1 believes {1, 3}: the pair (0, 1) disagrees.
  auto a = sb::all_gather_v(0, 2, counts_t{1, 2}, 1, 3).value();
  auto b = sb::all_gather_v(1, 2, counts_t{1, 3}, 3, 4).value();
  const auto f = call_info_of<int>();
  auto e = check_headers(make_header(a, 1, 0, f), make_header(b, 0, 0, f), 0, 1);
  REQUIRE(!e);
  CHECK(contains(e.error().message, "rank 1 sends 3 elements to rank 0, which expects 2"));
  auto c = sb::reduce_scatter_v(0, 2, counts_t{1, 2}, 3, 1).value();
  auto d = sb::reduce_scatter_v(1, 2, counts_t{2, 2}, 4, 2).value();
  CHECK(!check_headers(make_header(c, 1, 0, f), make_header(d, 0, 0, f), 0, 1));
}
