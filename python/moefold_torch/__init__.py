"""moefold_torch: moefold's MoE layer and collectives on a PyTorch job's process groups. CPU
tensors over gloo; CUDA tensors over NCCL are not implemented yet (NotImplementedError).

    groups = moefold_torch.new_groups(tp=1, ep=4)            # after dist.init_process_group
    layer = moefold_torch.MoELayer(hidden_size=H, ffn_hidden_size=F, num_experts=E,
                                   router_topk=k, groups=groups, max_tokens=N)
    out, losses = layer(x)                                  # loss = ... + sum(losses.values())

    import torch.distributed as dist, moefold_torch
    dist.init_process_group("gloo", ...)
    comm = moefold_torch.Communicator(dist.group.WORLD)   # or any group of the job
    comm.all_to_all_v(send, send_counts, recv, recv_counts)   # counts: rows per peer

Every collective checks every rank's counts first (moefold's collective headers), sums in rank
order (the same bits as moefold's thread world and MPI backend), and raises MoefoldError on
every rank for a mismatch, a dead peer (at once) or a stalled one (at the group's timeout); the
communicator is broken afterwards.
"""
import torch  # noqa: F401  (loads libtorch before the extension)
import torch.distributed  # noqa: F401  (registers the ProcessGroup type the extension takes)

from ._C import MoefoldError
from ._C import Communicator as _Communicator
from .groups import Groups, groups_from, new_groups, thread_groups
from .layer import MoELayer, reduce_gradients


class Communicator(_Communicator):
    """moefold's communicator over `group` (a torch.distributed ProcessGroup; None: the world)."""

    def __init__(self, group=None):
        if group is None:
            group = torch.distributed.group.WORLD
        if group is None:
            raise ValueError("moefold_torch.Communicator: torch.distributed is not initialized "
                             "(call dist.init_process_group first) and no group was given")
        super().__init__(group)


def run_thread_world(n, fn, timeout_s=30.0):
    """fn(world) on n threads of this process, each a rank of moefold's C++ thread world
    (thread_groups(world, ...) gives a rank its groups). Returns each rank's error ('' where fn
    returned); a rank that raises is a dead peer to the others."""
    return _C._run_thread_world(n, fn, timeout_s)


__all__ = ["Communicator", "Groups", "MoELayer", "MoefoldError", "groups_from", "new_groups",
           "reduce_gradients", "run_thread_world", "thread_groups"]
