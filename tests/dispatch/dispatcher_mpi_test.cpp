// Both dispatcher paths under MPI (mpirun -np 8): every process is one rank, runs its part of the
// layer and checks it against the single-rank fp64 reference (dispatch_harness.hpp).
#include <moefold/comm/mpi/mpi_communicator.hpp>

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <mpi.h>

#include <iostream>
#include <sstream>

#include "dispatch_harness.hpp"

using namespace moefold;
using namespace moefold::test;

namespace {

template <class Path>
void check_on_this_rank(const problem& p) {
  CAPTURE(p.fold.tp);
  CAPTURE(p.fold.cp);
  CAPTURE(p.fold.pp);
  CAPTURE(p.fold.ep);
  CAPTURE(p.fold.etp.value_or(p.fold.tp));
  CAPTURE(std::string(p.fold.order));
  CAPTURE(p.drop);
  CAPTURE(p.pad);
  auto world = mpi_communicator::wrap(MPI_COMM_WORLD, {.timeout = std::chrono::seconds(60)});
  REQUIRE(world);
  auto got = run_rank<Path>(p, *world);
  REQUIRE_MESSAGE(got.has_value(), got.error().message);
  const auto want = expected_for_rank(p, world->rank());
  CHECK(rel_err(got->out, want.out) <= 1e-12);
  CHECK(rel_err(got->dx, want.dx) <= 1e-12);
  CHECK(rel_err(got->dprob, want.dprob) <= 1e-12);
  CHECK(rel_err(got->dw1, want.dw1) <= 1e-12);
  CHECK(rel_err(got->dw2, want.dw2) <= 1e-12);
  if (Path::exact_bytes && !p.pad) CHECK(got->a2a_rows == want.a2a_rows);
  if (p.pad) {  // static shapes: C rows per (source, local expert), padding travels
    const auto fold = make_folded(p.fold).value();
    const int L = p.experts / fold.ep(), P = fold.ep() * fold.etp();
    CHECK(got->rows == p.capacity * L * P);
    for (int c : got->per_expert) CHECK(c == p.capacity * P);
    if (Path::exact_bytes)
      CHECK(got->a2a_rows == static_cast<long long>(p.capacity) * L * (fold.ep() - 1));
  }
}

}  // namespace

TEST_CASE(
    "both dispatcher paths equal the reference on 12 folds of 8 MPI processes: dropless, "
    "dropping, dropping with padding") {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  REQUIRE_MESSAGE(size == 8, "run this test with mpirun -np 8");
  int i = 0;
  for (const auto& f : mpi_folds)
    for (int mode = 0; mode < 3; ++mode) {  // dropless, dropped pairs, capacity 2 with padding
      const auto fold = make_folded(f).value();
      problem p{.fold = f};
      p.experts = fold.ep() * (1 + i % 2);
      p.topk = std::min(2, p.experts);
      p.ffn = 2 * fold.etp();
      p.drop = mode == 1 ? 0.3 : 0.0;
      p.capacity = mode == 2 ? 2 : -1;
      p.pad = mode == 2;
      p.empty_rank = i % 3 == 2;
      check_on_this_rank<all_to_all_path<mpi_communicator>>(p);
      check_on_this_rank<all_gather_path<mpi_communicator>>(p);
      ++i;
    }
}

#include "../mpi_doctest_main.hpp"
