"""The errors a run stops with, each one line, and the process exit status that goes with each.

| status | meaning |
| --- | --- |
| 0 | done |
| 1 | an unexpected exception on this rank (its traceback is on the console and in its log) |
| 2 | :class:`ConfigError`: a bad config value, found before any process group exists (also an error Hydra finds
  while it composes the config: ``hydratrain.exits.end_composition``) |
| 3 | :class:`CheckpointError`: a checkpoint (or ``model.init_from`` file) cannot be used (nothing was trained), or a
  save cannot be written; :class:`OutputError`: another output (TensorBoard events, weights, results.json) cannot be
  written (a full, over-quota or read-only filesystem, a file-size limit, a dir whose permissions refuse the write):
  training stopped, the latest complete checkpoint is intact |
| 4 | :class:`DivergenceError`: a non-finite loss or gradient norm stopped the run (``trainer.on_nonfinite``) |
| 5 | another rank, or this rank's launcher (torchrun's agent), failed or died; this rank stopped after it
  (``distributed.failure_timeout_s``; ``hydratrain.dist.launch.LauncherGoneError``) |
| 6 | :class:`OutOfMemoryError`: this rank ran out of memory; the message has the memory plan and changes that fit |
| 75 | stopped by SIGTERM (or SIGUSR2 under submitit) after saving a checkpoint, or at once outside training (start-up,
  final outputs: :class:`PreemptedError`): its line gives the command that resumes |
| 130 | stopped by Ctrl-C (SIGINT) without saving (``hydratrain.exits``) |

Importing this module imports nothing heavy (no torch).
"""
from __future__ import annotations

import copyreg
import os
import sys
from typing import Any, Iterable, Optional, Union

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
    #: the run dir this launch made is removed at the exit (set on an instance: made for nothing; hydratrain.exits)
    discard_run_dir = False
    #: how the run goes on from its latest checkpoint after this error, e.g. ``"to resume from the latest
    #: checkpoint"``: rank 0's line then ends with it and the command that does it (``hydratrain.exits``); None:
    #: nothing to resume (a config error, a checkpoint that cannot be used) or the message says it already
    resume_hint: Optional[str] = None

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


class CallbackError(HydratrainError, RuntimeError):
    """A callback's hook raised (:mod:`hydratrain.train.callbacks`): one line naming ``callbacks.<name>``, the hook
    and the error."""

    label = "callback error"
    own_failure = True  # raised by this rank's own code


class CheckpointError(HydratrainError, RuntimeError):
    """A checkpoint cannot be used; ``str(err)`` is one line naming the file or dir and why."""

    label = "checkpoint error"
    exit_status = EXIT_CHECKPOINT


class OutputError(HydratrainError, RuntimeError):
    """A run's output could not be written because its filesystem is full, over quota or read-only, a file-size
    limit or the permissions of its dir refused it (:data:`UNWRITABLE_ERRNOS`); ``str(err)`` is one line: what,
    where, why, what tells the cause (the free space, the limit) and how to go on
    (:func:`hydratrain.dist.launch.unwritable_message`)."""

    label = "output error"
    exit_status = EXIT_CHECKPOINT
    own_failure = True  # this rank's filesystem refused the write


#: errno values that mean "this filesystem takes no more writes" (ENOSPC, EDQUOT, EROFS, EFBIG), not a bad path, and
#: those of a write that the permissions refused (:data:`DENIED_ERRNOS`)
UNWRITABLE_ERRNOS = (28, 122, 30, 27, 13, 1)
#: EACCES, EPERM (a dir's mode or owner, an immutable or append-only attribute): on a read they mean an unreadable
#: input, not an output that cannot be written, so :func:`unwritable_cause` counts them only for writes it is told of
DENIED_ERRNOS = (13, 1)
#: below this many free bytes, a failed write that lost its errno is put down to a full filesystem
#: (:func:`hydratrain.dist.launch.unwritable_message`)
LOW_SPACE_BYTES = 1 << 30


