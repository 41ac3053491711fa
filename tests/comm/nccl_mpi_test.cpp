// NCCL bootstrapped by MPI (comm/cuda/nccl_mpi.hpp), compiled by the host compiler alone: one NCCL
// rank per MPI rank; a sum over ranks and a split must come out right. Without a GPU: exit 77.
#include <moefold/comm/cuda/nccl_mpi.hpp>

#include <cstdio>
#include <vector>

using namespace moefold;

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: skipped\n");
    MPI_Finalize();
    return 77;
  }
  int failures = 0;
  {
    auto mpi = mpi_communicator::wrap(MPI_COMM_WORLD).value();
    cudaSetDevice(mpi.rank() % devices);
    cudaStream_t s = nullptr;
    cudaStreamCreate(&s);
    auto nccl = nccl_from_mpi(mpi, {.stream = s});
    if (!nccl) {
      std::printf("nccl_from_mpi: %s\n", nccl.error().message.c_str());
      ++failures;
    } else {
      const int n = nccl->size();
      failures += nccl->rank() != mpi.rank() || n != mpi.size();
      std::vector<float> h{1.f, static_cast<float>(nccl->rank())};
      float* d = nullptr;
      cudaMalloc(&d, sizeof(float) * 2);
      cudaMemcpy(d, h.data(), sizeof(float) * 2, cudaMemcpyHostToDevice);
      failures += !nccl->all_reduce(std::span<float>(d, 2), reduce_op::sum).has_value();
      failures += !nccl->synchronize().has_value();
      cudaMemcpy(h.data(), d, sizeof(float) * 2, cudaMemcpyDeviceToHost);
      failures += h[0] != static_cast<float>(n) || h[1] != static_cast<float>(n * (n - 1) / 2);
      auto sub = nccl->split(0, nccl->rank());
      failures += !sub.has_value() || sub->size() != n;
      cudaFree(d);
    }
    cudaStreamDestroy(s);
  }
  int worst = failures;
  MPI_Allreduce(&failures, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 0)
    std::printf("[doctest] test cases: 1 | %d passed | %d failed | 0 skipped\n", worst ? 0 : 1,
                worst ? 1 : 0);
  MPI_Finalize();
  return worst ? 1 : 0;
}
