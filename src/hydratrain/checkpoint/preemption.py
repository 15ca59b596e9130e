"""Preemption: stop training after saving a checkpoint when the scheduler asks.

Signals: SIGTERM (how SLURM preempts and how torchrun stops workers), and SIGUSR2 inside a submitit task (submitit
asks SLURM for it before the time limit, ``--signal=USR2@90``, and its own handler requeues the job). One rank
receiving the signal is enough: with several ranks, each rank's flag rides on the all-reduce the step logger makes at
every log step (``trainer.log_every_n_steps``), so the agreement costs no collective and no host synchronisation of
its own, and the run stops at the first log step after the signal (one process: at the end of the current step).
After the save, submitit's own SIGUSR2 handler runs on rank 0, so the job is requeued as submitit would have done.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
from typing import Any, Optional

from hydratrain.dist.launch import resume_command
from hydratrain.errors import PreemptedError

log = logging.getLogger(__name__)


#: what a preemption signal interrupts while :func:`guard` is on: the message of its PreemptedError (then the
#: command that resumes, :func:`hydratrain.dist.launch.resume_command`)
PHASES = {
    "start-up": "during start-up, before this launch's first step: nothing trained, nothing to save; to resume",
    "final": "after the last step, during the final evaluation and outputs: nothing saved since the latest "
             "checkpoint; to finish from it",
}
_GUARD: dict = {"handlers": {}, "received": None, "exit_code": 75, "phase": "start-up", "held": False}


def early_guard() -> None:
    """Record a SIGTERM that arrives before :func:`guard` can be installed (``train.py`` calls this first: Hydra's
    composition takes seconds on a loaded machine), instead of dying of it with 143 and nothing said. The first
    :func:`guard` of the launch raises it at once (or, with ``checkpoint.save_on_sigterm=false``, lets it kill the
    process as it would have); a multirun's launching process ends at its start (:func:`take_early_signal`). Only
    when SIGTERM has its default handler (a parent that ignores it keeps it ignored), and not in a torchrun worker:
    its agent handles the signal (it forwards a preemption and reports it) and also sends it to stop the workers
    left after another failed, which must not read as preempted."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return
    try:
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _early_signal)
    except ValueError:  # not the main thread
        pass


def _early_signal(signum, frame) -> None:
    _GUARD["early"] = signum


def take_early_signal() -> Optional[int]:
    """Uninstall :func:`early_guard`'s handler (SIGTERM's default again) and return the signal it recorded, if
    any."""
    try:
        if signal.getsignal(signal.SIGTERM) is _early_signal:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except ValueError:
        pass
    return _GUARD.pop("early", None)


def guard(enabled: bool, exit_code: int, under_submitit: bool = False, phase: str = "start-up") -> None:
    """While training cannot stop at a step (start-up: imports, data, model, checkpoint load; ``final``: the final
    evaluation and outputs), a preemption signal (SIGTERM; SIGUSR2 under submitit) ends the launch at once:
    :class:`~hydratrain.errors.PreemptedError` (:data:`PHASES` gives its message) is raised where the main thread
    is, so ``hydratrain.run`` prints one line, releases the run dir and exits with ``exit_code``; a SLURM grace
    period is not spent on work a relaunch redoes anyway. Should code in between swallow the exception, the signal
    is remembered and :meth:`Preemption.arm` raises it. Under submitit, SIGUSR2 first goes to submitit's handler,
    which requeues the job. ``enabled``: ``checkpoint.save_on_sigterm`` (false keeps the default handlers)."""
    end_guard()
    early = take_early_signal()
    _GUARD.update(received=None, exit_code=exit_code, phase=phase)
    if not enabled:
        if early is not None:  # what the default handler would have done when it came
            os.kill(os.getpid(), early)
        return
    for sig in [signal.SIGTERM] + ([signal.SIGUSR2] if under_submitit else []):
        try:
            _GUARD["handlers"][sig] = signal.signal(sig, _guard_signal)
        except ValueError:  # not the main thread
            pass
    if early is not None:
        _GUARD["received"] = early
        raise _preempted(early)


def end_guard() -> None:
    """Restore the handlers :func:`guard` replaced (idempotent); a signal it recorded stays recorded, and SIGTERM is
    then ignored: the launch is ending with its status, which a second SIGTERM must not turn into 143. SIGTERM stays
    ignored while :func:`hold_sigterm` holds it."""
    handlers = _GUARD["handlers"]
    while handlers:
        sig, previous = handlers.popitem()
        if sig == signal.SIGTERM and (_GUARD["received"] is not None or _GUARD["held"]):
            previous = signal.SIG_IGN
        signal.signal(sig, previous if previous is not None else signal.SIG_DFL)


def hold_sigterm() -> None:
    """This rank is ending with an error: ignore SIGTERM until :func:`release_sigterm` (``hydratrain.run``, once
    the error is logged). Once one worker has exited, torchrun SIGTERMs the others; a rank still unwinding its own
    error (or finding which peer failed) would otherwise die with 143 before saying why in its log, or read the
    agent's signal as a preemption. A rank that hangs meanwhile still ends: its failure watch bounds the teardown,
    and torchrun SIGKILLs 30 s after its SIGTERM. Applies also with ``checkpoint.save_on_sigterm=false``: the rank
    is ending anyway; only its last line is at stake. No-op outside the main thread."""
    try:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except ValueError:
        return
    _GUARD["held"] = True


