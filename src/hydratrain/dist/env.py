"""The one source of this process's rank, local rank and world size, read from the launch environment.

torchrun (and hydratrain's torchrun launcher) set ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``; inside a submitit task (SLURM, or submitit's local executor) they are derived
from ``SLURM_*`` / ``SUBMITIT_LOCAL_*`` first (:func:`export_cluster_env`). Ray Train sets the torchrun names itself
in its workers (and ``NODE_RANK``), so ``launcher=ray`` needs nothing here. Without any of them the process is rank
0 of 1. Also: :class:`RankZeroConsoleFilter`, which keeps the console to rank 0 (each rank's log file keeps all).

Importing this module does not import torch.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, Optional

from hydratrain.errors import ConfigError, say


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: ``rank`` in ``[0, world_size)``, ``local_rank`` in ``[0, local_world_size)`` on
    its node, and (once the process group is made) its ``device``."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    device: Optional[Any] = None  # torch.device, chosen by hydratrain.dist.process_group

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def export_cluster_env() -> None:
    """Inside a submitit task without torchrun's variables, set ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` from the scheduler's environment (via
    ``submitit.helpers.TorchDistributedEnvironment``). A no-op elsewhere, or when ``RANK`` is already set.

    Raises ImportError if submitit is missing (extra ``[slurm]``).
    """
    if "RANK" in os.environ or not os.environ.get("SUBMITIT_EXECUTOR"):
        return
    from submitit.helpers import TorchDistributedEnvironment

    # Keep CUDA_VISIBLE_DEVICES as submitit's task set-up left it (see hydratrain.dist.process_group.device_index).
    TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


def dist_info() -> DistInfo:
    """This process's :class:`DistInfo` (without a device) from the launch environment; rank 0 of 1 without one.

    Raises :class:`~hydratrain.errors.ConfigError` naming the variable when the environment is not one a launcher
    sets: a value that is not a number, ``RANK >= WORLD_SIZE`` (a ``RANK`` left over from another launch), a
    ``LOCAL_WORLD_SIZE`` above ``WORLD_SIZE`` or a ``LOCAL_RANK`` not below it (the same: a stray value would cut
    a single process's threads and memory budget without a word), or
    ``WORLD_SIZE > 1`` without ``MASTER_ADDR``/``MASTER_PORT`` (``python train.py`` where torchrun was meant).
    """
    export_cluster_env()
    world_size = _env_int("WORLD_SIZE", 1)
    rank, local_rank = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    if world_size < 1:
        raise ConfigError("$WORLD_SIZE", world_size, "must be >= 1")
    if rank >= world_size:
        raise ConfigError("$RANK", rank, f"must be < $WORLD_SIZE={world_size} (a RANK left from another launch?); "
                          "unset RANK or launch with torchrun")
    if not 1 <= local_world_size <= world_size:  # it sets the threads and memory budget of each rank
        raise ConfigError("$LOCAL_WORLD_SIZE", local_world_size, f"must be in 1..$WORLD_SIZE={world_size} (a "
                          "LOCAL_WORLD_SIZE left from another launch?); unset it or launch with torchrun")
    if local_rank >= local_world_size:
        raise ConfigError("$LOCAL_RANK", local_rank, f"must be < $LOCAL_WORLD_SIZE={local_world_size} (a LOCAL_RANK "
                          "left from another launch?); unset it or launch with torchrun")
    if world_size > 1 and not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        raise ConfigError("$WORLD_SIZE", world_size, "is > 1 but MASTER_ADDR/MASTER_PORT are not set: launch with "
                          "torchrun (or launcher=torchrun), or unset WORLD_SIZE for one process")
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world_size, local_world_size=local_world_size)


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit():
        raise ConfigError(f"${name}", raw, "must be a non-negative integer (torchrun and the schedulers set it)")
    return int(raw)


def env_rank() -> int:
    """This process's global rank from the environment alone (``RANK``, else SLURM's or submitit's task id), 0 when
    none is set; usable before :func:`export_cluster_env` has run (logging filters, Hydra resolvers)."""
    for key in ("RANK", "SLURM_PROCID", "SUBMITIT_LOCAL_GLOBALID"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


def under_submitit() -> bool:
    """True inside a task started by submitit (SLURM or its local executor)."""
    return bool(os.environ.get("SUBMITIT_EXECUTOR"))


class RankZeroConsoleFilter(logging.Filter):
    """A logging filter for console handlers: rank 0 shows everything, other ranks only ERROR and above (a failing
    rank's error must reach the console), prefixed with ``[rank R]``; records logged with ``extra={"file_only":
    True}`` stay out of the console on every rank. Installed on Hydra's console handler by the default
    ``hydra/job_logging`` (``conf/hydra/job_logging/hydratrain.yaml``), so it holds from the first line a job logs;
    under another option, by :func:`quiet_console`."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "file_only", False):  # already printed in its own form (``hydratrain: ...`` lines)
            return False
        rank = env_rank()
        if rank == 0:
            return True
        if record.levelno < logging.ERROR:
            return False
        if not getattr(record, "_rank_prefixed", False):
            record.msg = f"[rank {rank}] {record.msg}"
            record._rank_prefixed = True
        return True


class _DropsWhenUnwritable:
    """A logging handler mixin: when writing a record fails with an OSError, :meth:`failed_once` says so once
    (the subclass's line) and every later record is dropped, instead of ``logging``'s traceback block per record.
    Other errors go to ``logging`` as usual."""

    failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)  # type: ignore[misc]  # a mixin: the handler class it is mixed into

    def handleError(self, record: logging.LogRecord) -> None:
        err = sys.exc_info()[1]
        if not isinstance(err, OSError):
            super().handleError(record)  # type: ignore[misc]  # (the mixed-in handler's)
            return
        if not self.failed:
            self.failed = True
            with contextlib.suppress(OSError):
                self.failed_once(err)

    def failed_once(self, err: OSError) -> None:
        raise NotImplementedError


