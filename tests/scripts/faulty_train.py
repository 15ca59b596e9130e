"""A train.py twin that injects one fault, for the fail-fast, resume and restart tests. Environment:

- ``HT_FAULT``: ``raise`` (a RuntimeError), ``oom`` (``torch.OutOfMemoryError``, as CUDA's allocator raises it),
  ``kill`` (SIGKILL itself) or ``stop`` (SIGSTOP itself: alive, sockets open, silent, as a rank hung in a driver or
  dead behind NCCL looks).
- ``HT_FAULT_DELAY``: ``RANK:SECONDS``: that rank sleeps before its fault (so another rank's is recorded first).
- ``HT_FAULT_AT=compose``: SIGTERM itself before Hydra composes the config (no ``HT_FAULT`` needed).
- ``HT_FAULT_STEP``: the optimizer step; ``HT_FAULT_AT``: ``step`` (inside it, before its backward; default),
  ``after_step`` (after the step's eval, checkpoint save and preemption check), ``async_write`` (in the background
  write of that step's save, ``checkpoint.async_save=true``: after the rank's shards, before DCP's ``.metadata``,
  while the loop goes on), ``startup`` (while the data is
  built, before any step) or ``final`` (while the outputs are written, after the last step); with ``HT_FAULT=sleep``
  the rank touches ``fault_rank<R>_startup`` (``_final``) and sleeps 120 s there, as a long start-up (a slow export
  of the weights) would. ``HT_FAULT=swallow`` at ``startup``: the rank sleeps 120 s inside ``try: ... except
  Exception: pass``, as library code that catches too much would.
- ``HT_FAULT_RANK``: the rank that fails, or ``all`` (default 1).
- ``HT_FAULT_ATTEMPT``: only on this elastic restart attempt (``TORCHELASTIC_RESTART_COUNT``; default 0).
- ``HT_FAULT_ONCE=1``: only while the marker below does not exist yet (launchers without an attempt count: Ray).
- ``HT_SLOW_FAILURE``: ``RANK:SECONDS``: when that rank's process group unwinds an error, it sleeps before telling a
  lost peer from its own failure, as a loaded machine slows that path: torchrun's SIGTERM then comes first.
- ``HT_HANG_TEARDOWN``: ``RANK``: when that rank's process group is torn down after an error, it blocks in C for
  good with the GIL held, as ``~ProcessGroupGloo`` does when it joins a gloo worker thread that waits for that GIL
  to free the tensors of a collective the peer left: no Python thread of the rank runs meanwhile.
Before failing, the rank touches ``fault_rank<R>_step<S>`` in its run dir, so tests can see where the fault happened.

- ``HT_FAULT_JOBS``: ``NUM:MODE[,NUM:MODE...]``, for sweeps: Hydra job NUM fails before training. MODE ``raise``:
  every rank raises FloatingPointError (as a diverged run does); ``kill``: rank 1 SIGKILLs itself (a crashed rank);
  ``term``: SIGTERM itself after Hydra composed the job, before hydratrain's guard; ``term_after``: SIGTERM itself
  after the job's training returned, before Hydra composes the next job. Other jobs run train.py's task unchanged.

``HT_FAKE_SUBMITIT=DIR`` stands in for submitit's job environment: a SIGUSR2 handler that, like submitit's
``checkpoint_and_try_requeue``, records the requeue (``DIR/requeued_rank<R>``) and calls ``sys.exit(-1)``.
"""
import os
import signal
import time
from pathlib import Path

from hydratrain.checkpoint.preemption import early_guard

early_guard()  # as train.py
if os.environ.get("HT_FAULT_AT") == "compose":  # a SIGTERM (a scheduler's) while Hydra is still to compose
    os.kill(os.getpid(), signal.SIGTERM)
import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402

from hydratrain.config import register_configs  # noqa: E402
from hydratrain.dist.run_dir import register_resolvers  # noqa: E402

register_configs()
register_resolvers()
_INJECTED = False  # the trainer is patched once per process


def _job_fault() -> str:
    plan = dict(item.split(":") for item in os.environ.get("HT_FAULT_JOBS", "").split(",") if item)
    return plan.get(str(HydraConfig.get().job.num)) if plan else None  # a single run has no job number


def _fail_job() -> None:
    """``HT_FAULT_JOBS``: fail this Hydra job before training if the plan names it."""
    mode = _job_fault()
    if mode == "term":
        os.kill(os.getpid(), signal.SIGTERM)
    if mode == "raise":
        raise FloatingPointError("loss diverged (test)")
    if mode == "kill" and os.environ.get("RANK") == "1":
        os.kill(os.getpid(), signal.SIGKILL)