def release_sigterm() -> None:
    """End :func:`hold_sigterm` (idempotent): SIGTERM gets its default action again, unless a preemption signal was
    recorded (then it stays ignored, as :func:`end_guard` leaves it), so that a rank lingering for its peers after
    its error is logged is stopped by its launcher's SIGTERM at once."""
    if not _GUARD["held"]:
        return
    _GUARD["held"] = False
    if _GUARD["received"] is None:
        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _preempted(signum: int):
    return PreemptedError(f"{signal.Signals(signum).name} {PHASES[_GUARD['phase']]}: {resume_command()}",
                          _GUARD["exit_code"])


def recorded_preemption():
    """The :class:`~hydratrain.errors.PreemptedError` of a signal :func:`guard` caught in this launch, else None:
    whatever error this rank ends with after it (a collective a preempted peer left, a swallowed exception), it ends
    as preempted."""
    return _preempted(_GUARD["received"]) if _GUARD["received"] is not None else None


def _guard_signal(signum, frame) -> None:
    if _GUARD["received"] is not None:
        return  # raised once already (a launcher may signal twice)
    _GUARD["received"] = signum
    previous = _GUARD["handlers"].get(signum)
    if signum == signal.SIGUSR2 and callable(previous):
        previous(signum, frame)  # submitit: requeue (rank 0) and sys.exit
    raise _preempted(signum)


class Preemption:
    """Installs the handlers (when ``enabled``) in :meth:`arm`, agrees on stopping, and restores the handlers in
    :meth:`close`.

    Args:
        enabled: ``checkpoint.save_on_sigterm``.
        exit_code: ``checkpoint.preempt_exit_code``, for the log line.
        under_submitit: also handle SIGUSR2, and call submitit's handler after the save.
    """

    def __init__(self, enabled: bool, exit_code: int, under_submitit: bool = False):
        self.enabled, self.exit_code = enabled, exit_code
        self.received: Optional[int] = None  # the signal this rank got, if any
        self.stopped = False
        self._previous: dict[int, Any] = {}  # signal.signal's answers: handlers
        self.under_submitit = under_submitit
        self.world_size = 1  # (set by arm)

    def arm(self) -> None:
        """Take over from the start-up :func:`guard` as training starts: raise the PreemptedError of a signal that
        came during start-up (if the code it interrupted swallowed it), then install the handlers that stop at a
        step. Every rank calls it at the start of ``Trainer.fit``."""
        import torch.distributed as dist

        end_guard()
        if recorded_preemption() is not None:
            raise recorded_preemption()
        self.world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if not self.enabled:
            return
        signals = [signal.SIGTERM] + ([signal.SIGUSR2] if self.under_submitit else [])
        for sig in signals:
            try:
                self._previous[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread: a Ray Train worker runs the job in a thread (docs/launching.md)
                log.info("checkpoint.save_on_sigterm: no %s handler outside the main thread (a Ray worker): a "
                         "preemption is not saved here; the run resumes from its latest periodic checkpoint",
                         signal.Signals(sig).name)

    def _on_signal(self, signum, frame) -> None:
        if self.received is None:
            log.warning("%s received: saving a checkpoint at the %s, then exiting with %d",
                        signal.Signals(signum).name, "end of this step" if self.world_size == 1 else "next log step",
                        self.exit_code)
            self.received = signum

    def vote(self) -> float:
        """This rank's flag for the log step's all-reduce: 1.0 when it received a signal, else 0.0."""
        return float(self.enabled and self.received is not None)

    def should_stop(self, votes: Optional[float]) -> bool:
        """True when any rank received a signal; every rank gets the same answer. ``votes``: the mean of
        :meth:`vote` over ranks when this step was a log step, else None (with several ranks, only log steps stop;
        one process stops at any step)."""
        if not self.enabled:
            return False
        if self.world_size == 1:
            return self.received is not None
        return votes is not None and votes > 0

    def stopping(self, step: int, checkpoint: Optional[str]) -> None:
        """Called by every rank after the stop's checkpoint is saved: log it, with the command that resumes from
        it, and, inside submitit, let its SIGUSR2 handler requeue the job (rank 0)."""
        self.stopped = True
        log.warning("stopping at step %d after a preemption signal; checkpoint %s; exit status %d; to resume: %s",
                    step, checkpoint, self.exit_code, resume_command())
        handler = self._previous.get(signal.SIGUSR2)
        if self.received == signal.SIGUSR2 and callable(handler):
            try:
                handler(signal.SIGUSR2, None)  # submitit: requeue (rank 0) and sys.exit
            except SystemExit:
                pass
            except Exception as err:  # e.g. submitit's UncompletedJobError: not requeueable
                log.warning("submitit did not requeue the job: %s", err)

    def close(self) -> None:
        """Restore the previous handlers -- unless stopping after a signal: then SIGTERM is ignored from here on, so
        the launcher's own SIGTERM (torchrun signals every other worker once one has exited) cannot kill a rank still
        tearing down before it exits with ``checkpoint.preempt_exit_code`` (``SIG_IGN``, unlike a Python handler,
        survives interpreter shutdown; a hung teardown still ends with torchrun's SIGKILL 30 s later)."""
        for sig, previous in self._previous.items():
            if sig == signal.SIGTERM and (self.stopped or _GUARD["held"]):
                signal.signal(sig, signal.SIG_IGN)
            elif previous is not None:
                signal.signal(sig, previous)
        self._previous = {}
