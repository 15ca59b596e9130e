"""Where a run's checkpoints are on disk, read without torch: the ``step_XXXXXXXX`` dirs (:func:`list_checkpoints`,
:func:`latest_checkpoint`), what a killed save left (:func:`recover_unfinished_saves`), which checkpoint a run starts
from (:func:`find_resume`) and whether it belongs to another sweep trial (:func:`other_trial`). The run dir and the
start of a run ask these before torch is imported; :mod:`.manager` saves and loads."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Mapping, Optional, Sequence

from omegaconf import OmegaConf

from hydratrain.checkpoint import METADATA
from hydratrain.config import flat_keys
from hydratrain.errors import CheckpointError, DamagedCheckpointError
from hydratrain.paths import resolve_path

log = logging.getLogger("hydratrain.checkpoint.manager")  # (its records keep the name they had there)

STEP_RE = re.compile(r"^step_(\d{8})$")
TMP_PREFIX = ".tmp-"


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


def resolve_checkpoint(path: Path, prefer_best: bool = False) -> Path:
    """A checkpoint dir from ``path``: a ``step_*`` dir itself, or the latest complete one in a ``checkpoints`` dir
    or in a run dir's ``checkpoints/`` (``prefer_best``: a run dir's best one, by its ``best_checkpoints.json``,
    when it kept some: ``checkpoint.monitor``). Raises :class:`CheckpointError` when there is none."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint dir")
    record = path / "best_checkpoints.json"
    if prefer_best and record.is_file():
        try:
            best = json.loads(record.read_text())["best"][0]["step"]
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            best = None
        if best is not None and (path / "checkpoints" / step_dir_name(best) / METADATA).is_file():
            return path / "checkpoints" / step_dir_name(best)
    if (path / METADATA).is_file() or step_of(path) is not None:
        if not (path / METADATA).is_file():
            raise CheckpointError(f"{path / METADATA}: missing, so {path} is not a complete checkpoint")
        return path
    for root in (path, path / "checkpoints"):
        latest = latest_checkpoint(root)
        if latest is not None:
            return latest
    raise CheckpointError(f"{path}: holds no complete checkpoint (step_XXXXXXXX/{METADATA})")


def saved_config(ckpt: Path) -> Optional[dict]:
    """The config ``ckpt`` was saved with, as a plain container (resolved where it still resolves), or None."""
    path = ckpt / "config.yaml"
    if not path.is_file():
        return None
    try:
        saved = OmegaConf.load(path)
    except Exception:  # a config file we cannot read is not a reason to refuse the checkpoint
        return None
    try:  # (a run's .hydra/config.yaml keeps its interpolations; a checkpoint's is resolved)
        return OmegaConf.to_container(saved, resolve=True)  # type: ignore[return-value]  # (a config file's dict)
    except Exception:  # noqa: BLE001 (one that no longer resolves: compared as written)
        return OmegaConf.to_container(saved)  # type: ignore[return-value]  # (as above)


def with_previous(err: DamagedCheckpointError, ckpt: Path) -> DamagedCheckpointError:
    """``err`` about ``ckpt`` (damaged), with how to resume from the complete checkpoint before it in its dir instead,
    when there is one."""
    earlier = [path for step, path in list_checkpoints(Path(ckpt).parent) if step < (step_of(ckpt) or 0)]
    if not earlier:
        return err
    return DamagedCheckpointError(f"{err}; to resume from the previous checkpoint instead: "
                                  f"checkpoint.auto_resume=false checkpoint.resume_from={earlier[-1]} (later ones are "
                                  "then set aside)")


def find_resume(ccfg, run_dir: Path, launch_dir: Path, prefer_best: bool = False) -> Optional[Path]:
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

        ckpt = resolve_checkpoint(resolve_path(ccfg.resume_from, launch_dir), prefer_best)
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
    saved = saved_config(ckpt)
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
