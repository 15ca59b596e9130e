"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): a dict of Stateful components, saved
atomically, found again for auto-resume, and loaded into any strategy and world size.

Layout: ``<run dir>/checkpoints/step_XXXXXXXX/`` is one complete DCP checkpoint (``.metadata`` plus one
``__<rank>_0.distcp`` file per saving rank, and ``config.yaml``, the run config that wrote it). Each component given
to :class:`CheckpointManager` is stored under its own name (``run.py`` passes ``model``, ``optim``, ``scheduler``,
``scaler``, ``progress``, ``data``) and each rank's own ones under ``rank<r>`` (``rng``, ``step_logger``); the
manager knows nothing else about them. Format 1 (hydratrain before the Stateful components: ``trainer`` held the
counters and data position, ``rank<r>`` the loss window directly) still loads.

Every rank writes its own shards and nothing is gathered to one rank. A save goes to ``.tmp-step_XXXXXXXX``; after
every rank has finished (DCP writes ``.metadata`` last, then a barrier), rank 0 renames it to ``step_XXXXXXXX``,
fsyncs the directory, prunes to ``checkpoint.keep_last``, and all ranks wait at a barrier, so a run killed mid-save
leaves only a temporary dir that is never loaded. A ``step_*`` dir without ``.metadata`` is not complete. A state
holding a non-finite value is never saved (so it can never evict a good checkpoint).

Loading (:mod:`hydratrain.checkpoint.io`) reads DCP's ``.metadata`` with an allow-list unpickler and every other
pickled value with ``torch.load(weights_only=True)``; shard files are checked against the metadata's offsets first,
and the model's shapes against this run's model, so an unusable checkpoint stops the run with one line naming it.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch

from hydratrain.checkpoint import METADATA
from hydratrain.checkpoint.architecture import check_architecture
from hydratrain.config import flat_keys
from hydratrain.dist.collectives import any_rank, barrier, rank_and_world
from hydratrain.dist.launch import stop_if_launcher_gone, unwritable_message
from hydratrain.errors import CheckpointError, DamagedCheckpointError, DivergenceError
from hydratrain.paths import resolve_path

log = logging.getLogger(__name__)

STEP_RE = re.compile(r"^step_(\d{8})$")
TMP_PREFIX = ".tmp-"
FORMAT_VERSION = 2


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
        elif p not in _WARNED_INCOMPLETE:  # once: the dir is listed again at every save
            _WARNED_INCOMPLETE.add(p)
            log.warning("ignoring %s: no %s, so it is not a complete checkpoint", p, METADATA)
    return sorted(out)


_WARNED_INCOMPLETE: set = set()


def recover_unfinished_saves(root: Path) -> None:
    """Undo what a save killed midway left under ``root`` (one process, rank 0, before any rank chooses a checkpoint
    to resume from): a ``.tmp-old-step_*`` whose replacement never arrived is put back as ``step_*`` (it is the
    complete checkpoint of that step); other ``.tmp-*`` dirs (unfinished new checkpoints) are removed."""
    root = Path(root)
    if not root.is_dir():
        return
    for stale in root.glob(TMP_PREFIX + "*"):
        replaced = root / stale.name[len(TMP_PREFIX + "old-"):]
        if stale.name.startswith(TMP_PREFIX + "old-") and not replaced.exists():
            os.replace(stale, replaced)  # killed between the two renames of a re-save: the old one is good
            log.warning("restored %s, set aside by a save that did not finish", replaced)
            continue
        try:
            shutil.rmtree(stale)
            log.warning("removed %s, left by a save that did not finish", stale)
        except OSError as err:  # (never log "removed" when nothing could be removed)
            log.warning("could not remove %s, left by a save that did not finish (%s: %s); the save of that step "
                        "will fail the same way unless it is removed", stale, type(err).__name__, err)


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


