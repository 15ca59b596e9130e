"""The errors a run stops with, each one line, and the process exit status that goes with each.

| status | meaning |
| --- | --- |
| 0 | done |
| 1 | an unexpected exception on this rank (its traceback is on the console and in its log) |
| 2 | :class:`ConfigError`: a bad config value, found before any process group exists |
| 3 | :class:`CheckpointError`: a checkpoint (or ``model.init_from`` file) cannot be used (nothing was trained), or a
  save cannot be written; :class:`OutputError`: another output (TensorBoard events, weights, results.json) cannot be
  written (a full, over-quota or read-only filesystem): training stopped, the latest complete checkpoint is intact |
| 4 | :class:`DivergenceError`: a non-finite loss or gradient norm stopped the run (``trainer.on_nonfinite``) |
| 5 | another rank failed or died; this rank stopped after it (``distributed.failure_timeout_s``) |
| 6 | :class:`OutOfMemoryError`: this rank ran out of memory; the message has the memory plan and changes that fit |
| 75 | stopped by SIGTERM (or SIGUSR2 under submitit) after saving a checkpoint, or at once outside training (start-up,
  final outputs: :class:`PreemptedError`): relaunch to resume |
| 130 | stopped by Ctrl-C (SIGINT) without saving (``hydratrain.exits``) |

Importing this module imports nothing heavy (no torch).
"""
from __future__ import annotations

import copyreg
import sys
from typing import Any, Optional

from hydra.errors import CompactHydraException

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_CONFIG = 2
EXIT_CHECKPOINT = 3
EXIT_DIVERGED = 4
EXIT_PEER_FAILED = 5
EXIT_OOM = 6
EXIT_INTERRUPTED = 130  # Ctrl-C: 128 + SIGINT, as a shell reports a process that SIGINT ended
EXIT_PREEMPTED = 75  # EX_TEMPFAIL of sysexits.h, "try again later"; the default of checkpoint.preempt_exit_code
RESERVED_EXIT_CODES = (EXIT_OK, EXIT_ERROR, EXIT_CONFIG, EXIT_CHECKPOINT, EXIT_DIVERGED, EXIT_PEER_FAILED, EXIT_OOM)


class HydratrainError(CompactHydraException):
    """An error that ends a run with one line on the console (``hydratrain: <label>: <message>``) and the exit
    status :attr:`exit_status`. A Hydra ``CompactHydraException``: where one reaches Hydra itself (a launcher's
    ``job_check`` rejecting a job's config, raised again by the sweeper) Hydra prints its one line, not a traceback,
    and exits 1."""

    label = "error"
    exit_status = EXIT_ERROR
    #: this rank found the error in its own state (its allocator, a config value, the gradient norm reduced over all
    #: ranks): a peer's failure cannot cause it, so the rank keeps its exit status whichever rank recorded a failure
    #: first (hydratrain.dist.process_group); otherwise only an error with the first failure's text does
    own_failure = False
    #: every rank raises this very error (set on an instance, e.g. a failed save): only rank 0 prints it
    same_on_every_rank = False

    def __reduce__(self):
        """Pickle as the message and the attributes, not the constructor's arguments: a launcher that runs the job
        elsewhere (submitit, Ray) pickles its exception back, and a subclass's ``__init__`` (``ConfigError(key,
        value, why)``) cannot be called again with the formatted message alone."""
        return copyreg.__newobj__, (type(self), *self.args), self.__dict__


class ConfigError(HydratrainError, ValueError):
    """A config value is invalid. ``str(err)`` is one line: ``<key>=<value>: <why> (allowed: ...)``."""

    label = "config error"
    exit_status = EXIT_CONFIG
    own_failure = True

    def __init__(self, key: str, value: Any, why: str):
        self.key, self.value, self.why = key, value, why
        super().__init__(f"{key}={_show(value)}: {why}")


class CheckpointError(HydratrainError, RuntimeError):
    """A checkpoint cannot be used; ``str(err)`` is one line naming the file or dir and why."""

    label = "checkpoint error"
    exit_status = EXIT_CHECKPOINT


class OutputError(HydratrainError, RuntimeError):
    """A run's output could not be written because its filesystem is full, over quota or read-only
    (:data:`UNWRITABLE_ERRNOS`); ``str(err)`` is one line: what, where, why, the free space and how to go on
    (:func:`unwritable_message`)."""

    label = "output error"
    exit_status = EXIT_CHECKPOINT
    own_failure = True  # this rank's filesystem refused the write


#: errno values that mean "this filesystem takes no more writes" (ENOSPC, EDQUOT, EROFS, EFBIG), not a bad path
UNWRITABLE_ERRNOS = (28, 122, 30, 27)


def say(*parts: object) -> None:
    """Print ``parts`` (joined by spaces) as one line on stderr, in one write: ``print(..., file=sys.stderr)`` writes
    the text and its newline separately, and in a log that several processes share (torchrun's, SLURM's ``-o``,
    ``2>&1 | tee``) another process's line was glued onto the end of a ``hydratrain: ...`` line (tester 13)."""
    sys.stderr.write(" ".join(map(str, parts)) + "\n")
    sys.stderr.flush()


