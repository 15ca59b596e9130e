"""The user's own datasets: a ``data`` node with ``_target_``, and batches from ``torch.utils.data.DataLoader``.

The target is a function (or class) that returns either ``{"train": Dataset, "val": Dataset}`` or one map-style
``Dataset`` that is split here by ``data.val_fraction`` (a fixed permutation, seed 0: the split does not depend on
``trainer.seed`` or the world size). A map-style dataset has ``__len__`` and ``__getitem__(index)``; its samples are
``(inputs, targets)`` pairs or dicts (``model(**batch)``), collated by ``data.collate_fn`` (a ``_target_`` node,
default PyTorch's ``default_collate``)::

    # my_conf/data/digits.yaml                   python train.py --config-dir my_conf data=digits loss=cross_entropy
    _target_: mypkg.data.digits       # -> {"train": ..., "val": ...}
    batch_size: 32
    num_workers: 2

The node's other keys are the function's keyword arguments; :data:`~hydratrain.config.schema.LOADER_KEYS` are
hydratrain's (the loader's), read through :class:`~hydratrain.config.settings.DataSettings`.
Samples are chosen in the main process from the global order of :class:`hydratrain.data.streams.ShardedBatches`
(a ``DistributedSampler`` permutation per epoch, independent of the world size) and handed to the DataLoader as its
batch sampler, so workers only load: the position saved in a checkpoint is exact, a resume repeats and skips
nothing, on any world size and batch size, and no worker holds a stale epoch. The eval set is the first
``trainer.eval_samples`` of a fixed order of the val split, each counted once at any world size
(:class:`~hydratrain.data.streams.EvalBatches`).
"""
from __future__ import annotations

import hashlib
import logging
import zlib
from typing import Any, Iterable, Iterator, Optional

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from hydratrain.components import build_callable, check_call, importable, instantiate_node, locate, target_of
from hydratrain.config.schema import LOADER_KEYS
from hydratrain.config.settings import DataSettings
from hydratrain.data.streams import EvalBatches, ShardedBatches
from hydratrain.dist.collectives import unlike_rank0
from hydratrain.errors import ConfigError
from hydratrain.train.batch import shapes

log = logging.getLogger(__name__)

def is_dataset_node(data: Any) -> bool:
    """Whether the ``data`` node builds the user's datasets (has ``_target_``) rather than naming a corpus."""
    return data is not None and OmegaConf.is_dict(data) and "_target_" in data


def _kwargs(data: DictConfig) -> dict:
    plain: Any = OmegaConf.to_container(data, resolve=True)
    return {k: v for k, v in plain.items() if k not in LOADER_KEYS and not k.startswith("_")}


def check_data_node(data: DictConfig) -> None:
    """The checks of a dataset node that need nothing built: its target imports and takes its keywords, the
    loader's keys have sensible values, ``collate_fn`` imports. Raises :class:`ConfigError` naming the key."""
    s = vars(DataSettings.of(data))
    if s["batch_size"] == "auto":
        raise ConfigError("data.batch_size", "auto", "needs the memory planner to run the model on a batch of the "
                          "data, which a dataset node gives only once built; allowed here: a positive integer")
    for key in ("batch_size", "num_workers", "prefetch_factor"):
        value = s[key]
        if value is None and key == "prefetch_factor":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if key == "num_workers" else 1):
            least = ">= 0" if key == "num_workers" else ">= 1"
            raise ConfigError(f"data.{key}", value, f"must be an integer {least}")
    if s["prefetch_factor"] is not None and s["num_workers"] == 0:
        raise ConfigError("data.prefetch_factor", s["prefetch_factor"], "needs data.num_workers > 0 (batches are "
                          "loaded in this process otherwise)")
    if not isinstance(s["val_fraction"], (int, float)) or not 0.0 < s["val_fraction"] < 1.0:
        raise ConfigError("data.val_fraction", s["val_fraction"], "must be in (0, 1)")
    for key in ("pin_memory", "persistent_workers"):
        if s[key] is not None and not isinstance(s[key], bool):
            raise ConfigError(f"data.{key}", s[key], "must be true or false" + (" (or null: on CUDA)"
                                                                                if key == "pin_memory" else ""))
    target = target_of(data, "data")
    check_call(locate(target, "data"), _kwargs(data), "data", target)
    if s["collate_fn"] is not None:
        build_callable(data.collate_fn, "data.collate_fn", supplied=1)