def _load_template(tree: dict, stored: Mapping) -> tuple[dict, dict]:
    """``tree`` made a template for ``dcp.load`` from a checkpoint whose entries are ``stored`` (its metadata's
    ``state_dict_metadata``: flat DCP key -> storage metadata), in DCP's own flat layout, and the entries whose kind
    it changed.

    Entries the checkpoint does not hold are left out (torch versions add scheduler keys, a CPU run saved no CUDA
    RNG, a run on more ranks than saved has no RNG state for the new ranks). Each other entry takes the kind the
    checkpoint stored it as, where this run's differs: DCP reads a tensor only into a tensor ("expected
    BytesStorageMetadata but found TensorStorageMetadata" otherwise) and a pickled value only as one. The kind of
    a value is the writer's choice, not the state's: torchao's AdamW8bit keeps ``lr`` and ``initial_lr`` in its
    param_groups as 0-d tensors, torch's AdamW as floats, so a checkpoint of one optimizer holds the other kind.
    A stored tensor is read into an empty tensor of its saved size and dtype, a stored pickle into ``None``.

    Returns ``(template, changed)``: ``changed`` maps the flat key of each entry whose kind was changed to its path
    in ``template`` and this run's value, for :func:`_restore_kinds`.
    """
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    flat, paths = flatten_state_dict(tree)
    kept, changed = {}, {}
    for key, value in flat.items():
        if key not in stored:
            continue
        md = stored[key]
        if isinstance(md, TensorStorageMetadata) and not isinstance(value, torch.Tensor):
            kept[key] = torch.empty(md.size, dtype=md.properties.dtype)
        elif isinstance(md, BytesStorageMetadata) and isinstance(value, torch.Tensor):
            kept[key] = None
        else:
            kept[key] = value
            continue
        changed[key] = (paths[key], value)
    return unflatten_state_dict(kept, {k: paths[k] for k in kept}), changed


def _restore_kinds(loaded: dict, changed: Mapping) -> None:
    """Put each entry of ``loaded`` that :func:`_load_template` read in the checkpoint's kind back in this run's
    (``changed``: flat key -> (path, this run's value)), in place: a loaded one-value tensor becomes a number of this
    run's type, a loaded number a tensor of this run's dtype, device and shape. Anything else stays as loaded."""
    from torch.distributed.checkpoint._traverse import get_element, set_element

    for path, live in changed.values():
        set_element(loaded, path, _of_kind(get_element(loaded, path), live))


def _of_kind(value: Any, like: Any) -> Any:
    """``value`` in the kind (tensor or number) of ``like`` where one converts into the other without loss of
    meaning, else ``value``."""
    if isinstance(like, torch.Tensor):
        if isinstance(value, (bool, int, float)) and like.numel() == 1:
            return torch.full_like(like, value)
        return value
    if isinstance(like, (bool, int, float)) and isinstance(value, torch.Tensor) and value.numel() == 1:
        number = value.item()  # read into _load_template's plain tensor, never a DTensor
        return type(like)(number) if type(like)(number) == number else number
    return value


def _has(stored: set, name: str) -> bool:
    return any(k == name or k.startswith(name + ".") for k in stored)


def _non_finite(state: dict) -> list[str]:
    """Names of floating tensors (local shards) in ``state`` that hold a NaN or an inf."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    bad = []
    for key, v in flatten_state_dict(state)[0].items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            local = v.to_local() if hasattr(v, "to_local") else v
            if local.numel() and not bool(torch.isfinite(local).all()):
                bad.append(key)
    return bad


def _as_format_1(targets: dict, rank_key: str) -> dict:
    """Format 1's layout of ``targets``: ``trainer`` held the progress and the data position, ``rank<r>`` the loss
    window directly, and there was no ``checkpoint`` entry."""
    out = {k: v for k, v in targets.items() if k not in ("progress", "data", "checkpoint")}
    out["trainer"] = {**targets.get("progress", {}), **targets.get("data", {})}
    mine = targets[rank_key]
    out[rank_key] = {"rng": mine.get("rng", {}), **mine.get("step_logger", {})}
    return out


def _from_format_1(loaded: dict, rank_key: str, components: Mapping) -> dict:
    """Loaded format-1 entries back in this format's layout (the inverse of :func:`_as_format_1`)."""
    trainer = loaded.pop("trainer", {})
    for name in ("progress", "data"):
        if name in components:
            keys = components[name].state_dict().keys()
            loaded[name] = {k: v for k, v in trainer.items() if k in keys}
    mine = loaded.get(rank_key, {})
    loaded[rank_key] = {"rng": mine.get("rng", {}), "step_logger": {k: v for k, v in mine.items() if k != "rng"}}
    return loaded



