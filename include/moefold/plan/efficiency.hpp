//! @file efficiency.hpp
//! @brief The few calibrated numbers of the step model: what fraction of a datasheet rate real
//! kernels reach. They are properties of the software stack (cuBLAS, flash attention, NCCL), the
//! same for every model and every mapping; docs/planner.md says where each one comes from.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace moefold {
inline namespace v0_1 {
namespace plan {

struct calibration;

//! How the EP dispatch and combine move tokens (Megatron-Core's --moe-token-dispatcher-type and
//! --moe-flex-dispatcher-backend).
enum class ep_dispatcher : std::uint8_t {
  //! `alltoall`: tokens are permuted per expert, then NCCL all-to-all sends one copy per
  //! (token, expert) pair: T*k rows.
  alltoall,
  //! `flex` with DeepEP's normal kernels: one copy per (token, destination node) over RDMA,
  //! forwarded over NVLink to each destination GPU once; the experts' copies are made on arrival.
  deepep,
  //! `flex` with HybridEP: the same hierarchical traffic as DeepEP on fewer SMs.
  hybridep,
};

//! The dispatchers by the names moefold-plan's --dispatcher and its JSON use, in enum order.
inline constexpr std::array<std::string_view, 3> ep_dispatcher_names = {"alltoall", "deepep",
                                                                        "hybridep"};

[[nodiscard]] constexpr std::string_view to_string(ep_dispatcher d) noexcept {
  return ep_dispatcher_names[static_cast<std::size_t>(d)];
}

//! The training recipe's choices that change what a step costs but not what it computes. They
//! are stated by the user (published recipes state them), not searched.
struct training_stack {
  ep_dispatcher dispatcher = ep_dispatcher::alltoall;
  //! Dispatch in fp8 (1 byte per element plus a 4-byte scale per 128, DeepEP's format): the
  //! forward dispatch only; the combine and every backward transfer stay bf16.
  bool fp8_dispatch = false;
  //! Megatron-Core's --overlap-moe-expert-parallel-comm: the forward of one micro-batch runs
  //! beside the backward of another, so each one's EP traffic overlaps the other's compute.
  //! Needs ep > 1, an interleaved schedule when pp > 1, and no full recomputation.
  bool ep_overlap = false;
  //! Transformer Engine's scoped CUDA graphs (Megatron-Core's --cuda-graph-impl
  //! transformer_engine with --cuda-graph-scope moe_router moe_preprocess, with or without attn):
  //! the graphed modules are replayed, not issued op by op, so the eager host floor
  //! (efficiency::host_moe_layer_s) does not bind.
  bool cuda_graphs = false;
};

struct efficiency {
  // GEMM: rate = peak * gemm_max * s(M) * s(N) * s(K), s(x) = x / (x + gemm_half), plus a fixed
  // cost per GEMM call. Fitted (least squares on log rate, 17 shapes, rms error 5.7%) to the
  // cuBLAS rates of reference/gpu-baselines.md (H200, bf16, dense and per-expert loop).
  double gemm_max = 0.746;
  double gemm_half = 40.0;
  double gemm_call_s = 8e-6;
  // Causal flash attention, fwd+bwd average, as a fraction of peak at long sequences, with
  // s(S) = S / (S + attn_half). From published FlashAttention-3 / cuDNN rates on H100, what
  // Megatron-Core runs through Transformer Engine. PyTorch's SDPA measured 0.41-0.56 at 2K-32K
  // on an H200 (calibration_probe.py, docs/calibration/h200-2026-12-04.json); a calibration
  // file applies that, the built-in curve stays (docs/planner.md, "Calibration").
  double attn_max = 0.50;
  double attn_half = 512.0;
  // Memory-bound kernels (norms, activations, permutes, optimizer): fraction of HBM bandwidth.
  // From reference/gpu-baselines.md: copy 4.21 of 4.8 TB/s, gathers 3.4-4.0 TB/s.
  double mem = 0.80;
  // Collectives, fraction of the nominal per-direction link rate. Ring collectives (NCCL
  // all-gather / reduce-scatter: assumed 0.80) and all-to-all (NCCL send/recv, Megatron's
  // alltoall dispatcher) separately. The all-to-all rates are Megatron-Core's measured dispatch
  // and combine latencies on H100 (arXiv 2603.07685, Table 7; hidden 7168, 4096 tokens, top-8 of
  // 256): EP 8 in a node 0.72 of NVLink; EP 16-64 over 2-8 nodes 0.81-0.90 of the NIC.
  double ring_intra = 0.80;
  double ring_inter = 0.80;
  double a2a_intra = 0.72;
  double a2a_inter = 0.85;
  // DeepEP-class dispatch, fraction of the nominal link rates. DeepEP's published normal-kernel
  // rates (deepseek-ai/DeepEP README, H800 with CX7 400 Gb/s, 4096 tokens, hidden 7168, top-8):
  // 43-46 GB/s over RDMA of the NIC's 50 GB/s, 153-158 GB/s over NVLink of H800's 160 GB/s.
  double deepep_inter = 0.88;
  double deepep_intra = 0.95;
  // Streaming multiprocessors the communication kernels hold while they run beside compute:
  // Megatron-Core's defaults moe_deepep_num_sms = 20 and moe_hybridep_num_sms = 16; NCCL's
  // all-to-all is taken as 16 (assumed: NCCL's channel count on NVLink). Of sm_count (H100 and
  // H200 SXM: 132).
  double deepep_sms = 20;
  double hybridep_sms = 16;
  double nccl_sms = 16;
  double sm_count = 132;
  // FP8 GEMMs reach this fraction of the fp8 peak relative to what bf16 reaches of bf16 peak.
  double fp8_vs_bf16 = 0.85;
  // Bytes of HBM traffic per element an fp8 GEMM operand costs to produce (Transformer Engine's
  // current-scaling recipe, Megatron-Bridge's H100 default): an amax pass reads the bf16 tensor
  // (2), the cast reads it again (2) and writes a row-wise and a column-wise fp8 copy (1 + 1),
  // both needed on Hopper, whose fp8 tensor cores take only K-major operands.
  double fp8_cast_bytes = 6.0;
  // GPU idle per MoE layer forward and micro-batch: dropless dispatch sizes the experts' inputs
  // on the host (the all-to-all dispatcher's splits, DeepEP's and HybridEP's received counts), so
  // the host waits for the GPU there and the GPU then waits for the host to issue what follows.
  // Measured: Megatron-Bridge's Nsight profile of Qwen3-30B-A3B (bf16, 16 H100, EP 16, HybridEP,
  // no EP overlap; skills/nemo-mbridge-perf-expert-parallel-overlap/SKILL.md, 2026-07-25): the
  // GPU was active 22.821 s of a 24.714 s step, 1.893 s idle over 64 micro-batches x 48 MoE
  // layers. Under the EP overlap the other micro-batch's queued work fills it (step_time.hpp).
  double dispatch_sync_s = 1.893 / (64.0 * 48.0);
  // Host time of one MoE transformer layer, forward and backward, one micro-batch, in eager
  // Megatron-Core (no CUDA graphs): Python, PyTorch and Transformer Engine issuing some 150
  // kernels per layer (the Nsight profile above: 463,348 kernels per step) one by one. A stage
  // cannot run its micro-batches faster than its MoE layers times this, whatever the GPU does.
  // Measured: the Megatron-Core MoE team's Qwen3-235B-A22B run on 256 H100 with TP 4, EP 8,
  // PP 8, VPP 4, GBS 2048, bf16, DeepEP, no recomputation, no EP overlap, no CUDA graphs
  // (yanring/Megatron-MoE-ModelZoo, best_practice/qwen3/readme.md: 29.0 s per step), whose GPU
  // work per layer is half its step's: 256 micro-batches and 7/4 bubble slots of 12 layers
  // (step_time.hpp; docs/planner.md, "Accuracy").
  double host_moe_layer_s = 29.0 / ((256.0 + 7.0 / 4.0) * 12.0);
  // Measured rates that replace the curves above where they have data (calibration.hpp;
  // moefold-plan --calibration). Not owned; null: the built-in curves only.
  const calibration* measured = nullptr;
  //! The recipe's dispatcher, dispatch precision and overlap.
  training_stack stack;
};

}  // namespace plan
}  // namespace v0_1
}  // namespace moefold
