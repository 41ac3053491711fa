// moefold-plan's flags (examples/moefold_plan.cpp), parsed without running the tool: the tool and
// its flag fuzzer (tests/fuzz/fuzz_flags.cpp) call the same parse().
#pragma once

#include <moefold/plan/cluster.hpp>
#include <moefold/plan/model_presets.hpp>
#include <moefold/plan/search.hpp>

#include "cli_args.hpp"

#include <iterator>
#include <optional>
#include <string>
#include <vector>

namespace moefold::examples::plan_cli {

namespace mp = moefold::plan;

inline constexpr const char* usage_text =
    "usage: moefold-plan --model NAME|FILE --cluster NAME|FILE --gpus N [--gbs N] [--seq N]\n"
    "                    [--tp N --cp N --ep N --etp N --pp N --vpp N --mbs N] [--top N]\n"
    "                    [--format text|json|svg] [--calibration FILE]\n"
    "                    [--dispatcher alltoall|deepep|hybridep] [--fp8-dispatch] [--ep-overlap]\n"
    "                    [--cuda-graphs]\n";

inline std::string notes_text() {
  std::string models, clusters;
  for (auto n : mp::model_preset_names) models += " " + std::string(n);
  for (auto n : mp::cluster_preset_names) clusters += " " + std::string(n);
  return "With all seven sizes given, evaluates that one mapping. Otherwise searches every legal\n"
         "folded mapping (the sizes given are held fixed) and prints the best --top N (default "
         "5).\n"
         "dp = gpus / (tp*cp*pp) and edp = gpus / (etp*ep*pp) are derived; the order is\n"
         "Megatron-Core's default tp-cp-ep-dp-pp. mfu is a fraction of the cluster's bf16 peak.\n"
         "\n"
         "model presets:  " +
         models +
         "\n"
         "cluster presets:" +
         clusters +
         "\n"
         "A model or cluster may also be a JSON file (fields in docs/planner.md; JSON Schema in\n"
         "docs/planner-model.schema.json and docs/planner-cluster.schema.json).\n";
}

struct options {
  std::string model, cluster, format = "text";
  int gpus = 0;
  std::optional<int> gbs, seq;
  mp::search_constraints fixed;
  int top = 5;
  std::string calibration;   // measured rates (docs/planner.md, "Calibration"); empty: built-in
  mp::training_stack stack;  // the recipe's dispatcher, dispatch precision and EP overlap
};

//! The flags, on CLI11, and the checks after them.
inline parse_outcome parse(int argc, const char* const* argv, options& o) {
  CLI::App app{"", "moefold-plan"};
  configure(app, usage_text, notes_text());
  app.add_option("--model", o.model, "model preset or model JSON file")->required();
  app.add_option("--cluster", o.cluster, "cluster preset or cluster JSON file")->required();
  app.add_option("--gpus", o.gpus,
                 "GPUs in the job (1 to " + std::to_string(mp::max_planned_gpus) + ")")
      ->default_str("")
      ->required();
  // Sizes: >= 1 when given; not given, the model's value (gbs, seq) or searched (the rest).
  struct size_flag {
    const char* flag;
    const char* help;
    const char* absent;
    std::optional<int>* dst;
  };
  const size_flag sizes[] = {
      {"--gbs", "global batch, sequences", "the model's", &o.gbs},
      {"--seq", "sequence length", "the model's", &o.seq},
      {"--tp", "attention tensor-parallel size", "searched", &o.fixed.tp},
      {"--cp", "context-parallel size", "searched", &o.fixed.cp},
      {"--ep", "expert-parallel size", "searched", &o.fixed.ep},
      {"--etp", "expert tensor-parallel size", "searched", &o.fixed.etp},
      {"--pp", "pipeline-parallel size", "searched", &o.fixed.pp},
      {"--vpp", "virtual pipeline stages per rank", "searched", &o.fixed.vpp},
      {"--mbs", "micro-batch, sequences", "searched", &o.fixed.mbs}};
  int values[std::size(sizes)] = {};
  for (std::size_t i = 0; i < std::size(sizes); ++i)
    app.add_option(sizes[i].flag, values[i], sizes[i].help)
        ->default_str(sizes[i].absent)
        ->check(at_least(1));
  app.add_option("--top", o.top, "how many mappings a search prints")
      ->check(int_in(1, 1000, "1..1000"));
  app.add_option("--format", o.format, "output format")
      ->check(CLI::IsMember({"text", "json", "svg"}));
  app.add_option("--calibration", o.calibration,
                 "measured rates replacing the built-in curves (JSON, calibration_probe.py's "
                 "output or bench-comm-a2av-mpi's, as they are)")
      ->default_str("none");
  std::string dispatcher = "alltoall";
  app.add_option("--dispatcher", dispatcher,
                 "EP dispatcher: NCCL all-to-all, or DeepEP / HybridEP (Megatron-Core's flex)")
      ->check(CLI::IsMember(std::vector<std::string>(mp::ep_dispatcher_names.begin(),
                                                     mp::ep_dispatcher_names.end())));
  app.add_flag("--fp8-dispatch", o.stack.fp8_dispatch, "the forward dispatch travels in fp8");
  app.add_flag("--ep-overlap", o.stack.ep_overlap,
               "EP communication overlaps another micro-batch's compute "
               "(--overlap-moe-expert-parallel-comm)");
  app.add_flag("--cuda-graphs", o.stack.cuda_graphs,
               "Transformer Engine's scoped CUDA graphs (--cuda-graph-scope moe_router "
               "moe_preprocess [attn]): no eager host floor per MoE layer");
  return examples::parse(app, argc, argv, [&] {
    for (std::size_t i = 0; i < mp::ep_dispatcher_names.size(); ++i)
      if (dispatcher == mp::ep_dispatcher_names[i])
        o.stack.dispatcher = static_cast<mp::ep_dispatcher>(i);
    for (std::size_t i = 0; i < std::size(sizes); ++i)
      if (app.count(sizes[i].flag)) *sizes[i].dst = values[i];
    if (o.gpus < 1) throw usage_error{"--gpus must be >= 1 (got " + std::to_string(o.gpus) + ")"};
  });
}

}  // namespace moefold::examples::plan_cli