# keys that say how a launch is started and where it resumes from, not what it trains: not listed as differences
_WHERE_A_LAUNCH_STARTS = ("launcher.", "checkpoint.resume_from:", "checkpoint.auto_resume:")


def config_diff(saved: Mapping, now: Mapping) -> list[str]:
    """``key: old -> new`` for every leaf that differs between two config containers (keys in either)."""
    a, b = flat_keys(saved), flat_keys(now)
    return [f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}" for k in sorted(set(a) | set(b))
            if a.get(k, "<absent>") != b.get(k, "<absent>")]


class CheckpointManager:
    """Saves and loads a dict of Stateful components under ``root``; every rank calls every method together.

    Args:
        root: where checkpoints go (``<run dir>/checkpoints``).
        components: ``{name: Stateful}`` saved by all ranks (sharded tensors are split by DCP); loaded in this order.
        rank_components: ``{name: Stateful}`` of this rank alone, stored under ``rank<r>``.
        config: the run config as a plain container; written to each checkpoint's ``config.yaml`` and compared
            with the saved one on load.
        keep_last: complete checkpoints kept (0 = all).
        attachments: ``{file name: text, or a Path to copy}`` written into every checkpoint dir (the resolved
            model config, the tokenizer), so a checkpoint is usable without the run that wrote it.
    """

    def __init__(self, root: Path, components: dict[str, Any], rank_components: dict[str, Any],
                 config: Mapping, keep_last: int, device: torch.device, attachments: Optional[Mapping] = None):
        self.root, self.components, self.rank_components = Path(root), components, rank_components
        self.config, self.keep_last, self.device = config, keep_last, device
        self.attachments = dict(attachments or {})
        self.rank, self.world_size = rank_and_world()
        self.last_saved_step: Optional[int] = None
        self.loaded_from: Optional[Path] = None  # the checkpoint this run resumed from (it may be another run's)
        if self.rank == 0:
            recover_unfinished_saves(self.root)  # done already when run.main chose the checkpoint (idempotent)

    def supersede_after(self, step: int) -> None:
        """Move the complete checkpoints under ``root`` of steps after ``step`` (where this launch starts: the
        step it resumed at, 0 for a fresh start) to ``root/superseded-<time>/``. They belong to a line of training
        this launch replaces (it resumed from an earlier checkpoint with ``checkpoint.resume_from``, or started
        afresh with ``checkpoint.auto_resume=false``); left in place they would outrank this launch's own
        checkpoints, which ``checkpoint.keep_last`` would then delete as older, and a relaunch would auto-resume
        from them. Nothing is deleted. Rank 0 moves them; every rank calls (a barrier follows)."""
        if self.rank == 0:
            later = [path for s, path in list_checkpoints(self.root) if s > step]
            if later:
                aside = self.root / time.strftime("superseded-%Y%m%d-%H%M%S")
                aside.mkdir(exist_ok=True)
                for path in later:
                    os.replace(path, aside / path.name)
                _fsync_dir(self.root)
                log.warning("this launch starts at step %d, so the run dir's checkpoints of later steps (%s) belong to "
                            "the training it replaces: moved to %s, where auto-resume and checkpoint.keep_last do "
                            "not see them", step, ", ".join(p.name for p in later), aside)
        barrier()

    def latest(self) -> Optional[Path]:
        """The newest complete checkpoint under ``root`` (None if there is none)."""
        return latest_checkpoint(self.root)

    def last_good(self) -> Optional[Path]:
        """What a failed run can go back to: the newest checkpoint under ``root``, else the one it resumed from."""
        return self.latest() or self.loaded_from

    def _state(self) -> dict[str, Any]:
        state = {name: obj.state_dict() for name, obj in self.components.items()}
        state[f"rank{self.rank}"] = {name: obj.state_dict() for name, obj in self.rank_components.items()}
        state["checkpoint"] = {"format_version": FORMAT_VERSION, "world_size": self.world_size}
        return state

    # ------------------------------------------------------------------------------------------------- save
    def save(self, step: int) -> Path:
        """Write a checkpoint for optimizer step ``step``; every rank calls. Returns the final dir.

        Written to ``.tmp-step_XXXXXXXX`` then renamed by rank 0 once all ranks have finished; older checkpoints
        beyond ``keep_last`` are deleted. Replaces a checkpoint of the same step, if any. Raises
        :class:`~hydratrain.errors.DivergenceError`, writing nothing, when any rank's state holds a non-finite value.
        """
        import torch.distributed.checkpoint as dcp
        from omegaconf import OmegaConf
        from torch.distributed.checkpoint import FileSystemWriter

        from hydratrain.checkpoint.io import quiet_without_process_group, root_cause  # (start-up: DCP, ~1 s)

        t0 = time.perf_counter()
        stop_if_launcher_gone(f"before saving step {step}")
        state = self._state()
        bad = _non_finite(state)
        if any_rank(bool(bad), self.device):
            raise DivergenceError(f"not saving step {step}: the state holds non-finite values"
                                  + (f" ({', '.join(bad[:3])} on rank {self.rank})" if bad else ""),
                                  step, str(self.last_good()) if self.last_good() else None)
        final = self.root / step_dir_name(step)
        tmp = self.root / (TMP_PREFIX + final.name)
        problem: Optional[BaseException] = None
        if self.rank == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                if tmp.exists():  # a save of this step that did not finish; its own error if it stays
                    shutil.rmtree(tmp)
                tmp.mkdir()
                (tmp / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(self.config)))
                for name, content in self.attachments.items():
                    if isinstance(content, Path):
                        shutil.copyfile(content, tmp / name)
                    else:
                        (tmp / name).write_text(content)
            except OSError as err:
                problem = err
        if any_rank(problem is not None, self.device):  # (the barrier before the shards are written)
            raise self._save_failed(step, tmp, problem)
        try:
            with quiet_without_process_group():
                dcp.save(state, storage_writer=FileSystemWriter(str(tmp)))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # DCP's CheckpointException (a BaseException) holds each rank's error

            if isinstance(root_cause(err), KeyboardInterrupt):
                raise  # Ctrl-C (hydratrain.run)
            raise self._save_failed(step, tmp, root_cause(err)) from err
        barrier()  # every rank's shards are written and DCP's .metadata is in place
        if self.rank == 0:
            stop_if_launcher_gone(f"before completing its save of step {step} (left as {tmp.name})")
            if final.exists():
                old = self.root / (TMP_PREFIX + "old-" + final.name)
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            _fsync_dir(self.root)
        barrier()  # no rank goes on (or exits) before the rename is done
        self.last_saved_step = step
        log.info("saved checkpoint %s (%.2f s)", final, time.perf_counter() - t0)
        if self.rank == 0:
            self._prune()  # after the new one is complete and logged: the log reads in the order things happened
        return final

    def _save_failed(self, step: int, tmp: Path, cause: Optional[BaseException]) -> CheckpointError:
        """The one-line error of a save that could not be written, with the remedy for its cause
        (:func:`hydratrain.dist.launch.unwritable_message`: no space, quota, read-only, permissions, file-size limit, or
        told from the dir when the error lost its errno, as torch's checkpoint writer's ``RuntimeError`` does); then
        rank 0 removes the partial ``tmp`` dir, which frees its space (the next start would remove it anyway)."""
        err = CheckpointError(unwritable_message(f"saving step {step}", self.root, cause, self.last_good(),
                                                 frees="lower checkpoint.keep_last" if self.keep_last != 1 else "",
                                                 run_dir=self.root.parent))
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        err.same_on_every_rank = True  # every rank raises it (DCP gathers the failures): rank 0 prints it
        err.own_failure = True  # ... as its own, whichever rank recorded it first (not "another rank failed first")
        return err

    def _prune(self) -> None:
        if not self.keep_last:
            return
        for _, path in list_checkpoints(self.root)[:-self.keep_last]:
            stop_if_launcher_gone(f"before pruning {path.name}")
            shutil.rmtree(path, ignore_errors=True)
            log.info("removed old checkpoint %s (checkpoint.keep_last=%d)", path, self.keep_last)

    # ------------------------------------------------------------------------------------------------- load
    def load(self, ckpt: Path) -> None:
        """Restore every component from ``ckpt`` (resharded by DCP to this strategy and world size); every rank
        calls. Logs every config value that differs from the one the checkpoint was saved with.

        Raises :class:`CheckpointError` when the checkpoint is unreadable, from a model of another shape, or a
        component refuses its state (e.g. the data order changed).
        """
        from hydratrain.checkpoint.io import check_model_shapes, load_dcp, verify  # (start-up: DCP, ~1 s)

        ckpt = Path(ckpt)
        md = verify(ckpt)
        stored = set(md.state_dict_metadata)
        saved_config = self._saved_config(ckpt)
        if saved_config is None:
            log.warning("%s has no readable config.yaml: the model architecture and the config it was saved with are "
                        "not checked against this run's (only tensor shapes are)", ckpt)
        if "model" in self.components:
            from torch.distributed.checkpoint._nested_dict import flatten_state_dict

            # the tensors by their flat DCP keys: a module's extra state may be a dict (of numbers, of tensors), which
            # DCP stores entry by entry
            flat = flatten_state_dict({"model": self.components["model"].state_dict()})[0]
            shapes = {k[len("model."):]: tuple(v.shape) for k, v in flat.items() if isinstance(v, torch.Tensor)}
            check_model_shapes(md, shapes, ckpt, saved_config, dict(self.config))
        check_architecture((saved_config or {}).get("model"), dict(self.config).get("model") or {}, str(ckpt))
        rank_key = f"rank{self.rank}"
        targets = {name: obj.state_dict() for name, obj in self.components.items()}
        targets[rank_key] = {name: obj.state_dict() for name, obj in self.rank_components.items()}
        targets["checkpoint"] = {"format_version": 0, "world_size": 0}
        format_1 = not _has(stored, "checkpoint.format_version")
        if format_1:
            targets = _as_format_1(targets, rank_key)
        loadable, changed = _load_template(targets, md.state_dict_metadata)
        load_dcp(loadable, ckpt)
        _restore_kinds(loadable, changed)
        if format_1:
            loadable = _from_format_1(loadable, rank_key, self.components)
        for name, obj in self.components.items():
            if name not in loadable:
                if obj.state_dict():
                    log.warning("%s holds no '%s' state: it starts fresh", ckpt, name)
                continue
            try:
                obj.load_state_dict(loadable[name])
            except CheckpointError as err:
                related = [d for d in config_diff(saved_config or {}, self.config) if saved_config is not None
                           and d.startswith((f"{name}.", "trainer.seed"))]
                also = f" (the config differs: {'; '.join(related)})" if related else ""
                raise CheckpointError(f"{ckpt}: {err}{also}") from None
        mine = loadable.get(rank_key, {})
        if not mine.get("rng"):
            log.warning("%s has no RNG state for rank %d: keeping this rank's seeded RNG", ckpt, self.rank)
        for name, obj in self.rank_components.items():
            if mine.get(name):
                obj.load_state_dict(mine[name])
        if self.root.resolve() == ckpt.parent.resolve():
            self.last_saved_step = step_of(ckpt)
        self.loaded_from = ckpt
        if saved_config is not None:
            diff = [d for d in config_diff(saved_config, self.config) if not d.startswith(_WHERE_A_LAUNCH_STARTS)]
            if diff:
                log.warning("resuming from %s with a config that differs from the one that saved it (the new values "
                            "apply; optimizer moments, step counts and data position come from the checkpoint):\n  %s",
                            ckpt, "\n  ".join(diff))
        saved_world = loadable.get("checkpoint", {}).get("world_size") or loadable.get("data", {}).get("world_size")
        step = step_of(ckpt) if step_of(ckpt) is not None else loadable.get("progress", {}).get("step", "?")
        log.info("resumed from %s: step %s (saved by %s ranks, now %d)", ckpt, step, saved_world or "?",
                 self.world_size)

    @staticmethod
    def _saved_config(ckpt: Path) -> Optional[dict]:
        from omegaconf import OmegaConf

        path = ckpt / "config.yaml"
        if not path.is_file():
            return None
        try:
            saved = OmegaConf.load(path)
        except Exception:  # a config file we cannot read is not a reason to refuse the checkpoint
            return None
        try:  # (a run's .hydra/config.yaml keeps its interpolations; a checkpoint's is resolved)
            return OmegaConf.to_container(saved, resolve=True)
        except Exception:  # noqa: BLE001 (one that no longer resolves: compared as written)
            return OmegaConf.to_container(saved)


