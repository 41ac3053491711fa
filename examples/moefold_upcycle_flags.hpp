// moefold-upcycle's flags (examples/moefold_upcycle.cpp), parsed without running the tool: the tool
// and its flag fuzzer (tests/fuzz/fuzz_flags.cpp) call the same parse().
#pragma once

#include "cli_args.hpp"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace moefold::examples::upcycle_cli {

inline constexpr const char* usage_text =
    "usage: moefold-upcycle --dense PATH --out DIR --experts E --topk K [--granularity G]\n"
    "                       [--activation swiglu|geglu|relu|squared_relu|gelu|silu]\n"
    "                       [--pre-softmax] [--router-init random|uniform] [--seed S]\n"
    "                       --world N [--tp T --cp C --pp P --ep EP --etp ETP] [--rank R]\n"
    "                       [--layers all|i,j,...] [--dtype same|fp32|bf16]\n";
inline constexpr const char* notes_text =
    "Turns a dense Hugging Face checkpoint's FFNs into MoE experts, as each rank of the mapping\n"
    "owns them, reading only the slices each rank needs: DIR/rank-RRRRR.safetensors for every\n"
    "rank (or only --rank R) and DIR/index.json. --dense is a .safetensors file or a folder with\n"
    "model.safetensors.index.json and its shards. The activation defaults to hidden_act of a\n"
    "config.json beside the weights. Layers are split over --pp as Megatron-Core splits them.\n"
    "Layer i's router uses seed S + i. See docs/upcycling.md.\n";

//! The largest world the tool writes files for (one file per rank).
inline constexpr int max_world = 1 << 16;
//! The most experts: the router [E, H] and each rank's declarations grow with E.
inline constexpr int max_experts = 1 << 16;

struct options {
  std::string dense, out;
  int experts = 0, topk = 0, granularity = 1;
  std::string activation;  // empty: hidden_act of config.json
  bool pre_softmax = false;
  std::string router_init = "random";
  std::uint64_t seed = 1234;
  int world = 0, tp = 1, cp = 1, pp = 1, ep = 1;
  std::optional<int> etp, rank;
  std::vector<int> layers;  // empty: all
  std::string dtype = "same";
};

//! The flags, on CLI11, and the limits checked after them.
inline parse_outcome parse(int argc, const char* const* argv, options& o) {
  CLI::App app{"", "moefold-upcycle"};
  configure(app, usage_text, notes_text);
  app.add_option("--dense", o.dense, "dense checkpoint: a .safetensors file or a folder")
      ->required();
  app.add_option("--out", o.out, "output folder (created; must be empty)")->required();
  app.add_option("--experts", o.experts, "number of experts E")
      ->required()
      ->check(int_in(1, max_experts, "1.." + std::to_string(max_experts)));
  app.add_option("--topk", o.topk, "experts per token k")->required()->check(at_least(1));
  app.add_option("--granularity", o.granularity, "G: each expert is a 1/G slice of the FFN")
      ->check(at_least(1));
  app.add_option("--activation", o.activation, "the dense FFN's activation")
      ->check(CLI::IsMember({"swiglu", "geglu", "relu", "squared_relu", "gelu", "silu"}))
      ->default_str("hidden_act of config.json");
  app.add_flag("--pre-softmax", o.pre_softmax, "softmax before top-k (moe_router_pre_softmax)");
  app.add_option("--router-init", o.router_init, "router initialisation")
      ->check(CLI::IsMember({"random", "uniform"}));
  app.add_option("--seed", o.seed, "router generator seed (layer i uses seed + i)");
  app.add_option("--world", o.world, "GPUs in the job")
      ->required()
      ->check(int_in(1, max_world, "1.." + std::to_string(max_world)));
  app.add_option("--tp", o.tp, "attention tensor-parallel size")->check(at_least(1));
  app.add_option("--cp", o.cp, "attention context-parallel size")->check(at_least(1));
  app.add_option("--pp", o.pp, "pipeline-parallel size")->check(at_least(1));
  app.add_option("--ep", o.ep, "expert-parallel size")->check(at_least(1));
  int etp = 0, rank = 0;
  app.add_option("--etp", etp, "expert tensor-parallel size")
      ->default_str("--tp")
      ->check(at_least(1));
  app.add_option("--rank", rank, "write only this rank's file")
      ->default_str("all")
      ->check(at_least(0));
  std::string layers = "all";
  app.add_option("--layers", layers, "layers to upcycle: all, or indices i,j,...");
  app.add_option("--dtype", o.dtype, "expert weight dtype (the router is fp32)")
      ->check(CLI::IsMember({"same", "fp32", "bf16"}));
  return examples::parse(app, argc, argv, [&] {
    if (app.count("--etp")) o.etp = etp;
    if (app.count("--rank")) {
      if (rank >= o.world)
        throw usage_error{"--rank " + std::to_string(rank) + " is outside --world " +
                          std::to_string(o.world)};
      o.rank = rank;
    }
    if (o.topk > o.experts)
      throw usage_error{"--topk " + std::to_string(o.topk) + " exceeds --experts " +
                        std::to_string(o.experts)};
    if (layers != "all") {
      std::size_t at = 0;
      while (at <= layers.size()) {
        const std::size_t comma = std::min(layers.find(',', at), layers.size());
        const std::string item = layers.substr(at, comma - at);
        int v = 0;
        if (item.empty() || item.size() > 9 ||
            item.find_first_not_of("0123456789") != std::string::npos)
          throw usage_error{"--layers: '" + item + "' is not a layer index (all, or i,j,...)"};
        v = std::stoi(item);
        o.layers.push_back(v);
        at = comma + 1;
      }
    }
  });
}

}  // namespace moefold::examples::upcycle_cli
