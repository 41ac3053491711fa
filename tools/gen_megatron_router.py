#!/usr/bin/env python3
"""Produce tests/routing/data/megatron_router.txt: Megatron-Core's own router on small inputs,
used as an independent reference for moefold's routing layer (router variants, aux losses,
z-loss, sub-sequence token dropping, expert-bias update, gradients).

Nothing here re-implements Megatron's routing: for every case we build the real
``megatron.core.transformer.moe.router.TopKRouter`` from a Megatron-LM checkout given on the
command line, on the CPU, in a one-process gloo world (every process group has size 1), run its
forward in training mode on a random input, back-propagate ``sum(w * probs)`` through torch
autograd (with Megatron's aux-loss auto-scaler at scale 1, so the aux losses and the z-loss add
their gradients), and record inputs and outputs. Two hooks observe without changing anything:
``MoEAuxLossAutoScaler.apply`` (to read each attached loss value) and
``apply_router_token_dropping`` (to read the routing map before dropping). The expert-bias
update is Megatron's ``get_updated_expert_bias``.

Needs: Python 3.11, torch (CPU), numpy, einops (Megatron's import chain).

Usage:
    python3 tools/gen_megatron_router.py --megatron /path/to/Megatron-LM \
        > tests/routing/data/megatron_router.txt
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import warnings
from pathlib import Path

S, B, H, E = 4, 2, 4, 8  # sequence, batch, hidden, experts: N = S*B = 8 tokens

# name, TransformerConfig overrides, number of micro-batches
CASES: list[tuple[str, dict, int]] = [
    ("softmax_post_k2_aux", dict(moe_router_topk=2, lb=["aux_loss"], coeff=[0.01]), 1),
    ("softmax_post_k3_scale_seq", dict(moe_router_topk=3, moe_router_topk_scaling_factor=2.5,
                                       lb=["seq_aux_loss"], coeff=[0.02]), 1),
    ("softmax_pre_k1_aux_z", dict(moe_router_topk=1, moe_router_pre_softmax=True,
                                  lb=["aux_loss"], coeff=[0.01], moe_z_loss_coeff=0.001), 1),
    ("softmax_pre_k2_groups_aux_seq", dict(moe_router_topk=2, moe_router_pre_softmax=True,
                                           moe_router_num_groups=4, moe_router_group_topk=2,
                                           lb=["aux_loss", "seq_aux_loss"], coeff=[0.01, 0.03]),
     1),
    ("softmax_post_k4_groups_z", dict(moe_router_topk=4, moe_router_num_groups=4,
                                      moe_router_group_topk=2, lb="none",
                                      moe_z_loss_coeff=0.002), 1),
    ("sigmoid_k1_aux", dict(moe_router_topk=1, moe_router_score_function="sigmoid",
                            lb=["aux_loss"], coeff=[0.01]), 1),
    ("sigmoid_k3_aux_z", dict(moe_router_topk=3, moe_router_score_function="sigmoid",
                              lb=["aux_loss"], coeff=[0.01], moe_z_loss_coeff=0.001), 1),
    ("sigmoid_k4_groups_bias_scale", dict(moe_router_topk=4, moe_router_score_function="sigmoid",
                                          moe_router_num_groups=4, moe_router_group_topk=2,
                                          moe_router_topk_scaling_factor=2.5,
                                          moe_router_enable_expert_bias=True, lb="none"), 1),
    ("sqrtsoftplus_k2_aux_seq_z", dict(moe_router_topk=2, moe_router_score_function="sqrtsoftplus",
                                       lb=["aux_loss", "seq_aux_loss"], coeff=[0.01, 0.02],
                                       moe_z_loss_coeff=0.001), 1),
    ("sqrtsoftplus_k4_groups_bias", dict(moe_router_topk=4,
                                         moe_router_score_function="sqrtsoftplus",
                                         moe_router_num_groups=4, moe_router_group_topk=2,
                                         moe_router_enable_expert_bias=True,
                                         lb=["seq_aux_loss"], coeff=[0.01]), 1),
    ("softmax_post_k2_global", dict(moe_router_topk=2, lb=["global_aux_loss"], coeff=[0.05]), 2),
    ("sigmoid_k2_padding_bias_aux_seq_global_z",
     dict(moe_router_topk=2, moe_router_score_function="sigmoid",
          moe_router_enable_expert_bias=True, padding=True,
          lb=["aux_loss", "seq_aux_loss", "global_aux_loss"], coeff=[0.01, 0.02, 0.03],
          moe_z_loss_coeff=0.001), 1),
    ("drop_probs_cf05", dict(moe_router_topk=2, lb=["aux_loss"], coeff=[0.01],
                             moe_expert_capacity_factor=0.5, moe_token_drop_policy="probs"), 1),
    ("drop_probs_cf1_pad", dict(moe_router_topk=2, moe_router_score_function="sigmoid",
                                lb="none", moe_expert_capacity_factor=1.0,
                                moe_token_drop_policy="probs",
                                moe_pad_expert_input_to_capacity=True), 1),
    ("drop_position_cf075", dict(moe_router_topk=2, moe_router_score_function="sigmoid",
                                 lb="none", moe_expert_capacity_factor=0.75,
                                 moe_token_drop_policy="position"), 1),
    ("drop_position_cf1_pad", dict(moe_router_topk=2, lb="none", moe_expert_capacity_factor=1.0,
                                   moe_token_drop_policy="position",
                                   moe_pad_expert_input_to_capacity=True), 1),
    ("drop_position_cf4", dict(moe_router_topk=2, lb="none", moe_expert_capacity_factor=4.0,
                               moe_token_drop_policy="position"), 1),
]
BIAS_UPDATE_RATE = 1e-3


def fmt(t) -> str:
    # %.9g round-trips float32 exactly.
    return " ".join("%.9g" % v for v in t.detach().double().reshape(-1).tolist())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron", required=True, type=Path,
                        help="root of a Megatron-LM checkout (the folder holding megatron/)")
    args = parser.parse_args()
    root = args.megatron.resolve()
    router_file = root / "megatron" / "core" / "transformer" / "moe" / "router.py"
    utils_file = root / "megatron" / "core" / "transformer" / "moe" / "moe_utils.py"
    if not router_file.is_file():
        parser.error(f"{router_file} not found")
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], check=True,
                                capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"

    sys.path.insert(0, str(root))
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist

    # Megatron allocates router buffers on torch.cuda.current_device(); run them on the CPU.
    torch.cuda.current_device = lambda: "cpu"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from megatron.core.transformer.moe import moe_utils, router as router_mod
    from megatron.core.transformer.transformer_config import TransformerConfig

    group = dist.new_group([0])

    class Groups:
        tp = cp = tp_cp = tp_dp_cp = group

    # Observers (they call the originals unchanged).
    seen_losses: list[float] = []
    seen_routing_map: list = []
    original_apply = moe_utils.MoEAuxLossAutoScaler.apply
    original_drop = router_mod.apply_router_token_dropping

    def observe_apply(output, aux_loss):
        seen_losses.append(float(aux_loss.detach()))
        return original_apply(output, aux_loss)

    def observe_drop(probs, routing_map, **kw):
        seen_routing_map.append(routing_map.detach().clone())
        return original_drop(probs, routing_map, **kw)

    router_mod.MoEAuxLossAutoScaler.apply = staticmethod(observe_apply)
    router_mod.apply_router_token_dropping = observe_drop
    moe_utils.MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))

    out = sys.stdout
    out.write(
        "# Megatron-Core TopKRouter on the CPU: inputs, outputs and gradients for moefold's "
        "routing cross-check\n"
        "# repository: NVIDIA/Megatron-LM\n"
        f"# commit: {commit}\n"
        f"# files: megatron/core/transformer/moe/router.py sha256 "
        f"{hashlib.sha256(router_file.read_bytes()).hexdigest()}, moe_utils.py sha256 "
        f"{hashlib.sha256(utils_file.read_bytes()).hexdigest()}\n"
        "# command: python3 tools/gen_megatron_router.py --megatron <path to Megatron-LM "
        "checkout> > tests/routing/data/megatron_router.txt\n"
        f"# torch: {torch.__version__} (CPU), one-process gloo world (all groups of size 1), "
        "router dtype fp32, unfused path (no TransformerEngine), training mode, aux-loss "
        "backward scale 1\n"
        f"# shapes: S={S} B={B} H={H} E={E}, N=S*B tokens in Megatron order n = s*B + b\n"
        "# format: 'case <name>', 'config key=value ...', then per micro-batch m: 'array "
        "<name>.<m> <count> <values>'; 'end'. Arrays: x [N*H] input, weight [E*H], "
        "expert_bias [E] (before the forward), w [N*E] (loss = sum(w*probs) + attached losses), "
        "logits [N*E], padding [N] (1 = padding token; padding cases), routing_map_predrop [N*E] (capacity cases), probs [N*E] and routing_map "
        "[N*E] (router outputs, after dropping), losses (each attached loss in order: z-loss, "
        "aux_loss, seq_aux_loss, global_aux_loss, those enabled), dx [N*H], dweight [E*H], "
        "tokens_per_expert [E] and expert_bias_updated [E] (bias cases, get_updated_expert_bias "
        f"with rate {BIAS_UPDATE_RATE})\n")

    gen = torch.Generator().manual_seed(20260822)
    for name, over, microbatches in CASES:
        over = dict(over)
        lb = over.pop("lb")
        padding = over.pop("padding", False)
        coeff = over.pop("coeff", None)
        cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=1,
                                num_moe_experts=E, moe_router_load_balancing_type=lb,
                                moe_aux_loss_coeff=coeff if coeff is not None else 0.0,
                                moe_router_dtype="fp32", use_cpu_initialization=True,
                                add_bias_linear=False, moe_router_bias_update_rate=BIAS_UPDATE_RATE,
                                **over)
        r = router_mod.TopKRouter(cfg, pg_collection=Groups)
        r.train()
        with torch.no_grad():
            r.weight.copy_(torch.rand(E, H, generator=gen) * 2 - 1)
            if r.expert_bias is not None:
                r.expert_bias.copy_((torch.rand(E, generator=gen) * 2 - 1) * 0.05)
        keys = {"topk": cfg.moe_router_topk, "score": cfg.moe_router_score_function,
                "pre_softmax": int(bool(cfg.moe_router_pre_softmax)),
                "num_groups": cfg.moe_router_num_groups or 0,
                "group_topk": cfg.moe_router_group_topk or 0,
                "scaling": cfg.moe_router_topk_scaling_factor or 0,
                "expert_bias": int(bool(cfg.moe_router_enable_expert_bias)),
                "lb": "+".join(lb) if isinstance(lb, list) else lb,
                "coeff": "+".join("%.9g" % c for c in coeff) if coeff else "0",
                "z": "%.9g" % (cfg.moe_z_loss_coeff or 0),
                "cf": "%.9g" % (cfg.moe_expert_capacity_factor or 0),
                "drop": cfg.moe_token_drop_policy,
                "pad": int(bool(cfg.moe_pad_expert_input_to_capacity)),
                "microbatches": microbatches}
        out.write(f"case {name}\nconfig " + " ".join(f"{k}={v}" for k, v in keys.items()) + "\n")
        out.write(f"array weight {E * H} {fmt(r.weight)}\n")
        if r.expert_bias is not None:
            out.write(f"array expert_bias {E} {fmt(r.expert_bias)}\n")
        for m in range(microbatches):
            x = (torch.rand(S, B, H, generator=gen) * 4 - 2).requires_grad_(True)
            w = torch.rand(S * B, E, generator=gen) * 2 - 1
            r.weight.grad = None
            seen_losses.clear()
            seen_routing_map.clear()
            with torch.no_grad():
                logits = r.gating(x).reshape(S * B, E)
            # Padding mask [S, B], True = padding token (Megatron's convention).
            pm = (torch.rand(S, B, generator=gen) < 0.3) if padding else None
            probs, routing_map = r(x, padding_mask=pm)
            (w * probs).sum().backward()
            out.write(f"array x.{m} {S * B * H} {fmt(x)}\n")
            out.write(f"array w.{m} {S * B * E} {fmt(w)}\n")
            out.write(f"array logits.{m} {S * B * E} {fmt(logits)}\n")
            if pm is not None:
                out.write(f"array padding.{m} {S * B} {fmt(pm.int())}\n")
            if seen_routing_map:
                out.write(f"array routing_map_predrop.{m} {S * B * E} "
                          f"{fmt(seen_routing_map[0].int())}\n")
            out.write(f"array probs.{m} {S * B * E} {fmt(probs)}\n")
            out.write(f"array routing_map.{m} {S * B * E} {fmt(routing_map.int())}\n")
            out.write(f"array losses.{m} {len(seen_losses)} "
                      + " ".join("%.9g" % v for v in seen_losses) + "\n")
            out.write(f"array dx.{m} {S * B * H} {fmt(x.grad)}\n")
            out.write(f"array dweight.{m} {E * H} {fmt(r.weight.grad)}\n")
        if r.expert_bias is not None:
            tokens = r.local_tokens_per_expert.clone()
            updated = moe_utils.get_updated_expert_bias(tokens.clone(), r.expert_bias,
                                                        BIAS_UPDATE_RATE, group)
            out.write(f"array tokens_per_expert {E} {fmt(tokens)}\n")
            out.write(f"array expert_bias_updated {E} {fmt(updated)}\n")
        out.write("end\n")
    print(f"{len(CASES)} cases", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
