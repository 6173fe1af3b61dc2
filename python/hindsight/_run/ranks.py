"""A recording that spans the ranks of a `torchrun` or `srun` job: the
collectives that keep every rank's session in step. The rules (rank 0 owns
the run and decides; a resume needs the world size that saved) are core's
(`runs::ranks`); this module only moves values between the ranks.

The ranks meet when the outer `hs.loop` starts, over the default process
group, which the script has set up by then (DDP and FSDP need it before
they train). Every later meeting is at a boundary every rank reaches in the
same order: each step boundary, each block end, each iteration end."""

from __future__ import annotations

from typing import Any

from hindsight import _native
from hindsight.errors import InvalidArgumentError


class Ranks:
    """This process's place in the job, and the collectives it uses."""

    def __init__(self, world: _native.World) -> None:
        self.rank = world.rank
        self.size = world.size
        self.leads = world.leads
        self.source = world.source
        self._device: str | None = None

    @classmethod
    def of_framework(cls, rank: int, size: int, source: str) -> Ranks:
        """The ranks a framework started (Lightning's own launcher sets no
        variable the launch rules read), over its default process group."""
        ranks = cls.__new__(cls)
        ranks.rank, ranks.size, ranks.leads, ranks.source = rank, size, rank == 0, source
        ranks._device = None
        ranks.check()
        return ranks

    def check(self) -> None:
        """The process group is up and is the launch's: refused otherwise,
        naming what to do (a recording cannot agree on its run without it)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise InvalidArgumentError(
                f"this process is rank {self.rank} of {self.size} ({self.source}), and an hs.loop recording under "
                "several ranks is one run that the ranks agree on through torch.distributed: call "
                "torch.distributed.init_process_group() before the outer hs.loop starts"
            )
        if (dist.get_rank(), dist.get_world_size()) != (self.rank, self.size):
            raise InvalidArgumentError(
                f"the default process group is rank {dist.get_rank()} of {dist.get_world_size()}, but the launcher "
                f"says rank {self.rank} of {self.size} ({self.source}): hindsight follows the launcher's ranks"
            )
        if dist.get_backend() == "nccl":
            import torch

            self._device = f"cuda:{torch.cuda.current_device()}"

    def agree(self, values: list[float]) -> list[float]:
        """The largest of each value over the ranks: a signal any rank got,
        the slowest rank's time, rank 0's decision (the others give 0)."""
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self._device or "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [float(v) for v in t.tolist()]

    def from_leader(self, payload: Any) -> Any:
        """Rank 0's ``payload`` on every rank (the others pass None)."""
        import torch
        import torch.distributed as dist

        box = [payload if self.leads else None]
        dist.broadcast_object_list(box, src=0, device=None if self._device is None else torch.device(self._device))
        return box[0]

    def to_leader(self, payload: Any) -> list[Any] | None:
        """Every other rank's ``payload``, on rank 0 (in rank order, its
        own left out); None on the others."""
        import torch.distributed as dist

        got: list[Any] | None = [None] * self.size if self.leads else None
        dist.gather_object(payload, got, dst=0)
        return None if got is None else got[1:]


# What gloo and NCCL raise in a rank whose peer went away mid-collective (the
# peer was killed, ran out of memory, or its node left).
_PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote process exited",
)


def lost_peer(error: BaseException) -> bool:
    """Whether `error` is a collective failing because another rank of the
    job is gone, not a fault of this rank's code (torch's DistError and
    gloo's plain errors alike are RuntimeErrors)."""
    text = str(error)
    return isinstance(error, RuntimeError) and any(p in text for p in _PEER_GONE)
