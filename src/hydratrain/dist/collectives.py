"""The small collectives the run needs: mean, max, any-rank, barrier. Every rank must call each one together;
without a process group (or with one rank) they return their input.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def _group_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce_mean(values: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over ranks (reduced in place; returned)."""
    if _group_size() > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        values /= _group_size()
    return values


def all_reduce_max(values: torch.Tensor) -> torch.Tensor:
    """Element-wise max of ``values`` over ranks (reduced in place; returned)."""
    if _group_size() > 1:
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values


def max_over_ranks(value: float, device: torch.device) -> float:
    """The largest ``value`` any rank has."""
    return all_reduce_max(torch.tensor([float(value)], dtype=torch.float64, device=device)).item()


def any_rank(flag: bool, device: torch.device) -> bool:
    """True if ``flag`` is set on any rank."""
    return bool(all_reduce_max(torch.tensor([int(flag)], dtype=torch.int32, device=device)).item())


def unlike_rank0(label: str, fingerprint: str) -> Optional[tuple[int, list]]:
    """Gather every rank's ``(label, fingerprint)`` (what it read, and a digest of it) and return ``(r, every)``
    for the first rank ``r`` whose fingerprint is not rank 0's, with every rank's pair; None when all agree, or
    without a process group. The same answer on every rank, so each can raise the same error."""
    if _group_size() <= 1:
        return None
    every = [None] * _group_size()
    dist.all_gather_object(every, (label, fingerprint))
    other = next((r for r, theirs in enumerate(every) if theirs[1] != every[0][1]), None)
    return None if other is None else (other, every)


def barrier() -> None:
    if _group_size() > 1 or (dist.is_available() and dist.is_initialized()):
        dist.barrier()
