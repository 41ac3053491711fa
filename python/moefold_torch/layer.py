"""moefold_torch.MoELayer: moefold's MoE layer as a torch.nn.Module on a job's process groups.

The forward and backward are moefold's (C++, on this rank's CPU tensors; the collectives over the
groups' gloo backends); the module holds the parameters as torch Parameters, sharded as
Megatron-Core shards them, and a custom autograd Function links moefold's backward into
autograd. Nothing is recomputed in Python: activation checkpointing (torch.utils.checkpoint,
reentrant or not) runs moefold's own recomputation, which adds nothing to the expert bias or the
global load-balancing counts a second time.
"""
import collections
import math
import numbers

import torch

from . import _C
from .groups import Groups

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float64: "float64"}
_LOSSES = ("aux", "seq_aux", "global_aux", "z")
_PARAMS = ("router.weight", "experts.fc1", "experts.fc2", "shared_expert.fc1",
           "shared_expert.fc2", "shared_expert.gate")
# Gradient groups: what each parameter's gradient is summed over (moefold's layer docs).
_GRADIENT_GROUPS = {"router.weight": "tp-dp-cp", "experts.fc1": "edp", "experts.fc2": "edp",
                    "shared_expert.fc1": "dp-cp", "shared_expert.fc2": "dp-cp",
                    "shared_expert.gate": "tp-dp-cp"}
# At most this many forwards whose activations were dropped wait for their recomputation (a
# forward without gradients in training mode is one: reentrant checkpointing's first pass); the
# oldest is forgotten beyond it. A recomputation is recognized by its input's bytes (the
# checkpointed function runs again, so the layer's input is a new tensor with the same bytes).
_MAX_PENDING = 64


def _int(name, v, low=1):
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < low:
        raise ValueError(f"moefold_torch.MoELayer: {name} must be an int >= {low} (got {v!r})")
    return int(v)


def _float(name, v, low=0.0, allow_none=False, strict=False):
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or \
            (v <= low if strict else v < low):
        rel = ">" if strict else ">="
        raise ValueError(f"moefold_torch.MoELayer: {name} must be a finite number {rel} {low} "
                         f"(got {v!r})")
    return float(v)


def _choice(name, v, options):
    if v not in options:
        raise ValueError(f"moefold_torch.MoELayer: {name} must be one of {options} (got {v!r})")
    return v


def _position(groups, kind, rank):
    ranks = groups.ranks.get(kind)
    return ranks.index(rank) if ranks else 0


def _seeded(seed, kind, index):
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + kind * 7_919 + index) % (2 ** 63))
    return g


def _fc1_shard(full, ffn, shards, r, gated):
    """Rows of shard r of an fc1 [(2) F, H]: its gate rows then its up rows (gated)."""
    fs = ffn // shards
    if gated:
        return torch.cat([full[r * fs:(r + 1) * fs], full[ffn + r * fs:ffn + (r + 1) * fs]])
    return full[r * fs:(r + 1) * fs]


def _fc2_shard(full, ffn, shards, r):
    fs = ffn // shards
    return full[:, r * fs:(r + 1) * fs]


class _Forward:
    """One forward of moefold in flight: its context id and losses. moefold holds it (its
    activations until the backward, then the forward itself, so a retained graph can run its
    backward again) until the autograd node that owns it, or the checkpoint waiting to recompute
    it, lets it go."""

    def __init__(self, layer, cid, losses):
        self.layer, self.id, self.losses = layer, cid, losses

    def __del__(self):
        if self.id >= 0:
            try:
                self.layer._c.release(self.id)
            except Exception:  # noqa: BLE001  (the layer may be gone at interpreter shutdown)
                pass


