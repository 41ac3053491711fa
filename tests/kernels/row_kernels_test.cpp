// The row kernels (kernels/permute.hpp, unpermute.hpp, chunk_copy.hpp, elementwise.hpp) on the
// CPU executor against the host's row operations (host_exec, exec/host_memory_ops.hpp) on fresh
// random inputs (seed printed; MOEFOLD_TEST_SEED replays one): outputs poisoned before each
// launch, every element compared bit for bit (the kernels sum in the host's order, rounding each
// product and sum once). Sizes: tokens 1, 7, 513; hidden 1, 7, 8, 4096 + 8; k 1, 2, 8; the
// 16-byte path (rows a multiple of 16 bytes) and the element path (hidden 7, odd strides).
//
// Each operation's kernel (the struct exec/simt_memory_ops.hpp launches for it, built from the
// same views the same way) is also launched directly on host_exec, over host_exec's grid (one
// block striding over all the work; the scan and the histogram as a team of one), on the same
// inputs: cpu_exec's result bit for bit (the row kernels add in a fixed order, the rest is
// integer or per element).
#include <doctest/doctest.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <moefold/core/dtype.hpp>
#include <moefold/dispatch/chunk_sort.hpp>
#include <moefold/dispatch/plan_builders.hpp>
#include <moefold/exec/cpu_exec.hpp>
#include <moefold/exec/host_exec.hpp>
#include <moefold/kernels/chunk_copy.hpp>
#include <moefold/kernels/chunk_table.hpp>
#include <moefold/kernels/elementwise.hpp>
#include <moefold/kernels/histogram.hpp>
#include <moefold/kernels/permute.hpp>
#include <moefold/kernels/scan.hpp>
#include <moefold/kernels/simt/block_scan.hpp>
#include <moefold/kernels/simt/row_copy.hpp>
#include <moefold/kernels/store_values.hpp>
#include <moefold/kernels/unpermute.hpp>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "../support/simt_test_sizes.hpp"

using namespace moefold;

