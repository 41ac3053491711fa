//! @file calibration.hpp
//! @brief Measured rates that replace the step model's built-in curves (docs/planner.md,
//! "Calibration"): dense GEMM by shape, expert GEMM by rows per expert, causal attention by
//! sequence length, memory-bound bandwidth, and collective bus bandwidth by message size and
//! link. Each section is optional; a missing one leaves the built-in curve in place.
//!
//! Rates are kept as fractions of the measured GPU's datasheet rate (bf16 peak for GEMM and
//! attention, HBM bandwidth for memory-bound kernels) and applied as fractions of the planned
//! cluster's, so an H200 measurement applies to an H100 cluster with the same compute (same
//! tensor cores and clocks) and its memory-bound rates scaled by the HBM ratio (3.35 / 4.8 TB/s,
//! about 1 / 1.43). Collective bus bandwidths are taken as measured (bytes/s), per link class.
//!
//! How a table replaces a curve:
//!   - GEMM (dense, and expert GEMMs separately): the measured shape nearest the query in
//!     log(M), log(N), log(K) gives a correction, measured fraction / the built-in curve's
//!     fraction at that shape (call cost included: a measured rate includes it), which
//!     multiplies the built-in fraction at the query. At a measured shape the rate is the
//!     measured one; between shapes the curve's shape dependence remains.
//!   - attention: the measured fwd+bwd fraction, interpolated linearly in log(sequence length),
//!     held constant beyond the measured range.
//!   - memory-bound kernels: the measured copy bandwidth as a fraction of HBM bandwidth.
//!   - collectives: bus bandwidth interpolated in log(bytes) (held beyond the range); it then
//!     includes latency, so no separate latency term is added.
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "../core/expected.hpp"
#include "efficiency.hpp"

