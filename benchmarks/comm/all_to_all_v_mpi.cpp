// all_to_all_v throughput of the MPI backend on CPU processes, reported the way nccl-tests
// reports all-to-all: size = bytes each rank sends (its whole send buffer), algbw = size / time,
// busbw = algbw * (n - 1) / n. The peer is a raw MPI_Alltoallv with the same counts in the same
// process; the last column is moefold's time over MPI's (the header exchange and the verdict are
// the overhead, most visible at small sizes).
//
//   mpirun --allow-run-as-root --oversubscribe -np 8 build/benchmarks/comm/bench-comm-a2av-mpi
#include <moefold/comm/mpi/mpi_communicator.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

using namespace moefold;

namespace {

// Seconds per call of f, the slowest rank's, after warm-up.
template <class F>
double time_per_call(MPI_Comm comm, int iters, F&& f) {
  for (int i = 0; i < 3; ++i) f();
  MPI_Barrier(comm);
  const double t0 = MPI_Wtime();
  for (int i = 0; i < iters; ++i) f();
  double t = (MPI_Wtime() - t0) / iters, worst = t;
  MPI_Allreduce(&t, &worst, 1, MPI_DOUBLE, MPI_MAX, comm);
  return worst;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  auto comm = mpi_communicator::wrap(MPI_COMM_WORLD);
  if (!comm) {
    std::fprintf(stderr, "%s\n", comm.error().message.c_str());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  const int n = comm->size(), me = comm->rank();
  const long long max_bytes = argc > 1 ? std::atoll(argv[1]) : (64ll << 20);
  // Nodes spanned (ranks that share memory count as one node), so that moefold-plan
  // --calibration can tell an intra-node table from an inter-node one.
  MPI_Comm local;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &local);
  int local_rank = 0, nodes = 0;
  MPI_Comm_rank(local, &local_rank);
  MPI_Comm_free(&local);
  const int leader = local_rank == 0 ? 1 : 0;
  MPI_Allreduce(&leader, &nodes, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (me == 0) {
    std::printf("# moefold all_to_all_v, MPI backend, %d ranks on %d node%s, float32\n", n, nodes,
                nodes == 1 ? "" : "s");
    std::printf("# %12s %12s %10s %10s %10s %10s %10s\n", "size(B)", "count", "time(us)", "algbw",
                "busbw", "mpi(us)", "ratio");
    std::printf("# %12s %12s %10s %10s %10s %10s %10s\n", "", "(elements)", "", "(GB/s)", "(GB/s)",
                "", "");
  }
  bool failed = false;
  for (long long bytes = 1024 * n; bytes <= max_bytes; bytes *= 4) {
    const int per_peer = static_cast<int>(bytes / (static_cast<long long>(sizeof(float)) * n));
    const std::size_t count = static_cast<std::size_t>(per_peer) * static_cast<std::size_t>(n);
    std::vector<float> send(count, static_cast<float>(me)), recv(count);
    std::vector<int> counts(static_cast<std::size_t>(n), per_peer), displs(counts.size());
    for (int p = 0; p < n; ++p) displs[static_cast<std::size_t>(p)] = p * per_peer;
    const int iters = bytes <= (1 << 20) ? 50 : 10;
    const double t = time_per_call(MPI_COMM_WORLD, iters, [&] {
      if (!comm->all_to_all_v<float>(send, counts, recv, counts)) failed = true;
    });
    const double t_mpi = time_per_call(MPI_COMM_WORLD, iters, [&] {
      MPI_Alltoallv(send.data(), counts.data(), displs.data(), MPI_FLOAT, recv.data(),
                    counts.data(), displs.data(), MPI_FLOAT, MPI_COMM_WORLD);
    });
    // Every block from rank p holds p.
    for (int p = 0; p < n; ++p)
      failed = failed || recv[static_cast<std::size_t>(p * per_peer)] != static_cast<float>(p);
    const double size = static_cast<double>(count * sizeof(float));
    const double algbw = size / t / 1e9, busbw = algbw * (n - 1) / n;
    if (me == 0)
      std::printf("  %12.0f %12zu %10.1f %10.3f %10.3f %10.1f %10.2f\n", size, count, t * 1e6,
                  algbw, busbw, t_mpi * 1e6, t / t_mpi);
  }
  int bad = failed ? 1 : 0, any = bad;
  MPI_Allreduce(&bad, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (me == 0 && any) std::printf("# ERROR: a collective failed or delivered wrong data\n");
  { auto done = std::move(*comm); }  // free moefold's communicator before MPI_Finalize
  MPI_Finalize();
  return any;
}
