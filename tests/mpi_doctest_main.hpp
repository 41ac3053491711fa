// The main of a doctest program run under mpirun: only rank 0 prints the summary (so CI counts
// each case once), other ranks print only their failures, and the exit code is the maximum over
// ranks. Define DOCTEST_CONFIG_IMPLEMENT before including doctest, then include this file.
#pragma once

#include <doctest/doctest.h>
#include <mpi.h>

#include <iostream>
#include <sstream>
#include <string>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  doctest::Context ctx(argc, argv);
  std::ostringstream quiet;
  if (rank != 0) ctx.setCout(&quiet);
  int rc = ctx.run();
  if (rc != 0 && rank != 0) {
    // A failure seen only on this rank: show its report (without its summary lines).
    std::istringstream in(quiet.str());
    for (std::string line; std::getline(in, line);)
      if (line.rfind("[doctest]", 0) != 0) std::cerr << "[rank " << rank << "] " << line << "\n";
  }
  int worst = rc;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst;
}
