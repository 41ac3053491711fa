// moefold-mesh's flags (examples/moefold_mesh.cpp), parsed without running the tool: the tool and
// its flag fuzzer (tests/fuzz/fuzz_flags.cpp) call the same parse().
#pragma once

#include <moefold/mesh/groups.hpp>

#include "cli_args.hpp"

#include <optional>
#include <string>
#include <vector>

namespace moefold::examples::mesh_cli {

inline constexpr const char* usage_text =
    "usage: moefold-mesh --world N [--tp N] [--cp N] [--pp N] [--ep N] [--etp N] [--order STR]\n"
    "                    [--dist-opt-instances N] [--hierarchical-cp A,B,...] [--rank-offset N]\n"
    "                    [--gpus-per-node N] [--format text|json|svg]\n";
inline constexpr const char* notes_text =
    "Sizes not given are 1, except --etp, which defaults to --tp (as Megatron-Core's trainer\n"
    "does). dp = world / (tp*cp*pp) and edp = world / (etp*ep*pp) are derived. --order is a\n"
    "Megatron order string (default tp-cp-ep-dp-pp; leftmost varies fastest).\n";

//! The largest job the tool describes: its output lists every rank of every group, so the size
//! of the world bounds its time and memory (a 2^20-GPU job prints about a gigabyte).
inline constexpr int max_world = 1 << 20;

struct options {
  int world = 0;
  int tp = 1, cp = 1, pp = 1, ep = 1;
  std::optional<int> etp;
  std::string order = "tp-cp-ep-dp-pp";
  int dist_opt_instances = 1;
  std::vector<int> hierarchical_cp;
  int rank_offset = 0;
  int gpus_per_node = 8;
  std::string format = "text";
};

//! The flags, on CLI11, and the limits checked after them.
inline parse_outcome parse(int argc, const char* const* argv, options& o) {
  CLI::App app{"", "moefold-mesh"};
  configure(app, usage_text, notes_text);
  app.add_option("--world", o.world, "GPUs in the job (1 to " + std::to_string(max_world) + ")")
      ->default_str("")
      ->required();
  app.add_option("--tp", o.tp, "attention tensor-parallel size");
  app.add_option("--cp", o.cp, "attention context-parallel size");
  app.add_option("--pp", o.pp, "pipeline-parallel size (shared by both mappings)");
  app.add_option("--ep", o.ep, "expert-parallel size");
  int etp = 0;
  app.add_option("--etp", etp, "expert tensor-parallel size")->default_str("--tp");
  app.add_option("--order", o.order, "Megatron-Core order string, leftmost varies fastest");
  app.add_option("--dist-opt-instances", o.dist_opt_instances,
                 "distributed-optimizer instances (partial data parallelism)");
  app.add_option("--hierarchical-cp", o.hierarchical_cp,
                 "hierarchical context-parallel sizes, comma-separated")
      ->delimiter(',')
      ->default_str("none");
  app.add_option("--rank-offset", o.rank_offset, "global rank of this job's rank 0");
  app.add_option("--gpus-per-node", o.gpus_per_node, "GPUs per node (text and SVG layout)");
  app.add_option("--format", o.format, "output format")
      ->check(CLI::IsMember({"text", "json", "svg"}));
  return examples::parse(app, argc, argv, [&] {
    if (app.count("--etp")) o.etp = etp;
    if (o.world > max_world)
      throw usage_error{"--world " + std::to_string(o.world) + " exceeds the limit of " +
                        std::to_string(max_world) + " GPUs (rule: the output lists every rank)"};
    if (o.hierarchical_cp.size() > static_cast<std::size_t>(max_hierarchical_cp_levels))
      throw usage_error{"--hierarchical-cp: at most " + std::to_string(max_hierarchical_cp_levels) +
                        " levels"};
    if (o.gpus_per_node < 1)
      throw usage_error{"--gpus-per-node must be >= 1 (got " + std::to_string(o.gpus_per_node) +
                        ")"};
  });
}

}  // namespace moefold::examples::mesh_cli