namespace {

template <class T>
T draw(std::mt19937_64& rng) {
  std::normal_distribution<double> d(0.0, 1.0);
  if constexpr (std::is_same_v<T, int>)
    return static_cast<int>(rng() % 2001) - 1000;
  else
    return static_cast<T>(static_cast<float>(d(rng)));
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         std::memcmp(static_cast<const void*>(a.data()), static_cast<const void*>(b.data()),
                     sizeof(T) * a.size()) == 0;
}

//! A [rows, width] matrix with `pad` extra elements per row (stride = width + pad), poisoned.
template <class T>
struct mat {
  int rows, width, stride;
  std::vector<T> v;
  mat(int r, int w, int pad = 0)
      : rows(r), width(w), stride(w + pad), v(static_cast<std::size_t>(r) * (w + pad) + 16) {
    std::memset(static_cast<void*>(v.data()), 0xFF, sizeof(T) * v.size());
  }
  // Views start 16-byte aligned (std::vector's allocation is) unless `offset` moves them.
  template <class S = host_space>
  row_view<T, S> view(int offset = 0) {
    return row_view<T, S>(v.data() + offset, rows, width, stride);
  }
  void randomize(std::mt19937_64& rng) {
    for (auto& x : v) x = draw<T>(rng);
  }
};

// cpu_exec's memory is host memory: a test may hand the executor views of its own vectors
// (cpu_device_space views of host allocations), so both contexts see the same inputs.
template <class T>
row_view<T, cpu_device_space> dev(row_view<T> h) {
  return row_view<T, cpu_device_space>(h.data(), h.rows(), h.width(), h.stride());
}

// A kernel launched directly on host_exec over host_exec's grid (max_grid_blocks: one block).
template <class K>
void on_host(const K& kernel, std::size_t smem_bytes = 0) {
  REQUIRE(launch(host_exec{},
                 launch_grid{.blocks = host_exec::max_grid_blocks, .smem_bytes = smem_bytes},
                 kernel));
}
// A row operation's kernel so: one with an index fault counter gets one, as simt_memory_ops.hpp
// gives it, which the tests' indices (all in range) leave at 0.
template <class K>
void row_op_on_host(K kernel) {
  int faults = 0;
  if constexpr (requires { kernel.fault; }) kernel.fault = &faults;
  on_host(kernel);
  CHECK(faults == 0);
}

// Whether a kernel moves src and dst rows as 16-byte pieces (simt_memory_ops.hpp's test).
template <class T>
bool vec16(const row_view<const T>& src, const row_view<T>& dst) {
  return kernels::simt::rows_vec16<T>(src.data(), src.width(), src.stride()) &&
         kernels::simt::rows_vec16<T>(dst.data(), dst.width(), dst.stride());
}

// gather_rows's kernel on host_exec.
template <class T>
void gather_on_host(row_view<const T> src, row_view<const int> index, int divisor,
                    row_view<T> dst) {
  row_op_on_host(kernels::gather_rows_kernel<T>{.src = src.data(),
                                                .src_stride = src.stride(),
                                                .src_rows = src.rows(),
                                                .index = index.data(),
                                                .index_stride = index.stride(),
                                                .divisor = divisor,
                                                .dst = dst.data(),
                                                .dst_stride = dst.stride(),
                                                .rows = dst.rows(),
                                                .width = dst.width(),
                                                .vec16 = vec16<T>(src, dst)});
}

// The elementwise kernels' [rows, width] arguments of a view.
template <class T>
kernels::rows_arg<T> arg(row_view<T> v) {
  return {v.data(), v.stride()};
}

// expert_histogram's kernels (what count_routed_pairs launches on cpu_exec) on host_exec: counts
// and fault filled, the histogram (a team of one), the fault record.
void histogram_on_host(row_view<const int> ids, row_view<int> counts, row_view<int> fault) {
  const int E = counts.width();
  row_op_on_host(kernels::fill_kernel<int>{.dst = arg(counts), .v = 0, .rows = 1, .width = E});
  row_op_on_host(
      kernels::fill_kernel<int>{.dst = arg(fault), .v = 2147483647, .rows = 1, .width = 2});
  if (ids.extent() > 0)
    on_host(kernels::expert_histogram_kernel{.ids = ids.data(),
                                             .n = ids.extent(),
                                             .num_experts = E,
                                             .counts = counts.data(),
                                             .first_bad = fault.data(),
                                             .topk = ids.width() > 0 ? ids.width() : 1},
            kernels::expert_histogram_kernel::smem_bytes(E));
  on_host(kernels::record_fault_kernel{.ids = ids.data(), .fault = fault.data()});
}

// exclusive_scan's three kernels on host_exec (the tile scans as a team of one).
void scan_on_host(const int* in, int* out, long long n, int* total, int* scratch) {
  const long long tiles = cpu_exec::exclusive_scan_scratch(n);
  constexpr std::size_t smem = sizeof(int) * kernels::simt::block_scan_scratch<host_team_ctx>;
  if (tiles > 0)
    on_host(kernels::scan_tiles_kernel{.in = in, .out = out, .n = n, .tile_sums = scratch}, smem);
  on_host(kernels::scan_tile_sums_kernel{.tile_sums = scratch, .tiles = tiles, .total = total},
          smem);
  if (tiles > 0)
    on_host(kernels::add_tile_offsets_kernel{.out = out, .n = n, .tile_offsets = scratch});
}

const std::vector<int> token_sizes() {
  return test::simt_reduced ? std::vector<int>{1, 7, 64} : std::vector<int>{1, 7, 513};
}
const std::vector<int> hidden_sizes() {
  return test::simt_reduced ? std::vector<int>{1, 7, 8, 72} : std::vector<int>{1, 7, 8, 4096 + 8};
}

template <class T>
void check_gather(std::mt19937_64& rng, int tokens, int hidden, int k, int pad) {
  const int slots = tokens * k;
  mat<T> src(tokens, hidden, pad);
  src.randomize(rng);
  // Index into slots (divisor k): a permutation of the slots with some -1 (dropped / padding).
  mat<int> index(slots + 3, 1);
  for (int r = 0; r < slots + 3; ++r)
    index.v[static_cast<std::size_t>(r)] =
        rng() % 5 == 0 ? -1 : static_cast<int>(rng() % static_cast<unsigned>(slots));
  mat<T> ref(slots + 3, hidden, pad), got(slots + 3, hidden, pad);
  REQUIRE(host_exec{}.gather_rows<T>(src.view(), index.view(), k, ref.view()));
  REQUIRE(cpu_exec{rng()}.gather_rows<T>(dev(src.view()), dev(index.view()), k, dev(got.view())));
  // The padding between rows is never written by either (still poisoned in both).
  CHECK(same_bits(ref.v, got.v));
  mat<T> kernel_on_host(slots + 3, hidden, pad);
  gather_on_host<T>(src.view(), index.view(), k, kernel_on_host.view());
  CHECK_MESSAGE(same_bits(kernel_on_host.v, got.v), "the kernel on host_exec against cpu_exec");
}

template <class T, class Acc>
void check_gather_sum(std::mt19937_64& rng, int tokens, int hidden, int k, int pad, bool weighted) {
  const int rows = tokens * k;
  mat<T> src(rows, hidden, pad);
  src.randomize(rng);
  mat<int> index(tokens, k);
  for (auto& i : index.v)
    i = rng() % 6 == 0 ? -1 : static_cast<int>(rng() % static_cast<unsigned>(rows));
  mat<T> w(tokens, k);
  w.randomize(rng);
  mat<T> ref(tokens, hidden, pad), got(tokens, hidden, pad);
  auto wv = weighted ? w.view() : row_view<T>();
  REQUIRE(host_exec{}.gather_sum_rows<T, T, Acc>(src.view(), index.view(), wv, ref.view()));
  REQUIRE(cpu_exec{rng()}.gather_sum_rows<T, T, Acc>(dev(src.view()), dev(index.view()),
                                                     dev(row_view<const T>(wv)), dev(got.view())));
  CHECK(same_bits(ref.v, got.v));
  mat<T> kernel_on_host(tokens, hidden, pad);
  const row_view<const T> sv = src.view();
  const row_view<T> dv = kernel_on_host.view();
  row_op_on_host(
      kernels::gather_sum_rows_kernel<T, T, Acc>{.src = sv.data(),
                                                 .src_stride = sv.stride(),
                                                 .src_rows = sv.rows(),
                                                 .index = index.v.data(),
                                                 .index_stride = index.stride,
                                                 .k = index.width,
                                                 .weights = weighted ? w.v.data() : nullptr,
                                                 .weight_stride = weighted ? w.stride : 0,
                                                 .dst = dv.data(),
                                                 .dst_stride = dv.stride(),
                                                 .rows = dv.rows(),
                                                 .width = dv.width(),
                                                 .vec16 = vec16<T>(sv, dv)});
  CHECK_MESSAGE(same_bits(kernel_on_host.v, got.v), "the kernel on host_exec against cpu_exec");
}

template <class T>
void check_chunks(std::mt19937_64& rng, int rows, int hidden, int pad) {
  // Chunks of random sizes (some empty) that tile the rows, moved to a shuffled order.
  std::vector<int> sizes;
  for (int left = rows; left > 0;) {
    const int n = std::min(left, static_cast<int>(rng() % 9));
    sizes.push_back(n);
    left -= n;
  }
  sizes.push_back(0);
  const int c = static_cast<int>(sizes.size());
  std::vector<int> order(static_cast<std::size_t>(c));
  for (int i = 0; i < c; ++i) order[static_cast<std::size_t>(i)] = i;
  std::shuffle(order.begin(), order.end(), rng);
  mat<int> sz(c, 1), from(c, 1), to(c, 1);
  int f = 0, t = 0;
  for (int i = 0; i < c; ++i) {
    sz.v[static_cast<std::size_t>(i)] = sizes[static_cast<std::size_t>(i)];
    from.v[static_cast<std::size_t>(i)] = f;
    f += sizes[static_cast<std::size_t>(i)];
  }
  for (int i : order) {
    to.v[static_cast<std::size_t>(i)] = t;
    t += sizes[static_cast<std::size_t>(i)];
  }
  mat<T> src(rows, hidden, pad);
  src.randomize(rng);
  mat<T> ref(rows, hidden, pad), got(rows, hidden, pad);
  REQUIRE(host_exec{}.copy_chunks<T>(src.view(), sz.view(), from.view(), to.view(), ref.view()));
  REQUIRE(cpu_exec{rng()}.copy_chunks<T>(dev(src.view()), dev(sz.view()), dev(from.view()),
                                         dev(to.view()), dev(got.view())));
  CHECK(same_bits(ref.v, got.v));
  mat<T> kernel_on_host(rows, hidden, pad);
  const row_view<const T> sv = src.view();
  const row_view<T> dv = kernel_on_host.view();
  row_op_on_host(kernels::copy_chunks_kernel<T>{.src = sv.data(),
                                                .src_stride = sv.stride(),
                                                .sizes = sz.v.data(),
                                                .from = from.v.data(),
                                                .to = to.v.data(),
                                                .sizes_stride = sz.stride,
                                                .from_stride = from.stride,
                                                .to_stride = to.stride,
                                                .chunks = c,
                                                .dst = dv.data(),
                                                .dst_stride = dv.stride(),
                                                .width = dv.width(),
                                                .vec16 = vec16<T>(sv, dv)});
  CHECK_MESSAGE(same_bits(kernel_on_host.v, got.v), "the kernel on host_exec against cpu_exec");
}

}  // namespace

