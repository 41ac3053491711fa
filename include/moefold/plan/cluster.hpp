//! @file cluster.hpp
//! @brief The machines a plan is made for: nominal (datasheet) rates of one GPU and its links,
//! and the presets the planner knows by name. What fraction of these rates real kernels reach
//! is not a property of the cluster but of the software; it lives in efficiency.hpp.
#pragma once

#include <array>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "../core/expected.hpp"

namespace moefold {
inline namespace v0_1 {
namespace plan {

struct cluster_config {
  std::string name = "custom";
  int gpus = 0;                   //!< GPUs in the job (set by --gpus)
  int gpus_per_node = 8;          //!< GPUs that share the fast intra-node network (NVLink domain)
  double peak_bf16_flops = 0;     //!< dense bf16 tensor-core peak, FLOP/s
  double peak_fp8_flops = 0;      //!< dense fp8 peak, FLOP/s; 0: no fp8
  double memory_gib = 0;          //!< usable memory per GPU, GiB
  double memory_bw = 0;           //!< HBM bandwidth, bytes/s
  double intra_bw = 0;            //!< intra-node bandwidth per GPU per direction, bytes/s
  double inter_bw = 0;            //!< inter-node bandwidth per GPU per direction, bytes/s
  double intra_latency_s = 3e-6;  //!< per message step inside a node
  double inter_latency_s = 8e-6;  //!< per message step between nodes
};

//! The largest job the planner accepts.
inline constexpr int max_planned_gpus = 65536;

[[nodiscard]] inline status validate(const cluster_config& c) {
  auto bad = [&](const std::string& what) {
    return make_error(errc::invalid_size, "cluster '" + c.name + "': " + what);
  };
  if (c.gpus < 1)
    return bad("the number of GPUs must be >= 1 (got " + std::to_string(c.gpus) + ")");
  // The search prices every real group of every fold, O(GPUs) each: keep it interactive.
  if (c.gpus > max_planned_gpus)
    return bad("at most " + std::to_string(max_planned_gpus) + " GPUs can be planned (got " +
               std::to_string(c.gpus) + ")");
  if (c.gpus_per_node < 1)
    return bad("gpus_per_node must be >= 1 (got " + std::to_string(c.gpus_per_node) + ")");
  const std::pair<const char*, double> positive[] = {{"peak_bf16_flops", c.peak_bf16_flops},
                                                     {"memory_gib", c.memory_gib},
                                                     {"memory_bw", c.memory_bw},
                                                     {"intra_bw", c.intra_bw},
                                                     {"inter_bw", c.inter_bw}};
  for (auto [name, v] : positive)
    if (!(v > 0) || v > 1e300) return bad(std::string(name) + " must be a positive number");
  if (!(c.peak_fp8_flops >= 0) || c.peak_fp8_flops > 1e300)
    return bad("peak_fp8_flops must be >= 0");
  if (!(c.intra_latency_s >= 0) || !(c.inter_latency_s >= 0) || c.intra_latency_s > 1 ||
      c.inter_latency_s > 1)
    return bad("latencies must be between 0 and 1 second");
  return {};
}

inline constexpr std::array<std::string_view, 3> cluster_preset_names = {"h100-sxm", "h200-sxm",
                                                                         "gb200-nvl72"};

//! Datasheet numbers (NVIDIA H100/H200/GB200 datasheets; sources in docs/planner.md). gpus is
//! left 0: the job size comes from --gpus.
[[nodiscard]] inline std::optional<cluster_config> cluster_preset(std::string_view name) {
  cluster_config c;
  if (name == "h100-sxm") {  // DGX H100: 8 GPUs, NVLink 4 (900 GB/s both ways), 8x400G IB
    c.name = "h100-sxm";
    c.gpus_per_node = 8;
    c.peak_bf16_flops = 989e12;
    c.peak_fp8_flops = 1979e12;
    c.memory_gib = 79.6;  // 80 GB HBM3 as CUDA reports it (81,559 MiB)
    c.memory_bw = 3.35e12;
    c.intra_bw = 450e9;
    c.inter_bw = 50e9;
    return c;
  }
  if (name == "h200-sxm") {  // HGX H200: same compute and links as H100, 141 GB HBM3e
    c.name = "h200-sxm";
    c.gpus_per_node = 8;
    c.peak_bf16_flops = 989e12;
    c.peak_fp8_flops = 1979e12;
    c.memory_gib = 139.8;
    c.memory_bw = 4.8e12;
    c.intra_bw = 450e9;
    c.inter_bw = 50e9;
    return c;
  }
  if (name == "gb200-nvl72") {  // 72 Blackwell GPUs in one NVLink 5 domain (1.8 TB/s both ways)
    c.name = "gb200-nvl72";
    c.gpus_per_node = 72;
    c.peak_bf16_flops = 2.5e15;
    c.peak_fp8_flops = 5e15;
    c.memory_gib = 184.0;  // 186 GB HBM3e per GPU
    c.memory_bw = 8e12;
    c.intra_bw = 900e9;
    c.inter_bw = 50e9;  // one 400G ConnectX-7 per GPU between racks
    c.intra_latency_s = 3e-6;
    return c;
  }
  return std::nullopt;
}

}  // namespace plan
}  // namespace v0_1
}  // namespace moefold
