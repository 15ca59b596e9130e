"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): save, auto-resume, resharding, safe loading.

Layout: ``<run dir>/checkpoints/step_XXXXXXXX/`` is one complete DCP checkpoint (``.metadata`` plus one
``__<rank>_0.distcp`` file per saving rank, and ``config.yaml``, the run config that wrote it). It holds

- ``model``, ``optim``: from ``torch.distributed.checkpoint.state_dict.get_state_dict`` -- parameter names without
  DDP/FSDP/activation-checkpointing/compile prefixes, DTensor shards under FSDP -- so a checkpoint loads into any
  strategy, world size, AC or compile setting (DCP reshards on load). Adam moments and step counts included.
- ``scheduler``, ``scaler`` (when fp16), ``trainer`` (step, skipped steps, data position and what it depends on).
- ``rank<r>``: rank r's RNG states (torch CPU and CUDA, numpy, python) and its logging-window sums.

Every rank writes its own shards and nothing is gathered to one rank. A save goes to ``.tmp-step_XXXXXXXX``; after
every rank has finished (DCP writes ``.metadata`` last, then a barrier), rank 0 renames it to ``step_XXXXXXXX``,
fsyncs the directory, prunes to ``checkpoint.keep_last``, and all ranks wait at a barrier, so a run killed mid-save
leaves only a temporary dir that is never loaded. A ``step_*`` dir without ``.metadata`` is not complete.

Loading (``hydratrain.checkpoint_io``) reads DCP's ``.metadata`` with an allow-list unpickler and every other pickled
value with ``torch.load(weights_only=True)``; shard files are checked against the metadata's offsets first, so a
truncated or missing file stops the run with one line naming it (:class:`CheckpointError`).

