"""The small collectives the run needs: mean, max, any-rank, barrier. Every rank must call each one together;
without a process group (or with one rank) they return their input.
"""
from __future__ import annotations

import hashlib
from typing import Any, Callable, Optional

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


def sampled_digest(read: Callable[[int, int], bytes], length: int, window: int, windows: int = 64,
                   digest=None) -> str:
    """Hex BLAKE2b digest (8 bytes) of ``windows + 1`` evenly spaced windows of a sequence of ``length`` items (bytes of
    a file, tokens of an array), the first starting at 0 and the last ending at ``length``: ``read(start, n)`` returns
    the bytes of items ``start .. start + n``. A fingerprint for :func:`unlike_rank0` that reads the same small
    amount whatever the size: two copies that differ anywhere differ, almost surely, in their length or in one of the
    windows (a sample, not a proof: a single changed item between windows passes). ``digest``: a
    ``hashlib.blake2b`` to continue (e.g. after a header), else a new one."""
    digest = digest if digest is not None else hashlib.blake2b(digest_size=8)
    last = max(0, length - window)
    for i in range(windows + 1):
        digest.update(read(last * i // windows, window))
    return digest.hexdigest()


def unlike_rank0(label: str, fingerprint: str) -> Optional[tuple[int, list]]:
    """Gather every rank's ``(label, fingerprint)`` (what it read, and a digest of it) and return ``(r, every)``
    for the first rank ``r`` whose fingerprint is not rank 0's, with every rank's pair; None when all agree, or
    without a process group. The same answer on every rank, so each can raise the same error."""
    if _group_size() <= 1:
        return None
    every: list[Any] = [None] * _group_size()
    dist.all_gather_object(every, (label, fingerprint))
    other = next((r for r, theirs in enumerate(every) if theirs[1] != every[0][1]), None)
    return None if other is None else (other, every)


def first_given(value: Optional[str]) -> Optional[str]:
    """The first rank's ``value`` that is not None (by rank), gathered from every rank; ``value`` itself without a
    process group."""
    if _group_size() <= 1:
        return value
    every: list[Any] = [None] * _group_size()
    dist.all_gather_object(every, value)
    return next((v for v in every if v is not None), None)


def barrier() -> None:
    if _group_size() > 1 or (dist.is_available() and dist.is_initialized()):
        dist.barrier()