def _checkpointing():
    """True inside torch.utils.checkpoint's non-reentrant forward (its saved-tensor hooks)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    hooks = top(False) if top is not None else None
    if not hooks:
        return False
    pack = hooks[0]
    return bool(getattr(pack, "_checkpoint_internal", False)) or \
        getattr(pack, "__module__", "") == "torch.utils.checkpoint"


class _MoEFunction(torch.autograd.Function):
    """(layer, plan, x2d, keys, *params) -> (out, aux, seq_aux, global_aux, z). moefold keeps the
    activations; the backward seeds moefold's backward with dout and each loss's gradient (0
    where the training loss does not use a loss) and gives autograd dx (and, with
    grad_mode='return', the parameters' gradients)."""

    @staticmethod
    def forward(ctx, layer, plan, x2d, keys, *params):
        out = torch.empty_like(x2d)
        fwd = layer._run_forward(plan, x2d, keys, out)
        ctx.layer, ctx.fwd, ctx.keys = layer, fwd, keys
        # The input, for a second backward of a retained graph (moefold recomputes from it); and
        # non-reentrant checkpointing recomputes a forward when its backward unpacks it.
        ctx.save_for_backward(x2d)
        return (out, *[torch.tensor(v, dtype=layer._router_dtype) for v in fwd.losses])

    @staticmethod
    def backward(ctx, dout, *dlosses):
        (x2d,) = ctx.saved_tensors  # non-reentrant checkpointing recomputes here
        layer, fwd = ctx.layer, ctx.fwd
        if not layer._c.ready(fwd.id):  # a second backward (retain_graph=True)
            layer._c.recompute(fwd.id, x2d, ctx.keys, torch.empty_like(x2d))
        seeds = [1.0] + [0.0 if d is None else float(d) for d in dlosses]
        dx = torch.empty_like(dout)
        grads = layer._bind_for_backward()
        layer._forget(fwd)
        layer._c.backward(fwd.id, dout.contiguous(), seeds, dx)
        present = [g for g in grads if g is not None]
        if layer.grad_mode == "return":  # (layer, plan, x2d, keys, *params)
            pgrads = [g.to(p.dtype) if need else None for g, p, need in
                      zip(present, layer._present_params(), ctx.needs_input_grad[4:])]
        else:
            pgrads = [None] * len(present)
        return (None, None, dx, None, *pgrads)


class MoELayer(torch.nn.Module):
    """moefold's MoE layer (router, token dropping, dispatcher, experts, combine, shared expert)
    on this rank's groups. See docs/pytorch.md for every argument."""

    def __init__(self, *, hidden_size, ffn_hidden_size, num_experts, router_topk, groups,
                 max_tokens, micro_batch=1, router_score_function="softmax",
                 router_pre_softmax=False, router_topk_scaling_factor=None,
                 router_num_groups=None, router_group_topk=None,
                 router_enable_expert_bias=False, router_bias_update_rate=1e-3,
                 expert_capacity_factor=None, token_drop_policy="probs",
                 pad_expert_input_to_capacity=False, token_dispatcher_type="alltoall",
                 aux_loss_coeff=0.0, z_loss_coeff=0.0, shared_expert_intermediate_size=0,
                 shared_expert_gate=False, router_dtype=torch.float32, seq_aux_loss_coeff=0.0,
                 global_aux_loss_coeff=0.0, full_sequence_dropping=False, activation="swiglu",
                 params_dtype=torch.float32, device="cpu", grad_mode="accumulate",
                 init_seed=0, max_recv_rows=None):
        super().__init__()
        if not isinstance(groups, Groups):
            raise ValueError("moefold_torch.MoELayer: groups must be a moefold_torch.Groups "
                             "(new_groups or groups_from)")
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"moefold_torch.MoELayer: device {device!r} is not a device") from None
        if device.type != "cpu":
            raise NotImplementedError(
                f"moefold_torch.MoELayer: device {device!r}: moefold_torch runs CPU tensors over "
                "gloo so far (CUDA tensors over NCCL are not implemented yet)")
        if params_dtype not in _DTYPES:
            raise ValueError(f"moefold_torch.MoELayer: params_dtype must be one of "
                             f"{list(_DTYPES)} (got {params_dtype!r})")
        want_router = torch.float64 if params_dtype == torch.float64 else torch.float32
        if router_dtype != want_router:
            raise ValueError(f"moefold_torch.MoELayer: router_dtype must be {want_router} for "
                             f"params_dtype {params_dtype} (got {router_dtype!r}): the router "
                             "computes in the parameters' accumulator type")
        H = _int("hidden_size", hidden_size)
        F = _int("ffn_hidden_size", ffn_hidden_size)
        E = _int("num_experts", num_experts)
        k = _int("router_topk", router_topk)
        if k > E:
            raise ValueError(f"moefold_torch.MoELayer: router_topk = {k} exceeds num_experts = {E}")
        Fs = _int("shared_expert_intermediate_size", shared_expert_intermediate_size, low=0)
        if E % groups.ep:
            raise ValueError(f"moefold_torch.MoELayer: num_experts = {E} is not divisible by "
                             f"the groups' ep = {groups.ep}")
        if F % groups.etp:
            raise ValueError(f"moefold_torch.MoELayer: ffn_hidden_size = {F} is not divisible "
                             f"by the groups' etp = {groups.etp}")
        if Fs % groups.tp:
            raise ValueError(f"moefold_torch.MoELayer: shared_expert_intermediate_size = {Fs} "
                             f"is not divisible by the groups' tp = {groups.tp}")
        for name, v in (("router_pre_softmax", router_pre_softmax),
                        ("router_enable_expert_bias", router_enable_expert_bias),
                        ("pad_expert_input_to_capacity", pad_expert_input_to_capacity),
                        ("shared_expert_gate", shared_expert_gate),
                        ("full_sequence_dropping", full_sequence_dropping)):
            if not isinstance(v, bool):
                raise ValueError(f"moefold_torch.MoELayer: {name} must be a bool (got {v!r})")
        self.grad_mode = _choice("grad_mode", grad_mode, ("accumulate", "return"))
        self.hidden_size, self.ffn_hidden_size, self.num_experts, self.router_topk = H, F, E, k
        self.groups = groups
        self.activation = _choice("activation", activation,
                                  ("swiglu", "geglu", "gelu", "silu", "relu", "squared_relu"))
        self._gated = activation in ("swiglu", "geglu")
        self._router_dtype = want_router
        # None is off (Megatron-Core's default for moe_z_loss_coeff).
        coeffs = {n: _float(n, 0.0 if v is None else v) for n, v in (
            ("aux_loss_coeff", aux_loss_coeff), ("seq_aux_loss_coeff", seq_aux_loss_coeff),
            ("global_aux_loss_coeff", global_aux_loss_coeff), ("z_loss_coeff", z_loss_coeff))}
        self._enabled = [coeffs[n] > 0 for n in ("aux_loss_coeff", "seq_aux_loss_coeff",
                                                   "global_aux_loss_coeff", "z_loss_coeff")]
        spec = {
            "hidden_size": H, "ffn_hidden_size": F, "num_experts": E, "router_topk": k,
            "max_tokens": _int("max_tokens", max_tokens),
            "micro_batch": _int("micro_batch", micro_batch),
            "max_recv_rows": None if max_recv_rows is None else
            _int("max_recv_rows", max_recv_rows, low=0),
            "router_score_function": _choice("router_score_function", router_score_function,
                                             ("softmax", "sigmoid", "sqrt_softplus")),
            "router_pre_softmax": router_pre_softmax,
            "router_topk_scaling_factor": _float("router_topk_scaling_factor",
                                                 router_topk_scaling_factor, allow_none=True,
                                                 strict=True),
            "router_num_groups": None if router_num_groups is None else
            _int("router_num_groups", router_num_groups),
            "router_group_topk": None if router_group_topk is None else
            _int("router_group_topk", router_group_topk),
            "router_enable_expert_bias": router_enable_expert_bias,
            "router_bias_update_rate": _float("router_bias_update_rate", router_bias_update_rate),
            "expert_capacity_factor": _float("expert_capacity_factor", expert_capacity_factor,
                                             allow_none=True, strict=True),
            "token_drop_policy": _choice("token_drop_policy", token_drop_policy,
                                         ("probs", "position")),
            "pad_expert_input_to_capacity": pad_expert_input_to_capacity,
            "full_sequence_dropping": full_sequence_dropping,
            "token_dispatcher_type": _choice("token_dispatcher_type", token_dispatcher_type,
                                             ("alltoall", "allgather")),
            **coeffs,
            "shared_expert_intermediate_size": Fs,
            "shared_expert_gate": shared_expert_gate,
            "activation": activation,
            "params_dtype": _DTYPES[params_dtype],
        }
        if pad_expert_input_to_capacity and expert_capacity_factor is None:
            raise ValueError("moefold_torch.MoELayer: pad_expert_input_to_capacity needs "
                             "expert_capacity_factor")
        if shared_expert_gate and Fs == 0:
            raise ValueError("moefold_torch.MoELayer: shared_expert_gate needs "
                             "shared_expert_intermediate_size > 0")
        self._spec = spec
        self._c = _C.Layer(spec, {kind: groups.groups.get(kind) for kind in
                                  ("tp", "tp-cp", "tp-dp-cp", "dp-cp", "ep", "etp", "tp-ep",
                                   "edp")})
        self._grad_dtype = torch.float64 if params_dtype == torch.float64 else torch.float32
        rank = groups.rank
        self._ep_rank = _position(groups, "ep", rank)
        self._etp_rank = _position(groups, "etp", rank)
        self._tp_rank = _position(groups, "tp", rank)
        L = E // groups.ep
        self.num_local_experts = L
        f1 = (2 if self._gated else 1) * F // groups.etp
        dt = params_dtype
        self.router = torch.nn.Module()
        self.router.weight = torch.nn.Parameter(torch.empty(E, H, dtype=dt))
        self.experts = torch.nn.Module()
        self.experts.fc1 = torch.nn.Parameter(torch.empty(L, f1, H, dtype=dt))
        self.experts.fc2 = torch.nn.Parameter(torch.empty(L, H, F // groups.etp, dtype=dt))
        if Fs > 0:
            self.shared_expert = torch.nn.Module()
            f1s = (2 if self._gated else 1) * Fs // groups.tp
            self.shared_expert.fc1 = torch.nn.Parameter(torch.empty(f1s, H, dtype=dt))
            self.shared_expert.fc2 = torch.nn.Parameter(torch.empty(H, Fs // groups.tp, dtype=dt))
            if shared_expert_gate:
                self.shared_expert.gate = torch.nn.Parameter(torch.empty(1, H, dtype=dt))
        else:
            self.shared_expert = None
        counts = self._c.counts()
        for name, p in zip(_PARAMS, self._param_list()):
            key = name.replace("router.weight", "router").replace("experts.", "") \
                .replace("shared_expert.", "shared_")
            if (p.numel() if p is not None else 0) != counts[key]:
                raise RuntimeError(f"moefold_torch: {name} has {p.numel()} elements, the layer "
                                   f"expects {counts[key]}")
        self._init_weights(_int("init_seed", init_seed, low=0))
        self._pending = collections.OrderedDict()  # (input key, serial) -> checkpointed _Forward
        self._serial = 0
        self._last = None
        self.train(True)

    # --- parameters --------------------------------------------------------------------------

    def _param_list(self):
        se = self.shared_expert
        return [self.router.weight, self.experts.fc1, self.experts.fc2,
                se.fc1 if se is not None else None, se.fc2 if se is not None else None,
                getattr(se, "gate", None) if se is not None else None]

    def gradient_groups(self):
        """Each parameter's gradient group by name: the group its gradient is summed over
        (experts: 'edp'; router and shared gate: 'tp-dp-cp', partial over TP; shared MLP:
        'dp-cp'), for a trainer that reduces the gradients itself."""
        return {n: _GRADIENT_GROUPS[n] for n, p in zip(_PARAMS, self._param_list())
                if p is not None}

    def _local_experts(self):
        L = self.num_local_experts
        return range(self._ep_rank * L, (self._ep_rank + 1) * L)

    @torch.no_grad()
    def _init_weights(self, seed):
        """Every global expert and the router drawn from (seed, global index): the same weights
        under every mapping. Normal(0, 0.02), Megatron-Core's init_method_std."""
        H, F, E = self.hidden_size, self.ffn_hidden_size, self.num_experts
        gen_dt = torch.float64 if self.router.weight.dtype == torch.float64 else torch.float32
        f1 = (2 if self._gated else 1) * F

        def draw(kind, index, shape):
            return torch.empty(shape, dtype=gen_dt).normal_(0.0, 0.02,
                                                           generator=_seeded(seed, kind, index))

        full = {"router": draw(0, 0, (E, H))}
        fc1 = torch.empty(E, f1, H, dtype=gen_dt)
        fc2 = torch.empty(E, H, F, dtype=gen_dt)
        for e in self._local_experts():
            fc1[e] = draw(1, e, (f1, H))
            fc2[e] = draw(2, e, (H, F))
        full.update(fc1=fc1, fc2=fc2)
        if self.shared_expert is not None:
            Fs = self._spec["shared_expert_intermediate_size"]
            full["shared_fc1"] = draw(3, 0, ((2 if self._gated else 1) * Fs, H))
            full["shared_fc2"] = draw(4, 0, (H, Fs))
            if hasattr(self.shared_expert, "gate"):
                full["shared_gate"] = draw(5, 0, (1, H))
        self.load_global(**full, _local_only=True)

    @torch.no_grad()
    def load_global(self, router=None, fc1=None, fc2=None, shared_fc1=None, shared_fc2=None,
                    shared_gate=None, _local_only=False):
        """Copies full (unsharded) tensors into this rank's shards: router [E, H]; fc1 [E, (2)F,
        H] (per expert the gate rows, then the up rows); fc2 [E, H, F]; shared_fc1 [(2)Fs, H];
        shared_fc2 [H, Fs]; shared_gate [1, H] or [H]. Any may be omitted."""
        H, F, E = self.hidden_size, self.ffn_hidden_size, self.num_experts
        etp, r = self.groups.etp, self._etp_rank
        f1 = (2 if self._gated else 1) * F

        def shape_check(name, t, shape):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"moefold_torch.MoELayer.load_global: {name} must be {shape} "
                                 f"(got {got})")

        if router is not None:
            shape_check("router", router, (E, H))
            self.router.weight.copy_(router)
        if fc1 is not None:
            shape_check("fc1", fc1, (E, f1, H))
            for l, e in enumerate(self._local_experts()):
                self.experts.fc1[l].copy_(_fc1_shard(fc1[e], F, etp, r, self._gated))
        if fc2 is not None:
            shape_check("fc2", fc2, (E, H, F))
            for l, e in enumerate(self._local_experts()):
                self.experts.fc2[l].copy_(_fc2_shard(fc2[e], F, etp, r))
        se = self.shared_expert
        given_shared = [t is not None for t in (shared_fc1, shared_fc2, shared_gate)]
        if se is None and any(given_shared):
            raise ValueError("moefold_torch.MoELayer.load_global: shared-expert tensors given to "
                             "a layer without a shared expert")
        if se is not None:
            Fs, tp, tr = self._spec["shared_expert_intermediate_size"], self.groups.tp, \
                self._tp_rank
            if shared_fc1 is not None:
                shape_check("shared_fc1", shared_fc1, ((2 if self._gated else 1) * Fs, H))
                se.fc1.copy_(_fc1_shard(shared_fc1, Fs, tp, tr, self._gated))
            if shared_fc2 is not None:
                shape_check("shared_fc2", shared_fc2, (H, Fs))
                se.fc2.copy_(_fc2_shard(shared_fc2, Fs, tp, tr))
            if shared_gate is not None:
                if not hasattr(se, "gate"):
                    raise ValueError("moefold_torch.MoELayer.load_global: shared_gate given to a "
                                     "layer without shared_expert_gate")
                if not isinstance(shared_gate, torch.Tensor) or shared_gate.numel() != H:
                    shape_check("shared_gate", shared_gate, (1, H))
                se.gate.copy_(shared_gate.reshape(1, H))

    def load_megatron_grouped_mlp(self, state, prefix=""):
        """Loads Megatron-Core TEGroupedMLP weights of this rank's local experts:
        `{prefix}linear_fc1.weight{i}` [(2)F/ETP, H] and `{prefix}linear_fc2.weight{i}` [H,
        F/ETP] for local expert i (Megatron-Core's per-rank checkpoint of the same mapping)."""
        with torch.no_grad():
            for i in range(self.num_local_experts):
                for name, dst in (("linear_fc1", self.experts.fc1[i]),
                                  ("linear_fc2", self.experts.fc2[i])):
                    key = f"{prefix}{name}.weight{i}"
                    if key not in state:
                        raise ValueError(f"moefold_torch.MoELayer.load_megatron_grouped_mlp: "
                                         f"{key!r} is missing")
                    t = state[key]
                    if tuple(t.shape) != tuple(dst.shape):
                        raise ValueError(f"moefold_torch.MoELayer.load_megatron_grouped_mlp: "
                                         f"{key} is {tuple(t.shape)}, this rank's shard "
                                         f"{tuple(dst.shape)}")
                    dst.copy_(t)

    def load_upcycled(self, directory, layer):
        """Loads layer `layer` of moefold-upcycle's output (docs/upcycling.md): this rank's file
        `rank-RRRRR.safetensors` in `directory`, whose index.json must describe this job's
        mapping and this layer's experts and activation (the file's shards are then this rank's).
        The router weight and this rank's local experts are copied, converted to the parameters'
        dtype."""
        import json
        import os
        from . import _safetensors
        where = f"moefold_torch.MoELayer.load_upcycled: {directory}"
        with open(os.path.join(directory, "index.json")) as f:
            index = json.load(f)
        m, o, g = index["mapping"], index["options"], self.groups
        for key, mine in (("world", g.world), ("tp", g.tp), ("cp", g.cp), ("pp", g.pp),
                          ("ep", g.ep), ("etp", g.etp), ("order", g.order),
                          ("experts", self.num_experts), ("activation", self.activation)):
            theirs = m.get(key, o.get(key))
            if theirs != mine:
                raise ValueError(f"{where}: its {key} is {theirs!r}, this layer's {mine!r}")
        t = _safetensors.read(os.path.join(directory, f"rank-{g.rank:05d}.safetensors"))
        pre = f"layers.{layer}."
        if not any(n.startswith(pre) for n in t):
            raise ValueError(f"{where}: rank {g.rank}'s file has no layer {layer}")
        if any(n.startswith(pre) and n.endswith(".bias") for n in t):
            raise ValueError(f"{where}: layer {layer} has FFN biases; moefold's experts have none")

        def get(name, shape):
            if name not in t:
                raise ValueError(f"{where}: {name} is missing from rank {g.rank}'s file")
            if tuple(t[name].shape) != tuple(shape):
                raise ValueError(f"{where}: {name} is {tuple(t[name].shape)}, this layer's "
                                 f"{tuple(shape)}")
            return t[name]

        with torch.no_grad():
            self.router.weight.copy_(get(pre + "router.weight", self.router.weight.shape))
            for l, e in enumerate(self._local_experts()):
                self.experts.fc1[l].copy_(get(f"{pre}experts.{e}.fc1.weight",
                                              self.experts.fc1.shape[1:]))
                self.experts.fc2[l].copy_(get(f"{pre}experts.{e}.fc2.weight",
                                              self.experts.fc2.shape[1:]))

    def _grad_buffer(self, p, name):
        """The buffer moefold accumulates p's gradient into (grad_mode 'accumulate'):
        p.main_grad when the trainer gave one, else p.grad (created when None)."""
        mg = getattr(p, "main_grad", None)
        if mg is not None:
            if mg.dtype != self._grad_dtype or mg.shape != p.shape or not mg.is_contiguous():
                raise ValueError(f"moefold_torch.MoELayer: {name}.main_grad must be a contiguous "
                                 f"{self._grad_dtype} tensor of shape {tuple(p.shape)}")
            return mg
        if p.dtype != self._grad_dtype:
            raise ValueError(f"moefold_torch.MoELayer: {name} is {p.dtype} and has no main_grad: "
                             f"moefold accumulates its gradient in {self._grad_dtype} "
                             "(give it a main_grad, as Megatron-Core's DDP does, or use "
                             "grad_mode='return')")
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        elif not p.grad.is_contiguous() or p.grad.dtype != self._grad_dtype:
            raise ValueError(f"moefold_torch.MoELayer: {name}.grad must be a contiguous "
                             f"{self._grad_dtype} tensor")
        return p.grad

    def _bind(self, grads):
        """Points moefold at the parameters' current tensors, and at `grads` (None: the
        gradient buffers stay as last bound; a forward writes none)."""
        ws = [p.detach() if p is not None else None for p in self._param_list()]
        for name, w in zip(_PARAMS, ws):
            if w is not None and (not w.is_contiguous() or w.device.type != "cpu"):
                raise ValueError(f"moefold_torch.MoELayer: {name} must be a contiguous CPU tensor")
        self._c.bind(ws, [None] * 6 if grads is None else grads)

    def _bind_for_backward(self):
        """Binds the weights and the gradient buffers of this backward: the parameters' own
        (accumulate) or zeroed temporaries returned to autograd (return). A frozen parameter
        (requires_grad False) gets a zeroed scratch buffer in accumulate mode: moefold computes
        every gradient, and neither its .grad nor its main_grad sees one."""
        if self.grad_mode == "accumulate":
            grads = [None if p is None else self._grad_buffer(p, n) if p.requires_grad else
                     torch.zeros(p.shape, dtype=self._grad_dtype)
                     for n, p in zip(_PARAMS, self._param_list())]
        else:
            grads = [torch.zeros(p.shape, dtype=self._grad_dtype) if p is not None else None
                     for p in self._param_list()]
        self._bind(grads)
        return grads

    # --- forward -----------------------------------------------------------------------------

    def train(self, mode=True):
        super().train(mode)
        if hasattr(self, "_c"):
            self._c.set_training(bool(mode))
        return self

    @staticmethod
    def _key(x2d):
        """The input's identity for a checkpoint's recomputation: its dtype, shape and a digest
        of its bytes. The recomputation runs the checkpointed function again, so the layer sees a
        new tensor (a norm's output, say) holding the same bytes; another forward in flight has
        other bytes (and if it had the same, recomputing either gives the same result)."""
        return (x2d.dtype, tuple(x2d.shape), _C._digest(x2d))

    def _take_pending(self, key):
        for k in self._pending:
            if k[0] == key:
                return self._pending.pop(k)
        return None

    def _forget(self, fwd):
        for key, f in list(self._pending.items()):
            if f is fwd:
                del self._pending[key]

    def _run_forward(self, plan, x2d, keys, out):
        """moefold's forward, or the recomputation of a checkpointed one (plan: (mode, forward
        to recompute, the input's key)); returns the _Forward."""
        mode, fwd, key = plan
        if mode == "recompute":
            self._c.recompute(fwd.id, x2d, keys, out)
            return fwd
        cid, losses, rows, routed, kept, dropped = self._c.forward(x2d, keys, out,
                                                                   mode != "once")
        self._last = {"rows_per_local_expert": torch.tensor(rows, dtype=torch.int64),
                      "routed": torch.tensor(routed, dtype=torch.int64),
                      "kept": torch.tensor(kept, dtype=torch.int64),
                      "dropped_pairs": torch.tensor(dropped, dtype=torch.int64)}
        fwd = _Forward(self, cid, losses)  # id -1 when nothing was kept ("once")
        if mode == "checkpointed":
            self._c.drop_activations(cid)  # recomputed by the checkpoint before its backward
            self._pending[(key, self._serial)] = fwd
            self._serial += 1
            while len(self._pending) > _MAX_PENDING:
                self._pending.popitem(last=False)
        return fwd

    def _present_params(self):
        return [p for p in self._param_list() if p is not None]

    def forward(self, x, order_keys=None):
        """out, losses = layer(x): x [S, B, H] or [N, H] (token n = s*B + b); out has x's shape;
        losses: the enabled ones of 'aux', 'seq_aux', 'global_aux', 'z' as 0-d tensors (this
        rank's partials, coefficient included). order_keys: [N] int64 true sequence positions for
        full-sequence dropping by position (optional)."""
        H = self.hidden_size
        if not isinstance(x, torch.Tensor):
            raise ValueError("moefold_torch.MoELayer: x must be a tensor")
        if x.device.type != "cpu":
            raise NotImplementedError(
                f"moefold_torch.MoELayer: x is a {x.device} tensor: moefold_torch runs CPU "
                "tensors over gloo so far (CUDA tensors over NCCL are not implemented yet)")
        if x.dtype != self.router.weight.dtype:
            raise ValueError(f"moefold_torch.MoELayer: x is {x.dtype}, the layer's parameters "
                             f"{self.router.weight.dtype}")
        if x.dim() not in (2, 3) or x.shape[-1] != H:
            raise ValueError(f"moefold_torch.MoELayer: x must be [S, B, {H}] or [N, {H}] "
                             f"(got {list(x.shape)})")
        x2d = x.reshape(-1, H).contiguous()
        B = self._spec["micro_batch"]
        if x.dim() == 3 and x.shape[1] != B:
            raise ValueError(f"moefold_torch.MoELayer: x is [S, B, H] with B = {x.shape[1]}, the "
                             f"layer's micro_batch = {B}")
        if x2d.shape[0] % B:
            raise ValueError(f"moefold_torch.MoELayer: {x2d.shape[0]} tokens are not a multiple "
                             f"of micro_batch = {B} (token n = s*B + b)")
        if x2d.shape[0] > self._spec["max_tokens"]:
            raise ValueError(f"moefold_torch.MoELayer: {x2d.shape[0]} tokens exceed max_tokens "
                             f"= {self._spec['max_tokens']}")
        if order_keys is not None:
            if not isinstance(order_keys, torch.Tensor) or order_keys.dtype != torch.int64 or \
                    order_keys.numel() != x2d.shape[0] or order_keys.device.type != "cpu":
                raise ValueError("moefold_torch.MoELayer: order_keys must be a CPU int64 tensor "
                                 f"of N = {x2d.shape[0]} entries")
            order_keys = order_keys.reshape(-1).contiguous()
        params = self._present_params()
        grad_on = torch.is_grad_enabled()
        needs_grad = grad_on and (x.requires_grad or any(p.requires_grad for p in params))
        # The input's key (a pass over its bytes) only where a checkpoint may be involved: plain
        # training and evaluation never compute it.
        key = pending = None
        if self.training and self._pending and torch._C._current_graph_task_id() != -1:
            key = self._key(x2d)
            pending = self._take_pending(key)
        if pending is not None:
            plan = ("recompute", pending, key)  # a checkpoint recomputing an earlier forward
        elif self.training and (not grad_on or (needs_grad and _checkpointing())):
            # a checkpoint's first pass: activations dropped
            plan = ("checkpointed", None, self._key(x2d) if key is None else key)
        elif needs_grad:
            plan = ("keep", None, None)
        else:
            plan = ("once", None, None)
        self._bind(None)
        if needs_grad:
            res = _MoEFunction.apply(self, plan, x2d, order_keys, *params)
            out, losses = res[0], res[1:]
        else:
            out = torch.empty_like(x2d)
            fwd = self._run_forward(plan, x2d, order_keys, out)
            losses = [torch.tensor(v, dtype=self._router_dtype) for v in fwd.losses]
        return out.reshape(x.shape), {n: l for n, l, on in zip(_LOSSES, losses, self._enabled)
                                      if on}

    # --- statistics, state, the global batch -------------------------------------------------

    def last_stats(self):
        """This rank's latest forward: 'rows_per_local_expert' [E/EP] (padding included),
        'routed' [E] and 'kept' [E] (pairs of this rank's tokens), 'dropped_pairs' (0-d), int64."""
        if self._last is None:
            raise RuntimeError("moefold_torch.MoELayer.last_stats: no forward has run")
        return dict(self._last)

    def end_global_batch(self):
        """Once per global batch after the last backward: the expert-bias update (counts summed
        over tp-dp-cp) and the global load-balancing counts restarted. Collective."""
        self._c.end_global_batch()

    def get_extra_state(self):
        s = self._c.save_state()
        return {"expert_bias": torch.tensor(s["expert_bias"], dtype=torch.float32),
                "expert_bias_counts": torch.tensor(s["expert_bias_counts"], dtype=torch.float32),
                "global_aux_counts": torch.tensor(s["global_aux_counts"], dtype=torch.float64),
                "global_aux_steps": torch.tensor(s["global_aux_steps"], dtype=torch.int64)}

    def set_extra_state(self, state):
        want = ("expert_bias", "expert_bias_counts", "global_aux_counts", "global_aux_steps")
        if not isinstance(state, dict) or any(k not in state for k in want):
            raise ValueError("moefold_torch.MoELayer: the extra state must be the dict "
                             f"get_extra_state gives (keys {list(want)})")
        self._c.load_state({
            "expert_bias": state["expert_bias"].tolist(),
            "expert_bias_counts": state["expert_bias_counts"].tolist(),
            "global_aux_counts": state["global_aux_counts"].tolist(),
            "global_aux_steps": int(state["global_aux_steps"])})

    def extra_repr(self):
        s = self._spec
        return (f"hidden={s['hidden_size']}, ffn={s['ffn_hidden_size']}, "
                f"experts={s['num_experts']} (local {self.num_local_experts}), "
                f"topk={s['router_topk']}, dispatcher={s['token_dispatcher_type']}, "
                f"ep={self.groups.ep}, etp={self.groups.etp}, tp={self.groups.tp}")


def reduce_gradients(layer, groups=None, scale=1.0):
    """Sums each of the layer's gradients over its gradient group (MoELayer.gradient_groups) with
    plain sums in rank order, then multiplies by `scale`: what a DDP or FSDP user, who excludes the
    layer's parameters from DDP, calls after the backward. Collective over the layer's groups."""
    if not isinstance(layer, MoELayer):
        raise ValueError("moefold_torch.reduce_gradients: layer must be a MoELayer")
    if groups is not None and groups is not layer.groups:
        raise ValueError("moefold_torch.reduce_gradients: groups must be the layer's own")
    if layer.grad_mode != "accumulate":
        raise ValueError("moefold_torch.reduce_gradients: the layer's gradients are autograd's "
                         "(grad_mode='return'); reduce them as any parameter's")
    scale = _float("scale", scale)
    grads = layer._bind_for_backward()
    layer._c.reduce_gradients()
    if scale != 1.0:
        for g in grads:
            if g is not None:
                g.mul_(scale)