Data position: the loader's order in an epoch is one permutation of the train samples that does not depend on the
world size (see ``hydratrain.data.ShardedBatches``); the checkpoint stores how many samples of it all ranks have
consumed together, so a resume on another world size or batch size continues at exactly that sample.
"""
from __future__ import annotations

import logging
import os
import random
import re
import shutil
import signal
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from hydratrain.checkpoint_io import (METADATA, CheckpointError, load_dcp, quiet_without_process_group, rank_and_world,
                                      verify)

log = logging.getLogger(__name__)

STEP_RE = re.compile(r"^step_(\d{8})$")
TMP_PREFIX = ".tmp-"
FORMAT_VERSION = 1
# Exit status of a run stopped by SIGTERM after saving (EX_TEMPFAIL of sysexits.h: "try again later").
EXIT_PREEMPTED = 75
# Exit status of a run refused because its checkpoint is missing, incomplete or corrupt.
EXIT_CHECKPOINT_ERROR = 3


def step_dir_name(step: int) -> str:
    """``step_XXXXXXXX`` (8 digits) for optimizer step ``step``."""
    return f"step_{step:08d}"


def step_of(path: Path) -> Optional[int]:
    """The step of a ``step_XXXXXXXX`` dir, else None."""
    m = STEP_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` as (step, path), oldest first. Skips (with a warning) ``step_*`` dirs
    without ``.metadata`` and ignores temporary ``.tmp-*`` dirs of unfinished saves."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        step = step_of(p)
        if step is None or not p.is_dir():
            continue
        if (p / METADATA).is_file():
            out.append((step, p))
        else:
            log.warning("ignoring %s: no %s, so it is not a complete checkpoint", p, METADATA)
    return sorted(out)


def latest_checkpoint(root: Path) -> Optional[Path]:
    """The complete checkpoint with the highest step under ``root``, or None."""
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint dir from ``path``: a ``step_*`` dir itself, or the latest complete one in a ``checkpoints`` dir
    or in a run dir's ``checkpoints/``. Raises :class:`CheckpointError` when there is none."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint dir")
    if (path / METADATA).is_file() or step_of(path) is not None:
        if not (path / METADATA).is_file():
            raise CheckpointError(f"{path / METADATA}: missing, so {path} is not a complete checkpoint")
        return path
    for root in (path, path / "checkpoints"):
        latest = latest_checkpoint(root)
        if latest is not None:
            return latest
    raise CheckpointError(f"{path}: holds no complete checkpoint (step_XXXXXXXX/{METADATA})")


# ---------------------------------------------------------------------------------------------- RNG states
def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's RNG states: torch CPU (and CUDA of ``device``), numpy's global, python's ``random``."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "numpy_keys": torch.from_numpy(keys.astype(np.int64)),
             "numpy_rest": [kind, int(pos), int(has_gauss), float(cached)], "python": list(random.getstate())}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore what :func:`rng_state` returned (entries missing from ``state`` are left alone)."""
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "numpy_keys" in state and "numpy_rest" in state:
        kind, pos, has_gauss, cached = state["numpy_rest"]
        np.random.set_state((kind, state["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, cached))
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


# ------------------------------------------------------------------------------------------- the checkpointer
def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class Checkpointer:
    """Saves and restores a :class:`~hydratrain.trainer.Trainer` per ``cfg.checkpoint``; all ranks call together.

    Args:
        cfg: the run config (``checkpoint``, ``trainer.seed``, ``data`` are read).
        root: where checkpoints go (``<run dir>/checkpoints``).
        device: this rank's device (for the SIGTERM flag's all-reduce and CUDA RNG).
    ``after_step(trainer)`` runs after every optimizer step: periodic saves, SIGTERM handling (returns True when the
    run must stop), and the test-only ``checkpoint.debug_kill_at_step``. Call :meth:`close` at the end.
    """

    def __init__(self, cfg, root: Path, device: torch.device):
        self.cfg, self.ccfg, self.root, self.device = cfg, cfg.checkpoint, Path(root), device
        self.rank, self.world_size = rank_and_world()
        self.last_saved_step: Optional[int] = None
        self._sigterm = False
        self._old_handler = None
        if self.ccfg.save_on_sigterm:
            try:
                self._old_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
            except ValueError:  # not the main thread
                log.warning("checkpoint.save_on_sigterm: cannot install a SIGTERM handler outside the main thread")
        if self.rank == 0 and self.root.is_dir():
            for stale in self.root.glob(TMP_PREFIX + "*"):
                log.warning("removing %s, left by a save that did not finish", stale)
                shutil.rmtree(stale, ignore_errors=True)

    def _on_sigterm(self, signum, frame) -> None:
        if not self._sigterm:
            log.warning("SIGTERM received: finishing this step, then saving a checkpoint and exiting with %d",
                        self.ccfg.preempt_exit_code)
        self._sigterm = True

    def close(self) -> None:
        """Restore the SIGTERM handler that was there before -- unless the run is stopping after a SIGTERM: then
        SIGTERM is ignored from here on, so the launcher's own SIGTERM (torchrun signals every other worker once one
        has exited) cannot kill a rank that is still tearing down before it exits with
        ``checkpoint.preempt_exit_code``. (``SIG_IGN``, unlike a Python handler, survives interpreter shutdown; a
        hung teardown still ends with torchrun's SIGKILL 30 s later.)"""
        if self._sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        elif self._old_handler is not None:
            signal.signal(signal.SIGTERM, self._old_handler)
        self._old_handler = None

    # ------------------------------------------------------------------------------------------------ hooks
    def _any_rank(self, flag: bool) -> bool:
        """True if ``flag`` is set on any rank (an all-reduce MAX; every rank must call)."""
        if self.world_size == 1:
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int32, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def after_step(self, trainer) -> bool:
        """Called by every rank after each optimizer step. Returns True if the run must stop (SIGTERM)."""
        step, every = trainer.state.step, self.ccfg.every_n_steps
        stop = self._any_rank(self._sigterm) if self.ccfg.save_on_sigterm else False
        if (stop or (every and step % every == 0)) and step != self.last_saved_step:
            self.save(trainer)
        if self.ccfg.debug_kill_at_step is not None and step == self.ccfg.debug_kill_at_step:
            log.warning("checkpoint.debug_kill_at_step=%d: killing this process with SIGKILL (testing only)", step)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)
        if stop:
            self._sigterm = True  # also on ranks that did not get the signal: see close()
            log.warning("stopping at step %d after SIGTERM; checkpoint %s; exit status %d", step,
                        self.root / step_dir_name(step), self.ccfg.preempt_exit_code)
        return stop

    def at_end(self, trainer) -> None:
        """Called by every rank when training finished: saves the last step if ``checkpoint.save_last``."""
        if self.ccfg.save_last and trainer.state.step != self.last_saved_step:
            self.save(trainer)

    # ------------------------------------------------------------------------------------------------- save
    def _state(self, trainer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
        batches = trainer.train_batches
        epoch, consumed = batches.position()
        state: dict[str, Any] = {
            "model": model_sd, "optim": optim_sd, "scheduler": trainer.scheduler.state_dict(),
            "trainer": {"format_version": FORMAT_VERSION, "step": trainer.state.step,
                        "skipped_steps": trainer.state.skipped_steps, "first_loss": trainer.state.first_loss,
                        "epoch": epoch, "samples_in_epoch": consumed,
                        "world_size": self.world_size, "batch_size": batches.batch_size,
                        "seed": self.cfg.trainer.seed, "train_samples": len(batches.dataset),
                        "seq_len": batches.dataset.seq_len},
            f"rank{self.rank}": {"rng": rng_state(self.device),
                                 "window_loss": trainer.window_loss.detach().clone().cpu(),
                                 "window_steps": int(trainer.window_steps)},
        }
        if trainer.scaler is not None:
            state["scaler"] = trainer.scaler.state_dict()
        return state

    def save(self, trainer) -> Path:
        """Write a checkpoint of ``trainer`` for its current step; every rank calls. Returns the final dir.

        Written to ``.tmp-step_XXXXXXXX`` then renamed by rank 0 once all ranks have finished; older checkpoints
        beyond ``checkpoint.keep_last`` are deleted. Replaces a checkpoint of the same step, if any.
        """
        import time

        t0 = time.perf_counter()
        step = trainer.state.step
        final = self.root / step_dir_name(step)
        tmp = self.root / (TMP_PREFIX + final.name)
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            from omegaconf import OmegaConf

            (tmp / "config.yaml").write_text(OmegaConf.to_yaml(self.cfg, resolve=True))
        _barrier()
        with quiet_without_process_group():
            dcp.save(self._state(trainer), storage_writer=FileSystemWriter(str(tmp)))
        _barrier()  # every rank's shards are written and DCP's .metadata is in place
        if self.rank == 0:
            if final.exists():
                old = self.root / (TMP_PREFIX + "old-" + final.name)
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            _fsync_dir(self.root)
            self._prune()
        _barrier()  # no rank goes on (or exits) before the rename is done
        self.last_saved_step = step
        log.info("saved checkpoint %s (%.2f s)", final, time.perf_counter() - t0)
        return final

    def _prune(self) -> None:
        keep = self.ccfg.keep_last
        if not keep:
            return
        for _, path in list_checkpoints(self.root)[:-keep]:
            shutil.rmtree(path, ignore_errors=True)
            log.info("removed old checkpoint %s (checkpoint.keep_last=%d)", path, keep)

    # ------------------------------------------------------------------------------------------------- load
    def load(self, trainer, ckpt: Path) -> None:
        """Restore ``trainer`` (model, optimizer, scheduler, scaler, counters, data position, RNG) from ``ckpt``.

        Every rank calls. The model and optimizer are resharded to this run's strategy and world size by DCP.
        Raises :class:`CheckpointError` when the checkpoint is unreadable or the data position cannot be kept
        (another ``trainer.seed`` or train split; see ``checkpoint.restore_data_position``).
        """
        from torch.distributed.checkpoint.state_dict import set_state_dict

        ckpt = Path(ckpt)
        md = verify(ckpt)
        keys = md.state_dict_metadata
        state = self._state(trainer)
        rank_key = f"rank{self.rank}"
        if "scaler" in state and not any(k.startswith("scaler.") for k in keys):
            log.warning("%s has no grad scaler state (saved without fp16): the scaler starts fresh", ckpt)
            state.pop("scaler")
        # Ask only for entries the checkpoint has: torch versions add scheduler keys, a CPU run saved no CUDA RNG,
        # and a run on more ranks than saved has no RNG state for the new ranks.
        for prefix, group in (("trainer", state.get("trainer")), ("scheduler", state.get("scheduler")),
                              ("scaler", state.get("scaler")),
                              (rank_key, state.get(rank_key)), (rank_key + ".rng", state.get(rank_key, {}).get("rng"))):
            if isinstance(group, dict):
                for k in [k for k, v in group.items() if not isinstance(v, dict) and f"{prefix}.{k}" not in keys]:
                    del group[k]
        if not any(k.startswith(rank_key + ".rng.") for k in keys):
            state.pop(rank_key)
        load_dcp(state, ckpt)
        set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        trainer.scheduler.load_state_dict({**trainer.scheduler.state_dict(), **state["scheduler"]})
        if "scaler" in state:
            trainer.scaler.load_state_dict(state["scaler"])
        saved = state["trainer"]
        trainer.state.step, trainer.state.skipped_steps = int(saved["step"]), int(saved["skipped_steps"])
        trainer.state.first_loss = float(saved.get("first_loss", float("nan")))
        self._restore_position(trainer, saved, ckpt)
        same_layout = saved["world_size"] == self.world_size
        if rank_key in state:
            set_rng_state(state[rank_key]["rng"], self.device)
            if same_layout and "window_steps" in state[rank_key]:
                trainer.window_loss = state[rank_key]["window_loss"].to(self.device)
                trainer.window_steps = int(state[rank_key]["window_steps"])
        else:
            log.warning("%s has no RNG state for rank %d (saved by %d ranks): keeping this rank's seeded RNG", ckpt,
                        self.rank, saved["world_size"])
        if self.root.resolve() == ckpt.parent.resolve():
            self.last_saved_step = trainer.state.step
        self._purge_tensorboard(trainer)
        log.info("resumed from %s: step %d, epoch %d, %d samples of the epoch consumed (saved by %d ranks, now %d)",
                 ckpt, trainer.state.step, saved["epoch"], saved["samples_in_epoch"], saved["world_size"],
                 self.world_size)

    @staticmethod
    def _purge_tensorboard(trainer) -> None:
        """Tell TensorBoard to drop what earlier launches logged after the resumed step (a run killed at step 12
        whose last checkpoint is step 10 had logged 11 and 12; they are logged again now): a ``SessionLog.START``
        event at the next step, as ``SummaryWriter(purge_step=...)`` writes. Rank 0 only (it owns the writer)."""
        writer = getattr(getattr(trainer, "tb", None), "writer", None)
        if writer is None:
            return
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        writer.file_writer.add_event(Event(step=trainer.state.step + 1,
                                           session_log=SessionLog(status=SessionLog.START)))

    def _restore_position(self, trainer, saved: dict, ckpt: Path) -> None:
        batches = trainer.train_batches
        mismatch = [(key, saved[name], now) for key, name, now in (
            ("trainer.seed", "seed", self.cfg.trainer.seed),
            ("data.seq_len", "seq_len", batches.dataset.seq_len),
            ("data (train split size, in samples)", "train_samples", len(batches.dataset)))
            if saved[name] != now]
        if mismatch and self.ccfg.restore_data_position:
            what = "; ".join(f"{k} was {a}, now {b}" for k, a, b in mismatch)
            raise CheckpointError(f"{ckpt}: cannot restore the data position ({what}): the sample order would "
                                  "differ and samples would be skipped or repeated. Use the saved values, or set "
                                  "checkpoint.restore_data_position=false to start that epoch over")
        if not self.ccfg.restore_data_position:
            log.warning("checkpoint.restore_data_position=false: epoch %d starts over from its first sample "
                        "(samples already seen in it will be seen again)", saved["epoch"])
            batches.seek(int(saved["epoch"]), 0)
            return
        batches.seek(int(saved["epoch"]), int(saved["samples_in_epoch"]))
        if saved["world_size"] != self.world_size or saved["batch_size"] != batches.batch_size:
            log.warning("data position remapped: %d ranks x batch %d -> %d ranks x batch %d; epoch %d continues at "
                        "sample %d of its order (nothing skipped or repeated); %d micro-batches per rank left in it",
                        saved["world_size"], saved["batch_size"], self.world_size, batches.batch_size,
                        saved["epoch"], saved["samples_in_epoch"], batches.batches_left_in_epoch())


def find_resume(cfg, run_dir: Path, launch_dir: Path) -> Optional[Path]:
    """The checkpoint this run starts from, checked for completeness: the latest complete one in
    ``<run_dir>/checkpoints`` (auto-resume, when ``checkpoint.auto_resume``), else ``checkpoint.resume_from``
    (relative to ``launch_dir``), else None. A run dir's own checkpoint wins over ``resume_from`` so that a
    relaunch of a preempted run continues where it stopped.

    Raises :class:`CheckpointError` when the chosen checkpoint is incomplete, truncated or unreadable.
    """
    ccfg = cfg.checkpoint
    ckpt = latest_checkpoint(Path(run_dir) / "checkpoints") if ccfg.auto_resume else None
    if ckpt is None and ccfg.resume_from:
        src = Path(ccfg.resume_from).expanduser()
        ckpt = resolve_checkpoint(src if src.is_absolute() else launch_dir / src)
    if ckpt is not None:
        verify(ckpt)
    return ckpt
