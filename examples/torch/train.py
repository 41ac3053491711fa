#!/usr/bin/env python3
"""A tiny transformer block with moefold's MoE layer, trained over 4 gloo processes: attention
data-parallel over the 4 ranks (DP 4), the experts expert-parallel over the same 4 (EP 4), AdamW,
two micro-batches in flight per step (F1 F2 B2 B1, as a pipeline schedule runs them), the
DeepSeek-V3 router (sigmoid scores, the expert bias updated once per global batch) and the aux
loss. The task: fit a fixed random teacher block. The loss falls; the script says by how much.

    python examples/torch/train.py                 # starts its 4 ranks itself (plain processes)
    python examples/torch/train.py --steps 60 --world 4

Each rank computes its micro-batches' share of the global batch's mean loss, so plain sums of
the gradients give the gradient of that mean: the attention and norms (replicated on the
tp-dp-cp group) are summed with dist.all_reduce, the MoE layer's with
moefold_torch.reduce_gradients (each parameter over its own gradient group)."""
import argparse
import datetime
import os
import socket
import subprocess
import sys
import time

H, F, E, K, S, B = 16, 32, 8, 2, 8, 2  # hidden, expert FFN, experts, top-k, sequence, batch


def rank_main(rank, world, port, steps):
    import torch
    import torch.distributed as dist
    import moefold_torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    groups = moefold_torch.new_groups(ep=world)  # attention DP = world, experts EP = world

    class Block(torch.nn.Module):
        def __init__(self, moe):
            super().__init__()
            self.ln1, self.ln2 = torch.nn.LayerNorm(H), torch.nn.LayerNorm(H)
            self.attn = torch.nn.MultiheadAttention(H, 2)
            self.moe = moe

        def forward(self, x):  # x [S, B, H]
            h = self.ln1(x)
            x = x + self.attn(h, h, h, need_weights=False)[0]
            y, losses = self.moe(self.ln2(x))
            return x + y, losses

    torch.manual_seed(0)  # the replicated parameters start equal on every rank
    moe = moefold_torch.MoELayer(hidden_size=H, ffn_hidden_size=F, num_experts=E, router_topk=K,
                                 groups=groups, max_tokens=S * B, micro_batch=B,
                                 router_score_function="sigmoid",
                                 router_enable_expert_bias=True, aux_loss_coeff=1e-3,
                                 init_seed=1)
    block = Block(moe)
    teacher = torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.Tanh(), torch.nn.Linear(H, H))
    for p in teacher.parameters():
        p.requires_grad_(False)
    dense = [p for n, p in block.named_parameters() if not n.startswith("moe.")]
    opt = torch.optim.AdamW(block.parameters(), lr=1e-2, weight_decay=0.01)
    dp_group = groups.group("tp-dp-cp")
    micro = 2
    tokens = micro * S * B * world  # the global batch's tokens
    log = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        inflight, total = [], 0.0
        for m in range(micro):  # F1 F2 ...
            g = torch.Generator().manual_seed(1000 * step + 10 * rank + m)
            x = torch.randn(S, B, H, generator=g)
            out, losses = block(x)
            loss = ((out - teacher(x)) ** 2).sum() / (tokens * H)
            inflight.append(loss + sum(losses.values()))
            total += loss.item()
        for loss in reversed(inflight):  # ... B2 B1
            loss.backward()
        for p in dense:
            dist.all_reduce(p.grad, group=dp_group)
        moefold_torch.reduce_gradients(moe, groups)
        opt.step()
        moe.end_global_batch()  # the expert bias moves toward balance
        t = torch.tensor([total])
        dist.all_reduce(t)
        log.append(t.item())
        if rank == 0:
            load = moe.last_stats()["routed"].tolist()
            print(f"step {step:3d}  loss {log[-1]:.6f}  routed {load}", flush=True)
    if rank == 0:
        ratio = log[-1] / log[0]
        print(f"final/initial loss: {ratio:.4f} ({'below' if ratio < 0.5 else 'NOT below'} 0.5)",
              flush=True)
    dist.barrier()
    return 0 if rank != 0 or log[-1] / log[0] < 0.5 else 1


def launch(world, steps):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank", str(r),
                               "--world", str(world), "--port", str(port), "--steps",
                               str(steps)], env=env, stdout=None if r == 0 else
                              subprocess.DEVNULL) for r in range(world)]
    deadline = time.monotonic() + 900
    rcs = []
    for p in procs:
        try:
            rcs.append(p.wait(timeout=max(1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            print("train.py: a rank did not finish in 15 minutes", file=sys.stderr)
            return 1
    if any(rcs):
        print(f"train.py: rank exit codes {rcs}", file=sys.stderr)
    return max(rcs)


def main():
    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("--world", type=int, default=4)
    a.add_argument("--steps", type=int, default=40)
    a.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    a.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    o = a.parse_args()
    if o.world < 1 or o.steps < 2 or E % o.world:
        a.error(f"--world must divide {E} experts and --steps be >= 2")
    if o.rank is None:
        return launch(o.world, o.steps)
    return rank_main(o.rank, o.world, o.port, o.steps)


if __name__ == "__main__":
    sys.exit(main())
