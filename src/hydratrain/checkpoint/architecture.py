"""Whether saved weights were written by this run's model architecture (:func:`check_architecture`): a resume
(:mod:`.manager`) and ``model.init_from`` (:mod:`.io`) compare the saved model node with this run's. No torch
import."""
from __future__ import annotations

from typing import Mapping, Optional

from hydratrain import components
from hydratrain.errors import CheckpointError, ConfigError
from hydratrain.protocols import has_architecture

#: the model a saved model node without ``_target_`` describes (checkpoints written before models were components)
LEGACY_MODEL = "hydratrain.models.GPT"


def architecture_diff(saved_model: Optional[Mapping], model: Mapping) -> list[str]:
    """``model.KEY: old -> new`` for each difference between two model nodes (a checkpoint's or weights file's, and
    this run's) that changes what weights of the same shapes compute: another ``_target_``, or a key of the class's
    ``architecture(kwargs) -> {key: effective value}`` (hydratrain's GPT: ``ARCHITECTURE_KEYS``, with derived values
    such as the feed-forward width compared as built). None when ``saved_model`` is unknown; a class without
    ``architecture`` has no keys compared (the resume's config-difference warning lists them)."""
    if not saved_model:
        return []

    before, now = saved_model.get("_target_") or LEGACY_MODEL, model.get("_target_") or LEGACY_MODEL
    try:
        cls = components.locate(now, "model")
    except ConfigError:
        cls = None
    if _canonical_target(before) != _canonical_target(now):
        try:  # one class under two paths (a re-export, a moved module the old path still imports) is the same model
            same = cls is not None and components.locate(before, "model") is cls
        except ConfigError:
            same = False
        if not same:
            return [f"model._target_: {before!r} -> {now!r}"]
    if cls is None:
        return []
    if not has_architecture(cls):
        return []
    old, new = cls.architecture(dict(saved_model)), cls.architecture(dict(model))
    return [f"model.{k}: {old[k]!r} -> {new.get(k)!r}" for k in old if old[k] != new.get(k)]


def _canonical_target(target: str) -> str:
    """A target with the ``hydratrain.models.gpt`` spelling of the GPT made ``hydratrain.models``'."""
    return target.replace("hydratrain.models.gpt.GPT", "hydratrain.models.GPT")


def check_architecture(saved_model: Optional[Mapping], model: Mapping, where: str) -> None:
    """Raise :class:`CheckpointError` naming each :func:`architecture_diff` entry: weights ``where`` (a checkpoint
    or a weights file) were written by another architecture of the same shapes."""
    arch = architecture_diff(saved_model, model)
    if arch:
        raise CheckpointError(f"{where}: written by another model architecture ({'; '.join(arch)}): use its model "
                              "settings (weights of other shapes do not load; of the same shapes, they would load and "
                              "compute something else)")
