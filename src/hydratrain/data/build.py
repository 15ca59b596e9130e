"""The run's data: the token splits of ``cfg.data`` (any built-in corpus), this rank's train micro-batches and
the eval set, with the checks that every rank read the same data and that each split is long enough.
"""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from hydratrain.config.settings import DataSettings
from hydratrain.data.loader import build_dataset_batches, is_dataset_node
from hydratrain.data.registry import corpus
from hydratrain.data.streams import EvalBatches, ShardedBatches, TokenDataset
from hydratrain.data.tokenized import tokenizer_for, vocab_size_for
from hydratrain.dist.collectives import barrier, sampled_digest, unlike_rank0
from hydratrain.errors import ConfigError

log = logging.getLogger(__name__)

def load_splits(data_cfg, vocab_size: int, launch_dir: Path, progress: bool,
                files: Optional[Sequence[Path]] = None, cache_dir: Optional[Path] = None) -> dict[str, np.ndarray]:
    """Token arrays ``{"train", "val"}`` (1-D; read-only memmaps: uint8 for the byte corpora, uint16/uint32 for
    token_bin, tokenized_text, python_stdlib_bpe and hf_dataset) of the built-in corpus ``data_cfg`` (a DataConfig)
    names, from its entry in :mod:`hydratrain.data.registry`. ``files``: python_stdlib(_bpe)'s files instead of the
    whole stdlib (tests). Relative data paths resolve against ``launch_dir`` (the run passes ``paths.data_dir``);
    caches go to ``cache_dir`` (the run passes ``data.cache_dir`` or ``paths.cache_dir``, see
    :class:`hydratrain.paths.Paths`), by default :func:`hydratrain.data.registry.cache_root`'s.

    Builds the cache when it is missing: call it on local rank 0 first, then barrier, then on the other ranks.
    Raises ConfigError: a ``data.paths`` pattern that matches no file, an id not below ``vocab_size``, a bad file
    or setting.
    """
    return corpus(data_cfg.name).splits(data_cfg, vocab_size, launch_dir, progress, files, cache_dir)


def data_vocabulary(cfg, info, launch_dir: Path, progress: bool, cache_dir: Optional[Path] = None):
    """(the data's tokenizer or None, the model's vocab size): ``model.vocab_size`` when set, else the data's (256
    for bytes, the tokenizer's size padded to a multiple of 64). Local rank 0 trains a missing BPE first while the
    node's other ranks wait. Raises :class:`~hydratrain.errors.ConfigError` (see
    :func:`hydratrain.data.tokenized.vocab_size_for`). A dataset node (:mod:`hydratrain.data.loader`) has no
    vocabulary of its own: (None, ``model.vocab_size`` or None)."""
    if is_dataset_node(cfg.data):
        if "vocab_size" in cfg.model and cfg.model.vocab_size is None and not cfg.model.get("pretrained") and \
                info.is_main:  # (a pretrained dir's config fixes the vocabulary)
            log.warning("model.vocab_size=null takes the data's vocabulary, but data=%s (a dataset node) has none: the "
                        "model keeps its own default; set model.vocab_size to the ids your data holds",
                        cfg.data._target_)
        return None, cfg.model.get("vocab_size")
    tokenizer = tokenizer_for(cfg.data, launch_dir, progress and info.is_main, cache_dir=cache_dir) \
        if info.local_rank == 0 else None
    barrier()
    if info.local_rank != 0:
        tokenizer = tokenizer_for(cfg.data, launch_dir, cache_dir=cache_dir)
    return tokenizer, vocab_size_for(cfg.data, tokenizer, cfg.model.get("vocab_size"))


