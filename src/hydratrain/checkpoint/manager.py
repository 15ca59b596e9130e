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

``checkpoint.async_save``: :meth:`CheckpointManager.save` copies the state into host buffers (DCP's ``DefaultStager``,
pinned on CUDA, kept from one save to the next) and returns while ``torch.distributed.checkpoint.async_save`` writes
it in DCP's thread, on a gloo group of its own; :meth:`CheckpointManager.wait` (the next save, a preemption, the end)
completes it as above once every rank's write has finished, so a save in flight is never resumed from, pruned
against, or reported saved. At most one is in flight: the buffers it reads are the next save's.

Loading (:mod:`hydratrain.checkpoint.io`) reads DCP's ``.metadata`` with an allow-list unpickler and every other
pickled value with ``torch.load(weights_only=True)``; shard files are checked against the metadata's offsets first,
and the model's shapes against this run's model, so an unusable checkpoint stops the run with one line naming it.
"""
from __future__ import annotations

import logging
import os
import shutil
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from hydratrain.checkpoint.architecture import check_architecture
from hydratrain.checkpoint.layout import (  # noqa: F401 (their home was here; callers import them from here too)
    STEP_RE,
    TMP_PREFIX,
    find_resume,
    latest_checkpoint,
    list_checkpoints,
    other_trial,
    recover_unfinished_saves,
    resolve_checkpoint,
    saved_config,
    step_dir_name,
    step_of,
    with_previous,
)
from hydratrain.config import flat_keys
from hydratrain.dist.collectives import all_reduce_max, any_rank, barrier, rank_and_world
from hydratrain.dist.launch import stop_if_launcher_gone, unwritable_message
from hydratrain.errors import CheckpointError, DivergenceError, NonFiniteState, root_cause

log = logging.getLogger(__name__)

FORMAT_VERSION = 2


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
    kept: dict[str, Any]
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
_WHERE_A_LAUNCH_STARTS = ("launcher.", "checkpoint.resume_from:", "checkpoint.auto_resume:", "mode:")


def config_diff(saved: Mapping, now: Mapping) -> list[str]:
    """``key: old -> new`` for every leaf that differs between two config containers (keys in either)."""
    a, b = flat_keys(saved), flat_keys(now)
    return [f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}" for k in sorted(set(a) | set(b))
            if a.get(k, "<absent>") != b.get(k, "<absent>")]


@dataclass
class _InFlight:
    """A save written in the background: its step, dirs, DCP's future, start time, and the step saved before it."""

    step: int
    tmp: Path
    final: Path
    future: Future
    t0: float
    previous: Optional[int]


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
        async_save: stage each save in host memory and write it in the background (``checkpoint.async_save``).
    """

    def __init__(self, root: Path, components: dict[str, Any], rank_components: dict[str, Any],
                 config: Mapping, keep_last: int, device: torch.device, attachments: Optional[Mapping] = None,
                 async_save: bool = False):
        self.root, self.components, self.rank_components = Path(root), components, rank_components
        self.config, self.keep_last, self.device = config, keep_last, device
        self.attachments = dict(attachments or {})
        self.rank, self.world_size = rank_and_world()
        self.last_saved_step: Optional[int] = None
        self.loaded_from: Optional[Path] = None  # the checkpoint this run resumed from (it may be another run's)
        self.protected_steps: set[int] = set()  # kept whatever keep_last says (the best ones: checkpoint.monitor)
        self._in_flight: Optional[_InFlight] = None
        self._stager, self._group = None, None
        if async_save:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # (start-up: DCP, ~1 s)

            cuda = device.type == "cuda"  # pinned host buffers, kept from one save to the next; pinning needs CUDA
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=cuda))
            # the background write's collectives get their own group: on the training's group they would interleave
            # with the loop's (every rank calls new_group here, in the same order)
            self._group = dist.new_group(backend="gloo") if dist.is_initialized() else None
            if self._group is None:  # DCP's warning that one process saves alone (intended) comes from its thread,
                # where quiet_without_process_group's filter (held by the calling thread only while it runs) is gone
                warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                                        "uninitialized, assuming the intent is to save")
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
    def save(self, step: int) -> Optional[Path]:
        """Write a checkpoint for optimizer step ``step``; every rank calls. Returns the final dir, or None when it
        is written in the background (``checkpoint.async_save``: :meth:`wait` completes it and returns its dir).

        Written to ``.tmp-step_XXXXXXXX`` then renamed by rank 0 once all ranks have finished; older checkpoints
        beyond ``keep_last`` are deleted. Replaces a checkpoint of the same step, if any. Raises
        :class:`~hydratrain.errors.DivergenceError`, writing nothing, when any rank's state holds a non-finite value.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        from hydratrain.checkpoint.io import (  # (start-up: DCP, ~1 s)
            FiniteFirstPlanner,
            non_finite_keys,
            quiet_without_process_group,
        )

        self.wait()  # at most one save in flight (the trainer waits first itself, to report the one it completes)
        t0 = time.perf_counter()
        stop_if_launcher_gone(f"before saving step {step}")
        state = self._state()
        if self._stager is None:  # (async: FiniteFirstPlanner checks the staged copy in the background write)
            bad = non_finite_keys(state)
            if any_rank(bool(bad), self.device):
                raise self._diverged(step, bad)
        final = self.root / step_dir_name(step)
        tmp = self.root / (TMP_PREFIX + final.name)
        problem: Optional[BaseException] = None
        if self.rank == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                if tmp.exists():  # a save of this step that did not finish; its own error if it stays
                    shutil.rmtree(tmp)
                tmp.mkdir()
                # (the run config: a plain dict): why the ignore below
                (tmp / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(self.config)))  # type: ignore[call-overload]
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
                if self._stager is None:
                    dcp.save(state, storage_writer=FileSystemWriter(str(tmp)))
                else:  # stages (copies) the state here, then writes it in DCP's own background thread
                    future = dcp.async_save(state, storage_writer=FileSystemWriter(str(tmp)),
                                            planner=FiniteFirstPlanner(), async_stager=self._stager,
                                            process_group=self._group, no_dist=self._group is None)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # DCP's CheckpointException (a BaseException) holds each rank's error

            if isinstance(root_cause(err), KeyboardInterrupt):
                raise  # Ctrl-C (hydratrain.run)
            raise self._save_failed(step, tmp, root_cause(err)) from err
        if self._stager is not None:
            assert isinstance(future, Future)  # (staging is synchronous: DCP returns the write's future alone)
            self._in_flight = _InFlight(step, tmp, final, future, t0, self.last_saved_step)
            self.last_saved_step = step  # (not saved again by the trainer; complete only once wait() says so)
            log.info("staged checkpoint of step %d (%.2f s); writing it in the background", step,
                     time.perf_counter() - t0)
            return None
        barrier()  # every rank's shards are written and DCP's .metadata is in place
        return self._complete(step, tmp, final, t0)

    @property
    def in_flight(self) -> bool:
        """Whether a save (``checkpoint.async_save``) is being written in the background (the same on every rank)."""
        return self._in_flight is not None

    def wait(self) -> Optional[tuple[int, Path]]:
        """Wait for the save in flight, if any, and complete it: once every rank's background write has finished,
        rank 0 renames it to its ``step_XXXXXXXX`` and prunes, as :meth:`save` does for a synchronous one. Every
        rank calls. Returns ``(step, final dir)`` of the save it completed, else None. Raises
        :class:`~hydratrain.errors.CheckpointError` (and removes the partial dir) when any rank's write failed."""
        pending, self._in_flight = self._in_flight, None
        if pending is None:
            return None
        problem: Optional[BaseException] = None
        try:
            pending.future.result()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # DCP's CheckpointException (a BaseException) holds each rank's error
            problem = root_cause(err)
        # 0: written, 1: failed, 2: a non-finite state; the max over ranks is also the barrier after every write
        verdict = 2 if isinstance(problem, NonFiniteState) else int(problem is not None)
        verdict = int(all_reduce_max(torch.tensor([verdict], dtype=torch.int32, device=self.device)).item())
        if verdict:
            self.last_saved_step = pending.previous
            if verdict == 1:
                raise self._save_failed(pending.step, pending.tmp, problem)
            if self.rank == 0:
                shutil.rmtree(pending.tmp, ignore_errors=True)
            raise self._diverged(pending.step, problem.keys if isinstance(problem, NonFiniteState) else [])
        return pending.step, self._complete(pending.step, pending.tmp, pending.final, pending.t0)

    def wait_if_written(self) -> Optional[tuple[int, Path]]:
        """:meth:`wait` when every rank's background write has already finished (so it blocks for no write), else
        None. Every rank calls (one all-reduce while a save is in flight): where the ranks meet anyway, so that a
        written checkpoint counts for resume without waiting for the next save."""
        if self._in_flight is None or any_rank(not self._in_flight.future.done(), self.device):
            return None
        return self.wait()

    def _complete(self, step: int, tmp: Path, final: Path, t0: float) -> Path:
        """Rename ``tmp``, whose every shard and ``.metadata`` are written, to ``final``, then prune; every rank
        calls (after a barrier that follows the write)."""
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

    def _diverged(self, step: int, bad: list[str]) -> DivergenceError:
        """The error of a save refused for a non-finite state (``bad``: this rank's keys that hold one)."""
        return DivergenceError(f"not saving step {step}: the state holds non-finite values"
                               + (f" ({', '.join(bad[:3])} on rank {self.rank})" if bad else ""),
                               step, str(self.last_good()) if self.last_good() else None)

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

    def protect(self, steps: set[int], prune: bool = True) -> None:
        """Keep the checkpoints of ``steps`` whatever ``keep_last`` says (the best ones); a step no longer among them
        is pruned at once (rank 0), not at the next save, which may never come (the run's last evaluation can
        re-rank after its last save)."""
        dropped = self.protected_steps - set(steps)
        self.protected_steps = set(steps)
        if dropped and prune and self.rank == 0:
            self._prune()

    def _prune(self) -> None:
        if not self.keep_last:
            return
        for step, path in list_checkpoints(self.root)[:-self.keep_last]:
            if step in self.protected_steps:
                continue
            stop_if_launcher_gone(f"before pruning {path.name}")
            shutil.rmtree(path, ignore_errors=True)
            log.info("removed old checkpoint %s (checkpoint.keep_last=%d)", path, self.keep_last)

    # ------------------------------------------------------------------------------------------------- load
    def load(self, ckpt: Path, compare_config: bool = True, skip: tuple = ()) -> None:
        """Restore every component from ``ckpt`` (resharded by DCP to this strategy and world size) but those named
        in ``skip``, which are neither read nor asked for their state (an optimizer asked for one allocates it:
        ``mode=eval`` skips the training state); every rank calls. Logs every config value that differs from the one
        the checkpoint was saved with (``compare_config``: not when the weights are only evaluated, ``mode=eval``).

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
        components = {name: obj for name, obj in self.components.items() if name not in skip}
        targets = {name: obj.state_dict() for name, obj in components.items()}
        targets[rank_key] = {name: obj.state_dict() for name, obj in self.rank_components.items()}
        targets["checkpoint"] = {"format_version": 0, "world_size": 0}
        format_1 = not _has(stored, "checkpoint.format_version")
        if format_1:
            targets = _as_format_1(targets, rank_key)
        loadable, changed = _load_template(targets, md.state_dict_metadata)
        load_dcp(loadable, ckpt)
        _restore_kinds(loadable, changed)
        if format_1:
            loadable = _from_format_1(loadable, rank_key, components)
        for name, obj in components.items():
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
        if saved_config is not None and compare_config:
            diff = [d for d in config_diff(saved_config, self.config) if not d.startswith(_WHERE_A_LAUNCH_STARTS)]
            if diff:
                log.warning("resuming from %s with a config that differs from the one that saved it (the new values "
                            "apply; optimizer moments, step counts and data position come from the checkpoint):\n  %s",
                            ckpt, "\n  ".join(diff))
        saved_world = loadable.get("checkpoint", {}).get("world_size") or loadable.get("data", {}).get("world_size")
        step = step_of(ckpt) if step_of(ckpt) is not None else loadable.get("progress", {}).get("step", "?")
        log.info("resumed from %s: step %s (saved by %s ranks, now %d)", ckpt, step, saved_world or "?",
                 self.world_size)

    _saved_config = staticmethod(saved_config)