def with_previous(err: DamagedCheckpointError, ckpt: Path) -> DamagedCheckpointError:
    """``err`` about ``ckpt`` (damaged), with how to resume from the complete checkpoint before it in its dir instead,
    when there is one."""
    earlier = [path for step, path in list_checkpoints(Path(ckpt).parent) if step < (step_of(ckpt) or 0)]
    if not earlier:
        return err
    return DamagedCheckpointError(f"{err}; to resume from the previous checkpoint instead: "
                                  f"checkpoint.auto_resume=false checkpoint.resume_from={earlier[-1]} (later ones are "
                                  "then set aside)")


def find_resume(ccfg, run_dir: Path, launch_dir: Path) -> Optional[Path]:
    """The checkpoint this run starts from, checked for completeness: the latest complete one in
    ``<run_dir>/checkpoints`` (auto-resume, when ``checkpoint.auto_resume``), else ``checkpoint.resume_from``
    (relative to ``launch_dir``), else None. A run dir's own checkpoint wins over ``resume_from`` so that a
    relaunch of a preempted run continues where it stopped (logged when both are there).

    Raises :class:`CheckpointError` when the chosen checkpoint is incomplete, truncated or unreadable; for the run
    dir's own latest checkpoint the message names the previous complete one and how to resume from it.
    """
    own = list_checkpoints(Path(run_dir) / "checkpoints") if ccfg.auto_resume else []
    if own:
        ckpt = own[-1][1]
        if ccfg.resume_from:
            log.warning("checkpoint.resume_from=%s not used: this run dir has its own checkpoint %s, which auto-resume "
                        "prefers (add checkpoint.auto_resume=false to start from resume_from instead)",
                        ccfg.resume_from, ckpt)
        from hydratrain.checkpoint.io import verify  # (start-up: DCP, ~1 s)

        try:
            verify(ckpt)
        except DamagedCheckpointError as err:
            raise with_previous(err, ckpt) from None
        return ckpt
    if ccfg.resume_from:
        from hydratrain.checkpoint.io import verify  # (start-up: DCP, ~1 s)

        ckpt = resolve_checkpoint(resolve_path(ccfg.resume_from, launch_dir))
        verify(ckpt)
        return ckpt
    return None