TEST_CASE_TEMPLATE("permute (gather_rows): cpu_exec kernel equals the host, bit for bit", T, float,
                   bfloat16, double) {
  const auto seed = test::simt_seed();
  MESSAGE("seed " << seed);
  std::mt19937_64 rng(seed);
  for (int tokens : token_sizes())
    for (int hidden : hidden_sizes())
      for (int k : {1, 2, 8})
        for (int pad : {0, 1}) {
          CAPTURE(tokens);
          CAPTURE(hidden);
          CAPTURE(k);
          CAPTURE(pad);
          if (test::simt_reduced && tokens * k > 128) continue;
          check_gather<T>(rng, tokens, hidden, k, pad);
        }
}

TEST_CASE_TEMPLATE("un-permute (gather_sum_rows): the host's sums, bit for bit", T, float, bfloat16,
                   double) {
  const auto seed = test::simt_seed();
  MESSAGE("seed " << seed);
  std::mt19937_64 rng(seed + 1);
  for (int tokens : token_sizes())
    for (int hidden : hidden_sizes())
      for (int k : {1, 2, 8})
        for (int pad : {0, 3})
          for (bool weighted : {false, true}) {
            CAPTURE(tokens);
            CAPTURE(hidden);
            CAPTURE(k);
            CAPTURE(pad);
            CAPTURE(weighted);
            if (test::simt_reduced && tokens * k > 128) continue;
            check_gather_sum<T, accumulator_t<T>>(rng, tokens, hidden, k, pad, weighted);
          }
}