def say(*parts: object) -> None:
    """Print ``parts`` (joined by spaces) as one line on stderr, in one write: ``print(..., file=sys.stderr)`` writes
    the text and its newline separately, and in a log that several processes share (torchrun's, SLURM's ``-o``,
    ``2>&1 | tee``) another process's line was glued onto the end of a ``hydratrain: ...`` line."""
    sys.stderr.write(" ".join(map(str, parts)) + "\n")
    sys.stderr.flush()


def unwritable_cause(err: Optional[BaseException], writes: Iterable[Union[str, os.PathLike]] = ()) -> Optional[OSError]:
    """The OSError with an :data:`UNWRITABLE_ERRNOS` errno in ``err`` or its ``__cause__`` / ``__context__`` chain
    (TensorBoard's writer thread, logging, a library that wraps it), or one made from the text of an error of a
    library's own type that only quotes it (safetensors' ``SafetensorError: ... No space left on device (os error
    28)``); else None.

    A permission error (:data:`DENIED_ERRNOS`) counts only when it names a path that ``writes`` (the dirs the failed
    code writes to) covers: one of those dirs, a path below one (but not an existing file this process may not read:
    that was the read of an input) or above one (a dir made on the way to it). So an unreadable data file or
    checkpoint elsewhere is not reported as an output that cannot be written; without ``writes`` none counts."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError):
            if err.errno in UNWRITABLE_ERRNOS and (err.errno not in DENIED_ERRNOS
                                                   or _written(err.filename, writes)):
                return err
        else:
            for errno in UNWRITABLE_ERRNOS:
                if errno not in DENIED_ERRNOS and (f"(os error {errno})" in str(err)
                                                   or os.strerror(errno) in str(err)):
                    return OSError(errno, os.strerror(errno))
        err = err.__cause__ or err.__context__
    return None


def _written(filename: Any, writes: Iterable[Union[str, os.PathLike]]) -> bool:
    """Whether ``filename`` (an OSError's) is a path in, below or above one of the dirs ``writes``, and not an
    existing file that this process may not read."""
    if not isinstance(filename, (str, bytes, os.PathLike)):
        return False
    path = os.path.abspath(os.fsdecode(filename))
    if os.path.isfile(path) and not os.access(path, os.R_OK):
        return False
    for out in writes:
        out = os.path.abspath(os.fsdecode(out))
        if path == out or path.startswith(out.rstrip(os.sep) + os.sep) or out.startswith(path.rstrip(os.sep) + os.sep):
            return True
    return False


def write_refusal(cause: Optional[BaseException], where: Any, frees: str = "") -> tuple[str, str]:
    """``(what tells the cause, or "", the remedy)`` of a write under ``where`` that failed with ``cause`` (see
    :func:`hydratrain.dist.launch.unwritable_message`): by its errno, else (none: a library's error that lost it, or
    another rank's) by what ``where`` shows now. Raises nothing."""
    import errno as errnos

    code = getattr(cause, "errno", None)
    guessed = code not in UNWRITABLE_ERRNOS
    if guessed:
        code = _likely_errno(where)
    free = _free_bytes(where)
    space = f"{free / 1e6:.1f} MB free there" if free is not None else "free space unknown"
    also = f" (or {frees})" if frees else ""
    limit = _file_size_limit()
    if code == errnos.ENOSPC:
        detail, remedy = space, f"make room{also}"
    elif code == errnos.EDQUOT:
        detail, remedy = space, f"free some of your quota{also}"
    elif code == errnos.EROFS:
        detail, remedy = "", "make it writable (or write elsewhere)"
    elif code in DENIED_ERRNOS:
        refused = _refusing_dir(cause, _existing(where) or where)
        detail = ""
        remedy = (f"fix the permissions{' or attributes (lsattr -d)' if code == errnos.EPERM else ''} of "
                  f"{refused} (or write elsewhere)")
    elif code == errnos.EFBIG and limit is not None:
        size = f"{limit // 1024} KiB" if limit % 1024 == 0 else f"{limit} bytes"
        detail = f"this process's file-size limit (RLIMIT_FSIZE, `ulimit -f`) is {size}"
        remedy = "raise the file-size limit (`ulimit -f`, in the shell or job script that launches the run)"
    elif code == errnos.EFBIG:
        detail, remedy = "no file-size limit: the file is larger than this filesystem takes", "write elsewhere"
    else:
        said = "not this rank" if cause is None else _errno_said(cause)
        return (f"the cause is unknown: {said}, and "
                f"{_existing(where) or where} is writable, with {space} and no file-size limit"), (
            "find and fix what refused the write (the error above)")
    if guessed:
        detail = f"{_errno_said(cause)}; likely {os.strerror(code)}" + (f": {detail}" if detail else "")
    return detail, remedy


def _errno_said(cause: Optional[BaseException]) -> str:
    """``the error has no errno``, or, for one that tells no full or read-only disk (EEXIST: a file where the
    checkpoint dir was), ``its errno, EEXIST, tells no such cause``."""
    import errno as errnos

    code = getattr(cause, "errno", None)
    return "the error has no errno" if not isinstance(code, int) else \
        f"its errno, {errnos.errorcode.get(code, code)}, tells no full or read-only disk"


def _likely_errno(where: Any) -> Optional[int]:
    """The errno a write under ``where`` most likely failed with, from what it shows now: EFBIG under a finite
    file-size limit, EROFS / EACCES when this process may not write there, ENOSPC with under
    :data:`LOW_SPACE_BYTES` free; else None."""
    import errno as errnos

    if _file_size_limit() is not None:
        return errnos.EFBIG
    path = _existing(where)
    if path is not None and not os.access(path, os.W_OK):
        try:
            return errnos.EROFS if os.statvfs(path).f_flag & os.ST_RDONLY else errnos.EACCES
        except OSError:
            return errnos.EACCES
    free = _free_bytes(where)
    if free is not None and free < LOW_SPACE_BYTES:
        return errnos.ENOSPC
    return None


def _file_size_limit() -> Optional[int]:
    """This process's RLIMIT_FSIZE in bytes (``ulimit -f``), None when unlimited (or unknown)."""
    try:
        import resource
    except ImportError:  # (not on Windows)
        return None
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def _existing(where: Any) -> Optional[str]:
    """``where``, or its nearest dir above that exists (a dir not yet made); None when there is none."""
    try:
        path = os.path.abspath(os.fsdecode(where))
    except TypeError:
        return None
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
    return path


def _free_bytes(where: Any) -> Optional[int]:
    import shutil

    path = _existing(where)
    try:
        return shutil.disk_usage(path).free if path is not None else None
    except OSError:
        return None


def _refusing_dir(cause: Optional[BaseException], where: Any) -> str:
    """The path whose permissions refused a write: the error's file when it exists (a file it may not replace, a
    dir), else the dir it was to be made in; ``where`` when the error names none."""
    name = getattr(cause, "filename", None)
    if not isinstance(name, (str, bytes, os.PathLike)):
        return str(where)
    path = os.fsdecode(name)
    return path if os.path.lexists(path) else os.path.dirname(path)


def root_cause(err: BaseException) -> BaseException:
    """The first rank's exception inside DCP's ``CheckpointException`` (whose ``failures`` map ranks to an
    exception, a wrapper with ``.exc``, or an ``(exception, traceback frames)`` tuple), else ``err`` itself."""
    failures = getattr(err, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return err
    cause = next(iter(failures.values()))
    if isinstance(cause, tuple) and cause and isinstance(cause[0], BaseException):
        cause = cause[0]
    cause = getattr(cause, "exc", cause)
    return cause if isinstance(cause, BaseException) else RuntimeError(str(cause))


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
    resume_hint = "to resume from the latest checkpoint with such a change"

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
    resume_hint = "to resume from the latest checkpoint with such a change"


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


class NonFiniteState(Exception):
    """A staged state holds non-finite values (``keys``, on this rank): the background write stops before any shard."""

    def __init__(self, keys: list[str]):
        super().__init__(f"non-finite values in {', '.join(keys[:3])}")
        self.keys = keys

    def __reduce__(self):
        """Pickle as the message and the keys (DCP gathers a rank's exception to every rank pickled): ``__init__``
        cannot be called again with the formatted message."""
        return copyreg.__newobj__, (type(self), *self.args), self.__dict__