#: keys a relaunched sweep job may change and still continue its trial (run length, logging, checkpointing, where
#: and how it runs); any other overridden key that differs from its checkpoint's makes it another trial
TRIAL_NEUTRAL = ("checkpoint.", "logger.", "distributed.", "plan.", "launcher.", "paths.", "device",
                 "trainer.max_steps", "trainer.max_epochs", "trainer.log_every_n_steps", "trainer.eval_every_n_steps",
                 "trainer.progress_bar", "trainer.save_weights", "trainer.sample_tokens")


def other_trial(ckpt: Path, config: Mapping, overrides: Sequence[str]) -> list[str]:
    """``key: old -> new`` for each config leaf whose value in ``config`` (the job's config as a plain container)
    differs from the one ``ckpt`` was written with, leaving out :data:`TRIAL_NEUTRAL` keys: an override dropped
    since then counts as much as a changed one. A leaf that only one of the two configs has (a key another
    hydratrain version added) counts only under one of the job's command-line ``overrides`` (Hydra's
    ``hydra.overrides.task``; a group choice covers its whole subtree). Empty when ``ckpt`` has no readable
    ``config.yaml``."""
    saved = CheckpointManager._saved_config(ckpt)
    if saved is None:
        return []
    old, new = flat_keys(saved), flat_keys(config)
    named = {str(item).partition("=")[0].lstrip("+~") for item in overrides}
    out = []
    for k in sorted(set(old) | set(new)):
        if k.startswith(TRIAL_NEUTRAL) or old.get(k, "<absent>") == new.get(k, "<absent>"):
            continue
        if (k not in old or k not in new) and not any(k == n or k.startswith(n + ".") for n in named):
            continue
        out.append(f"{k}: {old.get(k, '<absent>')!r} -> {new.get(k, '<absent>')!r}")
    return out
