// The row operations of the execution contexts (exec/host_memory_ops.hpp) on host_exec and on
// cpu_exec (its device memory, poisoned, reached only through its copies): each against a naive
// reference written here, the padding and dropped markers (-1) giving zero, strided views, and
// bad shapes or indices refused with an error naming the operation, nothing written.
#include <moefold/exec/cpu_exec.hpp>
#include <moefold/exec/exec_buffer.hpp>
#include <moefold/exec/host_exec.hpp>

#include <doctest/doctest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

using namespace moefold;

namespace {

// Runs an operation on host data through a context: host_exec on the vectors themselves,
// cpu_exec on device copies made and read back with its copies.
template <class Exec>
struct harness;

template <>
struct harness<host_exec> {
  host_exec x;
  template <class T>
  struct buf {
    std::vector<T>* h;
    int rows, width;
    row_view<T> view() { return {h->data(), rows, width}; }
    row_view<const T> cview() { return {h->data(), rows, width}; }
    void read_back() {}
  };
  template <class T>
  buf<T> put(std::vector<T>& v, int rows, int width) {
    return {&v, rows, width};
  }
};

template <>
struct harness<cpu_exec> {
  cpu_exec x{7};
  template <class T>
  struct buf {
    cpu_exec* x;
    std::vector<T>* h;
    exec_buffer<T, cpu_exec> d;
    row_view<T, cpu_device_space> view() { return d.view(); }
    row_view<const T, cpu_device_space> cview() { return d.cview(); }
    void read_back() {
      REQUIRE(x->copy(d.cview(), row_view<T>(h->data(), d.view().rows(), d.view().width())));
    }
  };
  template <class T>
  buf<T> put(std::vector<T>& v, int rows, int width) {
    auto d = exec_buffer<T, cpu_exec>::make(x, rows, width);
    REQUIRE(d.has_value());
    REQUIRE(x.copy(row_view<const T>(v.data(), rows, width), d->view()));
    return {&x, &v, std::move(*d)};
  }
};

std::vector<double> random_rows(int n, std::uint32_t seed) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<double> v(static_cast<std::size_t>(n));
  for (auto& e : v) e = u(g);
  return v;
}

}  // namespace

TEST_CASE_TEMPLATE("row operations equal their naive references", Exec, host_exec, cpu_exec) {
  harness<Exec> h;
  constexpr int R = 5, W = 3, M = 7, K = 2;
  auto src = random_rows(R * W, 1);
  // gather_rows with divisor K: rows name slots, slot / K the source row; -1 pads.
  std::vector<int> index = {0, 3, -1, 9, 4, -1, 1};
  std::vector<double> out(M * W, 42.0);
  {
    auto s = h.put(src, R, W);
    auto i = h.put(index, M, 1);
    auto o = h.put(out, M, W);
    REQUIRE(h.x.template gather_rows<double>(s.cview(), i.cview(), K, o.view()));
    o.read_back();
  }
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < W; ++c) {
      const int i = index[static_cast<std::size_t>(r)];
      CHECK(out[static_cast<std::size_t>(r * W + c)] ==
            (i < 0 ? 0.0 : src[static_cast<std::size_t>((i / K) * W + c)]));
    }
  // gather_sum_rows: tokens [N, K] name rows of y; the sum in slot order, weighted or not.
  constexpr int N = 4;
  auto y = random_rows(M * W, 2);
  std::vector<int> token_rows = {0, 6, -1, -1, 2, 3, 5, -1};
  auto w = random_rows(N * K, 3);
  for (bool weighted : {false, true}) {
    std::vector<double> sum(N * W, 42.0);
    {
      auto ys = h.put(y, M, W);
      auto ti = h.put(token_rows, N, K);
      auto ws = h.put(w, N, K);
      auto o = h.put(sum, N, W);
      const auto wv = weighted ? ws.cview() : decltype(ws.cview()){};
      REQUIRE(h.x.template gather_sum_rows<double>(ys.cview(), ti.cview(), wv, o.view()));
      o.read_back();
    }
    for (int t = 0; t < N; ++t)
      for (int c = 0; c < W; ++c) {
        double acc = 0.0;
        for (int j = 0; j < K; ++j) {
          const int r = token_rows[static_cast<std::size_t>(t * K + j)];
          if (r < 0) continue;
          const double v = y[static_cast<std::size_t>(r * W + c)];
          acc += weighted ? w[static_cast<std::size_t>(t * K + j)] * v : v;
        }
        CHECK(sum[static_cast<std::size_t>(t * W + c)] == acc);  // same order: bitwise
      }
  }
  // copy_chunks: chunks of 2, 0, 3, 2 rows placed in the order 3, 0, 2, 1, and back.
  std::vector<int> sizes = {2, 0, 3, 2}, from = {0, 2, 2, 5}, to = {2, 7, 4, 0};
  auto rows7 = random_rows(M * W, 4);
  std::vector<double> sorted(M * W, 42.0), back(M * W, 42.0);
  {
    auto s = h.put(rows7, M, W);
    auto z = h.put(sizes, 4, 1);
    auto f = h.put(from, 4, 1);
    auto t = h.put(to, 4, 1);
    auto o = h.put(sorted, M, W);
    auto b = h.put(back, M, W);
    REQUIRE(h.x.template copy_chunks<double>(s.cview(), z.cview(), f.cview(), t.cview(), o.view()));
    REQUIRE(h.x.template copy_chunks<double>(o.cview(), z.cview(), t.cview(), f.cview(), b.view()));
    o.read_back();
    b.read_back();
  }
  for (int c = 0; c < 4; ++c)
    for (int r = 0; r < sizes[static_cast<std::size_t>(c)]; ++r)
      for (int e = 0; e < W; ++e)
        CHECK(sorted[static_cast<std::size_t>((to[static_cast<std::size_t>(c)] + r) * W + e)] ==
              rows7[static_cast<std::size_t>((from[static_cast<std::size_t>(c)] + r) * W + e)]);
  CHECK(back == rows7);
  // relabel: global ids of experts [4, 8) to local ones; others and -1 to -1.
  std::vector<int> ids = {0, 4, 7, -1, 8, 5}, local(6, 42);
  {
    auto i = h.put(ids, 3, 2);
    auto o = h.put(local, 3, 2);
    REQUIRE(h.x.relabel(i.cview(), 4, 4, o.view()));
    o.read_back();
  }
  CHECK(local == std::vector<int>{-1, 0, 3, -1, -1, 1});
  // add, scale, fill.
  auto a = random_rows(R * W, 5), b = random_rows(R * W, 6);
  const auto b0 = b;
  {
    auto as = h.put(a, R, W);
    auto bs = h.put(b, R, W);
    REQUIRE(h.x.template add<double>(as.cview(), bs.view()));
    REQUIRE(h.x.template scale<double>(bs.view().subrows(1, 2), 2.0));
    REQUIRE(h.x.template fill<double>(bs.view().subrows(4, 1), -3.0));
    bs.read_back();
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < W; ++c) {
      const auto i = static_cast<std::size_t>(r * W + c);
      const double want = r == 4 ? -3.0 : (b0[i] + a[i]) * (r == 1 || r == 2 ? 2.0 : 1.0);
      CHECK(b[i] == want);
    }
}

