"""The process group: device and backend choice, creation on a per-job store prefix, failure watch, teardown.

Commands this module serves::

    python train.py                                        # world_size 1 (a 1-rank group for ddp/fsdp)
    torchrun --standalone --nproc_per_node 2 train.py      # one node
    torchrun --nnodes 2 --node_rank R --rdzv_backend c10d --rdzv_endpoint HOST:PORT --nproc_per_node 8 train.py
    python train.py -m launcher=torchrun launcher.nproc_per_node=2   # the hydratrain launcher plugin starts ranks
    python train.py launcher=submitit_local                          # submitit tasks: ranks from submitit's env
    python train.py launcher=ray launcher.num_workers=2              # Ray Train workers: Ray made the group

A default group that already exists when a job starts (Ray Train creates one in every worker before the job runs)
is used, not replaced: hydratrain checks that its backend serves this run and that it spans the launch's world size,
watches it, and leaves its destruction to whoever made it.

Fail fast: when a rank raises, it records its error in the job's store and leaves without the teardown barrier; a
watch thread on every rank (:class:`FailureWatch`) sees that record, or a peer whose heartbeat stopped (killed,
OOM-killed, hung in C++), and ends its own process, so every rank exits within ``distributed.failure_timeout_s``
instead of waiting forever in a collective the failed rank will never join.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
import time
from dataclasses import replace
from datetime import timedelta
from typing import Any, Iterator, Optional

from hydratrain.checkpoint.preemption import hold_sigterm, recorded_preemption
from hydratrain.dist.env import DistInfo, allowed_cores, dist_info
from hydratrain.dist.launch import LauncherGoneError, end_within, launcher_gone, under_elastic_agent
from hydratrain.dist.run_dir import resume_hint
from hydratrain.dist.run_lock import RunDirLock
from hydratrain.dist.store import _store_client, base_store
from hydratrain.errors import EXIT_ERROR, EXIT_PEER_FAILED, ConfigError, HydratrainError

log = logging.getLogger(__name__)

_GROUPS_MADE = 0  # process groups created in this process (a sweep inside each rank makes one per job)


def let_workers_finish(seconds: float = 0.1) -> None:
    """Release the GIL for a moment before a process group is freed. gloo's worker thread drops its reference to a
    finished collective's work after the caller's wait has returned, and freeing that work's tensors takes the GIL;
    a group freed in the meantime joins that thread while holding the GIL (``~ProcessGroupGloo`` -> ``thread::join``
    against ``~AsyncWork`` -> ``gil_scoped_acquire``, seen with py-spy in torch 2.13): a deadlock at the end of a run
    that had finished."""
    time.sleep(seconds)


class PeerFailedError(HydratrainError):
    """Another rank of this job failed first; this rank stops (exit status 5) after ``linger_s`` seconds, so that the
    rank which failed leaves first (torchrun reports the first worker to exit as the root cause)."""

    label = "stopped"
    exit_status = EXIT_PEER_FAILED
    resume_hint = "to resume from the latest checkpoint"

    def __init__(self, message: str, linger_s: float = 0.0):
        self.linger_s = linger_s
        found = re.search(r"failed first \(rank (\d+)", message)
        self.failed_rank = int(found.group(1)) if found else None  # the rank that failed, when the record names it
        super().__init__(message)


def _all_arrived(store, prefix: str, world_size: int, timeout_s: float) -> None:
    """Wait, in short polls of the launch's store, until all ``world_size`` ranks have come here (before
    ``init_process_group``, whose own wait for the others blocks in C++: a signal's Python handler cannot run there,
    so a rank whose peer died before this point ignored its launcher's SIGTERM until the SIGKILL 30 s later).
    Raises TimeoutError after ``timeout_s`` seconds (``distributed.collective_timeout_s``), naming the count."""
    key = f"{prefix}/arrived"
    store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while (arrived := store.add(key, 0)) < world_size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {arrived} of {world_size} ranks reached the process group's creation within "
                               f"distributed.collective_timeout_s={timeout_s:g} s: the others failed or hang before it")
        time.sleep(0.05)


def _next_job_prefix() -> str:
    """A fresh key prefix for the next process group of this process.

    A sweep inside each rank (``torchrun ... train.py -m a=1,2``) runs several jobs, each with its own group, in one
    process; re-running ``init_process_group`` on the same keys fails or hangs. Every rank runs the same jobs in the
    same order, so the n-th group of each rank meets the others under prefix n (and under the agent's restart count,
    so restarted workers do not read the keys of the failed attempt).
    """
    global _GROUPS_MADE
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"hydratrain/attempt{attempt}/group{_GROUPS_MADE}"
    _GROUPS_MADE += 1
    return prefix


def device_index(local_rank: int, device_count: int) -> int:
    """The CUDA device of a rank: ``local_rank % device_count``, so it also works where each task sees only its own
    GPU (SLURM ``--gpus-per-task=1``: every rank has device count 1 and uses cuda:0)."""
    if device_count < 1:
        raise RuntimeError("no CUDA device visible to this process")
    return local_rank % device_count


def device_type(kind: str) -> str:
    """``cuda`` or ``cpu``: the kind of device ``kind`` (the ``device`` key: auto (CUDA when available) | cpu |
    cuda) gives, without touching a device."""
    import torch

    return "cpu" if kind == "cpu" or (kind == "auto" and not torch.cuda.is_available()) else "cuda"


def choose_device(kind: str, local_rank: int):
    """``torch.device`` for this rank and, on CUDA, ``torch.cuda.set_device`` to it (before anything touches CUDA,
    so no rank creates a context on cuda:0). ``kind``: auto (CUDA when available) | cpu | cuda."""
    import torch

    if device_type(kind) == "cpu":
        return torch.device("cpu")
    device = torch.device("cuda", device_index(local_rank, torch.cuda.device_count()))
    torch.cuda.set_device(device)
    return device


def cpu_threads(local_world_size: int) -> int:
    """Intra-op threads for one CPU rank.

    * ``$OMP_NUM_THREADS`` when the user (or a launcher such as Ray, from a worker's CPUs) set it; not torchrun's
      default of 1 for several workers, which it sets when the user did not and which would leave cores idle;
    * in a SLURM task of its own (``srun``, submitit; not torchrun inside one): ``$SLURM_CPUS_PER_TASK``, or the
      task's affinity mask when SLURM bound it to fewer cores than the host has;
    * else the cores this process may run on (its affinity mask: ``taskset``, a container's cpuset;
      ``os.cpu_count()`` counts the whole host) shared by the node's ``local_world_size`` ranks.

    Oversubscribed cores make every rank slower.
    """
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0 and not (omp == "1" and "TORCHELASTIC_RUN_ID" in os.environ):
        return int(omp)
    allowed = allowed_cores()
    if "SLURM_PROCID" in os.environ and "TORCHELASTIC_RUN_ID" not in os.environ:
        per_task = os.environ.get("SLURM_CPUS_PER_TASK", "").strip()
        if per_task.isdigit() and int(per_task) > 0:
            return max(1, min(allowed, int(per_task)))
        if allowed < (os.cpu_count() or allowed):
            return allowed
    return max(1, allowed // max(1, local_world_size))


def backend_for(device, configured: Optional[str], cpu_offload: bool) -> str:
    """The process-group backend: ``configured`` (``strategy.backend``) if set, else nccl on CUDA and gloo on CPU.

    On CUDA with ``cpu_offload``, FSDP keeps gradients (and so the grad-norm and inf-check reductions) on the CPU,
    which NCCL cannot reduce: the group then gets a gloo backend for CPU tensors too (``cuda:nccl,cpu:gloo``)."""
    name = str(configured) if configured else ("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda" and cpu_offload and name == "nccl":
        return "cuda:nccl,cpu:gloo"
    return name


class FailureWatch:
    """A daemon thread that ends this process when another rank of the job failed or died.

    Keys live under the job's store prefix: ``failed`` (the first failure's one-line message, set with
    ``compare_set`` so the first one wins) and ``hb/<rank>`` (a heartbeat: the wall-clock time of its last beat, ``done``
    after a clean finish). Every ``poll_s`` seconds each rank beats, checks ``failed`` and watches one neighbour's heartbeat
    (``rank + 1 mod world_size``, so every rank is watched by exactly one other, O(1) store traffic per rank). A
    neighbour silent for ``stale_s`` seconds (its process is gone, or hung with its GIL held) is reported as failed.
    Seeing a failure, the thread logs it and calls ``os._exit(5)``: the main thread may be blocked inside a C++
    collective that no Python exception can interrupt. The thread uses its own store connection. It also ends the
    process when this rank's launcher (torch's elastic agent) has died and the main thread has not stopped for it at a
    step within ``launcher_grace_s`` (:func:`hydratrain.dist.launch.stop_if_launcher_gone`); as this thread needs the
    GIL, which a main thread blocked in C++ may hold, it then also sets a deadline that needs none
    (:func:`hydratrain.dist.launch.end_within`, ``2 * launcher_grace_s``).
    """

    def __init__(self, prefix: str, rank: int, world_size: int, failure_timeout_s: float, poll_s: float = 1.0):
        from torch.distributed import PrefixStore

        self.rank, self.world_size, self.poll_s = rank, world_size, poll_s
        self.stale_s = max(3 * poll_s, failure_timeout_s / 2)  # detection + exit fit in failure_timeout_s
        self.linger_s = min(3.0, self.stale_s)  # after a peer recorded its failure, before this rank exits
        self.launcher_grace_s = max(3 * poll_s, 5.0)  # for the main thread to stop at a step once the launcher died
        self.prefix = prefix + "/watch"
        self._timeout_s = failure_timeout_s
        self._main_store = PrefixStore(self.prefix, base_store())
        self._stop, self._torn_down = threading.Event(), threading.Event()
        self._exit_bound: Optional[tuple] = None
        self._thread = threading.Thread(target=self._run, name="hydratrain-failure-watch", daemon=True)

    def start(self) -> "FailureWatch":
        self._main_store.set(f"hb/{self.rank}", f"{time.time():.3f}")
        self._thread.start()
        return self

    def report(self, message: str) -> str:
        """Record ``message`` as the job's failure unless one is recorded already; returns the first failure (a
        line saying the store is gone when it is: the rank hosting it, or the launcher, ended first)."""
        try:
            return self._main_store.compare_set("failed", "", message).decode() or message
        except Exception as err:
            return _store_gone(err)

    def find_failure(self) -> tuple:
        """After a collective failed on this rank (a peer's connection closed; :func:`lost_a_peer`): the job's
        first failure, recorded by a peer within ``2.5 * poll_s`` seconds, else, of the ranks whose heartbeat stood
        still over that time (killed: the kernel's OOM killer sends SIGKILL), the one silent the longest (its
        launcher may have stopped the others since), recorded as the failure. Returns
        (the failure, whether the failed rank may still be running). Reads every rank's heartbeat: O(world_size),
        on this failure path only."""
        try:
            before, deadline = self._beats(), time.monotonic() + 2.5 * self.poll_s
            while time.monotonic() < deadline:
                if self._main_store.check(["failed"]):
                    failure = self._main_store.get("failed").decode()
                    if failure:
                        return failure, True
                time.sleep(0.1)
            after = self._beats()
        except Exception as err:
            return _store_gone(err), False
        silent = [r for r, beat in after.items() if r != self.rank and beat == before.get(r) and beat != "done"]
        if silent:
            first = min(silent, key=lambda r: float(after[r]))
            what = (f"rank {first} stopped responding (no heartbeat for {time.time() - float(after[first]):.1f} s: "
                    "killed, out of memory, or hung)")
        else:
            what = "a peer closed its connection in a collective"
        return self.report(what), not silent

    def _beats(self) -> dict:
        keys = [f"hb/{r}" for r in range(self.world_size)]
        return {r: self._main_store.get(k).decode() for r, k in enumerate(keys) if self._main_store.check([k])}

    def stop(self, done: bool, exit_bound: Optional[tuple] = None) -> None:
        """Stop the thread; ``done``: mark this rank finished (so its silence is not taken for a failure) once the
        thread has stopped beating. A failed rank does not wait for the thread: it should exit before its peers.
        ``exit_bound`` (seconds, status): the thread then ends the process with that status unless
        :meth:`torn_down` is called within that time (a teardown after a failure can hang on a peer; the thread
        exists already: under an exhausted address space a new one cannot be started)."""
        self._exit_bound = exit_bound
        self._stop.set()
        if done:
            self._thread.join(timeout=5 * self.poll_s)
            with contextlib.suppress(Exception):
                self._main_store.set(f"hb/{self.rank}", "done")

    def torn_down(self) -> None:
        self._torn_down.set()

    def _stopped(self) -> None:
        if self._exit_bound is not None and not self._torn_down.wait(self._exit_bound[0]):
            RunDirLock.release_held()
            os._exit(self._exit_bound[1])

    def _run(self) -> None:
        from torch.distributed import PrefixStore

        try:
            store = PrefixStore(self.prefix, _store_client(max(5.0, self._timeout_s / 4)))
        except Exception as err:
            self._die(f"cannot reach the job's store ({type(err).__name__}: {err})")
            return
        neighbour = (self.rank + 1) % self.world_size
        last_seen, last_change, store_ok = None, time.monotonic(), time.monotonic()
        gone_since: Any = None  # when this rank's launcher was first seen gone (a float from then on)
        while not self._stop.wait(self.poll_s):
            now = time.monotonic()
            who = launcher_gone()
            if who is not None and gone_since is None:
                gone_since = now
                end_within(2 * self.launcher_grace_s)  # should this thread, needing the GIL, never run again
            if who is not None and now - gone_since > self.launcher_grace_s and not self._stop.is_set():
                # the main thread stops at its next step; one blocked (a collective, a long step) ends here
                self._die(f"{who} is gone (it died without stopping this rank): stopped "
                          f"{now - gone_since:.0f} s later, inside a step")
                return
            try:
                store.set(f"hb/{self.rank}", f"{time.time():.3f}")
                if store.check(["failed"]):
                    failure = store.get("failed").decode()
                    if failure and not self._stop.is_set():
                        # let the failed rank leave first (its launcher then reports it as the root cause); if this
                        # rank's main thread raises meanwhile, it decides this rank's exit status, not this thread
                        if not self._leave_after(store, failure):
                            self._die(failure)
                        self._stopped()
                        return
                seen = store.get(f"hb/{neighbour}").decode() if store.check([f"hb/{neighbour}"]) else None
                store_ok = now
            except Exception as err:
                if now - store_ok > self.stale_s and not self._stop.is_set():
                    self._die(f"lost the job's store for {now - store_ok:.0f} s ({type(err).__name__}); the rank "
                              "hosting it (or the launcher) is gone")
                    return
                continue
            if seen != last_seen:
                last_seen, last_change = seen, now
            elif seen != "done" and now - last_change > self.stale_s and not self._stop.is_set():
                message = (f"rank {neighbour} stopped responding (no heartbeat for {now - last_change:.0f} s: killed, "
                           "out of memory, or hung)")
                with contextlib.suppress(Exception):
                    store.compare_set("failed", "", message)
                self._die(message)
                return
        self._stopped()

    def _leave_after(self, store, failure: str) -> bool:
        """Wait before this rank stops for ``failure`` so that the rank that failed exits first (torchrun names the
        first worker to exit as the root cause): ``linger_s``, or, when that rank recorded the failure itself
        (``rank N: Type: text``: it is alive and on its way out), until it says it is exiting
        (:func:`_mark_exiting`) and a second more, and never less than ``linger_s`` (this rank's own failure in the
        meantime, an out-of-memory of its own, keeps its own status), for at most half of
        ``distributed.failure_timeout_s``. A rank whose teardown after a large failed step took more than the fixed
        3 s (an out-of-memory rank 0, status 6) was reported as SIGTERMed behind its peer's status 5. Returns whether
        this rank's own main thread stopped the wait (``stop``)."""
        failed = failure.partition(":")[0]
        rank = int(failed[5:]) if failed.startswith("rank ") and failed[5:].isdigit() else None
        if rank is None or rank == self.rank:
            return self._stop.wait(self.linger_s)
        started = time.monotonic()
        deadline = started + max(self.linger_s, self._timeout_s / 2)
        while time.monotonic() < deadline:
            if self._stop.wait(0.2):
                return True
            with contextlib.suppress(Exception):
                if store.check([f"exiting/{rank}"]):  # never less than linger_s in all: this rank may fail too
                    return self._stop.wait(max(1.0, started + self.linger_s - time.monotonic()))
        return self._stop.is_set()

    def mark_exiting_at_exit(self) -> None:
        """This rank failed first: record, as the process exits (``atexit``, after its teardown), that it is
        leaving, for the peers that wait to leave after it (:meth:`_leave_after`)."""
        import atexit

        atexit.register(_mark_exiting, self._main_store, self.rank)

    def _die(self, failure: str) -> None:
        preempted = recorded_preemption()
        if preempted is not None:  # this rank got the preemption signal too: it ends as preempted
            log.warning("hydratrain: %s: %s (a peer left first: %s)", preempted.label, preempted, failure)
            RunDirLock.release_held()
            os._exit(preempted.exit_status)

        log.error("stopping rank %d (exit status %d): %s%s", self.rank, EXIT_PEER_FAILED, failure,
                  resume_hint(PeerFailedError.resume_hint) if self.rank == 0 else "")
        for handler in logging.getLogger().handlers:
            with contextlib.suppress(Exception):
                handler.flush()
        sys.stderr.flush()
        RunDirLock.release_held()  # os._exit runs no finally: the next launch should not find this job's lock
        os._exit(EXIT_PEER_FAILED)


def _mark_exiting(store, rank: int) -> None:
    with contextlib.suppress(Exception):
        store.set(f"exiting/{rank}", f"{time.time():.3f}")


def adopt_group(info: DistInfo, wanted: str) -> str:
    """Check that the existing default process group can serve this run: it spans ``info.world_size`` ranks and
    its backend covers ``wanted`` (:func:`backend_for`'s choice). Returns its backend name. Raises
    :class:`~hydratrain.errors.ConfigError` naming ``launcher.backend`` (the launcher chose the backend), or
    RuntimeError when the sizes disagree."""
    import torch.distributed as dist


    if dist.get_world_size() != info.world_size or dist.get_rank() != info.rank:
        raise RuntimeError(f"the launcher's process group has rank {dist.get_rank()} of {dist.get_world_size()}, "
                           f"but the environment says rank {info.rank} of {info.world_size}")
    name = str(dist.get_backend())
    if not all(part.split(":")[-1] in name for part in wanted.split(",")):
        raise ConfigError("launcher.backend", name, f"the launcher's process group cannot serve this run, which "
                          f"needs {wanted} (strategy.backend / strategy.cpu_offload); allowed: {wanted}")
    return name


def _caused_by_peer(first: str, mine: str, err: BaseException) -> bool:
    """Whether this rank's error ``err`` (recorded as ``mine``, ``rank R: Type: text``) is taken for a consequence
    of the job's first recorded failure ``first``: not when it is that failure, or has its text, or is an error a
    peer cannot cause (``HydratrainError.own_failure``: an out-of-memory, a divergence, a config error)."""
    return not (first == mine or getattr(err, "own_failure", False)
                or first.partition(": ")[2] == mine.partition(": ")[2])


def _store_gone(err: BaseException) -> str:
    return (f"the job's store is gone ({type(err).__name__}): the rank hosting it (rank 0) or the launcher ended "
            "first")


# what gloo's TCP transport and NCCL say when a peer's end of a collective went away
_LOST_PEER = ("connection reset by peer", "connection closed by peer", "communicator was aborted",
              "remote process exited")


def lost_a_peer(err: Optional[BaseException]) -> bool:
    """Whether ``err`` (or an error it was raised from) is a collective failing because a peer went away:
    ``torch.distributed.DistNetworkError``, or a RuntimeError carrying gloo's or NCCL's message for it ("Connection
    reset by peer", "Connection closed by peer", ...). Such an error is this rank's symptom, not its failure."""
    import torch.distributed as dist

    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, getattr(dist, "DistNetworkError", ())) or (
                isinstance(err, RuntimeError) and any(m in str(err).lower() for m in _LOST_PEER)):
            return True
        err = err.__cause__ or err.__context__
    return False