TEST_CASE_TEMPLATE("chunk copies: the host's result, bit for bit", T, float, bfloat16) {
  std::mt19937_64 rng(test::simt_seed() + 2);
  for (int rows : token_sizes())
    for (int hidden : hidden_sizes())
      for (int pad : {0, 1}) {
        CAPTURE(rows);
        CAPTURE(hidden);
        check_chunks<T>(rng, rows, hidden, pad);
      }
}

TEST_CASE(
    "pad-mode chunk table (uniform_chunk_table): the host's order and offsets on both "
    "contexts") {
  // The reference: dispatch/chunk_sort.hpp's expert-major order and chunk offsets over sizes all
  // equal to the capacity, as the dispatcher built the table on the host before.
  for (const auto& [etp, ep, L] : {std::array{1, 1, 1}, std::array{2, 4, 2}, std::array{1, 8, 3},
                                   std::array{4, 2, 5}, std::array{2, 64, 4}})
    for (int cap : {0, 1, 3}) {
      CAPTURE(etp);
      CAPTURE(ep);
      CAPTURE(L);
      CAPTURE(cap);
      const int C = etp * ep * L;
      std::vector<int> sizes(static_cast<std::size_t>(C), cap), order(sizes.size()),
          src(sizes.size()), dst(sizes.size());
      dispatch::expert_major_chunk_order(etp, ep, L, order);
      dispatch::chunk_offsets(sizes, order, src, dst);
      std::vector<int> want = sizes;
      want.insert(want.end(), src.begin(), src.end());
      want.insert(want.end(), dst.begin(), dst.end());
      const kernels::uniform_chunks u{.etp = etp, .ep = ep, .local_experts = L, .rows = cap};
      mat<int> host(3, C, 1), device(3, C, 1), kernel_on_host(3, C, 1);
      REQUIRE(host_exec{}.uniform_chunk_table(host.view(), u));
      REQUIRE(cpu_exec{test::simt_seed()}.uniform_chunk_table(dev(device.view()), u));
      row_op_on_host(kernels::uniform_chunk_table_kernel{
          .u = u, .table = kernel_on_host.v.data(), .stride = kernel_on_host.stride});
      CHECK_MESSAGE(same_bits(kernel_on_host.v, device.v),
                    "the kernel on host_exec against cpu_exec");
      for (int r = 0; r < 3; ++r)
        for (int c = 0; c < C; ++c) {
          const int w = want[static_cast<std::size_t>(r * C + c)];
          CHECK(host.view().row_data(r)[c] == w);
          CHECK(device.view().row_data(r)[c] == w);
        }
      CHECK(device.v[static_cast<std::size_t>(C)] == -1);  // the row padding is not written
    }
  // A table of the wrong shape or a fold below one is refused, naming the rule.
  mat<int> t(3, 8);
  const auto bad = cpu_exec{}.uniform_chunk_table(
      dev(t.view()), {.etp = 2, .ep = 2, .local_experts = 1, .rows = 1});
  REQUIRE_FALSE(bad);
  CHECK(bad.error().message.find("[3, etp * ep * local_experts]") != std::string::npos);
  CHECK_FALSE(host_exec{}.uniform_chunk_table(t.view(), {.etp = 0, .ep = 8, .rows = 1}));
}

