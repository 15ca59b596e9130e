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

Loading reads DCP's ``.metadata`` with an allow-list unpickler and every other pickled value with
``torch.load(weights_only=True)``; shard files are checked against the metadata's offsets first, so a truncated or
missing file stops the run with one line naming it (:class:`CheckpointError`).

Data position: the loader's order in an epoch is one permutation of the train samples that does not depend on the
world size (see ``hydratrain.data.ShardedBatches``); the checkpoint stores how many samples of it all ranks have
consumed together, so a resume on another world size or batch size continues at exactly that sample.
"""
from __future__ import annotations

import io
import logging
import os
import pickle
import random
import re
import shutil
import signal
import warnings
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

log = logging.getLogger(__name__)

STEP_RE = re.compile(r"^step_(\d{8})$")
TMP_PREFIX = ".tmp-"
METADATA = ".metadata"
FORMAT_VERSION = 1
# DCP warns on every call without a process group (strategy=single, export); that is intended here.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
# Exit status of a run stopped by SIGTERM after saving (EX_TEMPFAIL of sysexits.h: "try again later").
EXIT_PREEMPTED = 75
# Exit status of a run refused because its checkpoint is missing, incomplete or corrupt.
EXIT_CHECKPOINT_ERROR = 3


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; ``str(err)`` is one line naming the file or dir and why."""


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


