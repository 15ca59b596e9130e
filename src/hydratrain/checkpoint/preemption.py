"""Preemption: stop training after saving a checkpoint when the scheduler asks.

Signals: SIGTERM (how SLURM preempts and how torchrun stops workers), and SIGUSR2 inside a submitit task (submitit
asks SLURM for it before the time limit, ``--signal=USR2@90``, and its own handler requeues the job). One rank
receiving the signal is enough: every step all ranks agree through a non-blocking all-reduce of one flag, whose result
is read at the next step (so the agreement costs no wait on the hot path and the run stops one step later). On CUDA
the reduced flag is copied to pinned host memory behind the reduction (``non_blocking``) and read at the next step
without a device synchronisation of its own: the loop's one host sync per step, the non-finite check, has completed
that copy by then (it comes after it in stream order). After the save, submitit's own SIGUSR2 handler runs on rank 0,
so the job is requeued as submitit would have done.
"""
from __future__ import annotations

import logging
import signal
from typing import Optional

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class Preemption:
    """Installs the handlers (when ``enabled``), agrees on stopping, and restores the handlers in :meth:`close`.

    Args:
        enabled: ``checkpoint.save_on_sigterm``.
        device: where the agreement's flag lives (the process group's device).
        exit_code: ``checkpoint.preempt_exit_code``, for the log line.
        under_submitit: also handle SIGUSR2, and call submitit's handler after the save.
    """

    def __init__(self, enabled: bool, device: torch.device, exit_code: int, under_submitit: bool = False):
        self.enabled, self.device, self.exit_code = enabled, device, exit_code
        self.received: Optional[int] = None  # the signal this rank got, if any
        self.stopped = False
        self._previous: dict[int, object] = {}
        self._work, self._flag, self._host, self._copied = None, None, None, None
        self.world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if not enabled:
            return
        signals = [signal.SIGTERM] + ([signal.SIGUSR2] if under_submitit else [])
        for sig in signals:
            try:
                self._previous[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread
                log.warning("checkpoint.save_on_sigterm: cannot install a %s handler outside the main thread",
                            signal.Signals(sig).name)

    def _on_signal(self, signum, frame) -> None:
        if self.received is None:
            log.warning("%s received: finishing this step, then saving a checkpoint and exiting with %d",
                        signal.Signals(signum).name, self.exit_code)
            self.received = signum

    def should_stop(self) -> bool:
        """True when any rank received a signal (every rank calls once per step; all get the same answer)."""
        if not self.enabled:
            return False
        if self.world_size == 1:
            return self.received is not None
        agreed = False
        if self._work is not None:
            self._work.wait()
            if self._copied is not None:
                self._copied.synchronize()  # already complete (see the module docstring): returns at once
            agreed = bool(self._host.item())
        self._flag = torch.tensor([int(self.received is not None)], dtype=torch.int32, device=self.device)
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, async_op=True)
        if self.device.type == "cuda":
            # .item() on the device flag next step would be a second host sync per step: copy it to the host
            # behind the reduction instead (work.wait() only makes the current stream wait for NCCL's)
            if self._host is None:
                self._host = torch.empty_like(self._flag, device="cpu", pin_memory=True)
            self._work.wait()
            self._host.copy_(self._flag, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            self._host = self._flag  # gloo: the reduction ran on the host; wait() above returns when it is done
        return agreed

    def stopping(self, step: int, checkpoint: Optional[str]) -> None:
        """Called by every rank after the stop's checkpoint is saved: log it and, inside submitit, let its SIGUSR2
        handler requeue the job (rank 0)."""
        self.stopped = True
        log.warning("stopping at step %d after a preemption signal; checkpoint %s; exit status %d", step, checkpoint,
                    self.exit_code)
        handler = self._previous.get(signal.SIGUSR2)
        if self.received == signal.SIGUSR2 and callable(handler):
            try:
                handler(signal.SIGUSR2, None)  # submitit: requeue (rank 0) and sys.exit
            except SystemExit:
                pass
            except Exception as err:  # e.g. submitit's UncompletedJobError: not requeueable
                log.warning("submitit did not requeue the job: %s", err)

    def close(self, wait: bool = True) -> None:
        """Wait for the last agreement (unless ``wait`` is False: after an error a peer may never join it) and restore
        the previous handlers -- unless stopping after a signal: then SIGTERM is ignored from here on, so the
        launcher's own SIGTERM (torchrun signals every other worker once one has exited) cannot kill a rank still
        tearing down before it exits with ``checkpoint.preempt_exit_code`` (``SIG_IGN``, unlike a Python handler,
        survives interpreter shutdown; a hung teardown still ends with torchrun's SIGKILL 30 s later)."""
        if self._work is not None and wait:
            self._work.wait()
        self._work = None
        for sig, previous in self._previous.items():
            if self.stopped and sig == signal.SIGTERM:
                signal.signal(sig, signal.SIG_IGN)
            elif previous is not None:
                signal.signal(sig, previous)
        self._previous = {}
