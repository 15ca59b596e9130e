"""Process-group set-up and teardown from torchrun's environment, rank info, the shared run dir, rank-aware logs.

Commands this module serves::

    python train.py                                        # world_size 1 (a 1-rank group for ddp/fsdp)
    torchrun --standalone --nproc_per_node 2 train.py      # one node
    torchrun --nnodes 2 --node_rank R --rdzv_backend c10d --rdzv_endpoint HOST:PORT --nproc_per_node 8 train.py
    python train.py -m launcher=torchrun launcher.nproc_per_node=2   # the hydratrain launcher plugin starts ranks
    python train.py launcher=submitit_local                          # submitit tasks: ranks from submitit's env
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator, Optional

log = logging.getLogger(__name__)

_STAMP: Optional[str] = None
STAMP_ENV = "HYDRATRAIN_STAMP"  # a launcher's stamp, inherited by the processes it starts
_BASE_STORE = None  # this process's client (or, on rank 0 without an agent store, server) of MASTER_ADDR:PORT
_GROUPS_MADE = 0  # process groups created in this process (a sweep inside each rank makes one per job)


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: ``rank`` in ``[0, world_size)``, ``local_rank`` on its node, and its device."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: "object"  # torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def export_cluster_env() -> None:
    """Inside a submitit task (SLURM or submitit's local executor) without torchrun's variables, set ``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` from the scheduler's
    environment (``SLURM_*`` / ``SUBMITIT_LOCAL_*``, via ``submitit.helpers.TorchDistributedEnvironment``).

    A no-op elsewhere, or when ``RANK`` is already set. Raises ImportError if submitit is missing (extra [slurm]).
    """
    if "RANK" in os.environ or not os.environ.get("SUBMITIT_EXECUTOR"):
        return
    from submitit.helpers import TorchDistributedEnvironment

    # Keep CUDA_VISIBLE_DEVICES as submitit's task set-up left it: device choice is by LOCAL_RANK.
    TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


def env_rank_info() -> tuple[int, int, int, int]:
    """(rank, local_rank, world_size, local_world_size) from torchrun's variables (or a submitit task's, see
    :func:`export_cluster_env`); (0, 0, 1, 1) without them."""
    export_cluster_env()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    return rank, local_rank, world_size, local_world_size


def run_stamp() -> str:
    """A ``YYYY-MM-DD/HH-MM-SS`` stamp that every rank of one launch agrees on (Hydra resolver ``hydratrain.stamp``).

    Hydra's ``${now:}`` resolves per process, so ranks started a second apart would write to two run dirs.

    * With several ranks (torchrun, the ``launcher=torchrun`` plugin, submitit tasks), every rank proposes a stamp
      to the TCPStore at ``MASTER_ADDR``/``MASTER_PORT`` (see :func:`_base_store`) with ``compare_set``; the first
      proposal wins and all ranks, on all nodes, read it back. The proposal is the launching process's stamp
      (``$HYDRATRAIN_STAMP``, inherited from a launcher) if there is one, else the local time. The key is per
      launch (elastic run id / SLURM job id), so ranks restarted by the agent (``max_restarts``) keep the same run
      dir and can resume from it.
    * Else ``$HYDRATRAIN_STAMP`` if set, else the local time.

    The stamp is exported as ``$HYDRATRAIN_STAMP`` so processes this one starts (launcher workers) agree with it.
    """
    global _STAMP
    if _STAMP is None:
        mine = os.environ.get(STAMP_ENV) or time.strftime("%Y-%m-%d/%H-%M-%S")
        _, _, world_size, _ = env_rank_info()
        if world_size > 1 and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
            store = _base_store()
            launch_id = next((os.environ[k] for k in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SUBMITIT_LOCAL_JOB_ID")
                              if k in os.environ), "none")
            key = "hydratrain/run_stamp/" + launch_id
            _STAMP = store.compare_set(key, "", mine).decode()
            if _STAMP == "":  # very old stores return the expected value when they set the key
                _STAMP = store.get(key).decode()
        else:
            _STAMP = mine
        os.environ[STAMP_ENV] = _STAMP
    return _STAMP


def _base_store():
    """This process's TCPStore at ``MASTER_ADDR:MASTER_PORT``, made once and shared by the run-dir stamp and every
    process group of this process. Rank 0 hosts it unless a torch elastic agent already does
    (``TORCHELASTIC_USE_AGENT_STORE=True``, torchrun's c10d rendezvous)."""
    global _BASE_STORE
    if _BASE_STORE is None:
        from torch.distributed import TCPStore

        rank, _, world_size, _ = env_rank_info()
        agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        host = rank == 0 and not agent_hosts
        _BASE_STORE = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                               world_size if host else None, is_master=host, timeout=timedelta(minutes=5),
                               wait_for_workers=False, use_libuv=True)
    return _BASE_STORE


def _job_store():
    """A fresh key space on :func:`_base_store` for the next process group of this process.

    A sweep inside each rank (``torchrun ... train.py -m a=1,2``) runs several jobs, each with its own group, in one
    process; re-running ``init_process_group`` on the same keys fails or hangs. Every rank runs the same jobs in the
    same order, so the n-th group of each rank meets the others under prefix n (and under the agent's restart count,
    so restarted workers do not read the keys of the failed attempt).
    """
    global _GROUPS_MADE
    from torch.distributed import PrefixStore

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"hydratrain/attempt{attempt}/group{_GROUPS_MADE}"
    _GROUPS_MADE += 1
    return PrefixStore(prefix, _base_store())


def output_subdir() -> Optional[str]:
    """``.hydra`` on rank 0 and ``None`` (Hydra then writes no config copy) on the other ranks."""
    return ".hydra" if env_rank_info()[0] == 0 else None


def register_resolvers() -> None:
    """Register ``${hydratrain.stamp:}``, ``${hydratrain.output_subdir:}`` and ``${hydratrain.rank:}`` (idempotent)."""
    from omegaconf import OmegaConf

    for name, fn in (("hydratrain.stamp", run_stamp), ("hydratrain.output_subdir", output_subdir),
                     ("hydratrain.rank", lambda: env_rank_info()[0])):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn, use_cache=False)


def choose_device(kind: str, local_rank: int):
    """``torch.device`` for this rank: ``cuda:<local_rank>`` when CUDA is chosen (``kind`` auto/cuda), else cpu.

    Raises RuntimeError if ``kind == "cuda"`` and there is no GPU, or fewer GPUs than local ranks.
    """
    import torch

    if kind == "cpu" or (kind == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("device=cuda but torch sees no CUDA device (torch.cuda.is_available() is False)")
    if local_rank >= torch.cuda.device_count():
        raise RuntimeError(f"local_rank {local_rank} has no GPU: this node has {torch.cuda.device_count()}")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init_distributed(device_kind: str, backend: Optional[str], need_group: bool) -> DistInfo:
    """Create the default process group from torchrun's (or submitit's) environment and pick this rank's device.

    Each call makes a fresh group on its own key prefix of the ``MASTER_ADDR:MASTER_PORT`` store (see
    :func:`_job_store`), so one process can run several jobs one after another (a Hydra sweep inside each rank).

    Args:
        device_kind: ``auto`` | ``cpu`` | ``cuda``.
        backend: ``nccl`` | ``gloo`` | None (nccl on CUDA, gloo on CPU).
        need_group: create a 1-rank group even without torchrun (ddp/fsdp need one).
    Returns the :class:`DistInfo`. Undo with :func:`destroy_distributed` (use :func:`distributed` to be sure).
    """
    import torch
    import torch.distributed as dist

    rank, local_rank, world_size, local_world_size = env_rank_info()
    device = choose_device(device_kind, local_rank)
    if device.type == "cpu":
        # Ranks on one node share its cores; oversubscribing them makes every rank slower.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))
    if backend is None:
        backend = "nccl" if device.type == "cuda" else "gloo"
    if world_size > 1 or need_group:
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        if world_size > 1:
            dist.init_process_group(backend, store=_job_store(), rank=rank, world_size=world_size,
                                    timeout=timedelta(minutes=10), **kwargs)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
        log.info("process group: backend=%s world_size=%d rank=%d local_rank=%d device=%s",
                 backend, world_size, rank, local_rank, device)
    return DistInfo(rank, local_rank, world_size, local_world_size, device)


def destroy_distributed() -> None:
    """Barrier (so no rank tears down while a peer is mid-collective) then destroy the process group, if any."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.barrier()
        dist.destroy_process_group()


@contextlib.contextmanager
def distributed(device_kind: str, backend: Optional[str], need_group: bool) -> Iterator[DistInfo]:
    """Context manager around :func:`init_distributed` that always destroys the group, also on error."""
    try:
        yield init_distributed(device_kind, backend, need_group)
    finally:
        destroy_distributed()


def quiet_non_main_console(rank: int) -> None:
    """On ranks other than 0, drop console handlers so only rank 0 prints; every rank keeps its log file."""
    if rank == 0:
        return
    root = logging.getLogger()
    for h in list(root.handlers):
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
            root.removeHandler(h)


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
