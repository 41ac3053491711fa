// GPU collectives: the device loopback world (1 to 8 ranks on one GPU) and NCCL with one rank
// run the same collective checks as the CPU backends, against the same direct references
// (collective_reference.hpp): random counts with zeros and empty ranks, prime world sizes,
// float/double/int64/bf16/fp16. Loopback results must equal the references bit for bit (rank
// order, fp32 accumulation). Without a GPU the program exits 77 (meson: skipped).
#include <moefold/comm/cuda/loopback_world.cuh>
#include <moefold/comm/cuda/nccl_communicator.hpp>
#include <moefold/comm/cuda/nccl_reduce_fp32.cuh>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "collective_reference.hpp"

using namespace moefold;
using namespace moefold::test;

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

// A device copy of a host vector (at least one element, so pointers are never null).
template <class T>
struct device_vec {
  T* p = nullptr;
  std::size_t n = 0;
  explicit device_vec(const std::vector<T>& h) : n(h.size()) {
    cudaMalloc(&p, sizeof(T) * (n ? n : 1));
    if (n) cudaMemcpy(p, h.data(), sizeof(T) * n, cudaMemcpyHostToDevice);
  }
  explicit device_vec(std::size_t count) : n(count) {
    cudaMalloc(&p, sizeof(T) * (n ? n : 1));
    cudaMemset(p, 0xff, sizeof(T) * (n ? n : 1));
  }
  device_vec(const device_vec&) = delete;
  device_vec& operator=(const device_vec&) = delete;
  ~device_vec() { cudaFree(p); }
  std::span<T> span() { return {p, n}; }
  std::vector<T> host() const {
    std::vector<T> h(n);
    if (n) cudaMemcpy(h.data(), p, sizeof(T) * n, cudaMemcpyDeviceToHost);
    return h;
  }
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

  std::printf("[doctest] test cases: %d | %d passed | %d failed | 0 skipped\n", cases,
              cases - failed_cases, failed_cases);
  return failures.load() ? 1 : 0;
}
