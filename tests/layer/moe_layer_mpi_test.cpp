// The MoE layer under MPI (mpirun -np 8): every process is one rank and runs its part of the
// layer; the ranks' results are gathered and checked against the single-rank fp64 reference of
// layer_harness.hpp (outputs, input gradients, the reduced router and expert gradients, the aux
// and z-loss partials) for dropless, sub-sequence and full-sequence dropping, with and without
// padding, on 12 folds of 8 ranks.
#include <moefold/comm/mpi/mpi_communicator.hpp>

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <mpi.h>

#include "layer_harness.hpp"

using namespace moefold;
using namespace moefold::test;

namespace {

// Every rank's copy of one field of its result, in rank order.
template <class V>
std::vector<V> gather(const V& mine) {
  using E = typename V::value_type;
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const int n = static_cast<int>(mine.size());
  std::vector<int> counts(static_cast<std::size_t>(size)), displs(static_cast<std::size_t>(size));
  MPI_Allgather(&n, 1, MPI_INT, counts.data(), 1, MPI_INT, MPI_COMM_WORLD);
  int total = 0;
  for (int i = 0; i < size; ++i) {
    displs[static_cast<std::size_t>(i)] = total;
    total += counts[static_cast<std::size_t>(i)];
  }
  std::vector<E> all(static_cast<std::size_t>(total));
  const MPI_Datatype t = std::is_same_v<E, double> ? MPI_DOUBLE : MPI_INT;
  MPI_Allgatherv(mine.data(), n, t, all.data(), counts.data(), displs.data(), t, MPI_COMM_WORLD);
  std::vector<V> out;
  for (int i = 0; i < size; ++i)
    out.emplace_back(
        all.begin() + displs[static_cast<std::size_t>(i)],
        all.begin() + displs[static_cast<std::size_t>(i)] + counts[static_cast<std::size_t>(i)]);
  return out;
}

template <class Policy, class Dispatcher>
long long check_under_mpi(const problem& p, const Policy& policy, drop_mode mode) {
  auto world = mpi_communicator::wrap(MPI_COMM_WORLD, {.timeout = std::chrono::seconds(60)});
  REQUIRE(world);
  auto mine = run_layer_rank<double, Policy, Dispatcher>(p, policy, *world);
  REQUIRE_MESSAGE(mine.has_value(), mine.error().message);
  const std::vector<double> scalars = {mine->aux, mine->z, static_cast<double>(mine->dropped)};
  const auto out = gather(mine->out), dx = gather(mine->dx), dwr = gather(mine->dw_router),
             dw1 = gather(mine->dw1), dw2 = gather(mine->dw2), sc = gather(scalars);
  const auto idx = gather(mine->indices), kept = gather(mine->kept);
  std::vector<layer_result> all(out.size());
  for (std::size_t r = 0; r < all.size(); ++r)
    all[r] = {.out = out[r],
              .dx = dx[r],
              .dw_router = dwr[r],
              .dw1 = dw1[r],
              .dw2 = dw2[r],
              .aux = sc[r][0],
              .z = sc[r][1],
              .dropped = static_cast<long long>(sc[r][2]),
              .indices = idx[r],
              .kept = kept[r],
              .capacity = -1,  // not reported by the host runner
              .rows_per_expert = {}};
  return check_layer_results<double>(p, all, mode);
}

}  // namespace

TEST_CASE("the MoE layer under 8 MPI processes equals the fp64 reference on 12 folds") {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  REQUIRE_MESSAGE(size == 8, "run this test with mpirun -np 8");
  using a2a = all_to_all_dispatcher<double, mpi_communicator>;
  using ag = all_gather_dispatcher<double, mpi_communicator>;
  int i = 0, dropping = 0;
  for (const auto& f : mpi_folds) {
    const auto fold = make_folded(f).value();
    problem p{.fold = f};
    p.experts = std::max(2, fold.ep() * (1 + i % 2));
    p.topk = 2;
    p.ffn = 2 * fold.etp();
    p.tokens = 4;
    const bool pad = i % 2 == 1;
    CAPTURE(pad);
    CHECK(check_under_mpi<dropless, a2a>(p, dropless{}, drop_mode::none) == 0);
    dropping += check_under_mpi<sub_sequence, a2a>(
                    p, sub_sequence{.capacity_factor = 1.0, .pad_to_capacity = pad},
                    drop_mode::per_rank) > 0;
    dropping += check_under_mpi<full_sequence, ag>(
                    p, full_sequence{.capacity_factor = 1.0, .pad_to_capacity = pad},
                    drop_mode::per_sequence) > 0;
    ++i;
  }
  CHECK(dropping >= 12);  // tokens were actually dropped in most runs
}

#include "../mpi_doctest_main.hpp"
