// GPU collectives: the device loopback world (1 to 8 ranks on one GPU) and NCCL with one rank
// run the same collective checks as the CPU backends, against the same direct references
// (collective_reference.hpp): random counts with zeros and empty ranks, prime world sizes,
// float/double/int64/bf16/fp16. Loopback results must equal the references bit for bit (rank
// order, fp32 accumulation). Also: the fp32 sums of 16-bit floats (NCCL's cuBLAS row sum with
// 1 to 8 rows, the loopback kernel, NCCL's own collectives) on inputs where rounding after every
// step would give other bits, and nccl_options::verify_counts. Without a GPU the program exits
// 77 (meson: skipped).
#include <moefold/comm/cuda/loopback_world.cuh>
#include <moefold/comm/cuda/nccl_communicator.hpp>
#include <moefold/comm/cuda/nccl_reduce_fp32.cuh>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "collective_reference.hpp"
#include "device_vec.hpp"

using namespace moefold;
using namespace moefold::test;

// The GPU communicators take device memory and cuda_copy_exec; the host context does not fit them.
static_assert(communicator_for<nccl_communicator, cuda_copy_exec>);
static_assert(communicator_for<loopback_communicator, cuda_copy_exec, int>);
static_assert(!communicator_for<nccl_communicator, host_exec>);
static_assert(!communicator_for<loopback_communicator, cpu_exec>);

