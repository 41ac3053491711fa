#!/usr/bin/env python3
"""moefold_torch.MoELayer in one process (a gloo group of one rank), against the plain-PyTorch
reference of reference.py and torch.autograd.gradcheck:

- forward, input gradient and every parameter gradient equal the reference (fp32 within 1e-5,
  fp64 within 1e-12) over router options (softmax after and before the top-k, sigmoid with the
  scaling factor), sub-sequence dropping by probability and by position (and pad mode, the same
  output), activations, the shared expert and its gate, the aux and z losses (their values and
  their gradients through the loss tensors); bf16 within bf16's rounding;
- gradcheck in fp64 (grad_mode='return'): output and losses against finite differences for the
  input and every parameter, with every top-k and capacity margin >= 1e-3;
- last_stats against the reference's routing; accumulate mode adds into .grad / .main_grad;
- two forwards in flight (F1 F2 B2 B1) and activation checkpointing (reentrant and not) give the
  plain run's gradients bitwise and add nothing twice to the expert bias's counts;
- state_dict round trip (with the expert bias), load_global, Megatron-Core's TEGroupedMLP names,
  moefold-upcycle's output (argv[1]: the tool), whose copies of a dense FFN give its output;
- bad input: a clear exception naming the rule (TypeError for an unknown keyword).
Exit 77 without torch; a doctest-style summary line."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ranks  # noqa: E402

ranks.skip_without_torch()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.utils.checkpoint as ckpt  # noqa: E402

import moefold_torch  # noqa: E402
from reference import fc1_shard, fc2_shard, moe_world, rel_err  # noqa: E402

torch.set_num_threads(1)
cases = ranks.Cases()


def full_weights(seed, E, H, F, act, dtype, Fs=0, gate=False):
    g = torch.Generator().manual_seed(seed)
    f1 = (2 if act in ("swiglu", "geglu") else 1)

    def r(*shape, scale=0.5):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    w = {"router": r(E, H), "fc1": r(E, f1 * F, H), "fc2": r(E, H, F)}
    if Fs:
        w["shared_fc1"] = r(f1 * Fs, H)
        w["shared_fc2"] = r(H, Fs)
        if gate:
            w["shared_gate"] = r(1, H)
    return w


def make_layer(groups, E, H, F, k, N, dtype=torch.float32, **kw):
    return moefold_torch.MoELayer(hidden_size=H, ffn_hidden_size=F, num_experts=E, router_topk=k,
                                  groups=groups, max_tokens=N, params_dtype=dtype,
                                  router_dtype=torch.float64 if dtype == torch.float64
                                  else torch.float32, **kw)


def reference(w, x, k, act, opts, dtype=torch.float64):
    """The reference in fp64 on leaves: (out, losses, grads by name) for loss = sum(out * g) +
    sum(losses)."""
    leaves = {n: t.detach().to(dtype).requires_grad_() for n, t in w.items()}
    xr = x.detach().to(dtype).requires_grad_()
    shared = None
    if "shared_fc1" in leaves:
        shared = (leaves["shared_fc1"], leaves["shared_fc2"], leaves.get("shared_gate"))
    outs, losses = moe_world([xr], leaves["router"], leaves["fc1"], leaves["fc2"], k=k, act=act,
                             shared=shared, **opts)
    return xr, leaves, outs[0], losses[0]


CONFIGS = [
    ("softmax, dropless", {}, {}),
    ("softmax before top-k, capacity 1.0 by probs", {"router_pre_softmax": True,
                                                    "expert_capacity_factor": 1.0},
     {"pre_softmax": True, "capacity_factor": 1.0}),
    ("sigmoid, scaling 2.5, capacity 0.75 by position", {
        "router_score_function": "sigmoid", "router_topk_scaling_factor": 2.5,
        "expert_capacity_factor": 0.75, "token_drop_policy": "position"},
     {"score": "sigmoid", "scaling": 2.5, "capacity_factor": 0.75, "policy": "position"}),
    ("pad mode (capacity 1.0): the dropping run's output", {
        "expert_capacity_factor": 1.0, "pad_expert_input_to_capacity": True},
     {"capacity_factor": 1.0}),
    ("gelu, shared expert with gate, aux and z losses, allgather", {
        "activation": "gelu", "shared_expert_intermediate_size": 6, "shared_expert_gate": True,
        "aux_loss_coeff": 0.01, "z_loss_coeff": 0.001, "token_dispatcher_type": "allgather"},
     {"act": "gelu", "aux": 0.01, "z": 0.001}),
    ("sigmoid, group-limited (4 groups, 2 kept)", {
        "router_score_function": "sigmoid", "router_num_groups": 4, "router_group_topk": 2},
     {"score": "sigmoid", "groups": (4, 2)}),
    ("per-sequence and global aux losses (B = 2)", {
        "micro_batch": 2, "seq_aux_loss_coeff": 0.05, "global_aux_loss_coeff": 0.02},
     {"seq_aux": 0.05, "global_aux": 0.02, "batch": 2}),
    ("full-sequence dropping on one rank: sub-sequence's", {
        "expert_capacity_factor": 1.0, "full_sequence_dropping": True},
     {"capacity_factor": 1.0}),
    ("swiglu shared expert, aux loss, capacity 1.25", {
        "shared_expert_intermediate_size": 4, "aux_loss_coeff": 0.1,
        "expert_capacity_factor": 1.25},
     {"aux": 0.1, "capacity_factor": 1.25}),
]


def case_reference(groups):
    E, H, F, k, N = 8, 6, 5, 2, 24
    for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
        for name, kw, ref in CONFIGS:
            act = ref.pop("act", kw.get("activation", "swiglu"))
            ref = dict(ref)
            Fs = kw.get("shared_expert_intermediate_size", 0)
            w = full_weights(11, E, H, F, act, dtype, Fs, kw.get("shared_expert_gate", False))
            layer = make_layer(groups, E, H, F, k, N, dtype, **kw)
            layer.load_global(**w)
            x = (torch.randn(N, H, generator=torch.Generator().manual_seed(5),
                             dtype=torch.float64)).to(dtype).requires_grad_()
            g = torch.randn(N, H, generator=torch.Generator().manual_seed(6),
                            dtype=torch.float64).to(dtype)
            out, losses = layer(x)
            loss = (out * g).sum() + sum(losses.values(), torch.zeros((), dtype=dtype))
            loss.backward()
            xr, leaves, rout, rlosses = reference(w, x, k, act, ref)
            rloss = (rout * g.double()).sum() + sum(rlosses.values(),
                                                    torch.zeros((), dtype=torch.float64))
            rloss.backward()
            errs = {"out": rel_err(out.detach(), rout.detach()), "dx": rel_err(x.grad, xr.grad)}
            for n in losses:
                errs["loss " + n] = rel_err(losses[n].detach(), rlosses[n].detach())
            if set(losses) != set(rlosses):
                errs["losses"] = 1.0
            params = {"router": layer.router.weight, "fc1": layer.experts.fc1,
                      "fc2": layer.experts.fc2}
            if Fs:
                params.update(shared_fc1=layer.shared_expert.fc1,
                              shared_fc2=layer.shared_expert.fc2)
                if kw.get("shared_expert_gate"):
                    params["shared_gate"] = layer.shared_expert.gate
            for n, p in params.items():
                errs["d" + n] = rel_err(p.grad, leaves[n].grad.reshape(p.grad.shape))
            worst = max(errs.values())
            cases.check(f"reference, {dtype}: {name}", worst <= tol,
                        {n: e for n, e in errs.items() if e > tol})
            # The routing it reports: the reference's counts of routed and kept pairs.
            if dtype == torch.float32:
                st = layer.last_stats()
                with torch.no_grad():
                    from reference import keep_mask, route
                    probs, mask = route(x.detach().double() @ w["router"].double().t(), k,
                                        ref.get("score", "softmax"),
                                        ref.get("pre_softmax", False), ref.get("scaling"), None,
                                        ref.get("groups"))
                    keep = keep_mask(probs, mask, k, ref.get("capacity_factor"),
                                     ref.get("policy", "probs"))
                ok = (st["routed"].tolist() == mask.sum(0).tolist() and
                      st["kept"].tolist() == keep.sum(0).tolist() and
                      int(st["dropped_pairs"]) == int(mask.sum() - keep.sum()))
                if kw.get("pad_expert_input_to_capacity"):
                    import math
                    C = math.ceil(N * k / E * 1.0)
                    ok = ok and st["rows_per_local_expert"].tolist() == [C] * E
                else:
                    ok = ok and st["rows_per_local_expert"].tolist() == keep.sum(0).tolist()
                cases.check(f"last_stats: {name}", ok, str(st))


def case_bf16(groups):
    E, H, F, k, N = 4, 8, 6, 2, 16
    w = full_weights(3, E, H, F, "swiglu", torch.float64)
    layer = make_layer(groups, E, H, F, k, N, torch.bfloat16)
    layer.load_global(**{n: t.to(torch.bfloat16) for n, t in w.items()})
    for p in layer.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    x.requires_grad_()
    out, _ = layer(x)
    out.float().sum().backward()
    wb = {n: t.to(torch.bfloat16).double() for n, t in w.items()}
    xr, leaves, rout, _ = reference(wb, x.detach().double(), k, "swiglu", {})
    rout.sum().backward()
    errs = [rel_err(out.detach(), rout.detach()), rel_err(x.grad, xr.grad),
            rel_err(layer.router.weight.main_grad, leaves["router"].grad),
            rel_err(layer.experts.fc1.main_grad, leaves["fc1"].grad),
            rel_err(layer.experts.fc2.main_grad, leaves["fc2"].grad)]
    cases.check("bf16 (fp32 main_grad): within bf16 rounding of the fp64 reference",
                max(errs) < 3e-2, errs)
    cases.check("bf16: the gradients went to main_grad, .grad untouched",
                all(p.grad is None for p in layer.parameters()))


def margins_ok(w, x, k, cf):
    """Every top-k margin and (with a capacity) every capacity margin >= 1e-3."""
    lg = x @ w["router"].t()
    s = torch.sort(lg, -1, descending=True).values
    if float((s[:, k - 1] - s[:, k]).min()) < 1e-3:
        return False
    if cf is not None:
        from reference import route
        probs, mask = route(lg, k, "softmax", False, None, None)
        for e in range(probs.shape[1]):
            p = torch.sort(probs[mask[:, e], e], descending=True).values
            if p.numel() > 1 and float((p[:-1] - p[1:]).min()) < 1e-3:
                return False
    return True


def case_gradcheck(groups):
    E, H, F, k, N = 4, 4, 3, 2, 6
    for name, kw, cf in (("dropless, shared expert with gate, aux and z losses",
                          {"shared_expert_intermediate_size": 2, "shared_expert_gate": True,
                           "aux_loss_coeff": 0.1, "z_loss_coeff": 0.01}, None),
                         ("capacity 1.0 by probs", {"expert_capacity_factor": 1.0}, 1.0)):
        for seed in range(100):
            Fs = kw.get("shared_expert_intermediate_size", 0)
            w = full_weights(seed, E, H, F, "swiglu", torch.float64, Fs,
                             kw.get("shared_expert_gate", False))
            x = torch.randn(N, H, generator=torch.Generator().manual_seed(1000 + seed),
                            dtype=torch.float64)
            if margins_ok(w, x, k, cf):
                break
        layer = make_layer(groups, E, H, F, k, N, torch.float64, grad_mode="return", **kw)
        layer.load_global(**w)
        names = [n for n, _ in layer.named_parameters()]
        params = [p.detach().clone().requires_grad_() for p in layer.parameters()]

        def f(x, *ps):
            out, losses = torch.func.functional_call(layer, dict(zip(names, ps)), (x,))
            return (out, *losses.values())

        try:
            ok = torch.autograd.gradcheck(f, (x.clone().requires_grad_(), *params), eps=1e-6,
                                          atol=1e-7, rtol=1e-5)
            detail = ""
        except Exception as e:  # noqa: BLE001
            ok, detail = False, str(e)[:600]
        cases.check(f"gradcheck fp64: {name} (seed {seed})", ok, detail)


def case_modes(groups):
    """accumulate adds into .grad (created) and main_grad; in flight; checkpoint."""
    E, H, F, k, N = 4, 6, 4, 2, 12
    w = full_weights(7, E, H, F, "swiglu", torch.float32)
    kw = {"router_score_function": "sigmoid", "router_enable_expert_bias": True,
          "aux_loss_coeff": 0.01}

    def fresh():
        layer = make_layer(groups, E, H, F, k, N, **kw)
        layer.load_global(**w)
        return layer

    xs = [torch.randn(N, H, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]

    def grads(layer):
        return [p.grad.clone() for p in layer.parameters()]

    # Plain: F1 B1 F2 B2 accumulates both micro-batches' gradients.
    plain = fresh()
    dx_plain = []
    for x in xs:
        xi = x.clone().requires_grad_()
        out, losses = plain(xi)
        (out.sum() + sum(losses.values())).backward()
        dx_plain.append(xi.grad)
    g_plain, st_plain = grads(plain), plain.get_extra_state()
    # In flight: F1 F2 B2 B1.
    layer = fresh()
    xi = [x.clone().requires_grad_() for x in xs]
    res = [layer(v) for v in xi]
    for out, losses in reversed(res):
        (out.sum() + sum(losses.values())).backward()
    same = all(torch.equal(a, b) for a, b in zip(grads(layer), g_plain)) and \
        all(torch.equal(a.grad, b) for a, b in zip(xi, dx_plain))
    cases.check("two forwards in flight (F1 F2 B2 B1) equal F1 B1 F2 B2 bitwise", same)
    del res, out, losses
    cases.check("in flight: nothing held once autograd frees the graphs", layer._c.in_flight == 0,
                layer._c.in_flight)
    # A retained graph's second backward (moefold recomputes the forward it kept): the same
    # gradients again, so twice the first's.
    layer = fresh()
    v = xs[0].clone().requires_grad_()
    out, losses = layer(v)
    total = out.sum() + sum(losses.values())
    total.backward(retain_graph=True)
    first = grads(layer)
    total.backward()
    cases.check("retain_graph: a second backward adds the same gradients bitwise",
                all(torch.equal(b, 2 * a) for a, b in zip(first, grads(layer))))
    del out, losses, total

    def step(layer, v, reentrant):
        # A tuple of tensors, so reentrant checkpointing tracks the losses as outputs too.
        def run(x):
            out, losses = layer(x)
            return (out, *losses.values())
        outs = ckpt.checkpoint(run, v, use_reentrant=reentrant)
        (outs[0].sum() + sum(outs[1:])).backward()

    for reentrant in (True, False):
        layer = fresh()
        dx = []
        for i, x in enumerate(xs):
            if i == 0:
                v = x.clone().requires_grad_()
            else:  # a non-contiguous [N, H] input (the layer copies it into [N, H] rows)
                v = torch.empty(H, N).t()
                v.copy_(x)
                v.requires_grad_()
            step(layer, v, reentrant)
            dx.append(v.grad.reshape(N, H))
        same = all(torch.equal(a, b) for a, b in zip(grads(layer), g_plain)) and \
            all(torch.equal(a, b) for a, b in zip(dx, dx_plain))
        st = layer.get_extra_state()
        cases.check(f"checkpoint (use_reentrant={reentrant}) equals the plain run bitwise",
                    same)
        cases.check(f"checkpoint (use_reentrant={reentrant}): the expert bias counts once",
                    torch.equal(st["expert_bias_counts"], st_plain["expert_bias_counts"]),
                    f'{st["expert_bias_counts"]} vs {st_plain["expert_bias_counts"]}')
        cases.check(f"checkpoint (use_reentrant={reentrant}): nothing held afterwards",
                    layer._c.in_flight == 0 and not layer._pending,
                    (layer._c.in_flight, len(layer._pending)))
    # The layer behind another op of the checkpointed function (a norm's output in a block): the
    # recomputation feeds it a new tensor with the same bytes. x * 1.0 is that op, exactly: the
    # gradients stay the plain run's. Then two such checkpointed micro-batches in flight (F1 F2
    # B2 B1), whose freed inputs may share an address.
    def behind(layer, x):
        def run(v):
            out, losses = layer(v * 1.0)
            return (out, *losses.values())
        return run

    for reentrant in (True, False):
        for in_flight in (False, True):
            layer = fresh()
            vs = [x.clone().requires_grad_() for x in xs]
            if in_flight:
                outs = [ckpt.checkpoint(behind(layer, v), v, use_reentrant=reentrant)
                        for v in vs]
                for o in reversed(outs):
                    (o[0].sum() + sum(o[1:])).backward()
                del outs, o
            else:
                for v in vs:
                    o = ckpt.checkpoint(behind(layer, v), v, use_reentrant=reentrant)
                    (o[0].sum() + sum(o[1:])).backward()
                del o
            how = f"use_reentrant={reentrant}{', two in flight' if in_flight else ''}"
            same = all(torch.equal(a, b) for a, b in zip(grads(layer), g_plain)) and \
                all(torch.equal(v.grad, b) for v, b in zip(vs, dx_plain))
            st = layer.get_extra_state()
            cases.check(f"checkpoint of the layer behind another op ({how}) equals the plain "
                        "run bitwise", same)
            cases.check(f"checkpoint of the layer behind another op ({how}): the expert bias "
                        "counts once",
                        torch.equal(st["expert_bias_counts"], st_plain["expert_bias_counts"]),
                        f'{st["expert_bias_counts"]} vs {st_plain["expert_bias_counts"]}')
            cases.check(f"checkpoint of the layer behind another op ({how}): nothing held "
                        "afterwards", layer._c.in_flight == 0 and not layer._pending,
                        (layer._c.in_flight, len(layer._pending)))
    # inference_mode in eval: the same output as no_grad (inference tensors have no version
    # counter; nothing of the checkpoint machinery reads them).
    layer = fresh().eval()
    with torch.no_grad():
        want, _ = layer(xs[0])
    with torch.inference_mode():
        got, _ = layer(xs[0].clone())
    cases.check("eval under torch.inference_mode equals no_grad", torch.equal(got, want))
    # A frozen parameter (the router): no gradient written to it; the others as in the plain run.
    layer = fresh()
    layer.router.weight.requires_grad_(False)
    for x in xs:
        out, losses = layer(x.clone().requires_grad_())
        (out.sum() + sum(losses.values())).backward()
    cases.check("accumulate: a frozen parameter gets no .grad, the others the plain run's",
                layer.router.weight.grad is None and
                all(torch.equal(p.grad, g) for p, g in zip(layer.parameters(), g_plain)
                    if p.requires_grad))
    # main_grad: accumulated there, .grad untouched.
    layer = fresh()
    for p in layer.parameters():
        p.main_grad = torch.zeros_like(p)
    for x in xs:
        out, losses = layer(x.clone().requires_grad_())
        (out.sum() + sum(losses.values())).backward()
    cases.check("accumulate: into main_grad when the parameter has one",
                all(torch.equal(p.main_grad, g) for p, g in zip(layer.parameters(), g_plain)) and
                all(p.grad is None for p in layer.parameters()))
    # The expert bias after end_global_batch: rate * sign(mean - count).
    plain.end_global_batch()
    c = st_plain["expert_bias_counts"]
    want = 1e-3 * torch.sign(c.mean() - c)
    got = plain.get_extra_state()["expert_bias"]
    cases.check("end_global_batch: the bias moves by rate * sign(mean - count)",
                torch.allclose(got, want), f"{got} vs {want}")


def case_state(groups):
    E, H, F, k, N = 4, 6, 4, 2, 8
    kw = {"router_score_function": "sigmoid", "router_enable_expert_bias": True,
          "global_aux_loss_coeff": 0.01}
    a = make_layer(groups, E, H, F, k, N, init_seed=3, **kw)
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(9))
    out, losses = a(x.clone().requires_grad_())
    (out.sum() + sum(losses.values())).backward()
    a.end_global_batch()
    out, losses = a(x)
    sd = a.state_dict()
    b = make_layer(groups, E, H, F, k, N, init_seed=4, **kw)
    b.load_state_dict(sd)
    oa, la = a(x)
    ob, lb = b(x)
    cases.check("state_dict round trip: weights, expert bias and global counts continue exactly",
                torch.equal(oa, ob) and all(torch.equal(la[n], lb[n]) for n in la))
    c = make_layer(groups, E, H, F, k, N, init_seed=3, **kw)
    cases.check("init_seed: the same seed gives the same weights",
                all(torch.equal(p, q) for p, q in zip(c.parameters(),
                                                       make_layer(groups, E, H, F, k, N,
                                                                  init_seed=3,
                                                                  **kw).parameters())))
    # Megatron-Core's TEGroupedMLP names onto the stacked parameters.
    w = full_weights(2, E, H, F, "swiglu", torch.float32)
    meg = {}
    for i in range(E):
        meg[f"decoder.layers.0.mlp.experts.linear_fc1.weight{i}"] = fc1_shard(w["fc1"][i], F, 1,
                                                                              0, True)
        meg[f"decoder.layers.0.mlp.experts.linear_fc2.weight{i}"] = fc2_shard(w["fc2"][i], F, 1, 0)
    c.load_megatron_grouped_mlp(meg, prefix="decoder.layers.0.mlp.experts.")
    cases.check("load_megatron_grouped_mlp: linear_fc1.weight{i} / linear_fc2.weight{i}",
                torch.equal(c.experts.fc1, w["fc1"]) and torch.equal(c.experts.fc2, w["fc2"]))
    try:
        del meg["decoder.layers.0.mlp.experts.linear_fc2.weight3"]
        c.load_megatron_grouped_mlp(meg, prefix="decoder.layers.0.mlp.experts.")
        ok = False
    except ValueError as e:
        ok = "linear_fc2.weight3" in str(e)
    cases.check("load_megatron_grouped_mlp: a missing expert is named", ok)


def write_safetensors(path, tensors):
    """A safetensors file of fp32 tensors, written here (the format: header length, JSON, data)."""
    import json
    import struct
    header, blobs, at = {}, [], 0
    for name, t in tensors.items():
        b = t.to(torch.float32).contiguous().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [at, at + len(b)]}
        blobs.append(b)
        at += len(b)
    h = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def case_upcycled(groups, tool):
    """moefold-upcycle's output, loaded: every expert a copy of the dense FFN (granularity 1),
    so with the softmax after the top-k the layer's output is the dense FFN's."""
    import subprocess
    import tempfile
    E, H, F, k, N = 4, 6, 8, 2, 12
    g = torch.Generator().manual_seed(21)
    gate, up, down = (torch.randn(F, H, generator=g), torch.randn(F, H, generator=g),
                      torch.randn(H, F, generator=g))
    work = tempfile.mkdtemp(prefix="moefold-torch-upcycle-")
    dense = os.path.join(work, "dense.safetensors")
    write_safetensors(dense, {"model.layers.0.mlp.gate_proj.weight": gate,
                              "model.layers.0.mlp.up_proj.weight": up,
                              "model.layers.0.mlp.down_proj.weight": down})
    out_dir = os.path.join(work, "moe")
    r = subprocess.run([tool, "--dense", dense, "--out", out_dir, "--experts", str(E), "--topk",
                        str(k), "--activation", "swiglu", "--world", "1", "--dtype", "fp32"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        cases.check("load_upcycled: moefold-upcycle ran", False, r.stderr[-500:])
        return
    layer = make_layer(groups, E, H, F, k, N)
    layer.load_upcycled(out_dir, 0)
    x = torch.randn(N, H, generator=g)
    out, _ = layer(x)
    want = (torch.nn.functional.silu(x @ gate.t()) * (x @ up.t())) @ down.t()
    cases.check("load_upcycled: moefold-upcycle's experts reproduce the dense FFN",
                rel_err(out.detach(), want) < 1e-5, rel_err(out.detach(), want))
    expect("load_upcycled: another layer count of experts is refused", ValueError,
           lambda: make_layer(groups, 8, H, F, k, N).load_upcycled(out_dir, 0), ["experts"])
    expect("load_upcycled: a layer the file lacks is named", ValueError,
           lambda: layer.load_upcycled(out_dir, 3), ["no layer 3"])


def expect(name, exc, fn, words):
    try:
        fn()
        cases.check(name, False, "no exception")
    except exc as e:
        cases.check(name, all(wd in str(e) for wd in words), f"{type(e).__name__}: {e}")
    except Exception as e:  # noqa: BLE001
        cases.check(name, False, f"{type(e).__name__}: {e}")


def case_bad_input(groups):
    E, H, F, k, N = 4, 6, 4, 2, 8
    layer = make_layer(groups, E, H, F, k, N)
    expect("an unknown keyword is a TypeError", TypeError,
           lambda: make_layer(groups, E, H, F, k, N, moe_router_topk=2), ["moe_router_topk"])
    expect("a bad value names the argument", ValueError,
           lambda: make_layer(groups, E, H, F, k, N, router_score_function="tanh"),
           ["router_score_function"])
    expect("topk > num_experts", ValueError, lambda: make_layer(groups, E, H, F, 5, N),
           ["router_topk"])
    expect("a CUDA device is not implemented yet", NotImplementedError,
           lambda: make_layer(groups, E, H, F, k, N, device="cuda"), ["CUDA"])
    expect("x of another dtype", ValueError, lambda: layer(torch.zeros(N, H, dtype=torch.float64)),
           ["float64"])
    expect("x of another hidden size", ValueError, lambda: layer(torch.zeros(N, H + 1)),
           [f"[N, {H}]"])
    expect("more tokens than max_tokens", ValueError, lambda: layer(torch.zeros(N + 1, H)),
           ["max_tokens"])
    expect("x on another device", NotImplementedError,
           lambda: layer(torch.zeros(N, H, device="meta")), ["meta"])
    bf = make_layer(groups, E, H, F, k, N, torch.bfloat16)
    expect("a bf16 parameter without main_grad (accumulate)", ValueError,
           lambda: bf(torch.zeros(N, H, dtype=torch.bfloat16, requires_grad=True))[0].sum()
           .backward(), ["router.weight", "main_grad"])
    expect("a loss coefficient that is not a number names it", ValueError,
           lambda: make_layer(groups, E, H, F, k, N, z_loss_coeff="0.1"), ["z_loss_coeff"])
    off = make_layer(groups, E, H, F, k, N, z_loss_coeff=None, aux_loss_coeff=0.01)
    cases.check("z_loss_coeff=None (Megatron-Core's default) is off",
                sorted(off(torch.zeros(N, H))[1]) == ["aux"])
    expect("a device that is not one names the argument", ValueError,
           lambda: make_layer(groups, E, H, F, k, N, device="bogus"), ["device"])
    expect("x [S, B, H] with B other than micro_batch", ValueError,
           lambda: layer(torch.zeros(N // 2, 2, H)), ["micro_batch"])
    two = make_layer(groups, E, H, F, k, N, micro_batch=2)
    expect("N tokens not a multiple of micro_batch", ValueError,
           lambda: two(torch.zeros(N - 1, H)), ["micro_batch"])
    gated = make_layer(groups, E, H, F, k, N, shared_expert_intermediate_size=4,
                       shared_expert_gate=True)
    expect("a shared_gate of the wrong size names it", ValueError,
           lambda: gated.load_global(shared_gate=torch.zeros(H + 1)), ["shared_gate"])
    expect("an extra state without its keys", ValueError,
           lambda: layer.set_extra_state({"expert_bias": torch.zeros(E)}), ["expert_bias_counts"])
    keep = layer._c.forward(torch.zeros(N, H), None, torch.zeros(N, H), True)[0]
    expect("a backward with fewer rows than its forward", ValueError,
           lambda: layer._c.backward(keep, torch.zeros(N - 2, H), [1.0, 0, 0, 0, 0],
                                     torch.zeros(N - 2, H)), ["tokens"])
    layer._c.release(keep)
    expect("router options moefold refuses (expert bias with softmax)", ValueError,
           lambda: make_layer(groups, E, H, F, k, N, router_enable_expert_bias=True),
           ["expert bias"])


def main():
    port = ranks.free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    groups = moefold_torch.new_groups()
    tool = sys.argv[1] if len(sys.argv) > 1 else None  # moefold-upcycle (meson passes it)
    all_cases = [case_reference, case_bf16, case_gradcheck, case_modes, case_state, case_bad_input]
    if tool:
        all_cases.append(lambda g: case_upcycled(g, tool))
    else:
        cases.check("load_upcycled: the moefold-upcycle tool's path is given", False,
                    "usage: layer_test.py MOEFOLD_UPCYCLE")
    for case in all_cases:
        try:
            case(groups)
        except Exception as e:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            cases.check(getattr(case, "__name__", "case"), False, f"{type(e).__name__}: {e}")
    return cases.finish()


if __name__ == "__main__":
    sys.exit(main())
