"""Reading DCP checkpoints safely: allow-list unpickling of ``.metadata``, ``weights_only`` values, shard-file checks
with one-line errors; full model weights in one process; ``model.init_from`` from a safetensors file.

Used by :mod:`hydratrain.checkpoint.manager` (save/resume) and :mod:`hydratrain.checkpoint.export`. Nothing here
runs pickled code: DCP's ``.metadata`` is a plain pickle, read here by :class:`_MetadataUnpickler`, and every other
pickled value goes through ``torch.load(weights_only=True)`` (:class:`SafeLoadPlanner`; DCP's own planner uses
``weights_only=False``). Before a save: the check that a state holds no non-finite value (:func:`non_finite_keys`,
and :class:`FiniteFirstPlanner`, which makes it in an async save's background write).
"""
from __future__ import annotations

import contextlib
import io
import logging
import pickle
import warnings
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from hydratrain.checkpoint import METADATA
from hydratrain.checkpoint.architecture import check_architecture
from hydratrain.dist.collectives import rank_and_world, sampled_digest, unlike_rank0
from hydratrain.errors import CheckpointError, DamagedCheckpointError, NonFiniteState, root_cause

log = logging.getLogger(__name__)


@contextlib.contextmanager
def quiet_without_process_group() -> Iterator[None]:
    """Hide DCP's warning, given on every call without a process group (strategy=single, export): that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


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
        raise DamagedCheckpointError(f"{path}: missing, so {ckpt} is not a complete checkpoint") from None
    except Exception as err:  # truncated (EOFError), not a pickle, or a disallowed global
        raise DamagedCheckpointError(f"{path}: unreadable checkpoint metadata ({type(err).__name__}: {err})") from None
    if not isinstance(md, Metadata):
        raise DamagedCheckpointError(f"{path}: holds a {type(md).__name__}, not DCP checkpoint metadata")
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
            raise DamagedCheckpointError(f"{f}: missing shard file of checkpoint {ckpt}")
        if f.stat().st_size < size:
            raise DamagedCheckpointError(f"{f}: truncated ({f.stat().st_size} bytes, the checkpoint metadata needs "
                                  f"{size}); not loading {ckpt}")
    return md


class SafeReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is read by :func:`read_metadata` (allow-list unpickler)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = read_metadata(Path(self.path))
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id  # type: ignore[union-attr]  # (made just above when None)
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


def find_corrupt_entry(ckpt: Path) -> Optional[str]:
    """The first stored entry of ``ckpt`` that ``torch.load(weights_only=True)`` cannot read, as
    ``"<file>: bytes A..B (<key>)"``, or None when every entry reads. Reads the whole checkpoint: for diagnosis."""
    md = verify(ckpt)
    for index, info in sorted((md.storage_data or {}).items(), key=lambda kv: (kv[1].relative_path, kv[1].offset)):
        f = Path(ckpt) / info.relative_path
        try:
            with open(f, "rb") as fh:
                fh.seek(info.offset)
                torch.load(io.BytesIO(fh.read(info.length)), map_location="cpu", weights_only=True)
        except Exception as err:
            return (f"{f}: bytes {info.offset}..{info.offset + info.length} ({index.fqn}) are corrupt "
                    f"({type(err).__name__})")
    return None


def load_dcp(state: dict, ckpt: Path, alone: bool = False) -> None:
    """``dcp.load`` of ``state`` (filled in place) from ``ckpt`` with the safe reader and planner; every rank calls,
    unless ``alone``: one process reads by itself, without a collective even where a process group exists (rank 0
    exporting the best checkpoint while the other ranks go on: DCP's default would wait for them on the group).

    Raises :class:`CheckpointError` (one line naming the corrupt file, or ``ckpt``) when DCP fails on any rank.
    """
    try:
        with quiet_without_process_group():
            dcp.load(state, storage_reader=SafeReader(str(ckpt)), planner=SafeLoadPlanner(), no_dist=alone)
    except (CheckpointError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # DCP's CheckpointException derives from BaseException
        where = find_corrupt_entry(ckpt)
        if where:
            raise DamagedCheckpointError(where + f"; not loading {ckpt}") from err
        cause = root_cause(err)
        lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
        raise CheckpointError(f"{ckpt}: loading failed ({type(cause).__name__}: {lines[-1] if lines else ''})") \
            from err


def check_model_shapes(md: Metadata, model_shapes: dict[str, tuple], ckpt: Path, saved_config: Optional[dict],
                       config: Optional[dict]) -> None:
    """Raise :class:`CheckpointError` (one line) when the checkpoint's ``model.*`` tensors do not match
    ``model_shapes`` (``{name: full shape}``): missing or extra names, or other shapes; names the ``model.*`` config
    keys that differ between ``saved_config`` (the checkpoint's config.yaml) and ``config`` when both are given."""
    saved = {k[len("model."):]: tuple(v.size) for k, v in md.state_dict_metadata.items()
             if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    missing, extra = sorted(set(model_shapes) - set(saved)), sorted(set(saved) - set(model_shapes))
    wrong = [(k, saved[k], tuple(s)) for k, s in model_shapes.items() if k in saved and saved[k] != tuple(s)]
    if not (missing or extra or wrong):
        return
    if wrong:
        k, got, want = wrong[0]
        what = f"model.{k} has shape {got} in the checkpoint, this model has {want}"
    else:
        what = f"the checkpoint's model has other parameters (missing {missing[:3]}, unexpected {extra[:3]})"
    keys = ""
    if saved_config and config:
        diffs = [f"model.{k}: {saved_config['model'].get(k)!r} -> {config['model'].get(k)!r}"
                 for k in sorted(set(saved_config.get("model", {})) | set(config.get("model", {})))
                 if k not in ("name", "init_device", "init_from")
                 and saved_config["model"].get(k) != config["model"].get(k)]
        keys = f"; the model config differs: {', '.join(diffs)}" if diffs else ""
    raise CheckpointError(f"{ckpt}: {what}{keys}; load it with the model config it was saved with")


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
    load_dcp(state, ckpt, alone=True)
    return state["model"]


def read_all(ckpt: Path) -> dict[str, Any]:
    """Every entry of checkpoint ``ckpt`` by flat DCP key (tensors full size), in one process. For tests/tools."""
    md = verify(ckpt)
    flat: dict[str, Any] = {}
    for k, v in md.state_dict_metadata.items():
        flat[k] = torch.empty(v.size, dtype=v.properties.dtype) if isinstance(v, TensorStorageMetadata) else None
    load_dcp(flat, ckpt, alone=True)
    return flat


# ------------------------------------------------------------------------------------------ full-weight files
def file_fingerprint(path: Path, windows: int = 64, window_bytes: int = 1 << 16) -> str:
    """``<size> bytes, <hash>`` of the file ``path``: its size and :func:`~hydratrain.dist.collectives.sampled_digest`
    of ``windows + 1`` windows of ``window_bytes`` (the first, with a safetensors header, and the last included):
    tells two copies of a weights file apart after reading about 4 MiB, whatever its size. Raises OSError."""
    with open(path, "rb") as fh:
        size = fh.seek(0, 2)

        def read(start: int, n: int) -> bytes:
            fh.seek(start)
            return fh.read(n)

        return f"{size:,} bytes, {sampled_digest(read, size, window_bytes, windows)}"


def _same_file_on_every_rank(path: Path) -> None:
    """Every rank reads the same weights at ``path`` (a node-local copy may differ: it was refused only after the
    load, as "loaded shards differ from the file" naming no rank). Raises the same CheckpointError on every rank,
    naming rank 0's file and the first rank whose copy differs."""
    unlike = unlike_rank0(str(path), file_fingerprint(path))
    if unlike is not None:
        other, every = unlike
        err = CheckpointError(f"model.init_from={every[0][0]}: rank {other}'s file ({every[other][0]}: "
                              f"{every[other][1]}) is not rank 0's ({every[0][1]}): every rank, on every node, must "
                              "start from the same weights (a node-local copy that differs, or another path)")
        err.same_on_every_rank = True  # each node's first rank says it
        raise err


def check_same_resume(resume: Optional[Path]) -> None:
    """Every rank resumes from the same checkpoint, or none does, compared by the fingerprint of its DCP
    ``.metadata`` (:func:`file_fingerprint`; the file holds the save's own id, DCP's ``StorageMeta.save_id``), not
    by its step or path: nodes may mount the run dir at other paths, and another checkpoint of the same step (a
    node-local copy, another run's dir) had each rank load its own shards, optimizer state and data position, a
    spliced model trained without a word. Raises the same CheckpointError on every rank, naming rank 0's
    checkpoint and the first rank's that differs. Without a process group (one rank) it checks nothing."""
    if rank_and_world()[1] == 1:
        return
    mine = ("none", "")
    if resume is not None:
        try:
            mine = (str(resume), file_fingerprint(Path(resume) / METADATA))
        except OSError as err:
            mine = (str(resume), f"unreadable ({err.strerror})")
    unlike = unlike_rank0(*mine)
    if unlike is not None:
        other, every = unlike
        differ = CheckpointError(f"ranks found different checkpoints to resume from (rank 0: {every[0][0]}; rank "
                                 f"{other}: {every[other][0]}): every rank, on every node, must resume from the same "
                                 "checkpoint; is the run dir on a filesystem every node shares?")
        differ.same_on_every_rank = True
        raise differ


def init_from_file(model: torch.nn.Module, path: Path, model_config: Optional[dict] = None) -> int:
    """Load full weights from the safetensors file ``path`` into ``model`` (single, DDP or FSDP2; every rank calls),
    then check every rank's local shard against the matching slice of the file.

    With a process group, rank 0 reads the file and ``set_model_state_dict(full_state_dict=True,
    broadcast_from_rank0=True)`` scatters it; the check then reads, on each rank, only the slices that rank holds.
    Returns the number of tensors checked. Raises :class:`CheckpointError` naming ``model.init_from`` when keys or
    shapes differ from the model, a shard does not match the file, or the file's ``model_config`` (written by
    hydratrain) differs from ``model_config`` in a key that changes what the weights compute (e.g. ``n_head``).
    """
    from safetensors import safe_open
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from torch.distributed.tensor import DTensor

    rank, world = rank_and_world()
    where = f"model.init_from={path}"
    live: dict[str, Any] = get_model_state_dict(model)  # (tensors only, from below)
    # a module's extra state that is no tensor (get_extra_state() -> dict) is not in a safetensors file: the model
    # keeps its own (rank 0's, on every rank)
    own = {k: v for k, v in live.items() if not isinstance(v, torch.Tensor)}
    live = {k: v for k, v in live.items() if isinstance(v, torch.Tensor)}
    try:
        with safe_open(str(path), "pt", device="cpu") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
            saved = (f.metadata() or {}).get("model_config")
    except Exception as err:
        raise CheckpointError(f"{where}: unreadable safetensors file ({type(err).__name__}: {err})") from None
    if saved and model_config:
        import json

        try:
            saved_model = json.loads(saved)
        except ValueError:
            saved_model = None
        check_architecture(saved_model, model_config, where)
    missing, unexpected = sorted(set(live) - set(shapes)), sorted(set(shapes) - set(live))
    if missing or unexpected:
        compiled = unexpected and all(k.replace("_orig_mod.", "") in live for k in unexpected)
        raise CheckpointError(f"{where}: keys differ from the model's (missing {missing[:5]}, unexpected "
                              f"{unexpected[:5]}); " + ("the file's keys carry torch.compile's '_orig_mod.': save "
                                                        "the compiled module's _orig_mod.state_dict(), or the keys "
                                                        "without it" if compiled else "check the model config"))
    wrong = [(k, shapes[k], tuple(v.shape)) for k, v in live.items() if shapes[k] != tuple(v.shape)]
    if wrong:
        k, got, want = wrong[0]
        raise CheckpointError(f"{where}: {k} has shape {got} in the file, the model needs {want}; check the model "
                              "config")
    broadcast = dist.is_available() and dist.is_initialized() and world > 1
    if broadcast:
        _same_file_on_every_rank(path)
    # (DCP would hand a missing extra state to set_extra_state as a placeholder object of its own, strict or not)
    full = {**load_file(str(path)), **own} if (rank == 0 or not broadcast) else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast,
                                                               strict=True))
    del full
    bad = []
    with safe_open(str(path), "pt", device="cpu") as f:
        for k, v in get_model_state_dict(model).items():
            if k in own:
                continue
            if isinstance(v, DTensor):
                from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

                local = v.to_local()
                shape, offset = compute_local_shape_and_global_offset(v.shape, v.device_mesh, v.placements)
                ref = f.get_slice(k)[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
            else:
                local, ref = v, f.get_tensor(k)  # type: ignore[assignment]  # (a model's state: tensors)
            if tuple(ref.shape) != tuple(local.shape) or not torch.equal(local.detach().cpu(), ref.to(local.dtype)):
                bad.append(k)
    n_bad = torch.tensor([len(bad)], device=next(iter(live.values())).device if live else "cpu")
    if broadcast:
        dist.all_reduce(n_bad)
    if n_bad.item():
        raise CheckpointError(f"{where}: {int(n_bad.item())} loaded shards differ from the file"
                              + (f" ({len(bad)} on this rank, {rank}: {bad[:3]})" if bad else ""))
    log.info("initialised the model from %s: %d tensors, every rank's shard checked against the file", path,
             len(live))
    return len(live)


def non_finite_keys(state: dict) -> list[str]:
    """Names of floating tensors (local shards) in ``state`` that hold a NaN or an inf."""
    bad = []
    for key, v in flatten_state_dict(state)[0].items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            local = v.to_local() if hasattr(v, "to_local") else v
            if local.numel() and not all_finite(local):
                bad.append(key)
    return bad


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is finite. A NaN or an inf makes the sum non-finite, so a finite sum (accumulated
    in float32 at least: fp16 values would overflow) answers in one pass; only a non-finite sum, which finite values
    may also give by overflowing, is checked value by value. (torch.isfinite(t).all() allocates a mask: 9.6 s for
    1 GiB of float32 on the build machine against 0.16 s for the sum; it was most of a save's time.)"""
    total = t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32)
    return bool(torch.isfinite(total)) or bool(torch.isfinite(t).all())


class FiniteFirstPlanner(DefaultSavePlanner):
    """DCP's default save planner, refusing a state with a non-finite value before it plans anything: an async save
    checks its staged copy in the background write (reading the state costs as much as copying it, and the loop
    would wait for it); DCP gathers the refusal, so every rank's write fails with it."""

    def set_up_planner(self, state_dict: dict, storage_meta: Optional[StorageMeta] = None,
                       is_coordinator: bool = False) -> None:
        bad = non_finite_keys(state_dict)
        if bad:
            raise NonFiniteState(bad)
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
