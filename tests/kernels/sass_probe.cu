// Every row kernel's GPU entry, instantiated for the types the dispatcher moves (fp32, bf16), for
// sass_check.py to compile to sm_90a and read: 128-bit global accesses in the row kernels, no
// spills, registers and occupancy. Nothing here runs.
#include <moefold/core/dtype.hpp>
#include <moefold/exec/cuda/cuda_launch.cuh>
#include <moefold/kernels/activation.hpp>
#include <moefold/kernels/capacity.hpp>
#include <moefold/kernels/chunk_copy.hpp>
#include <moefold/kernels/chunk_table.hpp>
#include <moefold/kernels/elementwise.hpp>
#include <moefold/kernels/expert_bias.hpp>
#include <moefold/kernels/grouped_gemm.hpp>
#include <moefold/kernels/histogram.hpp>
#include <moefold/kernels/permute.hpp>
#include <moefold/kernels/permute_plan.hpp>
#include <moefold/kernels/router.hpp>
#include <moefold/kernels/router_aux_loss.hpp>
#include <moefold/kernels/router_block.hpp>
#include <moefold/kernels/router_z_loss.hpp>
#include <moefold/kernels/scan.hpp>
#include <moefold/kernels/sequence_order.hpp>
#include <moefold/kernels/shared_gate.hpp>
#include <moefold/kernels/store_values.hpp>
#include <moefold/kernels/unpermute.hpp>

namespace k = moefold::kernels;
using moefold::bfloat16;
using moefold::detail::simt_entry;

#define MOEFOLD_SASS_PROBE(...) template __global__ void simt_entry<__VA_ARGS__>(const __VA_ARGS__)
MOEFOLD_SASS_PROBE(k::gather_rows_kernel<float>);
MOEFOLD_SASS_PROBE(k::gather_rows_kernel<bfloat16>);
MOEFOLD_SASS_PROBE(k::gather_sum_rows_kernel<float, float, float>);
MOEFOLD_SASS_PROBE(k::gather_sum_rows_kernel<bfloat16, bfloat16, float>);
MOEFOLD_SASS_PROBE(k::copy_chunks_kernel<float>);
MOEFOLD_SASS_PROBE(k::copy_chunks_kernel<bfloat16>);
MOEFOLD_SASS_PROBE(k::uniform_chunk_table_kernel);
MOEFOLD_SASS_PROBE(k::store_values_kernel<int>);
MOEFOLD_SASS_PROBE(k::store_values_kernel<long long>);
MOEFOLD_SASS_PROBE(k::relabel_kernel);
MOEFOLD_SASS_PROBE(k::add_converted_kernel<bfloat16, float>);
MOEFOLD_SASS_PROBE(k::add_converted_kernel<float, float>);
MOEFOLD_SASS_PROBE(k::convert_kernel<bfloat16, float>);
MOEFOLD_SASS_PROBE(k::scale_kernel<bfloat16>);
MOEFOLD_SASS_PROBE(k::fill_kernel<float>);
MOEFOLD_SASS_PROBE(k::expert_histogram_kernel);
MOEFOLD_SASS_PROBE(k::record_fault_kernel);
MOEFOLD_SASS_PROBE(k::scan_tiles_kernel);
MOEFOLD_SASS_PROBE(k::scan_tile_sums_kernel);
MOEFOLD_SASS_PROBE(k::add_tile_offsets_kernel);
MOEFOLD_SASS_PROBE(k::router_topk_kernel);
MOEFOLD_SASS_PROBE(k::router_backward_kernel);
MOEFOLD_SASS_PROBE(k::router_topk_block_kernel);
MOEFOLD_SASS_PROBE(k::router_backward_block_kernel);
MOEFOLD_SASS_PROBE(k::aux_scores_kernel);
MOEFOLD_SASS_PROBE(k::aux_scores_block_kernel);
MOEFOLD_SASS_PROBE(k::aux_column_sums_kernel<>);
MOEFOLD_SASS_PROBE(k::switch_loss_kernel<>);
MOEFOLD_SASS_PROBE(k::aux_loss_backward_kernel);
MOEFOLD_SASS_PROBE(k::aux_loss_backward_block_kernel);
MOEFOLD_SASS_PROBE(k::logsumexp_kernel);
MOEFOLD_SASS_PROBE(k::logsumexp_block_kernel);
MOEFOLD_SASS_PROBE(k::z_loss_total_kernel<>);
MOEFOLD_SASS_PROBE(k::z_loss_backward_kernel);
MOEFOLD_SASS_PROBE(k::z_loss_backward_block_kernel);
MOEFOLD_SASS_PROBE(k::expert_counts_accumulate_kernel);
MOEFOLD_SASS_PROBE(k::expert_bias_update_kernel);
MOEFOLD_SASS_PROBE(k::plan_tile_counts_kernel);
MOEFOLD_SASS_PROBE(k::plan_tile_scan_kernel);
MOEFOLD_SASS_PROBE(k::plan_offsets_kernel);
MOEFOLD_SASS_PROBE(k::plan_rows_kernel);
MOEFOLD_SASS_PROBE(k::grouped_gemm_kernel<float, float, float>);
MOEFOLD_SASS_PROBE(k::grouped_gemm_kernel<bfloat16, bfloat16, bfloat16>);
MOEFOLD_SASS_PROBE(k::grouped_gemm_kernel<bfloat16, bfloat16, float>);
MOEFOLD_SASS_PROBE(k::activation_forward_kernel<float>);
MOEFOLD_SASS_PROBE(k::activation_forward_kernel<bfloat16, float>);
MOEFOLD_SASS_PROBE(k::activation_backward_kernel<float>);
MOEFOLD_SASS_PROBE(k::activation_backward_kernel<bfloat16, float>);
MOEFOLD_SASS_PROBE(k::expert_lists_kernel<float>);
MOEFOLD_SASS_PROBE(k::keep_rank_kernel<float>);
MOEFOLD_SASS_PROBE(k::drop_totals_kernel);
MOEFOLD_SASS_PROBE(k::kept_record_kernel);
MOEFOLD_SASS_PROBE(k::expert_offsets_kernel);
MOEFOLD_SASS_PROBE(k::sticky_fault_kernel);
MOEFOLD_SASS_PROBE(k::kept_probs_kernel<float, float>);
MOEFOLD_SASS_PROBE(k::kept_probs_kernel<float, bfloat16>);
MOEFOLD_SASS_PROBE(k::order_key_count_kernel);
MOEFOLD_SASS_PROBE(k::widen_offsets_kernel);
MOEFOLD_SASS_PROBE(k::order_key_check_kernel);
MOEFOLD_SASS_PROBE(k::order_from_keys_kernel);
MOEFOLD_SASS_PROBE(k::shared_gate_forward_kernel<float>);
MOEFOLD_SASS_PROBE(k::shared_gate_forward_kernel<bfloat16>);
MOEFOLD_SASS_PROBE(k::shared_gate_backward_kernel<float>);
MOEFOLD_SASS_PROBE(k::shared_gate_backward_kernel<bfloat16>);
MOEFOLD_SASS_PROBE(k::shared_gate_weight_grad_kernel<float, float>);
MOEFOLD_SASS_PROBE(k::shared_gate_weight_grad_kernel<bfloat16, float>);
MOEFOLD_SASS_PROBE(k::shared_gate_dx_kernel<float>);
MOEFOLD_SASS_PROBE(k::shared_gate_dx_kernel<bfloat16>);