TEST_CASE(
    "host values stored by kernels (store_host_values): the host's values on both contexts, "
    "nothing copied, any length") {
  // The values travel in the kernels' parameters (kernels/store_values.hpp), capacity values per
  // launch: lengths below, at and past one launch's capacity (long long: 256, int: 512), into a
  // strided [rows, width] destination whose row padding stays untouched; cpu_exec counts no copy.
  std::mt19937_64 rng(41);
  const auto run = [&]<class V>(V, int rows, int width) {
    CAPTURE(rows);
    CAPTURE(width);
    CAPTURE(sizeof(V));
    mat<V> src(rows, width), host(rows, width, 3), device(rows, width, 3);
    for (auto& v : src.v) v = static_cast<V>(rng() % 1000003) - 500000;
    cpu_exec x(test::simt_seed());
    REQUIRE(host_exec{}.store_host_values<V>(src.view(), host.view()));
    REQUIRE(x.store_host_values<V>(src.view(), dev(device.view())));
    CHECK(x.copies() == copy_counts{});
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < width + 3; ++c) {
        const auto i = static_cast<std::size_t>(r) * static_cast<std::size_t>(width + 3) +
                       static_cast<std::size_t>(c);
        if (c < width) {
          const V want = src.view().row_data(r)[c];
          CHECK(host.v[i] == want);
          CHECK(device.v[i] == want);
        } else {
          CHECK(device.v[i] == static_cast<V>(-1));  // the padding (0xFF bytes) is not written
        }
      }
  };
  static_assert(kernels::store_values_kernel<long long>::capacity == 256);
  static_assert(kernels::store_values_kernel<int>::capacity == 512);
  for (const auto& [rows, width] : {std::array{1, 1}, std::array{1, 3}, std::array{1, 256},
                                    std::array{1, 257}, std::array{3, 200}, std::array{5, 511}})
    run((long long)0, rows, width);
  for (const auto& [rows, width] : {std::array{3, 65}, std::array{1, 512}, std::array{3, 513}})
    run(0, rows, width);
  // Shapes that differ are refused, naming the operation; nothing is written.
  mat<int> a(1, 4), b(2, 2);
  const auto bad = cpu_exec{}.store_host_values<int>(a.view(), dev(b.view()));
  REQUIRE_FALSE(bad);
  CHECK(bad.error().message.find("store_host_values") != std::string::npos);
  CHECK(b.v[0] == -1);
  CHECK_FALSE(host_exec{}.store_host_values<int>(a.view(), b.view()));
}