def load_datasets(data: DictConfig) -> dict:
    """``{"train": Dataset, "val": Dataset}`` from the dataset node (its target's result, or one dataset split by
    ``data.val_fraction``). Raises :class:`ConfigError` naming ``data._target_`` when the target raises or returns
    something else, or an empty val split."""
    target = target_of(data, "data")
    importable()
    # (to_container of a DictConfig: a dict with str keys)
    node = {"_target_": target, **{k: v for k, v in OmegaConf.to_container(data, resolve=True).items()  # type: ignore[union-attr]
                                   if k.startswith("_") and k != "_target_"}, **_kwargs(data)}  # type: ignore[union-attr,arg-type]
    made = instantiate_node(node, "data._target_", target, "raised")
    expected = ("return {'train': Dataset, 'val': Dataset} ('validation' as Hugging Face names it; a 'test' Dataset "
                "may be beside them) or one Dataset (split by data.val_fraction)")
    if isinstance(made, dict):  # datasets' DatasetDict too
        keys = [str(k) for k in made]
        val = [k for k in ("val", "validation") if made.get(k) is not None]
        if "train" not in made or [k for k in keys if k not in ("train", "val", "validation", "test")] or len(val) > 1:
            raise ConfigError("data._target_", target, f"returned a dict with keys {', '.join(keys)}; {expected}")
        test = {"test": _checked(made["test"], target, "test")} if made.get("test") is not None else {}
        if val:
            splits = {"train": _checked(made["train"], target, "train"), "val": _checked(made[val[0]], target, "val"),
                      **test}
            if len(splits["val"]) == 0:
                raise ConfigError("data._target_", target, f"returned an empty '{val[0]}' split: every eval (each "
                                  "trainer.eval_every_n_steps and the last step) runs on it; return at least one val "
                                  "sample, or {'train': Dataset} or one Dataset, which data.val_fraction splits")
            return splits
        if test:
            return {**split(_checked(made["train"], target, "train"), float(DataSettings.of(data).val_fraction)),
                    **test}
        made = made["train"]
    if isinstance(made, (tuple, list)) and made and all(_is_dataset(d) for d in made):
        raise ConfigError("data._target_", target, f"returned a {type(made).__name__} of {len(made)} datasets; "
                          f"{expected}")
    dataset = _checked(made, target, "dataset")
    return split(dataset, float(DataSettings.of(data).val_fraction))


def _is_dataset(value: Any) -> bool:
    """A map-style dataset object (``__len__`` and ``__getitem__``), not a sample (a tuple, tensor, dict, string)."""
    return hasattr(value, "__len__") and hasattr(value, "__getitem__") and \
        not isinstance(value, (tuple, list, dict, str, bytes, torch.Tensor))


def _checked(dataset: Any, target: str, what: str) -> Any:
    """``dataset`` when it is map-style (``__len__`` and ``__getitem__``, not a ``torch.utils.data.IterableDataset``,
    which inherits a ``__getitem__`` that raises). Raises :class:`ConfigError` naming ``data._target_`` and what to
    return instead."""
    from torch.utils.data import IterableDataset

    iterable = isinstance(dataset, IterableDataset)
    if iterable or not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        kind = " (an IterableDataset)" if iterable else ""
        raise ConfigError("data._target_", target, f"its {what} is a {type(dataset).__name__}{kind}, not a map-style "
                          "Dataset (__len__ and __getitem__(index)): samples are drawn by index, so that a resume is "
                          "exact on any world size; return a map-style Dataset (a list of samples, a "
                          "torch.utils.data.TensorDataset, a Dataset subclass), or for token streams use "
                          "data=token_bin or data=text_files")
    return dataset


def split(dataset: Any, val_fraction: float) -> dict:
    """``dataset`` split into train and val: the val split is ``ceil(val_fraction * len)`` samples (at least one) of a
    fixed permutation (seed 0), the train split the rest, each in dataset order (``torch.utils.data.Subset``)."""
    import math

    from torch.utils.data import Subset

    n = len(dataset)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    n_val = min(max(1, math.ceil(val_fraction * n)), n - 1) if n > 1 else 0
    return {"train": Subset(dataset, sorted(order[n_val:])), "val": Subset(dataset, sorted(order[:n_val]))}


