"""moefold_torch: moefold's collectives (and, next, its MoE layer) on a PyTorch job's process
groups. CPU tensors over gloo; CUDA tensors over NCCL are not implemented yet
(NotImplementedError).

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
from .groups import Groups, groups_from, new_groups


class Communicator(_Communicator):
    """moefold's communicator over `group` (a torch.distributed ProcessGroup; None: the world)."""

    def __init__(self, group=None):
        if group is None:
            group = torch.distributed.group.WORLD
        if group is None:
            raise ValueError("moefold_torch.Communicator: torch.distributed is not initialized "
                             "(call dist.init_process_group first) and no group was given")
        super().__init__(group)


__all__ = ["Communicator", "Groups", "MoefoldError", "groups_from", "new_groups"]
