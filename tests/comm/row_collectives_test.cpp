// The row-view collectives of the thread world, over host memory (host_exec) and over the CPU
// executor's device memory (cpu_exec), against the element references: rows of width W with row
// counts C are the elements of counts C * W. Plus the rules of the row form: one width on every
// rank, contiguous views, 2^31 rows, 64-bit element offsets.
#include <moefold/comm/thread_world.hpp>
#include <moefold/exec/cpu_exec.hpp>
#include <moefold/exec/exec_buffer.hpp>
#include <moefold/exec/host_exec.hpp>

#include <doctest/doctest.h>

#include <climits>
#include <string>
#include <vector>

#include "row_checks.hpp"

using namespace moefold;
using namespace moefold::test;

static_assert(communicator_for<thread_communicator, host_exec>);
static_assert(communicator_for<thread_device_communicator, cpu_exec, int>);
// A communicator and a context of different memory spaces do not fit together.
static_assert(!communicator_for<thread_communicator, cpu_exec>);
static_assert(!communicator_for<thread_device_communicator, host_exec>);

namespace {

// Runs the checks on every rank; returns each rank's finding ("" when all held).
template <class T, class Space>
std::vector<std::string> run_checks(int n, int width) {
  std::vector<std::string> found(static_cast<std::size_t>(n));
  auto st = run_thread_world(n, [&](thread_communicator& w) -> status {
    if constexpr (std::is_same_v<Space, host_space>) {
      host_exec x;
      found[static_cast<std::size_t>(w.rank())] = check_row_collectives<T>(w, x, width, 7u);
    } else {
      auto d = std::move(w).in_space<cpu_device_space>();
      cpu_exec x(42);
      found[static_cast<std::size_t>(d.rank())] = check_row_collectives<T>(d, x, width, 7u);
    }
    return {};
  });
  for (std::size_t r = 0; r < st.size(); ++r)
    if (!st[r]) found[r] = st[r].error().message;
  return found;
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE_TEMPLATE("row-view collectives equal the element references, host and cpu_exec", T, float,
                   double, int, bfloat16) {
  for (int n : {1, 2, 3, 5, 8})
    for (int width : {1, 3, 16}) {
      CAPTURE(n);
      CAPTURE(width);
      for (const auto& f : run_checks<T, host_space>(n, width)) CHECK(f == "");
      for (const auto& f : run_checks<T, cpu_device_space>(n, width)) CHECK(f == "");
    }
}

TEST_CASE("cpu_exec: collectives move device rows without host transfers; copies are counted") {
  std::vector<copy_counts> during(3), total(3);
  auto st = run_thread_world(3, [&](thread_communicator& w) -> status {
    auto d = std::move(w).in_space<cpu_device_space>();
    cpu_exec x(1);
    const int me = d.rank();
    std::vector<float> h(static_cast<std::size_t>(3 * 4), static_cast<float>(me));
    auto send = exec_buffer<float, cpu_exec>::make(x, 3, 4);
    auto recv = exec_buffer<float, cpu_exec>::make(x, 9, 4);
    if (!send || !recv) return make_error(errc::backend_error, "allocation");
    if (auto ok = x.copy(row_view<const float>(h.data(), 3, 4), send->view()); !ok) return ok;
    const copy_counts before = x.copies();
    const std::vector<int> one{1, 1, 1}, three_ones{1, 1, 1};
    if (auto ok = d.all_to_all_v(x, send->cview(), one, recv->view().first(3), three_ones); !ok)
      return ok;
    if (auto ok = d.all_gather(x, send->cview(), recv->view()); !ok) return ok;
    during[static_cast<std::size_t>(me)] = x.copies();
    during[static_cast<std::size_t>(me)].to_device -= before.to_device;
    during[static_cast<std::size_t>(me)].bytes_to_device -= before.bytes_to_device;
    std::vector<float> out(9 * 4);
    if (auto ok = x.copy(recv->cview(), row_view<float>(out.data(), 9, 4)); !ok) return ok;
    for (int r = 0; r < 9; ++r)
      if (out[static_cast<std::size_t>(r * 4)] != static_cast<float>(r / 3))
        return make_error(errc::shape_mismatch, "all_gather rows");
    total[static_cast<std::size_t>(me)] = x.copies();
    return {};
  });
  for (const auto& s : st) CHECK(s.has_value());
  for (std::size_t r = 0; r < 3; ++r) {
    CHECK(during[r] == copy_counts{});  // the collectives themselves made no transfer
    CHECK(total[r].to_device == 1);
    CHECK(total[r].bytes_to_device == 3 * 4 * 4);
    CHECK(total[r].to_host == 1);
    CHECK(total[r].bytes_to_host == 9 * 4 * 4);
    CHECK(total[r].on_device == 0);
  }
}

TEST_CASE("row form rules: one width on every rank, contiguous views, fewer than 2^31 rows") {
  SUBCASE("a rank with another width: count mismatch on every rank") {
    auto st = run_thread_world(3, [](thread_communicator& w) -> status {
      host_exec x;
      const int W = w.rank() == 1 ? 5 : 4;
      std::vector<float> s(static_cast<std::size_t>(3 * W)), r(s.size());
      const std::vector<int> c{1, 1, 1};
      return w.all_to_all_v(x, row_view<const float>(s.data(), 3, W), c,
                            row_view<float>(r.data(), 3, W), c);
    });
    for (const auto& s : st) {
      REQUIRE(!s);
      CHECK(s.error().code == errc::comm_mismatch);
      CHECK(contains(s.error().message, "count mismatch in all_to_all_v"));
    }
  }
  SUBCASE("a strided view is refused by its rank, and its peers learn it at once") {
    auto st = run_thread_world(2, [](thread_communicator& w) -> status {
      host_exec x;
      std::vector<float> s(16), r(16);
      const std::vector<int> c{1, 1};
      const std::int64_t stride = w.rank() == 0 ? 8 : 4;
      return w.all_gather_v(x, row_view<const float>(s.data(), 1, 4, stride),
                            row_view<float>(r.data(), 2, 4, stride), c);
    });
    REQUIRE(!st[0]);
    CHECK(st[0].error().code == errc::invalid_argument);
    CHECK(contains(st[0].error().message, "contiguous row views"));
    REQUIRE(!st[1]);
    CHECK(st[1].error().code == errc::comm_peer_failed);
  }
  SUBCASE("row counts that add up to 2^31 or more: errc::overflow on every rank") {
    auto st = run_thread_world(2, [](thread_communicator& w) -> status {
      host_exec x;
      const int half = (1 << 30) + 1;
      const std::vector<int> c{half, half};
      // Never touched: the schedule is refused before any row moves.
      return w.all_to_all_v(x, row_view<const float>(nullptr, INT_MAX, 8), c,
                            row_view<float>(nullptr, INT_MAX, 8), c);
    });
    for (std::size_t r = 0; r < st.size(); ++r) {
      REQUIRE(!st[r]);
      CHECK((st[r].error().code == errc::overflow || st[r].error().code == errc::comm_peer_failed));
    }
    CHECK((st[0].error().code == errc::overflow || st[1].error().code == errc::overflow));
  }
}

TEST_CASE("schedules of rows address more than 2^31 elements in 64-bit offsets") {
  // DeepSeek-V3-sized rows (H 7168, padded to 8192 elements) from 300,000-row peers: offsets
  // beyond 2^31 elements, computed, never allocated.
  const int rows = 300000, W = 8192;
  const std::vector<int> counts{rows, rows};
  auto s = schedule_builder::all_to_all_v(1, 2, counts, counts, 2 * rows, 2 * rows, W);
  REQUIRE(s.has_value());
  CHECK(s->width() == W);
  CHECK(s->send_offset(1) == std::int64_t{rows} * W);
  CHECK(s->send_offset(1) > std::int64_t{INT_MAX});
  CHECK(s->send_count(0) == std::int64_t{rows} * W);
  CHECK(s->recv_extent() == std::int64_t{2} * rows * W);
  const schedule_step step1 = s->step(1);  // rank 1 sends to rank 0 and receives from rank 0
  CHECK(step1.send_offset == 0);
  CHECK(step1.recv_offset == 0);
  const schedule_step step0 = s->step(0);  // the copy to itself: the second block
  CHECK(step0.send_offset == std::int64_t{rows} * W);
  auto small = schedule_builder::all_to_all_v(0, 2, counts, counts, rows, 2 * rows, W);
  REQUIRE(!small);
  CHECK(small.error().code == errc::shape_mismatch);
  CHECK(contains(small.error().message, "send buffer holds 300000 rows (of 8192 elements)"));
  // The message stays in elements for the element form (width 1).
  auto el = schedule_builder::all_to_all_v(0, 1, std::vector<int>{6}, std::vector<int>{6}, 5, 6);
  REQUIRE(!el);
  CHECK(contains(el.error().message, "send buffer holds 5 elements but the counts need 6"));
}
