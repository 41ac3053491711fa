// The text bench-comm-a2av-mpi prints (benchmarks/comm/all_to_all_v_mpi.cpp), read as it is into
// a calibration's all-to-all table, for moefold-plan --calibration:
//
//   # moefold all_to_all_v, MPI backend, 16 ranks on 2 nodes, float32
//   #      size(B)        count   time(us)      algbw      busbw    mpi(us)      ratio
//   #                (elements)                (GB/s)     (GB/s)
//             2048          512        5.3      0.386      0.193        0.3      16.31
//   ...
//
// The header says how many nodes the ranks spanned: one node gives the intra-node table; more
// give the inter-node one, whose NIC rate is the bus bandwidth times the off-node share of a
// rank's peers, (ranks - ranks per node) / (ranks - 1), as for nccl-tests' figures
// (calibration_file.hpp). The bus bandwidth is taken from the size and time columns,
// size / time * (ranks - 1) / ranks, the benchmark's own definition, at full precision.
// A one-GPU loopback run measures no link and is refused, as is a run that reported a failed
// collective; a malformed line is an error naming its number.
#pragma once

#include <moefold/core/expected.hpp>
#include <moefold/plan/calibration.hpp>

#include <charconv>
#include <cmath>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

namespace moefold::examples {

//! The first line of every output of bench-comm-a2av-*.
inline constexpr std::string_view a2a_bench_banner = "# moefold all_to_all_v, ";

[[nodiscard]] inline bool is_a2a_bench_output(std::string_view text) noexcept {
  return text.substr(0, a2a_bench_banner.size()) == a2a_bench_banner;
}

[[nodiscard]] inline expected<plan::calibration> calibration_from_a2a_bench(std::string_view text) {
  auto bad = [](const std::string& what) {
    return make_error(errc::invalid_argument, "bench-comm-a2av output: " + what);
  };
  std::vector<std::string> lines;
  for (std::size_t at = 0; at < text.size();) {
    const std::size_t end = std::min(text.find('\n', at), text.size());
    lines.emplace_back(text.substr(at, end - at));
    at = end + 1;
  }
  if (lines.empty() || !is_a2a_bench_output(lines[0])) return bad("line 1 is not its banner");
  const std::string& head = lines[0];
  if (head.find("loopback") != std::string::npos)
    return bad(
        "a one-GPU loopback run measures no link; run bench-comm-a2av-mpi over the GPUs of a node "
        "(intra-node) or of several nodes (inter-node)");
  // "... backend, N ranks on K node(s), ..." (from_chars: no overflow, no locale).
  int ranks = 0, nodes = 0;
  const auto number = [&](std::size_t at, int& out) -> std::size_t {
    const char* end = head.data() + head.size();
    auto [p, ec] = std::from_chars(head.data() + at, end, out);
    return ec == std::errc{} ? static_cast<std::size_t>(p - head.data()) : std::string::npos;
  };
  std::size_t at = head.find("backend, ");
  if (at != std::string::npos) at = number(at + 9, ranks);
  if (at != std::string::npos && head.compare(at, 10, " ranks on ") == 0)
    at = number(at + 10, nodes);
  else
    at = std::string::npos;
  if (at == std::string::npos || head.compare(at, 5, " node") != 0)
    return bad(
        "line 1 does not say how many ranks on how many nodes (\"N ranks on K nodes\"); re-run "
        "a bench-comm-a2av-mpi that prints it");
  if (ranks < 2 || nodes < 1 || nodes > ranks)
    return bad("line 1: " + std::to_string(ranks) + " ranks on " + std::to_string(nodes) +
               " nodes is not a measurement of a link");
  if (nodes > 1 && ranks % nodes != 0)
    return bad("line 1: " + std::to_string(ranks) + " ranks do not spread evenly over " +
               std::to_string(nodes) + " nodes");
  plan::calibration c;
  c.source = "bench-comm-a2av-mpi, " + std::to_string(ranks) + " ranks on " +
             std::to_string(nodes) + (nodes == 1 ? " node" : " nodes");
  // The NIC's share of a rank's traffic: its peers on other nodes.
  const double share =
      nodes == 1 ? 1.0
                 : static_cast<double>(ranks - ranks / nodes) / static_cast<double>(ranks - 1);
  auto& table = nodes == 1 ? c.collectives.a2a_intra : c.collectives.a2a_inter;
  for (std::size_t i = 1; i < lines.size(); ++i) {
    const std::string& l = lines[i];
    const std::string where = "line " + std::to_string(i + 1);
    if (l.rfind("# ERROR", 0) == 0)
      return bad(where + ": the benchmark reported a failed collective");
    if (l.empty() || l[0] == '#') continue;
    double size = 0, count = 0, us = 0, algbw = 0, busbw = 0, mpi_us = 0, ratio = 0;
    char rest = 0;
    if (std::sscanf(l.c_str(), "%lf %lf %lf %lf %lf %lf %lf %c", &size, &count, &us, &algbw, &busbw,
                    &mpi_us, &ratio, &rest) != 7)
      return bad(where + " is not 7 numbers (size, count, time, algbw, busbw, mpi time, ratio)");
    if (!(size > 0) || !(us > 0) || !std::isfinite(size) || !std::isfinite(us))
      return bad(where + ": size and time must be positive");
    for (const auto& r : table)
      if (r.size == size) return bad(where + ": a second rate for " + std::to_string(size) + " B");
    // Bus bandwidth from size and time (the printed busbw has 3 decimals: 0.000 on a slow run).
    const double bus = size / (us * 1e-6) * (ranks - 1) / ranks;
    table.push_back({.size = size, .value = bus * share});
  }
  if (table.empty()) return bad("no measurement lines");
  if (auto s = plan::normalize(c); !s) return unexpected<error>(s.error());
  return c;
}

}  // namespace moefold::examples