def _inject() -> None:
    """``HT_FAULT*``: patch the trainer (once per process: the jobs of a local sweep share it)."""
    global _INJECTED
    from hydratrain.dist.run_dir import run_dir_of
    from hydratrain.train import trainer

    kind, step = os.environ.get("HT_FAULT"), int(os.environ.get("HT_FAULT_STEP", "0"))
    rank, who = os.environ.get("RANK", "0"), os.environ.get("HT_FAULT_RANK", "1")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if _INJECTED or not kind or (who != "all" and who != rank) or attempt != os.environ.get("HT_FAULT_ATTEMPT", "0"):
        return
    _INJECTED = True

    def fault() -> None:
        marker = run_dir_of() / f"fault_rank{rank}_step{step}"
        if os.environ.get("HT_FAULT_ONCE") == "1" and marker.exists():
            return
        marker.touch()
        delay_rank, _, seconds = os.environ.get("HT_FAULT_DELAY", "").partition(":")
        if delay_rank == rank:
            time.sleep(float(seconds))
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        if kind == "oom":
            import torch

            raise torch.OutOfMemoryError(f"CUDA out of memory (injected on rank {rank} at step {step})")
        raise RuntimeError(f"injected fault on rank {rank} at step {step}")

    if os.environ.get("HT_FAULT_AT") == "startup":
        import hydratrain.data.build as data
        import hydratrain.run as run_module

        original_build_data = data.build_data

        def build_data(*args, **kwargs):
            (run_dir_of() / f"fault_rank{rank}_startup").touch()
            if kind == "sleep":
                time.sleep(120)
            elif kind == "swallow":
                try:
                    time.sleep(120)
                except Exception:
                    pass
            else:
                fault()
            return original_build_data(*args, **kwargs)

        data.build_data = run_module.build_data = build_data  # (hydratrain.run imported it by name)
    elif os.environ.get("HT_FAULT_AT") == "final":
        import hydratrain.run as run_module
        import hydratrain.train.outputs as outputs

        original_write_outputs = outputs.write_outputs

        def write_outputs(*args, **kwargs):
            (run_dir_of() / f"fault_rank{rank}_final").touch()
            time.sleep(120)
            return original_write_outputs(*args, **kwargs)

        outputs.write_outputs = run_module.write_outputs = write_outputs  # (hydratrain.run imported it by name)
    elif os.environ.get("HT_FAULT_AT") == "async_write":
        import threading

        from torch.distributed.checkpoint import FileSystemWriter

        from hydratrain.checkpoint.layout import step_dir_name

        original_write = FileSystemWriter.write_data

        def write_data(self, *args, **kwargs):
            written = original_write(self, *args, **kwargs)
            if threading.current_thread() is not threading.main_thread() and \
                    str(self.path).endswith(step_dir_name(step)):
                fault()
            return written

        FileSystemWriter.write_data = write_data
    elif os.environ.get("HT_FAULT_AT", "step") == "step":
        original = trainer.Trainer.train_step

        def train_step(self, batches):
            if self.progress.step + 1 == step:
                fault()
            return original(self, batches)

        trainer.Trainer.train_step = train_step
    else:
        original_end = trainer.Trainer._end_of_step

        def end_of_step(self, s, votes):
            stop = original_end(self, s, votes)
            if s == step:
                fault()
            return stop

        trainer.Trainer._end_of_step = end_of_step


def _fake_submitit() -> None:
    marker_dir = os.environ.get("HT_FAKE_SUBMITIT")
    if not marker_dir:
        return

    def requeue(signum, frame):
        Path(marker_dir, f"requeued_rank{os.environ.get('RANK', '0')}").touch()
        raise SystemExit(-1)

    signal.signal(signal.SIGUSR2, requeue)


def sigterm_self(cfg) -> None:
    """A ``hydra.launcher.job_check`` (``__main__.sigterm_self``) that SIGTERMs this process: a scheduler's signal
    while the torchrun launcher prepares a job, before its workers exist."""
    os.kill(os.getpid(), signal.SIGTERM)


def sigint_self(cfg) -> None:
    """A ``hydra.launcher.job_check`` (``__main__.sigint_self``): Ctrl-C to this process while the torchrun launcher
    prepares a job."""
    os.kill(os.getpid(), signal.SIGINT)


def _slow_failure() -> None:
    """``HT_SLOW_FAILURE``: patch ``lost_a_peer``, which the process group calls first when its body raised."""
    rank, _, seconds = os.environ.get("HT_SLOW_FAILURE", "").partition(":")
    if rank != os.environ.get("RANK", "0"):
        return
    import hydratrain.dist.process_group as process_group

    original = process_group.lost_a_peer

    def lost_a_peer(err):
        time.sleep(float(seconds))
        return original(err)

    process_group.lost_a_peer = lost_a_peer


def _hang_teardown() -> None:
    """``HT_HANG_TEARDOWN``: patch ``torch.distributed.destroy_process_group``, which the process group calls as it
    is torn down, on that rank."""
    if os.environ.get("HT_HANG_TEARDOWN") != os.environ.get("RANK", "0"):
        return
    import ctypes
    import sys

    import torch.distributed as dist

    original = dist.destroy_process_group

    def destroy_process_group(*args, **kwargs):
        if sys.exc_info()[0] is not None:  # after an error: lock a normal mutex twice through PyDLL, which keeps
            libc, mutex = ctypes.PyDLL(None), ctypes.create_string_buffer(64)  # the GIL (zeros: glibc's initializer)
            libc.pthread_mutex_lock(mutex)
            libc.pthread_mutex_lock(mutex)  # blocks for good; a signal does not end the wait
        return original(*args, **kwargs)

    dist.destroy_process_group = destroy_process_group


@hydra.main(version_base="1.3", config_path=str(Path(__file__).resolve().parents[2] / "conf"), config_name="train")
def task(cfg) -> float:
    from hydratrain.run import main

    _fail_job()
    _inject()
    _slow_failure()
    _hang_teardown()
    _fake_submitit()
    eval_loss = main(cfg).objective
    if _job_fault() == "term_after":
        os.kill(os.getpid(), signal.SIGTERM)
    return eval_loss


if __name__ == "__main__":
    task()
