// The MPI backend with device buffers (comm/cuda/mpi_device_communicator.hpp) under mpirun:
// host buffers always (they go to MPI as they are), device buffers when a GPU is present (staged
// through host memory, or handed to a CUDA-aware MPI), against the direct references.
#include <moefold/comm/cuda/mpi_device_communicator.hpp>

#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "collective_reference.hpp"

using namespace moefold;
using namespace moefold::test;

namespace {

int failures = 0;
int cases = 0;
#define EXPECT(cond)                                                       \
  do {                                                                     \
    if (!(cond)) {                                                         \
      std::printf("%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                          \
    }                                                                      \
  } while (0)

// A buffer on the host or on the device, with its contents readable on the host.
template <class T>
struct buffer {
  bool device;
  std::vector<T> h;
  T* d = nullptr;
  buffer(bool on_device, std::vector<T> v) : device(on_device), h(std::move(v)) {
    if (device) {
      cudaMalloc(&d, sizeof(T) * (h.size() ? h.size() : 1));
      if (!h.empty()) cudaMemcpy(d, h.data(), sizeof(T) * h.size(), cudaMemcpyHostToDevice);
    }
  }
  buffer(const buffer&) = delete;
  buffer& operator=(const buffer&) = delete;
  ~buffer() {
    if (d) cudaFree(d);
  }
  std::span<T> span() { return device ? std::span<T>(d, h.size()) : std::span<T>(h); }
  std::vector<T> read() {
    if (device && !h.empty()) cudaMemcpy(h.data(), d, sizeof(T) * h.size(), cudaMemcpyDeviceToHost);
    return h;
  }
};

template <class T>
void check(mpi_device_communicator& c, bool device) {
  const int me = c.rank(), n = c.size();
  std::mt19937 g(static_cast<unsigned>(n * 31 + 7));
  const auto M = random_matrix(g, n, 5);
  const auto counts = random_counts(g, n, 4);
  ++cases;
  const int before = failures;
  {
    buffer<T> send(device, a2a_send<T>(M, me)),
        recv(device, std::vector<T>(a2a_want<T>(M, me).size()));
    EXPECT(c.all_to_all_v<T>(send.span(), row(M, me), recv.span(), column(M, me)).has_value());
    EXPECT(same_bits(recv.read(), a2a_want<T>(M, me)));
  }
  {
    buffer<T> send(device, agv_send<T>(counts, me)),
        recv(device, std::vector<T>(agv_want<T>(counts).size()));
    EXPECT(c.all_gather_v<T>(send.span(), recv.span(), counts).has_value());
    EXPECT(same_bits(recv.read(), agv_want<T>(counts)));
  }
  {
    buffer<T> send(device, rsv_send<T>(counts, me)),
        recv(device, std::vector<T>(rsv_want<T>(counts, me, false).size()));
    EXPECT(c.reduce_scatter_v<T>(send.span(), counts, recv.span(), reduce_op::sum).has_value());
    EXPECT(same_bits(recv.read(), rsv_want<T>(counts, me, false)));
  }
  {
    std::vector<int> c0(static_cast<std::size_t>(n), 0);
    c0[0] = 3;
    buffer<T> buf(device, rsv_send<T>(c0, me));
    EXPECT(c.all_reduce<T>(buf.span(), reduce_op::max).has_value());
    EXPECT(same_bits(buf.read(), rsv_want<T>(c0, 0, true)));
    buffer<T> b(device, std::vector<T>{value_of<T>(me, 3, 0), value_of<T>(me, 3, 1)});
    EXPECT(c.broadcast<T>(b.span(), n - 1).has_value());
    EXPECT(same_bits(b.read(), std::vector<T>{value_of<T>(n - 1, 3, 0), value_of<T>(n - 1, 3, 1)}));
  }
  if (failures != before)
    std::printf("rank %d: failed for %s buffers\n", me, device ? "device" : "host");
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
  {
    auto c = mpi_device_communicator::wrap(MPI_COMM_WORLD).value();
    if (devices > 0) cudaSetDevice(c.rank() % devices);
    for (bool device : {false, true}) {
      if (device && devices == 0) continue;  // counted as skipped below
      check<float>(c, device);
      check<std::int64_t>(c, device);
      check<bfloat16>(c, device);
    }
  }
  int worst = failures;
  MPI_Allreduce(&failures, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 0)
    std::printf("[doctest] test cases: %d | %d passed | %d failed | %d skipped\n",
                devices ? cases : cases + 3, worst ? 0 : cases, worst ? cases : 0, devices ? 0 : 3);
  MPI_Finalize();
  return worst ? 1 : 0;
}
