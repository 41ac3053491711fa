//! @file efficiency.hpp
//! @brief The few calibrated numbers of the step model: what fraction of a datasheet rate real
//! kernels reach. They are properties of the software stack (cuBLAS, flash attention, NCCL), the
//! same for every model and every mapping; docs/planner.md says where each one comes from.
#pragma once

namespace moefold {
inline namespace v0_1 {
namespace plan {

struct calibration;

struct efficiency {
  // GEMM: rate = peak * gemm_max * s(M) * s(N) * s(K), s(x) = x / (x + gemm_half), plus a fixed
  // cost per GEMM call. Fitted (least squares on log rate, 17 shapes, rms error 5.7%) to the
  // cuBLAS rates of reference/gpu-baselines.md (H200, bf16, dense and per-expert loop).
  double gemm_max = 0.746;
  double gemm_half = 40.0;
  double gemm_call_s = 8e-6;
  // Causal flash attention, fwd+bwd average, as a fraction of peak at long sequences, with
  // s(S) = S / (S + attn_half). From published FlashAttention-3 / cuDNN rates on H100 (not
  // measured here: shared/bench/calibration_probe.py has not been run yet).
  double attn_max = 0.50;
  double attn_half = 512.0;
  // Memory-bound kernels (norms, activations, permutes, optimizer): fraction of HBM bandwidth.
  // From reference/gpu-baselines.md: copy 4.21 of 4.8 TB/s, gathers 3.4-4.0 TB/s.
  double mem = 0.80;
  // Collectives, fraction of the nominal per-direction link rate. Ring collectives (NCCL
  // all-gather / reduce-scatter) and all-to-all (NCCL send/recv, Megatron's alltoall
  // dispatcher) separately, because all-to-all moves many small messages.
  double ring_intra = 0.80;
  double ring_inter = 0.80;
  double a2a_intra = 0.55;
  double a2a_inter = 0.55;
  // FP8 GEMMs reach this fraction of the fp8 peak relative to what bf16 reaches of bf16 peak.
  double fp8_vs_bf16 = 0.85;
  // Measured rates that replace the curves above where they have data (calibration.hpp;
  // moefold-plan --calibration). Not owned; null: the built-in curves only.
  const calibration* measured = nullptr;
};

}  // namespace plan
}  // namespace v0_1
}  // namespace moefold