namespace moefold {
inline namespace v0_1 {
namespace plan {

//! One measured GEMM: [M, K] x [K, N] at `flops` FLOP/s.
struct gemm_rate {
  double m = 0, n = 0, k = 0;
  double flops = 0;
};
//! A measured rate at one size: attention FLOP/s by sequence length, or a collective's rate in
//! bytes/s by message size.
struct sized_rate {
  double size = 0;
  double value = 0;
};

//! Collective rate tables, by message size (bytes each rank sends for all-to-all, the whole
//! result for the ring collectives), per link class, in bytes/s:
//!   - a2a_intra: all-to-all inside a node, bytes leaving a rank per second (nccl-tests' busbw);
//!   - a2a_inter: all-to-all across nodes, off-node bytes per second through a rank's NIC (the
//!     calibration file derives it from nccl-tests' busbw and the measured group's off-node
//!     share, calibration_file.hpp);
//!   - ring_intra, ring_inter: all-gather / reduce-scatter / all-reduce bus bandwidth.
struct collective_rates {
  std::vector<sized_rate> a2a_intra, a2a_inter;
  std::vector<sized_rate> ring_intra, ring_inter;
};

//! The measured rates. Call normalize() before use: the sized tables must be sorted.
struct calibration {
  std::string source;                  //!< where the numbers come from (file, date, commit)
  std::vector<gemm_rate> gemm;         //!< dense GEMMs, FLOP/s converted to fractions on use
  std::vector<gemm_rate> expert_gemm;  //!< per-expert GEMMs, M = rows per expert
  double measured_peak_flops = 0;      //!< bf16 peak of the measured GPU (0: the cluster's)
  double measured_memory_bw = 0;       //!< HBM bandwidth of the measured GPU (0: the cluster's)
  std::vector<sized_rate> attention;   //!< fwd+bwd causal attention FLOP/s by sequence length
  double copy_bw = 0;                  //!< memory-bound bandwidth measured, bytes/s (0: none)
  collective_rates collectives;

  //! The sections that hold measurements, for the tool to say which rates were measured.
  [[nodiscard]] std::vector<std::string> measured_sections() const {
    std::vector<std::string> s;
    if (!gemm.empty()) s.push_back("dense GEMM (" + std::to_string(gemm.size()) + " shapes)");
    if (!expert_gemm.empty())
      s.push_back("expert GEMM (" + std::to_string(expert_gemm.size()) + " shapes)");
    else if (!gemm.empty())
      s.emplace_back("expert GEMM (from the dense GEMM table)");
    if (!attention.empty())
      s.push_back("attention (" + std::to_string(attention.size()) + " sequence lengths)");
    if (copy_bw > 0) s.push_back("memory-bound bandwidth");
    const auto coll = [&](const std::vector<sized_rate>& v, const char* what) {
      if (!v.empty()) s.push_back(std::string(what) + " (" + std::to_string(v.size()) + " sizes)");
    };
    coll(collectives.a2a_intra, "all-to-all intra-node");
    coll(collectives.a2a_inter, "all-to-all inter-node");
    coll(collectives.ring_intra, "all-gather/reduce-scatter intra-node");
    coll(collectives.ring_inter, "all-gather/reduce-scatter inter-node");
    return s;
  }
  //! The built-in curves still in use.
  [[nodiscard]] std::vector<std::string> builtin_sections() const {
    std::vector<std::string> s;
    if (gemm.empty()) s.emplace_back("dense GEMM");
    if (expert_gemm.empty() && gemm.empty()) s.emplace_back("expert GEMM");
    if (attention.empty()) s.emplace_back("attention");
    if (copy_bw <= 0) s.emplace_back("memory-bound bandwidth");
    if (collectives.a2a_intra.empty()) s.emplace_back("all-to-all intra-node");
    if (collectives.a2a_inter.empty()) s.emplace_back("all-to-all inter-node");
    if (collectives.ring_intra.empty()) s.emplace_back("all-gather/reduce-scatter intra-node");
    if (collectives.ring_inter.empty()) s.emplace_back("all-gather/reduce-scatter inter-node");
    return s;
  }
};

namespace detail {

//! The built-in GEMM time: 2 M N K FLOPs at peak * gemm_max * s(M) s(N) s(K),
//! s(x) = x / (x + gemm_half), plus the cost of one call.
[[nodiscard]] inline double gemm_builtin_s(double m, double n, double k, double peak,
                                           const efficiency& e) {
  auto s = [&](double x) { return x / (x + e.gemm_half); };
  return 2.0 * m * n * k / (peak * e.gemm_max * s(m) * s(n) * s(k)) + e.gemm_call_s;
}

//! The fraction of `peak` a GEMM (m, n, k) reaches, everything included: the built-in curve's,
//! corrected by the nearest shape of `table` (measured on a GPU of bf16 peak `table_peak`):
//! measured fraction / the built-in fraction there (see the file comment). A measured rate
//! includes the call overhead, so the correction is taken against the built-in total time.
[[nodiscard]] inline double gemm_fraction(double m, double n, double k, double peak,
                                          const efficiency& e, const std::vector<gemm_rate>& table,
                                          double table_peak) {
  const auto builtin = [&](double mm, double nn, double kk, double pk) {
    return 2.0 * mm * nn * kk / (pk * gemm_builtin_s(mm, nn, kk, pk, e));
  };
  const gemm_rate* best = nullptr;
  double best_d = 0;
  for (const auto& p : table) {
    const double a = std::log(p.m / m), b = std::log(p.n / n), c = std::log(p.k / k);
    const double d = a * a + b * b + c * c;
    if (best == nullptr || d < best_d) best = &p, best_d = d;
  }
  const double at_best = builtin(best->m, best->n, best->k, table_peak);
  return builtin(m, n, k, peak) * (best->flops / table_peak) / at_best;
}

//! `table` (sorted by size) interpolated linearly in log(size), held constant beyond its ends.
[[nodiscard]] inline double interpolate_log(const std::vector<sized_rate>& table, double size) {
  if (size <= table.front().size) return table.front().value;
  if (size >= table.back().size) return table.back().value;
  auto hi = std::lower_bound(table.begin(), table.end(), size,
                             [](const sized_rate& r, double s) { return r.size < s; });
  auto lo = hi - 1;
  const double t = std::log(size / lo->size) / std::log(hi->size / lo->size);
  return lo->value + t * (hi->value - lo->value);
}

}  // namespace detail

//! Sorts the sized tables and checks every value: sizes and rates positive and finite, one rate
//! per size. Returns an error naming the table and the rule.
[[nodiscard]] inline status normalize(calibration& c) {
  auto bad = [](const std::string& what) {
    return make_error(errc::invalid_argument, "calibration: " + what);
  };
  for (auto* t : {&c.gemm, &c.expert_gemm})
    for (const auto& g : *t)
      if (!(g.m > 0 && g.n > 0 && g.k > 0 && g.flops > 0) || !std::isfinite(g.m * g.n * g.k) ||
          !std::isfinite(g.flops))
        return bad("GEMM shapes and rates must be positive and finite");
  for (auto [t, what] : {std::pair{&c.attention, "attention"},
                         std::pair{&c.collectives.a2a_intra, "all-to-all intra-node"},
                         std::pair{&c.collectives.a2a_inter, "all-to-all inter-node"},
                         std::pair{&c.collectives.ring_intra, "ring intra-node"},
                         std::pair{&c.collectives.ring_inter, "ring inter-node"}}) {
    std::sort(t->begin(), t->end(),
              [](const sized_rate& a, const sized_rate& b) { return a.size < b.size; });
    for (std::size_t i = 0; i < t->size(); ++i) {
      const auto& r = (*t)[i];
      if (!(r.size > 0 && r.value > 0) || !std::isfinite(r.size) || !std::isfinite(r.value))
        return bad(std::string(what) + ": sizes and rates must be positive and finite");
      if (i > 0 && (*t)[i - 1].size == r.size)
        return bad(std::string(what) + ": two rates for size " + std::to_string(r.size) +
                   " (rule: one per size)");
    }
  }
  if (!(c.copy_bw >= 0) || !(c.measured_peak_flops >= 0) || !(c.measured_memory_bw >= 0))
    return bad("bandwidths and peaks must be >= 0");
  return {};
}

}  // namespace plan
}  // namespace v0_1
}  // namespace moefold