def loader_fetch(dataset: Any, data: DictConfig, device, seed: int = 0) -> Any:
    """``fetch(index lists) -> batches`` (:data:`hydratrain.data.streams.Fetch`): a ``DataLoader`` over ``dataset``
    with the index lists as its batch sampler and the node's loader keys (``pin_memory`` null: on CUDA).

    Each batch is fetched under torch's, numpy's and python's RNGs seeded by (``seed``, its epoch, its first index)
    (:class:`_SeededBatches`), and the loader's own seed comes from a generator of ``seed``: the random numbers an
    augmentation draws in ``__getitem__`` depend on which batch it is, not on which process (main or worker) loads it
    or when the loader started, so a resume repeats them exactly; the training process's RNG (dropout) is left as it
    was.

    With ``persistent_workers`` (and ``num_workers > 0``), calls of one ``fetch`` reuse one loader and its workers (an
    eval every N steps starts none); a call made while another call's batches are still being handed out gets a
    loader of its own, whose workers end with it. A call abandoned midway is fine: torch drops what its workers had
    prefetched when the loader is iterated again."""
    from torch.utils.data import DataLoader


    s = DataSettings.of(data)
    collate = build_callable(s.collate_fn, "data.collate_fn", supplied=1) if s.collate_fn is not None else None
    pin = s.pin_memory if s.pin_memory is not None else device.type == "cuda"
    extra: dict[str, Any] = {"prefetch_factor": s.prefetch_factor} if s.prefetch_factor is not None else {}
    persistent = bool(s.persistent_workers) and s.num_workers > 0

    seeded = _SeededBatches(dataset, seed)
    kept: dict = {}  # the persistent loader ("loader", its sampler "lists") and whether a call iterates it ("busy")

    def loader_of(lists: "_Lists", keep: bool) -> DataLoader:
        # (seeded: a map-style dataset by duck typing, no torch Dataset subclass)
        return DataLoader(seeded, batch_sampler=lists, collate_fn=collate, num_workers=s.num_workers,  # type: ignore[arg-type]
                          pin_memory=pin, persistent_workers=keep, generator=torch.Generator().manual_seed(seed),
                          **extra)

    def reused(index_lists: Iterable[list]) -> Iterator[Any]:
        if kept.get("busy"):
            yield from _collated(iter(loader_of(_Lists(index_lists), False)), s.collate_fn is None, data)
            return
        if "loader" not in kept:
            kept["lists"] = _Lists(())
            kept["loader"] = loader_of(kept["lists"], True)
        kept["lists"].lists, kept["busy"] = index_lists, True
        try:
            yield from _collated(iter(kept["loader"]), s.collate_fn is None, data)
        finally:  # exhausted, or closed when the caller drops it
            kept["busy"] = False

    def fetch(index_lists: Iterable[list]) -> Iterator[Any]:
        if persistent:
            return reused(index_lists)  # (its loader is taken at the first batch asked for)
        return _collated(iter(loader_of(_Lists(index_lists), False)), s.collate_fn is None, data)

    return fetch


def _collated(batches: Iterator[Any], default_collate: bool, data: DictConfig) -> Iterator[Any]:
    """``batches``, where PyTorch's default collate failing on the samples (tensors of different sizes, types it
    does not know) is one config-error line naming ``data.collate_fn`` instead of a traceback from a loader, and so
    is a batch outside the batch contract (:mod:`hydratrain.train.batch`: a pair or a dict; a 3-tuple would train
    on its second item and drop the third, a bare tensor on its first two rows)."""
    from collections.abc import Mapping

    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (RuntimeError, TypeError) as err:
            if not default_collate or "collate" not in f"{err} {_frames(err)}":  # (a worker's error quotes its frames)
                raise
            lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()] or [type(err).__name__]
            why = lines[-1] if lines[0].startswith("Caught ") else lines[0]
            raise ConfigError("data.collate_fn", None, f"PyTorch's default collate cannot batch the samples ({why}): "
                              "give a function that pads or stacks them (data.collate_fn._target_=...)") from None
        if not isinstance(batch, Mapping) and not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            key = "data._target_" if default_collate else "data.collate_fn._target_"
            node = data.get("_target_") if default_collate else data.collate_fn.get("_target_")
            what = (f"hold {len(batch)} items {shapes(batch)}" if isinstance(batch, (tuple, list))
                    else f"are a {type(batch).__name__} {shapes(batch)}")
            raise ConfigError(key, node, f"its batches {what}, not (inputs, targets) pairs or dicts: "
                              "return (inputs, targets), or a dict whose keys are the forward's arguments with the "
                              "targets as 'labels' (TensorDataset(ids, mask, labels): a dataset of dicts)")
        yield batch


def _frames(err: BaseException) -> str:
    import traceback

    return " ".join(f.name for f in traceback.extract_tb(err.__traceback__))


class _SeededBatches:
    """``dataset`` read a batch at a time (``__getitems__``, which the DataLoader calls with a batch's keys: indices,
    or ``(epoch, index)`` pairs) under torch's CPU, numpy's and python's global RNGs seeded by (``seed``, the epoch,
    the batch's first index), each restored afterwards. A plain index counts as epoch -1 (eval, example batches)."""

    def __init__(self, dataset: Any, seed: int):
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: Any) -> Any:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list) -> list:
        import random


        pairs = [key if isinstance(key, tuple) else (-1, key) for key in keys]
        indices = [i for _, i in pairs]
        batch_seed = zlib.crc32(f"{self.seed}:{pairs[0][0]}:{indices[0]}".encode())
        py_state, np_state = random.getstate(), np.random.get_state()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(batch_seed)
            random.seed(batch_seed)
            np.random.seed(batch_seed)
            try:
                many = getattr(self.dataset, "__getitems__", None)
                return list(many(indices)) if callable(many) else [self.dataset[i] for i in indices]
            finally:
                random.setstate(py_state)
                np.random.set_state(np_state)