class RunConsoleHandler(_DropsWhenUnwritable, logging.StreamHandler):
    """The console handler of the default ``hydra/job_logging`` (``conf/hydra/job_logging/hydratrain.yaml``) that,
    when its stream can no longer be written (``| head`` or a ``| tee`` that ended: a broken pipe), says so once on
    stderr and drops its later records, instead of ``logging``'s 30-line ``--- Logging error ---`` block per record,
    which buried hydratrain's one-line errors on stderr. The log file keeps every line. A broken stdout
    is pointed at ``os.devnull``, so the interpreter's flush at exit raises nothing either."""

    def failed_once(self, err: OSError) -> None:
        if self.stream is sys.stdout:
            with contextlib.suppress(OSError, ValueError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        say(f"hydratrain: writing to the console failed ({type(err).__name__}: {err}); its lines go to the log file "
            "only from now on")


class RunLogFileHandler(_DropsWhenUnwritable, logging.FileHandler):
    """The log file handler (``train_rank<R>.log``) of the default ``hydra/job_logging``
    (``conf/hydra/job_logging/hydratrain.yaml``) that, when its file can no longer be written (a full or read-only
    disk), says so once on stderr and drops its later records, instead of the traceback block per record that
    ``logging`` prints; the console keeps every line. What else the disk refuses ends the run with one line
    (``hydratrain.run``)."""

    def failed_once(self, err: OSError) -> None:
        say(f"hydratrain: writing the log file {self.baseFilename} failed ({type(err).__name__}: {err}); its lines "
            "go to the console only from now on")


def quiet_console() -> None:
    """Install :class:`RankZeroConsoleFilter` on every console handler of the root logger (for runs that did not
    configure logging through ``conf/train.yaml``, e.g. tests calling ``run.main`` directly), and send Python
    warnings through logging so they obey it too. Idempotent."""
    logging.captureWarnings(True)
    for handler in logging.getLogger().handlers:
        console = isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
        if console and not any(isinstance(f, RankZeroConsoleFilter) for f in handler.filters):
            handler.addFilter(RankZeroConsoleFilter())


def allowed_cores() -> int:
    """CPU cores this process may run on: its affinity mask (``taskset``, a container's cpuset, a SLURM binding),
    else ``os.cpu_count()``."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