# --------------------------------------------------------------------------------------------- safe reading
class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` allowing only DCP's own classes (dataclasses and enums defined in
    ``torch.distributed.checkpoint.*``), torch sizes, dtypes and layouts, paths and plain containers: no code runs."""

    _ALLOWED = {"builtins": {"dict", "list", "tuple", "set", "frozenset", "int", "float", "str", "bytes", "bool",
                             "complex", "slice"},
                "collections": {"OrderedDict"},
                "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
                "torch": {"Size"},
                "torch.serialization": {"_get_layout"}}  # maps a layout's name to torch.strided etc.

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name:
            if name in self._ALLOWED.get(module, ()):
                return super().find_class(module, name)
            if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                           torch.memory_format)):
                return getattr(torch, name)
            if module.startswith("torch.distributed.checkpoint."):
                obj = super().find_class(module, name)
                if isinstance(obj, type) and obj.__module__ == module:
                    return obj
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in checkpoint metadata")


def read_metadata(ckpt: Path) -> Metadata:
    """DCP ``Metadata`` of checkpoint dir ``ckpt``, unpickled with an allow-list (no code runs).

    Raises :class:`CheckpointError` naming the file when it is missing, truncated or holds anything else."""
    path = Path(ckpt) / METADATA
    try:
        with open(path, "rb") as fh:
            md = _MetadataUnpickler(fh).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing, so {ckpt} is not a complete checkpoint") from None
    except Exception as err:  # truncated (EOFError), not a pickle, or a disallowed global
        raise CheckpointError(f"{path}: unreadable checkpoint metadata ({type(err).__name__}: {err})") from None
    if not isinstance(md, Metadata):
        raise CheckpointError(f"{path}: holds a {type(md).__name__}, not DCP checkpoint metadata")
    return md


def verify(ckpt: Path) -> Metadata:
    """Check that every shard file named by the metadata of ``ckpt`` exists and holds the bytes it should.

    Returns the metadata. Raises :class:`CheckpointError` naming the first missing or truncated file.
    """
    ckpt = Path(ckpt)
    md = read_metadata(ckpt)
    need: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is not None:
            need[rel] = max(need.get(rel, 0), info.offset + info.length)
    for rel, size in sorted(need.items()):
        f = ckpt / rel
        if not f.is_file():
            raise CheckpointError(f"{f}: missing shard file of checkpoint {ckpt}")
        if f.stat().st_size < size:
            raise CheckpointError(f"{f}: truncated ({f.stat().st_size} bytes, the checkpoint metadata needs "
                                  f"{size}); not loading {ckpt}")
    return md


class SafeReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is read by :func:`read_metadata` (allow-list unpickler)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = read_metadata(Path(self.path))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that unpickles non-tensor values with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.original_state_dict[read_item.dest_index.fqn] = obj


def load_dcp(state: dict, ckpt: Path) -> None:
    """``dcp.load`` of ``state`` (filled in place) from ``ckpt`` with the safe reader and planner; every rank calls.

    Raises :class:`CheckpointError` (one line naming ``ckpt``) when DCP fails on any rank.
    """
    try:
        dcp.load(state, storage_reader=SafeReader(str(ckpt)), planner=SafeLoadPlanner())
    except CheckpointError:
        raise
    except Exception as err:
        first = str(err).strip().splitlines()
        raise CheckpointError(f"{ckpt}: loading failed ({type(err).__name__}: "
                              f"{first[-1] if first else ''})") from err


def read_model_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """Full (unsharded) model weights of checkpoint ``ckpt`` in one process, no process group needed.

    Tensors are allocated from the metadata's shapes and dtypes and filled by DCP; keys are the model's parameter
    names (``tok_emb.weight``...). Raises :class:`CheckpointError` if ``ckpt`` is incomplete or corrupt.
    """
    md = verify(ckpt)
    model = {k[len("model."):]: torch.empty(v.size, dtype=v.properties.dtype)
             for k, v in md.state_dict_metadata.items()
             if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    if not model:
        raise CheckpointError(f"{ckpt}: holds no model weights (no 'model.*' entries)")
    state = {"model": model}
    load_dcp(state, ckpt)
    return state["model"]


def read_all(ckpt: Path) -> dict[str, Any]:
    """Every entry of checkpoint ``ckpt`` by flat DCP key (tensors full size), in one process. For tests/tools."""
    md = verify(ckpt)
    flat: dict[str, Any] = {}
    for k, v in md.state_dict_metadata.items():
        flat[k] = torch.empty(v.size, dtype=v.properties.dtype) if isinstance(v, TensorStorageMetadata) else None
    dcp.load(flat, storage_reader=SafeReader(str(ckpt)), planner=SafeLoadPlanner())
    return flat


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
def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


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
        self.rank, self.world_size = _rank_world()
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
        """Restore the SIGTERM handler that was there before."""
        if self._old_handler is not None:
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
            log.warning("stopping at step %d after SIGTERM; checkpoint %s; exit status %d", step,
                        self.root / step_dir_name(step), self.ccfg.preempt_exit_code)
        return stop

    def at_end(self, trainer) -> None:
        """Called by every rank when training finished: saves the last step if ``checkpoint.save_last``."""
        if self.ccfg.save_last and trainer.state.step != self.last_saved_step:
            self.save(trainer)

    # ------------------------------------------------------------------------------------------------- save
    def _state(self, trainer, for_load: bool) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
        batches = trainer.train_batches
        epoch, consumed = batches.position()
        state: dict[str, Any] = {
            "model": model_sd, "optim": optim_sd, "scheduler": trainer.scheduler.state_dict(),
            "trainer": {"format_version": FORMAT_VERSION, "step": trainer.state.step,
                        "skipped_steps": trainer.state.skipped_steps, "epoch": epoch, "samples_in_epoch": consumed,
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
        dcp.save(self._state(trainer, for_load=False), storage_writer=FileSystemWriter(str(tmp)))
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
        state = self._state(trainer, for_load=True)
        rank_key = f"rank{self.rank}"
        if not any(k.startswith(rank_key + ".") for k in keys):
            state.pop(rank_key)
        if "scaler" in state and not any(k.startswith("scaler.") for k in keys):
            log.warning("%s has no grad scaler state (saved without fp16): the scaler starts fresh", ckpt)
            state.pop("scaler")
        for group in ("scheduler", "scaler"):  # only entries the checkpoint has (torch versions add keys)
            if group in state:
                state[group] = {k: v for k, v in state[group].items() if f"{group}.{k}" in keys}
        load_dcp(state, ckpt)
        set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        trainer.scheduler.load_state_dict({**trainer.scheduler.state_dict(), **state["scheduler"]})
        if "scaler" in state:
            trainer.scaler.load_state_dict(state["scaler"])
        saved = state["trainer"]
        trainer.state.step, trainer.state.skipped_steps = int(saved["step"]), int(saved["skipped_steps"])
        self._restore_position(trainer, saved, ckpt)
        same_layout = saved["world_size"] == self.world_size
        if rank_key in state:
            set_rng_state(state[rank_key]["rng"], self.device)
            if same_layout:
                trainer.window_loss = state[rank_key]["window_loss"].to(self.device)
                trainer.window_steps = int(state[rank_key]["window_steps"])
        else:
            log.warning("%s has no RNG state for rank %d (saved by %d ranks): keeping this rank's seeded RNG", ckpt,
                        self.rank, saved["world_size"])
        if self.root.resolve() == ckpt.parent.resolve():
            self.last_saved_step = trainer.state.step
        log.info("resumed from %s: step %d, epoch %d, %d samples of the epoch consumed (saved by %d ranks, now %d)",
                 ckpt, trainer.state.step, saved["epoch"], saved["samples_in_epoch"], saved["world_size"],
                 self.world_size)

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


# ------------------------------------------------------------------------------------------ full-weight files
def init_from_file(model: torch.nn.Module, path: Path) -> int:
    """Load full weights from the safetensors file ``path`` into ``model`` (single, DDP or FSDP2; every rank calls),
    then check every rank's local shard against the matching slice of the file.

    With a process group, rank 0 reads the file and ``set_model_state_dict(full_state_dict=True,
    broadcast_from_rank0=True)`` scatters it; the check then reads, on each rank, only the slices that rank holds.
    Returns the number of tensors checked. Raises :class:`CheckpointError` naming ``model.init_from`` when keys or
    shapes differ from the model or a shard does not match the file.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from torch.distributed.tensor import DTensor

    rank, world = _rank_world()
    where = f"model.init_from={path}"
    live = get_model_state_dict(model)
    try:
        with safe_open(str(path), "pt", device="cpu") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as err:
        raise CheckpointError(f"{where}: unreadable safetensors file ({type(err).__name__}: {err})") from None
    missing, unexpected = sorted(set(live) - set(shapes)), sorted(set(shapes) - set(live))
    if missing or unexpected:
        raise CheckpointError(f"{where}: keys differ from the model's (missing {missing[:5]}, unexpected "
                              f"{unexpected[:5]}); check the model config")
    wrong = [(k, shapes[k], tuple(v.shape)) for k, v in live.items() if shapes[k] != tuple(v.shape)]
    if wrong:
        k, got, want = wrong[0]
        raise CheckpointError(f"{where}: {k} has shape {got} in the file, the model needs {want}; check the model "
                              "config")
    broadcast = dist.is_available() and dist.is_initialized() and world > 1
    full = load_file(str(path)) if (rank == 0 or not broadcast) else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast,
                                                               strict=True))
    del full
    bad = []
    with safe_open(str(path), "pt", device="cpu") as f:
        for k, v in get_model_state_dict(model).items():
            if isinstance(v, DTensor):
                from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

                local = v.to_local()
                shape, offset = compute_local_shape_and_global_offset(v.shape, v.device_mesh, v.placements)
                ref = f.get_slice(k)[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
            else:
                local, ref = v, f.get_tensor(k)
            if tuple(ref.shape) != tuple(local.shape) or not torch.equal(local.detach().cpu(), ref.to(local.dtype)):
                bad.append(k)
    n_bad = torch.tensor([len(bad)], device=next(iter(live.values())).device if live else "cpu")
    if broadcast:
        dist.all_reduce(n_bad)
    if n_bad.item():
        raise CheckpointError(f"{where}: {int(n_bad.item())} loaded shards differ from the file (rank {rank}: "
                              f"{bad[:3]})")
    log.info("initialised the model from %s: %d tensors, every rank's shard checked against the file", path,
             len(live))
    return len(live)