class _Lists:
    """An iterable of index lists as a DataLoader batch sampler (iterated once; a persistent loader's is given new
    ``lists`` before each iteration)."""

    def __init__(self, lists: Iterable[list]):
        self.lists = lists

    def __iter__(self) -> Iterator[list]:
        return iter(self.lists)


def dataset_fingerprint(splits: dict, samples: int = 4) -> str:
    """``train N samples, val M samples, <hash>``: the splits' lengths and a digest of the first and last
    ``samples`` samples of each (the bytes of their tensors, arrays and images; other values' repr without memory
    addresses). Tells two ranks' datasets apart. The samples are read as the batches are (:class:`_SeededBatches`):
    a random augmentation in ``__getitem__`` draws the same on every rank, and nothing from the global RNGs, which
    the model's initial weights come from next."""
    from torch.utils._pytree import tree_leaves

    digest = hashlib.blake2b(digest_size=8)
    for name in ("train", "val"):
        ds = _SeededBatches(splits[name], 0)
        n = len(ds)
        digest.update(f"{name}:{n}".encode())
        for i in sorted(set(list(range(min(samples, n))) + list(range(max(0, n - samples), n)))):
            for leaf in tree_leaves(ds[i]):
                digest.update(_leaf_bytes(leaf))
    return f"train {len(splits['train']):,} samples, val {len(splits['val']):,} samples, {digest.hexdigest()}"


def _leaf_bytes(leaf: Any) -> bytes:
    """What a sample's value is, as bytes: a tensor's, an array's or an image's (``PIL.Image``: its pixels) data,
    else its repr with any memory address (``<... at 0x7f...>``, which differs between processes) left out."""
    import re


    if isinstance(leaf, torch.Tensor):
        return leaf.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
    if hasattr(leaf, "__array_interface__") or hasattr(leaf, "__array__"):
        try:
            return np.asarray(leaf).tobytes()
        except (TypeError, ValueError):
            pass
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(leaf)).encode()


def build_dataset_batches(cfg: DictConfig, info, fetch_device: Optional[Any] = None):
    """This rank's train micro-batches, eval set and test set (every sample of the ``test`` split, or None when the
    target returns none) for a dataset node (every rank calls; the same datasets on every rank are checked by
    :func:`dataset_fingerprint`). Raises :class:`ConfigError`: the target's, a split smaller than the world size or
    a batch, ranks whose datasets differ."""
    data = cfg.data
    splits = load_datasets(data)
    if info.world_size > 1:
        unlike = unlike_rank0("", dataset_fingerprint(splits))
        if unlike is not None:
            other, every = unlike
            raise ConfigError("data._target_", data._target_, f"rank {other} built other datasets than rank 0 "
                              f"({every[other][1]}; rank 0: {every[0][1]}): every rank must load the same data")
    settings = DataSettings.of(data)
    batch_size = int(settings.batch_size)
    try:
        train = ShardedBatches(splits["train"], batch_size, info.rank, info.world_size, seed=cfg.trainer.seed,
                               device=info.device, strict_position=cfg.checkpoint.restore_data_position,
                               fetch=loader_fetch(splits["train"], data, info.device, cfg.trainer.seed))
    except ValueError as err:
        if len(splits["train"]) < info.world_size:  # fewer samples than ranks: the data's size, whatever the batch
            raise ConfigError("data._target_", data._target_, f"train split: {err}") from None
        raise ConfigError("data.batch_size", batch_size, f"train split ({len(splits['train'])} samples): {err}") \
            from None
    try:
        evals = EvalBatches(splits["val"], cfg.trainer.eval_samples, batch_size, info.rank, info.world_size,
                            device=info.device, fetch=loader_fetch(splits["val"], data, info.device,
                                                                   cfg.trainer.seed))
    except ValueError as err:
        raise ConfigError("data.val_fraction", settings.val_fraction,
                          f"val split: {err}") from None
    test = None
    if splits.get("test") is not None:
        try:
            test = EvalBatches(splits["test"], 0, batch_size, info.rank, info.world_size, device=info.device,
                               fetch=loader_fetch(splits["test"], data, info.device, cfg.trainer.seed))
        except ValueError as err:
            raise ConfigError("data._target_", data._target_, f"test split: {err}") from None
    log.info("data %s: train %d samples, val %d samples (eval on %d)%s, %d per micro-batch per rank, %d loader "
             "worker(s)", data._target_, len(splits["train"]), len(splits["val"]), evals.n_samples,
             f", test {len(splits['test'])} samples" if test is not None else "", batch_size, settings.num_workers)
    return train, evals, test