def build_data(cfg, info, launch_dir: Path, progress: bool, vocab_size: int,
               cache_dir: Optional[Path] = None, with_test: bool = False) -> tuple:
    """This rank's train micro-batches and eval set for the run config ``cfg`` and the model's ``vocab_size``.

    Local rank 0 builds missing caches first while the node's other ranks wait at a barrier. ``info`` is the
    :class:`~hydratrain.dist.env.DistInfo` (with its device). Raises :class:`~hydratrain.errors.ConfigError` when a
    split is too small for ``data.seq_len`` x ``data.batch_size`` x world size (naming its files, see
    :func:`split_error`), or holds an id >= ``vocab_size``. A dataset node: :func:`hydratrain.data.loader.
    build_dataset_batches`. ``with_test``: also the test set (every sample of a dataset node's ``test`` split, or
    None), third.
    """
    if is_dataset_node(cfg.data):
        made = build_dataset_batches(cfg, info)
        return made if with_test else made[:2]
    kwargs = dict(data_cfg=cfg.data, vocab_size=vocab_size, launch_dir=launch_dir,
                  progress=progress and info.is_main, cache_dir=cache_dir)
    splits = load_splits(**kwargs) if info.local_rank == 0 else None
    barrier()
    if splits is None:
        splits = load_splits(**kwargs)
    if info.world_size > 1:
        check_same_data(cfg.data, splits)
    batch_size = int(DataSettings.of(cfg.data).batch_size)
    try:
        train = ShardedBatches(TokenDataset(splits["train"], cfg.data.seq_len, vocab_size, "the train split"),
                               batch_size, info.rank,
                               info.world_size, seed=cfg.trainer.seed, device=info.device,
                               strict_position=cfg.checkpoint.restore_data_position)
    except ValueError as err:
        raise split_error(cfg.data, launch_dir, "train", len(splits["train"]), err) from None
    try:
        evals = EvalBatches(TokenDataset(splits["val"], cfg.data.seq_len, vocab_size, "the val split"),
                            cfg.trainer.eval_samples,
                            batch_size, info.rank, info.world_size, device=info.device)
    except ValueError as err:
        raise split_error(cfg.data, launch_dir, "val", len(splits["val"]), err) from None
    return (train, evals, None) if with_test else (train, evals)  # (the token corpora have no test split)


def data_fingerprint(splits: dict, windows: int = 64, window_tokens: int = 4096) -> str:
    """``train N tokens, val M tokens, <hash>`` of the token splits ``{"train", "val"}`` (1-D arrays): their lengths
    and dtypes and :func:`~hydratrain.dist.collectives.sampled_digest` of ``windows + 1`` windows of
    ``window_tokens`` tokens of each (the first and last included). Tells two copies of a corpus apart in
    milliseconds whatever its size (a sample, not a proof of identity)."""
    digest = hashlib.blake2b(digest_size=8)
    for name in ("train", "val"):
        tokens = splits[name]
        digest.update(f"{name}:{len(tokens)}:{tokens.dtype}".encode())
        sampled_digest(lambda start, n, tokens=tokens: np.ascontiguousarray(  # type: ignore[misc]  # (binds this split)
            tokens[start:start + n]).tobytes(),
                       len(tokens), window_tokens, windows, digest)
    return f"train {len(splits['train']):,} tokens, val {len(splits['val']):,} tokens, {digest.hexdigest()}"


def check_same_data(data_cfg, splits: dict) -> None:
    """Every rank of the process group read the same data (:func:`data_fingerprint`, compared over ranks): the data
    paths may differ per node (node-local copies), and a copy that differs (stale, partial, another Python's
    stdlib for ``data=python_stdlib``) had each node train on its own corpus without a word, and hang at an eval of
    another length. Raises :class:`~hydratrain.errors.ConfigError` on every rank, naming the data key, the first
    rank whose data differs from rank 0's and both fingerprints."""
    unlike = unlike_rank0("", data_fingerprint(splits))
    if unlike is None:
        return
    other, every = unlike
    key, value = corpus(data_cfg.name).source(data_cfg)
    raise ConfigError(key, value, f"rank {other} read other data than rank 0 ({every[other][1]}; rank 0: "
                      f"{every[0][1]}): every rank, on every node, must read the same data (a node-local copy that "
                      "differs, a stale cache, another Python's standard library)")


def split_error(data_cfg, launch_dir: Path, split: str, tokens: int, err: Exception):
    """The :class:`~hydratrain.errors.ConfigError` for ``split`` ("train" or "val", ``tokens`` long) being too short
    (``err``), naming where its tokens come from (the corpus's :meth:`~hydratrain.data.registry.Corpus.
    split_source`): ``data.train_path`` / ``data.val_path`` and the file for token_bin; ``data.paths`` and the
    split's files (the first five; ``(empty)`` after a file of 0 bytes) for text_files and tokenized_text;
    ``data.paths`` or ``data.val_paths`` and the text field for hf_dataset; ``data`` and its name for the others."""
    key, value, source = corpus(data_cfg.name).split_source(data_cfg, launch_dir, split)
    return ConfigError(key, value, f"{split} split ({tokens} tokens){source}: {err}")