TEST_CASE("elementwise kernels: relabel, add, add_converted, convert, scale, fill") {
  std::mt19937_64 rng(test::simt_seed() + 3);
  for (int rows : token_sizes())
    for (int width : {1, 7, 8}) {
      CAPTURE(rows);
      CAPTURE(width);
      mat<int> ids(rows, width, 1);
      for (auto& i : ids.v) i = static_cast<int>(rng() % 70) - 3;
      mat<int> r1(rows, width, 1), r2(rows, width, 1), r3(rows, width, 1);
      REQUIRE(host_exec{}.relabel(ids.view(), 16, 24, r1.view()));
      REQUIRE(cpu_exec{rng()}.relabel(dev(ids.view()), 16, 24, dev(r2.view())));
      CHECK(same_bits(r1.v, r2.v));
      // Each kernel on host_exec against cpu_exec (r3, h3, b3, c3, s3, f3).
      row_op_on_host(kernels::relabel_kernel{.ids = arg(row_view<const int>(ids.view())),
                                             .first = 16,
                                             .count = 24,
                                             .dst = arg(r3.view()),
                                             .rows = rows,
                                             .width = width});
      CHECK(same_bits(r3.v, r2.v));

      mat<float> a(rows, width, 1), b(rows, width, 1);
      a.randomize(rng);
      b.randomize(rng);
      mat<bfloat16> h1(rows, width, 1), h2(rows, width, 1);
      h1.randomize(rng);
      h2.v = h1.v;
      auto h3 = h2;
      REQUIRE(host_exec{}.add_converted<bfloat16, float>(a.view(), h1.view()));
      REQUIRE(cpu_exec{rng()}.add_converted<bfloat16, float>(dev(a.view()), dev(h2.view())));
      CHECK(same_bits(h1.v, h2.v));
      row_op_on_host(kernels::add_converted_kernel<bfloat16, float>{
          .src = arg(row_view<const float>(a.view())),
          .dst = arg(h3.view()),
          .rows = rows,
          .width = width});
      CHECK(same_bits(h3.v, h2.v));

      auto b2 = b, b3 = b;
      REQUIRE(host_exec{}.add<float>(a.view(), b.view()));
      REQUIRE(cpu_exec{rng()}.add<float>(dev(a.view()), dev(b2.view())));
      CHECK(same_bits(b.v, b2.v));
      row_op_on_host(
          kernels::add_converted_kernel<float, float>{.src = arg(row_view<const float>(a.view())),
                                                      .dst = arg(b3.view()),
                                                      .rows = rows,
                                                      .width = width});
      CHECK(same_bits(b3.v, b2.v));

      mat<bfloat16> c1(rows, width, 1), c2(rows, width, 1), c3(rows, width, 1);
      REQUIRE(host_exec{}.convert<bfloat16, float>(a.view(), c1.view()));
      REQUIRE(cpu_exec{rng()}.convert<bfloat16, float>(dev(a.view()), dev(c2.view())));
      CHECK(same_bits(c1.v, c2.v));
      row_op_on_host(
          kernels::convert_kernel<bfloat16, float>{.src = arg(row_view<const float>(a.view())),
                                                   .dst = arg(c3.view()),
                                                   .rows = rows,
                                                   .width = width});
      CHECK(same_bits(c3.v, c2.v));

      auto s2 = h1, s3 = h1;
      REQUIRE(host_exec{}.scale<bfloat16>(h1.view(), bfloat16(0.3f)));
      REQUIRE(cpu_exec{rng()}.scale<bfloat16>(dev(s2.view()), bfloat16(0.3f)));
      CHECK(same_bits(h1.v, s2.v));
      row_op_on_host(kernels::scale_kernel<bfloat16>{
          .dst = arg(s3.view()), .s = bfloat16(0.3f), .rows = rows, .width = width});
      CHECK(same_bits(s3.v, s2.v));

      mat<double> f1(rows, width, 1), f2(rows, width, 1), f3(rows, width, 1);
      REQUIRE(host_exec{}.fill<double>(f1.view(), -2.5));
      REQUIRE(cpu_exec{rng()}.fill<double>(dev(f2.view()), -2.5));
      CHECK(same_bits(f1.v, f2.v));
      row_op_on_host(kernels::fill_kernel<double>{
          .dst = arg(f3.view()), .v = -2.5, .rows = rows, .width = width});
      CHECK(same_bits(f3.v, f2.v));
    }
}