@contextlib.contextmanager
def process_group(device_kind: str, backend: Optional[str], needs_group: bool, cpu_offload: bool = False,
                  failure_timeout_s: float = 60.0, collective_timeout_s: float = 600.0) -> Iterator[DistInfo]:
    """Create the default process group (when ``needs_group`` or there are several ranks), choose this rank's
    device, watch for failed peers, and tear it all down on exit.

    Each call makes a fresh group on its own key prefix of the ``MASTER_ADDR:MASTER_PORT`` store, so one process can
    run several jobs one after another (a Hydra sweep inside each rank). Yields the :class:`DistInfo` with its
    device. On success every rank meets at a barrier before the group is destroyed. On an exception the rank records
    it for its peers (:class:`FailureWatch`), skips the barrier, and re-raises; if another rank had failed first with
    another error, it raises :class:`PeerFailedError` naming that failure instead. An error a peer cannot cause
    (``HydratrainError.own_failure``: an out-of-memory, a divergence) keeps its own exit status on every rank that
    raises it. A rank stopping for a peer's failure lingers ``FailureWatch.linger_s`` (<= 3 s) before it exits (here
    :func:`hydratrain.run.main`, after logging why) so that the rank which failed leaves first: torchrun reports the
    first worker to exit as the root cause. A rank of several whose launcher is gone ends within
    ``FailureWatch.launcher_grace_s`` of the start of its teardown, whatever hangs in it or after it
    (:func:`hydratrain.dist.launch.end_within`).
    """
    import torch
    import torch.distributed as dist

    info = dist_info()
    device = choose_device(device_kind, info.local_rank)
    info = replace(info, device=device)
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads(info.local_world_size))
    watch = None
    adopted = dist.is_available() and dist.is_initialized()  # made by the launcher (Ray Train)
    if adopted:
        name = adopt_group(info, backend_for(device, backend, cpu_offload))
        if info.world_size > 1:
            watch = FailureWatch(_next_job_prefix(), info.rank, info.world_size, failure_timeout_s).start()
        log.info("process group: the launcher's (backend=%s world_size=%d rank=%d local_rank=%d device=%s)", name,
                 info.world_size, info.rank, info.local_rank, device)
    elif info.world_size > 1 or needs_group:
        from torch.distributed import PrefixStore

        name = backend_for(device, backend, cpu_offload)
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        timeout = timedelta(seconds=collective_timeout_s)
        if info.world_size > 1:
            prefix = _next_job_prefix()
            _all_arrived(base_store(), prefix, info.world_size, collective_timeout_s)
            dist.init_process_group(name, store=PrefixStore(prefix, base_store()), rank=info.rank,
                                    world_size=info.world_size, timeout=timeout, **kwargs)
            watch = FailureWatch(prefix, info.rank, info.world_size, failure_timeout_s).start()
        else:
            dist.init_process_group(name, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, **kwargs)
        log.info("process group: backend=%s world_size=%d rank=%d local_rank=%d device=%s", name, info.world_size,
                 info.rank, info.local_rank, device)
    failed_with = None  # the exit status this rank will have when the body raised
    interrupted = False  # the body raised KeyboardInterrupt (SIGINT)
    try:
        yield info
    except BaseException as err:
        hold_sigterm()  # the launcher's SIGTERM (a peer has exited) must not cut this rank short before it says why
        failed_with = getattr(err, "exit_status", EXIT_ERROR)
        interrupted = isinstance(err, KeyboardInterrupt)
        if watch is not None and not isinstance(err, (KeyboardInterrupt, PeerFailedError, LauncherGoneError)):
            text = str(err).strip().splitlines()
            mine = f"rank {info.rank}: {type(err).__name__}" + (f": {text[0]}" if text else "")
            if lost_a_peer(err):  # learn which rank failed before blaming this one
                log.error("a collective failed on rank %d (%s); finding the rank that failed", info.rank, mine)
                failed_with = EXIT_PEER_FAILED
                first, running = watch.find_failure()
                raise PeerFailedError(f"another rank failed first ({first}); this rank lost it in a collective",
                                      watch.linger_s if running else 0.0) from err
            first = watch.report(mine)
            if _caused_by_peer(first, mine, err):
                failed_with = EXIT_PEER_FAILED
                raise PeerFailedError(f"another rank failed first ({first}); this rank stopped with "
                                      f"{type(err).__name__}", watch.linger_s) from err
            if first == mine:
                watch.mark_exiting_at_exit()
        raise
    finally:
        if watch is not None and (launcher_gone() is not None or (interrupted and under_elastic_agent())):
            # its launcher is gone, or it took SIGINT under one (Ctrl-C, or the parent-death SIGINT of
            # launcher=torchrun's workers, which comes as the launching process's threads die, before getppid()
            # shows it gone): this rank is ending, and its end can hang in C++ with the GIL held (gloo's worker
            # threads, joined as the group is freed, wait for that GIL to finish a collective the peer left), where
            # the watch thread cannot end it: every such rank is gone within launcher_grace_s
            end_within(watch.launcher_grace_s)
        if watch is not None:  # after a failure its thread bounds the teardown, which could hang on a peer
            watch.stop(done=failed_with is None,
                       exit_bound=None if failed_with is None else (failure_timeout_s, failed_with))
        if dist.is_available() and dist.is_initialized():
            if failed_with is None:
                dist.barrier()  # no rank tears down while a peer is still in a collective
                let_workers_finish()
                if not adopted:
                    dist.destroy_process_group()
            elif not adopted:  # no barrier: the peers may sit in another collective
                let_workers_finish()
                dist.destroy_process_group()
        if watch is not None:
            watch.torn_down()
