// train_moe_cpu's flags (examples/train_moe_cpu.cpp), parsed without running the example: the
// example and its flag fuzzer (tests/fuzz/fuzz_flags.cpp) call the same parse().
#pragma once

#include "cli_args.hpp"

#include <cmath>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>

namespace moefold::examples::train_cli {

struct options {
  int world = 8, tp = 1, cp = 1, pp = 1, ep = 1;
  std::optional<int> etp;
  std::string order = "tp-cp-ep-dp-pp";
  std::string drop = "dropless";
  double capacity = 1.0;
  bool pad = false;
  std::string dtype = "fp64";
  int experts = 8, topk = 2, hidden = 16, ffn = 32, tokens = 256, steps = 300;
  double lr = 0.2, aux = 0.01, z = 0.0;
  double seq_aux = 0.0, global_aux = 0.0;  // per-sequence and global-batch load balancing
  int shared_ffn = 0;                      // shared expert FFN size (0: none)
  bool shared_gate = false;                // its sigmoid gate
  bool expert_bias = false;                // sigmoid routing with aux-loss-free balancing
  bool quiet = false;
  std::string upcycle_from;  // moefold-upcycle's output folder: start from upcycled weights
};

inline constexpr const char* usage_text =
    "usage: train_moe_cpu [--world N] [--tp N] [--cp N] [--ep N] [--etp N] [--order STR]\n"
    "  [--drop dropless|sub_sequence|full_sequence] [--capacity F] [--pad] [--dtype "
    "fp32|fp64]\n"
    "  [--experts E] [--topk K] [--hidden H] [--ffn F] [--tokens N] [--steps N] [--lr F]\n"
    "  [--aux-loss F] [--seq-aux-loss F] [--global-aux-loss F] [--z-loss F]\n"
    "  [--shared-ffn F] [--shared-gate] [--expert-bias] [--quiet] [--upcycle-from DIR]\n";

//! The most simulated ranks (threads) the example starts.
inline constexpr int max_world = 1024;
//! The most values the example holds in one weight or activation set: experts x hidden x ffn
//! (the experts' weights, the teacher's and the student's), hidden x shared-ffn (the shared
//! expert) and tokens x hidden (a step's tokens): at the limits, a step takes seconds and under
//! a GiB.
inline constexpr long long max_values = 1 << 20;
//! The most SGD steps (a few seconds each at the largest sizes).
inline constexpr int max_steps = 100000;

//! The flags, on CLI11, and the checks between them.
inline parse_outcome parse(int argc, const char* const* argv, options& o) {
  CLI::App app{"", "train_moe_cpu"};
  configure(app, usage_text,
            "Trains one MoE layer on --world simulated ranks (one thread each) "
            "under the folded mapping given.\n");
  app.add_option("--world", o.world, "simulated ranks");
  app.add_option("--tp", o.tp, "attention tensor-parallel size");
  app.add_option("--cp", o.cp, "context-parallel size");
  app.add_option("--pp", o.pp, "pipeline-parallel size (must be 1: one layer)");
  app.add_option("--ep", o.ep, "expert-parallel size");
  int etp = 0;
  app.add_option("--etp", etp, "expert tensor-parallel size")->default_str("--tp");
  app.add_option("--order", o.order, "Megatron-Core order string");
  app.add_option("--drop", o.drop, "drop policy: dropless, sub_sequence or full_sequence");
  app.add_option("--capacity", o.capacity, "capacity factor of the dropping policies");
  app.add_flag("--pad", o.pad, "pad every expert to its capacity")
      ->multi_option_policy(CLI::MultiOptionPolicy::Throw);
  app.add_option("--dtype", o.dtype, "fp32 or fp64");
  app.add_option("--experts", o.experts, "routed experts");
  app.add_option("--topk", o.topk, "experts per token");
  app.add_option("--hidden", o.hidden, "hidden size");
  app.add_option("--ffn", o.ffn, "FFN size of one expert");
  app.add_option("--tokens", o.tokens, "tokens per step, over all ranks");
  app.add_option("--steps", o.steps, "SGD steps");
  app.add_option("--lr", o.lr, "learning rate");
  app.add_option("--aux-loss", o.aux, "micro-batch load-balancing loss coefficient");
  app.add_option("--seq-aux-loss", o.seq_aux, "per-sequence load-balancing loss coefficient");
  app.add_option("--global-aux-loss", o.global_aux, "global-batch load-balancing loss coefficient");
  app.add_option("--z-loss", o.z, "router z-loss coefficient");
  app.add_option("--shared-ffn", o.shared_ffn, "shared expert FFN size (0: none)");
  app.add_flag("--shared-gate", o.shared_gate, "sigmoid gate on the shared expert")
      ->multi_option_policy(CLI::MultiOptionPolicy::Throw);
  app.add_flag("--expert-bias", o.expert_bias, "sigmoid routing with aux-loss-free balancing")
      ->multi_option_policy(CLI::MultiOptionPolicy::Throw);
  app.add_flag("--quiet", o.quiet, "print only the last lines")
      ->multi_option_policy(CLI::MultiOptionPolicy::Throw);
  app.add_option("--upcycle-from", o.upcycle_from,
                 "start from moefold-upcycle's output (its experts, top-k, sizes and activation "
                 "replace --experts, --topk, --hidden and --ffn)")
      ->default_str("none");
  return examples::parse(app, argc, argv, [&] {
    if (app.count("--etp")) o.etp = etp;
    for (const auto& [flag, v] : {std::pair{"--capacity", o.capacity},
                                  {"--lr", o.lr},
                                  {"--aux-loss", o.aux},
                                  {"--seq-aux-loss", o.seq_aux},
                                  {"--global-aux-loss", o.global_aux},
                                  {"--z-loss", o.z}})
      if (!std::isfinite(v))
        throw usage_error{std::string(flag) + ": '" + std::to_string(v) +
                          "' is not a finite number"};
    if (o.drop != "dropless" && o.drop != "sub_sequence" && o.drop != "full_sequence")
      throw usage_error{"--drop must be dropless, sub_sequence or full_sequence"};
    if (o.dtype != "fp32" && o.dtype != "fp64") throw usage_error{"--dtype must be fp32 or fp64"};
    if (o.shared_ffn < 0) throw usage_error{"--shared-ffn must be >= 0 (0: no shared expert)"};
    if (o.shared_gate && o.shared_ffn == 0) throw usage_error{"--shared-gate needs --shared-ffn"};
    if (!o.upcycle_from.empty() && (o.expert_bias || o.shared_ffn > 0))
      throw usage_error{
          "--upcycle-from takes neither --expert-bias nor --shared-ffn (rule: the "
          "upcycled layer is the dense FFN split into softmax-routed experts)"};
    if (!(o.seq_aux >= 0) || !(o.global_aux >= 0))
      throw usage_error{"--seq-aux-loss and --global-aux-loss must be >= 0"};
    if (o.pp != 1)
      throw usage_error{
          "--pp must be 1: this example trains one layer (pipeline stages hold "
          "different layers)"};
    if (o.steps < 0 || o.tokens < 1 || o.hidden < 1 || o.ffn < 1 || o.experts < 1 || o.lr <= 0 ||
        o.aux < 0 || o.z < 0)
      throw usage_error{"sizes, steps and the learning rate must be positive (losses >= 0)"};
    if (o.world < 1 || o.world > max_world)
      throw usage_error{"--world must be between 1 and " + std::to_string(max_world) +
                        " (one thread per simulated rank; got " + std::to_string(o.world) + ")"};
    if (o.topk < 1 || o.topk > o.experts)
      throw usage_error{"--topk must be between 1 and --experts (" + std::to_string(o.experts) +
                        "; got " + std::to_string(o.topk) + ")"};
    if (o.steps > max_steps)
      throw usage_error{"--steps " + std::to_string(o.steps) + " exceeds the limit of " +
                        std::to_string(max_steps)};
    // A product of sizes, each >= 0, at most max_values (compared in floating point: the
    // product of three ints can exceed any integer type).
    const auto bound = [](const char* what, std::initializer_list<int> sizes) {
      double values = 1;
      std::string shown;
      for (int n : sizes) {
        values *= n;
        shown += (shown.empty() ? "" : " x ") + std::to_string(n);
      }
      if (values > static_cast<double>(max_values))
        throw usage_error{std::string(what) + " = " + shown + " values exceeds the limit of " +
                          std::to_string(max_values) + " (rule: the example holds them in memory)"};
    };
    bound("--experts x --hidden x --ffn", {o.experts, o.hidden, o.ffn});
    bound("--hidden x --shared-ffn", {o.hidden, o.shared_ffn});
    bound("--tokens x --hidden", {o.tokens, o.hidden});
    if (o.tokens % o.world != 0)
      throw usage_error{"--tokens (" + std::to_string(o.tokens) +
                        ") must be divisible by --world (" + std::to_string(o.world) + ")"};
  });
}

}  // namespace moefold::examples::train_cli