TEST_CASE("row kernels: views that start off 16 bytes take the element path, same result") {
  std::mt19937_64 rng(test::simt_seed() + 4);
  mat<float> src(9, 8), ref(9, 8), got(9, 8);
  src.randomize(rng);
  mat<int> index(9, 1);
  for (int r = 0; r < 9; ++r) index.v[static_cast<std::size_t>(r)] = (r * 4) % 9;
  // One float in: the rows are still 32 bytes apart, but no row starts on a 16-byte boundary.
  auto s = src.view(1), gr = got.view(1), rr = ref.view(1);
  REQUIRE(host_exec{}.gather_rows<float>(s, index.view(), 1, rr));
  REQUIRE(cpu_exec{1}.gather_rows<float>(dev(s), dev(index.view()), 1, dev(gr)));
  CHECK(same_bits(ref.v, got.v));
  mat<float> kernel_on_host(9, 8);
  auto kr = kernel_on_host.view(1);
  CHECK_FALSE(vec16<float>(s, kr));
  gather_on_host<float>(s, index.view(), 1, kr);
  CHECK_MESSAGE(same_bits(kernel_on_host.v, got.v), "the kernel on host_exec against cpu_exec");
}

TEST_CASE("row kernels: an index outside its range is refused before anything is written") {
  mat<float> src(4, 8), dst(2, 8);
  std::mt19937_64 rng(5);
  src.randomize(rng);
  mat<int> index(2, 1);
  index.v = {1, 4};
  index.v.resize(18);
  auto before = dst.v;
  auto st = cpu_exec{1}.gather_rows<float>(dev(src.view()), dev(index.view()), 1, dev(dst.view()));
  REQUIRE_FALSE(st);
  CHECK(st.error().code == errc::invalid_argument);
  CHECK(st.error().message.find("gather_rows: index 4 at (1, 0) outside [-1, 4)") !=
        std::string::npos);
  CHECK(same_bits(before, dst.v));
}

TEST_CASE(
    "expert histogram and count_routed_pairs: exact counts, the lowest bad slot and its id, in "
    "the context's memory") {
  const auto seed = test::simt_seed();
  MESSAGE("seed " << seed);
  std::mt19937_64 rng(seed + 5);
  for (int tokens : token_sizes())
    for (int E : {1, 8, 64, 256})
      for (int k : {1, 2, 8}) {
        CAPTURE(tokens);
        CAPTURE(E);
        CAPTURE(k);
        // Distinct experts per token (a valid record), some pairs dropped.
        mat<int> ids(tokens, k);
        for (int t = 0; t < tokens; ++t)
          for (int j = 0; j < k; ++j) {
            int& v = ids.v[static_cast<std::size_t>(t * k + j)];
            v = rng() % 7 == 0 || j >= E ? -1 : static_cast<int>((rng() % E + j) % E);
            for (int q = 0; q < j && v >= 0; ++q)
              if (ids.v[static_cast<std::size_t>(t * k + q)] == v) v = -1;
          }
        mat<int> ref(1, E), got(1, E), ref_fault(1, 2), fault(1, 2);
        using pair = std::pair<int, int>;
        const auto two = [](const mat<int>& f) { return pair{f.v[0], f.v[1]}; };
        // The kernels on host_exec after each count on cpu_exec: the same counts and fault.
        mat<int> host_counts(1, E), host_fault(1, 2);
        const auto kernels_agree = [&] {
          histogram_on_host(ids.view(), host_counts.view(), host_fault.view());
          INFO("the kernels on host_exec against cpu_exec");
          CHECK(host_counts.v == got.v);
          CHECK(two(host_fault) == two(fault));
        };
        const auto count = [&](auto& x, auto ids_view, auto counts, auto fault_view) {
          return count_routed_pairs(x, ids_view, counts, fault_view);
        };
        host_exec hx;
        REQUIRE(count(hx, row_view<const int>(ids.view()), ref.view(), ref_fault.view()));
        cpu_exec x{rng()};
        x.reset_copies();
        REQUIRE(count(x, dev(row_view<const int>(ids.view())), dev(got.view()), dev(fault.view())));
        CHECK(x.copies().to_host == 0);  // nothing read back
        kernels_agree();
        CHECK(two(ref_fault) == pair{-1, 0});
        CHECK(two(fault) == pair{-1, 0});
        CHECK(std::equal(ref.v.begin(), ref.v.begin() + E, got.v.begin()));
        // All tokens on one expert (k = 1, or the other slots dropped).
        for (std::size_t s = 0; s < ids.v.size(); ++s) ids.v[s] = s % k == 0 ? E - 1 : -1;
        REQUIRE(count(x, dev(row_view<const int>(ids.view())), dev(got.view()), dev(fault.view())));
        kernels_agree();
        CHECK(got.v[static_cast<std::size_t>(E - 1)] == tokens);
        CHECK(two(fault) == pair{-1, 0});
        // Two bad ids: the lower slot and its id.
        const int n = tokens * k;
        ids.v[static_cast<std::size_t>(n - 1)] = E;
        ids.v[static_cast<std::size_t>(n / 2)] = -2;
        REQUIRE(count(x, dev(row_view<const int>(ids.view())), dev(got.view()), dev(fault.view())));
        kernels_agree();
        REQUIRE(count(hx, row_view<const int>(ids.view()), ref.view(), ref_fault.view()));
        CHECK(fault.v[0] == n / 2);  // with n == 1 both writes hit slot 0 and -2 stays
        CHECK(fault.v[1] == -2);
        CHECK(two(ref_fault) == two(fault));
        // A token naming an expert twice (k > 1): its second slot, on both contexts.
        if (k > 1 && tokens > 1) {
          for (std::size_t s = 0; s < ids.v.size(); ++s) ids.v[s] = s % k == 0 ? 0 : -1;
          ids.v[static_cast<std::size_t>(k + k - 1)] = 0;  // token 1, slot k - 1
          REQUIRE(
              count(x, dev(row_view<const int>(ids.view())), dev(got.view()), dev(fault.view())));
          kernels_agree();
          REQUIRE(count(hx, row_view<const int>(ids.view()), ref.view(), ref_fault.view()));
          CHECK(two(fault) == pair{2 * k - 1, 0});
          CHECK(two(ref_fault) == two(fault));
        }
      }
  // Shapes: a fault row of the wrong width is refused on both contexts.
  mat<int> ids(2, 2), counts(1, 4), bad(1, 1);
  host_exec hx;
  CHECK_FALSE(count_routed_pairs(hx, row_view<const int>(ids.view()), counts.view(), bad.view()));
  cpu_exec x{1};
  CHECK_FALSE(count_routed_pairs(x, dev(row_view<const int>(ids.view())), dev(counts.view()),
                                 dev(bad.view())));
}