TEST_CASE("row operations on strided host views touch only their rows") {
  host_exec x;
  // A [3, 2] view of rows 4 apart inside a [3, 4] buffer: the columns 2, 3 stay as they were.
  std::vector<float> src = {1, 2, 3, 4}, dst(12, 9.f);
  std::vector<int> index = {1, -1, 0};
  REQUIRE(x.gather_rows<float>(row_view<const float>(src.data(), 2, 2),
                               row_view<const int>(index.data(), 3, 1), 1,
                               row_view<float>(dst.data(), 3, 2, 4)));
  CHECK(dst == std::vector<float>{3, 4, 9, 9, 0, 0, 9, 9, 1, 2, 9, 9});
}

TEST_CASE_TEMPLATE("row operations refuse bad shapes and indices, writing nothing", Exec, host_exec,
                   cpu_exec) {
  harness<Exec> h;
  std::vector<double> src(6, 1.0), out(6, 42.0);
  std::vector<int> index = {0, 3}, sizes = {1, 2}, from = {0, 1}, to = {0, 2};
  auto s = h.put(src, 3, 2);
  auto o = h.put(out, 3, 2);
  auto i = h.put(index, 2, 1);
  // 3 rows of destination but 2 indices.
  auto st = h.x.template gather_rows<double>(s.cview(), i.cview(), 1, o.view());
  REQUIRE(!st);
  CHECK(st.error().code == errc::shape_mismatch);
  CHECK(st.error().message.find(std::string(Exec::name) + "::gather_rows") != std::string::npos);
  // Index 3 of a 3-row source.
  st = h.x.template gather_rows<double>(s.cview(), i.cview(), 1, o.view().first(2));
  REQUIRE(!st);
  CHECK(st.error().code == errc::invalid_argument);
  CHECK(st.error().message.find("index 3 at (1, 0) outside [-1, 3)") != std::string::npos);
  // The same index with divisor 2 names source row 1: accepted.
  REQUIRE(h.x.template gather_rows<double>(s.cview(), i.cview(), 2, o.view().first(2)));
  // A chunk that runs past the destination (2 rows placed at row 2 of 3).
  auto z = h.put(sizes, 2, 1);
  auto f = h.put(from, 2, 1);
  auto t = h.put(to, 2, 1);
  st = h.x.template copy_chunks<double>(s.cview(), z.cview(), f.cview(), t.cview(), o.view());
  REQUIRE(!st);
  CHECK(st.error().message.find("copy_chunks") != std::string::npos);
  st = h.x.template add<double>(s.cview().first(2), o.view());
  REQUIRE(!st);
  CHECK(st.error().code == errc::shape_mismatch);
  std::vector<int> tok = {0, 5};
  auto ti = h.put(tok, 1, 2);
  st = h.x.template gather_sum_rows<double>(s.cview(), ti.cview(), {}, o.view().first(1));
  REQUIRE(!st);
  CHECK(st.error().code == errc::invalid_argument);
  // Nothing of the refused calls was written (the accepted gather wrote rows 0 and 1).
  o.read_back();
  CHECK(out[4] == 42.0);
  CHECK(out[5] == 42.0);
}