def unwritable_cause(err: BaseException) -> Optional[OSError]:
    """The OSError with an :data:`UNWRITABLE_ERRNOS` errno in ``err`` or its ``__cause__`` / ``__context__`` chain
    (TensorBoard's writer thread, logging, a library that wraps it), or one made from the text of an error of a
    library's own type that only quotes it (safetensors' ``SafetensorError: ... No space left on device (os error
    28)``); else None."""
    import os

    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError):
            if err.errno in UNWRITABLE_ERRNOS:
                return err
        else:
            for errno in UNWRITABLE_ERRNOS:
                if f"(os error {errno})" in str(err) or os.strerror(errno) in str(err):
                    return OSError(errno, os.strerror(errno))
        err = err.__cause__ or err.__context__
    return None


def unwritable_message(what: str, where: Any, cause: Optional[BaseException], last_checkpoint: Any,
                       room: Optional[str] = None, stopped: str = "training stopped") -> str:
    """``<what> under <where> failed (<cause>; <N> MB free there); <stopped>. The latest complete checkpoint,
    <last>, is intact: <room> and relaunch the same command to resume from it`` (or, without a checkpoint, ``No
    checkpoint was written before: <room> and relaunch``; with ``last_checkpoint=...`` (Ellipsis: not this call's to
    say, a sweep's), ``<Room> and relaunch the same command``). ``room`` defaults to the remedy for ``cause``'s errno:
    make it writable (read-only), free some of the quota, or make room."""
    import errno as errnos
    import shutil

    why = (f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}" if cause is not None
           else "another rank could not write its part")
    try:
        why += f"; {shutil.disk_usage(where).free / 1e6:.1f} MB free there"
    except OSError:
        pass
    if room is None:
        code = getattr(cause, "errno", None)
        room = {errnos.EROFS: "make it writable (or write elsewhere)", errnos.EDQUOT: "free some of your quota"}.get(
            code, "make room")
    if last_checkpoint is ...:
        tail = f"{room[0].upper()}{room[1:]} and relaunch the same command"
    elif last_checkpoint:
        tail = (f"The latest complete checkpoint, {last_checkpoint}, is intact: {room} and relaunch the same command "
                "to resume from it")
    else:
        tail = f"No checkpoint was written before: {room} and relaunch"
    return f"{what} under {where} failed ({why}); {stopped}. {tail}"


class DamagedCheckpointError(CheckpointError):
    """A checkpoint's files are damaged (a shard missing, truncated or corrupt, unreadable metadata): an earlier
    checkpoint of the same run may still be good."""


class DivergenceError(HydratrainError, RuntimeError):
    """Training produced a non-finite loss or gradient norm (see ``trainer.on_nonfinite``).

    Attributes: ``step`` (the optimizer step that was not taken), ``last_checkpoint`` (the newest complete checkpoint,
    or None).
    """

    label = "diverged"
    exit_status = EXIT_DIVERGED
    own_failure = True  # decided from the global gradient norm or the reduced eval loss, alike on every rank

    def __init__(self, message: str, step: int, last_checkpoint: Optional[str] = None):
        self.step, self.last_checkpoint = step, last_checkpoint
        where = f"last good checkpoint: {last_checkpoint}" if last_checkpoint else "no checkpoint was written before"
        super().__init__(f"{message}; {where}")


class OutOfMemoryError(HydratrainError, RuntimeError):
    """An allocation failed on this rank (CUDA's ``torch.OutOfMemoryError``, the CPU allocator's "can't allocate
    memory"). ``str(err)`` is one line: what failed, the planned peak and its parts, the budget, and the changes
    that fit (``hydratrain.plan``)."""

    label = "out of memory"
    exit_status = EXIT_OOM
    own_failure = True  # an allocation failed here; when several ranks run out, each says so with status 6


class Placeholder:
    """A value a :class:`ConfigError` shows as its bare text (``<deleted>``, ``???``, ``<unset>``), not as a quoted
    string: what stands where a config holds no value."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _show(value: Any) -> str:
    """``repr`` of a config value, but an option Enum shows as its plain name (``'fsdp'``)."""
    from enum import Enum

    if isinstance(value, Enum):
        value = value.value
    return repr(value)


class PreemptedError(HydratrainError):
    """A preemption signal (SIGTERM; SIGUSR2 under submitit) arrived outside training, where no step can stop for a
    save (start-up, or the final evaluation and outputs; ``hydratrain.checkpoint.preemption.guard``): the launch ends
    at once, and a relaunch starts from the latest checkpoint. The exit status is ``checkpoint.preempt_exit_code``
    (default 75), as for a preemption during training."""

    label = "preempted"
    exit_status = EXIT_PREEMPTED
    own_failure = True  # the signal came to this rank

    def __init__(self, message: str, exit_status: int = EXIT_PREEMPTED):
        self.exit_status = exit_status
        super().__init__(message)