TEST_CASE("device-wide exclusive scan: three launches, exact, across many tiles") {
  std::mt19937_64 rng(test::simt_seed() + 6);
  const std::vector<long long> sizes =
      test::simt_reduced ? std::vector<long long>{0, 1, 7, 1025}
                         : std::vector<long long>{0, 1, 7, 513, 1024, 1025, 70001};
  for (long long n : sizes) {
    CAPTURE(n);
    std::vector<int> in(static_cast<std::size_t>(n) + 1), out(in.size(), -7);
    for (auto& v : in) v = static_cast<int>(rng() % 100);
    const long long tiles = cpu_exec::exclusive_scan_scratch(n);
    std::vector<int> scratch(static_cast<std::size_t>(tiles) + 1, -7);
    int total = -7;
    const int w = static_cast<int>(n);
    REQUIRE(cpu_exec{rng()}.exclusive_scan(
        row_view<const int, cpu_device_space>(in.data(), 1, w),
        row_view<int, cpu_device_space>(out.data(), 1, w),
        row_view<int, cpu_device_space>(&total, 1, 1),
        row_view<int, cpu_device_space>(scratch.data(), 1, static_cast<int>(tiles) + 1)));
    long long run = 0;
    bool ok = true;
    for (long long i = 0; i < n; ++i) {
      ok = ok && out[static_cast<std::size_t>(i)] == run;
      run += in[static_cast<std::size_t>(i)];
    }
    CHECK(ok);
    CHECK(total == run);
    CHECK(out[static_cast<std::size_t>(n)] == -7);  // nothing written past the end
    // The three kernels on host_exec: the same outputs, tile offsets and total.
    std::vector<int> host_out(out.size(), -7), host_scratch(scratch.size(), -7);
    int host_total = -7;
    scan_on_host(in.data(), host_out.data(), n, &host_total, host_scratch.data());
    INFO("the kernels on host_exec against cpu_exec");
    CHECK(host_out == out);
    CHECK(host_scratch == scratch);
    CHECK(host_total == total);
  }
}