namespace {

std::atomic<int> failures{0};
std::mutex print_mutex;
#define EXPECT(cond)                                                       \
  do {                                                                     \
    if (!(cond)) {                                                         \
      std::lock_guard<std::mutex> lk_(print_mutex);                        \
      std::printf("%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                          \
    }                                                                      \
  } while (0)
#define EXPECT_OK(st)                                                                       \
  do {                                                                                      \
    const auto& st_ = (st);                                                                 \
    if (!st_) {                                                                             \
      std::lock_guard<std::mutex> lk_(print_mutex);                                         \
      std::printf("%s:%d: %s: %s\n", __FILE__, __LINE__, #st, st_.error().message.c_str()); \
      ++failures;                                                                           \
    }                                                                                       \
  } while (0)

void expect_cuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  std::lock_guard<std::mutex> lk_(print_mutex);
  std::printf("%s: %s\n", what, cudaGetErrorString(e));
  ++failures;
}

// The CUDA runtime calls of the buffer set-up (device_vec.hpp: the same sequence the
// stream-order fake checks on the CPU in tests/comm/stream_order_test.cpp), every error counted.
struct cuda_setup_calls {
  void* allocate(std::size_t bytes) {
    void* p = nullptr;
    expect_cuda(cudaMalloc(&p, bytes), "cudaMalloc");
    return p;
  }
  void release(void* p) { cudaFree(p); }
  void fill_from_host(void* dst, const void* src, std::size_t bytes) {
    expect_cuda(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
  }
  void fill_bytes(void* dst, int byte, std::size_t bytes) {
    expect_cuda(cudaMemset(dst, byte, bytes), "cudaMemset");
  }
  void synchronize_legacy() {
    expect_cuda(cudaStreamSynchronize(nullptr), "cudaStreamSynchronize (after a fill)");
  }
  void to_host(void* dst, const void* src, std::size_t bytes) {
    expect_cuda(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
  }
};

cuda_setup_calls cuda_calls;  // stateless: one for the whole program

template <class T>
struct device_vec : basic_device_vec<T, cuda_setup_calls> {
  explicit device_vec(const std::vector<T>& h)
      : basic_device_vec<T, cuda_setup_calls>(cuda_calls, h) {}
  explicit device_vec(std::size_t count)
      : basic_device_vec<T, cuda_setup_calls>(cuda_calls, count) {}
};

// The collective checks, for any device communicator with synchronize(). Every rank draws the
// same random counts (generator seeded by the world size).
template <class T, class C>
void check_collectives(C& c) {
  const int me = c.rank(), n = c.size();
  std::mt19937 g(static_cast<unsigned>(n * 977 + 5));
  for (int trial = 0; trial < 2; ++trial) {
    const auto M = random_matrix(g, n, 6);
    device_vec<T> send(a2a_send<T>(M, me));
    const auto want = a2a_want<T>(M, me);
    device_vec<T> recv(want.size());
    EXPECT_OK(c.template all_to_all_v<T>(send.span(), row(M, me), recv.span(), column(M, me)));
    EXPECT_OK(c.synchronize());
    EXPECT(same_bits(recv.host(), want));
  }
  const auto counts = random_counts(g, n, 5);
  {
    device_vec<T> send(agv_send<T>(counts, me));
    device_vec<T> recv(agv_want<T>(counts).size());
    EXPECT_OK(c.template all_gather_v<T>(send.span(), recv.span(), counts));
    EXPECT_OK(c.synchronize());
    EXPECT(same_bits(recv.host(), agv_want<T>(counts)));
  }
  {
    std::vector<T> mine{value_of<T>(me, 1, 0), value_of<T>(me, 1, 1)}, want;
    for (int i = 0; i < n; ++i)
      for (int k = 0; k < 2; ++k) want.push_back(value_of<T>(i, 1, k));
    device_vec<T> send(mine), recv(want.size());
    EXPECT_OK(c.template all_gather<T>(send.span(), recv.span()));
    EXPECT_OK(c.synchronize());
    EXPECT(same_bits(recv.host(), want));
  }
  for (bool max : {false, true}) {
    const auto op = max ? reduce_op::max : reduce_op::sum;
    device_vec<T> send(rsv_send<T>(counts, me));
    const auto want = rsv_want<T>(counts, me, max);
    device_vec<T> recv(want.size());
    EXPECT_OK(c.template reduce_scatter_v<T>(send.span(), counts, recv.span(), op));
    std::vector<int> c0(static_cast<std::size_t>(n), 0);
    c0[0] = 4;
    device_vec<T> buf(rsv_send<T>(c0, me));
    EXPECT_OK(c.template all_reduce<T>(buf.span(), op));
    EXPECT_OK(c.synchronize());
    EXPECT(same_bits(recv.host(), want));
    EXPECT(same_bits(buf.host(), rsv_want<T>(c0, 0, max)));
  }
  for (int root = 0; root < n; root += 3) {
    device_vec<T> b(std::vector<T>{value_of<T>(me, 4, 0), value_of<T>(me, 4, 1)});
    EXPECT_OK(c.template broadcast<T>(b.span(), root));
    EXPECT_OK(c.synchronize());
    EXPECT(same_bits(b.host(), std::vector<T>{value_of<T>(root, 4, 0), value_of<T>(root, 4, 1)}));
  }
  EXPECT_OK(c.barrier());
  EXPECT_OK(c.synchronize());
}

template <class C>
void check_all_types(C& c) {
  check_collectives<float>(c);
  check_collectives<double>(c);
  check_collectives<std::int64_t>(c);
  check_collectives<bfloat16>(c);
  check_collectives<float16>(c);
}

// Inputs whose 16-bit sum depends on the rounding: rows[p][k] is what rank p contributes to
// element k. Row 0 holds values near +-1 or 256 with an even last mantissa bit, the other rows
// hold half a unit in the last place of row 0's value (or small values that do not fit beside
// it). Rounding after every step (ties to even) drops each half unit; fp32 accumulation keeps
// them and rounds once. Every value is a multiple of a power of two small enough that all
// partial sums are exact in fp32, so the fp32 result does not depend on the summation order and
// cuBLAS's order, the loopback's rank order and the host reference agree bit for bit.
template <class T>
struct rounding_case {
  std::vector<std::vector<T>> rows;  // [P][n]
  std::vector<T> want;               // fp32 accumulation, one rounding
  std::vector<T> stepwise;           // rounded after every step, in rank order
};

template <class T>
rounding_case<T> make_rounding_case(int P, int n) {
  const float ulp = std::is_same_v<T, bfloat16> ? 0.0078125f : 0.0009765625f;  // at 1.0
  rounding_case<T> rc;
  rc.rows.assign(static_cast<std::size_t>(P), std::vector<T>(static_cast<std::size_t>(n)));
  for (int k = 0; k < n; ++k) {
    float base = 1.0f + 2.0f * ulp * static_cast<float>(k % 8), small = ulp / 2;
    if (k % 3 == 1) {
      base = -base;
      small = -small;
    }
    if (k % 3 == 2) base = 256.0f, small = 256.0f * ulp / 2 * static_cast<float>(1 + k % 2);
    for (int p = 0; p < P; ++p)
      rc.rows[static_cast<std::size_t>(p)][static_cast<std::size_t>(k)] = T(p == 0 ? base : small);
  }
  for (int k = 0; k < n; ++k) {
    double exact = 0;
    T step{};
    for (int p = 0; p < P; ++p) {
      const T x = rc.rows[static_cast<std::size_t>(p)][static_cast<std::size_t>(k)];
      exact += as_double(x);
      step = p == 0 ? x : T(static_cast<float>(step) + static_cast<float>(x));
    }
    rc.want.push_back(T(static_cast<float>(exact)));
    rc.stepwise.push_back(step);
  }
  return rc;
}

// cuBLAS's row sum of the NCCL communicator (detail::cublas_row_sum), with P = 1 to 8 rows: the
// numeric path of nccl_communicator's 16-bit reduce_scatter_v / all_reduce for P ranks, which one
// GPU cannot run through NCCL itself (NCCL refuses two ranks on one GPU).
template <class T>
void check_row_sum() {
  detail::cublas_row_sum sum;
  const int n = 24;
  for (int P = 1; P <= 8; ++P) {
    const auto rc = make_rounding_case<T>(P, n);
    std::vector<T> flat, ones(static_cast<std::size_t>(P), T(1.0f));
    for (const auto& r : rc.rows) flat.insert(flat.end(), r.begin(), r.end());
    device_vec<T> rows(flat), one(ones), out(static_cast<std::size_t>(n));
    EXPECT_OK(sum.sum<T>(rows.p, P, n, one.p, out.p, nullptr));
    EXPECT(cudaStreamSynchronize(nullptr) == cudaSuccess);
    EXPECT(same_bits(out.host(), rc.want));
    // The inputs tell the two roundings apart from three rows on (two rows: one rounding either
    // way).
    if (P >= 3) EXPECT(!same_bits(rc.stepwise, rc.want));
  }
  // The pedantic fp32 compute type is what should run; print it if cuBLAS refused it.
  if (!sum.pedantic()) std::printf("note: cuBLAS refused CUBLAS_COMPUTE_32F_PEDANTIC; used 32F\n");
  if (!sum.stream_independent())
    std::printf("note: cuBLAS refused a zero-byte workspace; sums use its default pool\n");
}

// The loopback world's fp32 rank-order kernel on the same inputs: reduce_scatter_v (every rank
// gets n elements) and all_reduce (rank 0's n elements).
template <class T>
void check_loopback_rounding(int P) {
  const int n = 24;
  const auto rc = make_rounding_case<T>(P, n);
  auto st = run_loopback_world(P, [&](loopback_communicator& c) {
    const auto& mine = rc.rows[static_cast<std::size_t>(c.rank())];
    std::vector<T> send;
    for (int j = 0; j < P; ++j) send.insert(send.end(), mine.begin(), mine.end());
    const std::vector<int> counts(static_cast<std::size_t>(P), n);
    device_vec<T> d_send(send), d_recv(static_cast<std::size_t>(n)), buf(mine);
    EXPECT_OK(c.template reduce_scatter_v<T>(d_send.span(), counts, d_recv.span(), reduce_op::sum));
    EXPECT_OK(c.template all_reduce<T>(buf.span(), reduce_op::sum));
    EXPECT_OK(c.synchronize());
    EXPECT(same_bits(d_recv.host(), rc.want));
    EXPECT(same_bits(buf.host(), rc.want));
  });
  for (const auto& s : st) EXPECT_OK(s);
}

// NCCL with one rank: a 16-bit sum over one rank is each value itself, so this checks that the
// staging + cuBLAS path moves every value through unchanged (one rank cannot show the fp32
// accumulation itself: check_row_sum does, with more rows). Normal finite values of both signs,
// integers and fractions, large and small.
template <class T>
void check_nccl_sum16_one_rank(nccl_communicator& c, cudaStream_t s) {
  std::vector<T> v;
  for (int k = 0; k < 37; ++k) {
    const float x = (static_cast<float>(k * 37 % 101) - 50.0f) * (k % 2 ? 0.0390625f : 3.5f);
    v.push_back(T(x == 0.0f ? 0.25f : x));
  }
  v.push_back(T(std::is_same_v<T, bfloat16> ? 3.0e38f : 65504.0f));    // the largest finite
  v.push_back(T(std::is_same_v<T, bfloat16> ? -1.0e-37f : -6.2e-5f));  // near the smallest normal
  const std::vector<int> counts{static_cast<int>(v.size())};
  device_vec<T> send(v), recv(v.size()), buf(v);
  // The row-view forms on the stream of the context passed (the communicator holds none).
  cuda_copy_exec x(s);
  const int n = static_cast<int>(v.size());
  EXPECT_OK(c.reduce_scatter_v(x, row_view<const T, device_space>(send.span().data(), n, 1), counts,
                               row_view<T, device_space>(recv.span().data(), n, 1),
                               reduce_op::sum));
  EXPECT_OK(c.all_reduce(x, row_view<T, device_space>(buf.span().data(), n, 1), reduce_op::sum));
  EXPECT_OK(c.synchronize(s));
  EXPECT(same_bits(recv.host(), v));
  EXPECT(same_bits(buf.host(), v));
}

// A one-rank NCCL communicator from a fresh unique id.
expected<nccl_communicator> one_rank_nccl(cudaStream_t s, bool verify) {
  auto id = nccl_communicator::make_unique_id();
  if (!id) return unexpected<error>(id.error());
  nccl_options opt;
  opt.timeout = std::chrono::seconds(60);
  opt.stream = s;
  opt.verify_counts = verify;
  return nccl_communicator::from_unique_id(*id, 1, 0, opt);
}

}  // namespace

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: skipped\n");
    return 77;
  }
  int cases = 0, failed_cases = 0;
  auto finish_case = [&](int before) {
    ++cases;
    if (failures.load() != before) ++failed_cases;
  };

  // The loopback world with 1, 2, 3, 5 and 8 ranks.
  for (int n : {1, 2, 3, 5, 8}) {
    const int before = failures.load();
    auto st = run_loopback_world(n, [](loopback_communicator& c) { check_all_types(c); });
    for (const auto& s : st) EXPECT_OK(s);
    finish_case(before);
  }

  // Loopback split: two halves of 8 ranks, each checked as a world of 4.
  {
    const int before = failures.load();
    auto st = run_loopback_world(8, [](loopback_communicator& c) {
      auto sub = c.split(c.rank() % 2, c.rank());
      EXPECT(sub.has_value());
      if (sub) check_collectives<float>(*sub);
    });
    for (const auto& s : st) EXPECT_OK(s);
    finish_case(before);
  }

  // Loopback faults: counts that disagree fail every rank through the host rendezvous.
  {
    const int before = failures.load();
    auto st = run_loopback_world(4,
                                 [](loopback_communicator& c) -> status {
                                   std::vector<int> sc(4, 1), rc(4, 1);
                                   if (c.rank() == 2) rc[0] = 2;
                                   device_vec<float> send(std::size_t{4}), recv(std::size_t{5});
                                   return c.all_to_all_v<float>(send.span(), sc, recv.span(), rc);
                                 },
                                 {.timeout = std::chrono::milliseconds(500)});
    for (const auto& s : st) EXPECT(!s && s.error().code == errc::comm_mismatch);
    finish_case(before);
  }

  // NCCL with one rank, created from a unique id, non-blocking.
  {
    const int before = failures.load();
    auto id = nccl_communicator::make_unique_id();
    EXPECT_OK(id);
    if (id) {
      cudaStream_t s = nullptr;
      cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
      auto c = nccl_communicator::from_unique_id(
          *id, 1, 0, {.timeout = std::chrono::seconds(60), .stream = s});
      EXPECT_OK(c);
      if (c) {
        EXPECT(c->rank() == 0 && c->size() == 1);
        check_all_types(*c);
        // The fp32 rank-order path for 16-bit floats.
        const std::vector<int> counts{5};
        for (bool max : {false, true}) {
          device_vec<bfloat16> send(rsv_send<bfloat16>(counts, 0)), out(std::size_t{5}),
              staging(reduce_scatter_v_fp32_staging(*c, counts));
          EXPECT_OK(reduce_scatter_v_fp32<bfloat16>(*c, send.span(), counts, out.span(),
                                                    max ? reduce_op::max : reduce_op::sum,
                                                    staging.span(), s));
          EXPECT_OK(c->synchronize());
          EXPECT(same_bits(out.host(), rsv_want<bfloat16>(counts, 0, max)));
        }
        auto sub = c->split(0, 0);
        EXPECT_OK(sub);
        if (sub) check_collectives<float>(*sub);
      }
      cudaStreamDestroy(s);
    }
    finish_case(before);
  }

  // fp32 accumulation of 16-bit sums with 1 to 8 summands: cuBLAS's row sum (NCCL's numeric
  // path) and the loopback kernel give the once-rounded sum on inputs where rounding after
  // every step differs.
  {
    const int before = failures.load();
    check_row_sum<bfloat16>();
    check_row_sum<float16>();
    for (int P : {3, 5, 8}) {
      check_loopback_rounding<bfloat16>(P);
      check_loopback_rounding<float16>(P);
    }
    finish_case(before);
  }

  // NCCL (one rank): the 16-bit sums through staging and cuBLAS keep every value; the
  // communicator's buffers survive a move and a move-assignment onto a communicator that holds
  // its own buffers; split children work too.
  {
    const int before = failures.load();
    cudaStream_t s = nullptr, s2 = nullptr;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking);
    {
      auto c = one_rank_nccl(s, false);
      EXPECT_OK(c);
      if (c) {
        check_nccl_sum16_one_rank<bfloat16>(*c, s);
        check_nccl_sum16_one_rank<float16>(*c, s);
        nccl_communicator moved = std::move(*c);
        check_nccl_sum16_one_rank<bfloat16>(moved, s);
        EXPECT(!c->reduce_scatter_v<bfloat16>({}, std::vector<int>{0}, {}, reduce_op::sum));
        auto other = one_rank_nccl(s2, false);
        EXPECT_OK(other);
        if (other) {
          check_nccl_sum16_one_rank<float16>(*other, s2);  // other owns buffers of its own
          *other = std::move(moved);                       // ... which the assignment releases
          // The buffers move to another stream: the calls pass cuda_copy_exec{s2}.
          check_nccl_sum16_one_rank<float16>(*other, s2);
          check_nccl_sum16_one_rank<bfloat16>(*other, s2);
          auto sub = other->split(0, 0);
          EXPECT_OK(sub);
          if (sub) check_nccl_sum16_one_rank<bfloat16>(*sub, s2);
        }
      }
    }
    cudaStreamDestroy(s);
    cudaStreamDestroy(s2);
    finish_case(before);
  }

  // NCCL (one rank) with verify_counts: matching counts run every collective as before (and the
  // split child inherits the option); counts a sender and a receiver disagree on (rank 0 sends
  // itself 1 element and expects 2) are errc::comm_mismatch naming both, not a hang; rejected
  // arguments are still reported as themselves. Either breaks the communicator. With one rank
  // every rank reporting the same message cannot be shown; the MPI and thread-world tests cover
  // the same check_headers rules across ranks.
  {
    const int before = failures.load();
    cudaStream_t s = nullptr;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    {
      auto c = one_rank_nccl(s, true);
      EXPECT_OK(c);
      if (c) {
        EXPECT(c->options().verify_counts);
        check_all_types(*c);
        check_nccl_sum16_one_rank<bfloat16>(*c, s);
        auto sub = c->split(0, 0);
        EXPECT_OK(sub);
        if (sub) {
          EXPECT(sub->options().verify_counts);
          check_collectives<float16>(*sub);
        }
        device_vec<float> send(std::size_t{1}), recv(std::size_t{2});
        const std::vector<int> one{1}, two{2};
        auto st = c->all_to_all_v<float>(send.span(), one, recv.span(), two);
        EXPECT(!st && st.error().code == errc::comm_mismatch);
        if (!st) {
          const auto& m = st.error().message;
          EXPECT(m.find("count mismatch in all_to_all_v") != std::string::npos);
          EXPECT(m.find("rank 0 sends 1 elements to rank 0, which expects 2") != std::string::npos);
        }
        EXPECT(c->broken());
        auto after = c->barrier();
        EXPECT(!after && after.error().code == errc::comm_broken);
      }
      auto r = one_rank_nccl(s, true);
      EXPECT_OK(r);
      if (r) {
        device_vec<float> send(std::size_t{4}), recv(std::size_t{4});
        const std::vector<int> wrong{1, 1};  // one count per rank is needed: 1
        auto st = r->reduce_scatter_v<float>(send.span(), wrong, recv.span(), reduce_op::sum);
        EXPECT(!st && st.error().code == errc::shape_mismatch);
        EXPECT(r->broken());
      }
    }
    cudaStreamDestroy(s);
    finish_case(before);
  }

  std::printf("[doctest] test cases: %d | %d passed | %d failed | 0 skipped\n", cases,
              cases - failed_cases, failed_cases);
  return failures.load() ? 1 : 0;
}
