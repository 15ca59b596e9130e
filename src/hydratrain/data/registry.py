"""The built-in corpora (``data=<name>``), one entry each in :data:`CORPORA`, looked up by name (:func:`corpus`).

An entry says what the code that builds data would otherwise decide by the corpus's name: where its files come from
(:meth:`TextCorpus.files`), its tokenizer (:meth:`Corpus.tokenizer`), its train/val token arrays and their caches
(:meth:`Corpus.splits`), its checks before any process group (:meth:`Corpus.preflight`), the config key an error
names as its source (:meth:`Corpus.source`, :meth:`Corpus.split_source`), and two facts the other checks ask:
``byte_level`` (the tokens are the 256 byte values: :func:`is_byte_level`) and ``trains_bpe``. Adding a corpus is
adding one entry here, beside its option in :mod:`hydratrain.config.schema` and its ``conf/data/<name>.yaml``.

- ``synthetic``: a generated, learnable stream (:func:`hydratrain.data.corpora.synthetic_stream`).
- ``python_stdlib``, ``text_files``: the standard library's ``.py`` files or ``data.paths``' files, as bytes
  (:func:`hydratrain.data.corpora.build_corpus`).
- ``python_stdlib_bpe``, ``tokenized_text``: the same files tokenized with ``data.tokenizer`` or a BPE trained on
  their training split (:mod:`hydratrain.data.token_cache`).
- ``token_bin``: flat token-id files made by another pipeline (:mod:`hydratrain.data.token_bin`).
- ``hf_dataset``: a text column of files read with Hugging Face ``datasets`` (:mod:`hydratrain.data.hf_dataset`).

The splits are 1-D read-only memmaps (uint8 for the byte corpora, uint16/uint32 for the token ones; the synthetic
stream is an array) that each rank reads only the windows of its share from.
"""
from __future__ import annotations

import json
import logging
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Optional, Sequence, cast

import numpy as np

from hydratrain.config.schema import SCHEMAS
from hydratrain.data import hf_dataset
from hydratrain.data.corpora import build_corpus, expand_paths, split_files, stdlib_files, synthetic_stream
from hydratrain.data.token_bin import open_token_bin
from hydratrain.data.token_cache import build_token_cache, check_token_ids, trained_tokenizer, warn_replaced
from hydratrain.data.tokenizer import TextTokenizer, load_tokenizer
from hydratrain.errors import ConfigError
from hydratrain.paths import default_cache_dir

log = logging.getLogger(__name__)

BPE_VOCAB_SIZE = 4096  # tokens of the BPE trained when data.tokenizer and data.vocab_size are null

Splits = dict[str, np.ndarray]  # {"train", "val"}: 1-D token arrays


def bpe_vocab_size(data_cfg) -> int:
    """Tokens of the BPE trained when ``data.tokenizer`` is null: ``data.vocab_size``, or :data:`BPE_VOCAB_SIZE`
    when that is null too."""
    return BPE_VOCAB_SIZE if data_cfg.get("vocab_size") is None else data_cfg.vocab_size


def cache_root(data_cfg, launch_dir: Path, cache_dir: Optional[Path] = None) -> Path:
    """``cache_dir`` when given (the run's, :class:`hydratrain.paths.Paths`), else ``data.cache_dir`` (relative: to
    ``launch_dir``), else $HYDRATRAIN_CACHE or ~/.cache/hydratrain."""
    if cache_dir is not None:
        return Path(cache_dir)
    return launch_dir / Path(data_cfg.cache_dir).expanduser() if data_cfg.cache_dir else default_cache_dir()


class Corpus(ABC):
    """A built-in corpus. Its methods take the data node ``data_cfg`` (a DataConfig); relative paths in it resolve
    against ``launch_dir`` (the run passes ``paths.data_dir``); caches go under ``cache_dir``, else
    :func:`cache_root`'s. ``files``: the corpus's text files instead of its own (tests). The defaults are those of a
    corpus that has neither files nor a tokenizer of its own."""

    name = ""  # data.name
    prompt = "\n"  # what the end-of-run sample continues
    trains_bpe = False  # with data.tokenizer null, its tokenizer is a BPE of data.vocab_size trained on its text

    @property
    def byte_level(self) -> bool:
        """Its tokens are the 256 byte values: its option schema says so (``byte_level``)."""
        return bool(getattr(SCHEMAS["data"].get(self.name), "byte_level", False))

    def tokenizer(self, data_cfg, launch_dir: Path, progress: bool = False, files: Optional[Sequence[Path]] = None,
                  cache_dir: Optional[Path] = None) -> Optional[TextTokenizer]:
        """``data.tokenizer`` (a tokenizer.json, relative to ``launch_dir``) when set, else None (the tokens are the
        ids). Raises :class:`ConfigError` naming ``data.tokenizer``."""
        if getattr(data_cfg, "tokenizer", None):
            return load_tokenizer(launch_dir / Path(data_cfg.tokenizer).expanduser())
        return None

    def vocab_size_without_tokenizer(self, explicit: Optional[int]) -> int:
        """The model's vocab size when there is no tokenizer and the tokens are not bytes: ``explicit``
        (``model.vocab_size``), else 256 (the synthetic stream takes any size)."""
        return explicit if explicit is not None else 256

    @abstractmethod
    def splits(self, data_cfg, vocab_size: int, launch_dir: Path, progress: bool,
               files: Optional[Sequence[Path]] = None, cache_dir: Optional[Path] = None) -> Splits:
        """``{"train", "val"}`` token arrays for a model of ``vocab_size``. Builds missing caches: call on local
        rank 0 first, then barrier. Raises :class:`ConfigError` (a bad file or setting, an id not below
        ``vocab_size``)."""

    def preflight(self, data_cfg, launch_dir: Path) -> None:  # noqa: B027 (none by default: synthetic, python_stdlib)
        """Cheap checks of the settings before any process group (nothing is built). Raises :class:`ConfigError`."""

    def source(self, data_cfg) -> tuple[str, Any]:
        """``(key, value)``: the config key (and its value) that says where the data comes from, for errors."""
        return "data", self.name

    def split_source(self, data_cfg, launch_dir: Path, split: str) -> tuple[str, Any, str]:
        """``(key, value, where)`` for an error about ``split`` ("train" or "val"): :meth:`source`, and the text
        naming the split's files (empty, or starting with a space)."""
        return (*self.source(data_cfg), "")


def _tokenizer_within(corpus: Corpus, vocab_size: int, data_cfg, launch_dir: Path, progress: bool,
                      files: Optional[Sequence[Path]], cache_dir: Optional[Path]) -> TextTokenizer:
    """``corpus``'s tokenizer (one it always has: given or trained), checked to fit a model of ``vocab_size``. Raises
    :class:`ConfigError` naming ``model.vocab_size``."""
    tokenizer = cast(TextTokenizer, corpus.tokenizer(data_cfg, launch_dir, progress, files, cache_dir))
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError("model.vocab_size", vocab_size, f"smaller than the tokenizer's {tokenizer.vocab_size} "
                          f"tokens ({tokenizer.path}); allowed: >= {tokenizer.vocab_size}")
    return tokenizer


class Synthetic(Corpus):
    """A generated stream of ``data.synthetic_tokens``, its last ``data.val_fraction`` the val split."""

    name = "synthetic"

    def splits(self, data_cfg, vocab_size, launch_dir, progress, files=None, cache_dir=None) -> Splits:
        stream = synthetic_stream(data_cfg.synthetic_tokens, vocab_size)
        cut = int(len(stream) * (1 - data_cfg.val_fraction))
        return {"train": stream[:cut], "val": stream[cut:]}


class TokenBin(Corpus):
    """``data.train_path`` and ``data.val_path``: flat token-id files (``data.dtype``, an llm.c header skipped)."""

    name = "token_bin"

    def vocab_size_without_tokenizer(self, explicit):
        if explicit is None:
            raise ConfigError("model.vocab_size", None, "data=token_bin has no tokenizer to take it from: set "
                              "model.vocab_size above the largest token id (e.g. 50304 for GPT-2's) or data.tokenizer")
        return explicit

    def splits(self, data_cfg, vocab_size, launch_dir, progress, files=None, cache_dir=None) -> Splits:
        splits: Splits = {}
        for split in ("train", "val"):
            key = f"data.{split}_path"
            value = getattr(data_cfg, f"{split}_path")
            if not value:
                raise ConfigError(key, value, "data=token_bin needs a token file for each split")
            path = launch_dir / Path(value).expanduser()
            splits[split] = open_token_bin(path, data_cfg.dtype, key)
            check_token_ids(splits[split], vocab_size, key, path)
        log.info("data=token_bin: train %d tokens (%s), val %d tokens (%s), %s", len(splits["train"]),
                 data_cfg.train_path, len(splits["val"]), data_cfg.val_path, splits["train"].dtype.name)
        return splits

    def preflight(self, data_cfg, launch_dir):
        for split in ("train", "val"):
            value = getattr(data_cfg, f"{split}_path")
            if not value:
                raise ConfigError(f"data.{split}_path", value, "data=token_bin needs a token file for each split")
            open_token_bin(launch_dir / Path(value).expanduser(), data_cfg.dtype, f"data.{split}_path")
        if data_cfg.tokenizer:
            load_tokenizer(launch_dir / Path(data_cfg.tokenizer).expanduser())

    def source(self, data_cfg):
        return "data.train_path", data_cfg.get("train_path")

    def split_source(self, data_cfg, launch_dir, split):
        value = getattr(data_cfg, f"{split}_path")
        return f"data.{split}_path", value, f" from {launch_dir / Path(value).expanduser()}"


class HfDataset(Corpus):
    """``data.paths`` (and ``data.val_paths``) read with ``datasets``, ``data.text_field`` tokenized."""

    name = "hf_dataset"
    trains_bpe = True

    def tokenizer(self, data_cfg, launch_dir, progress=False, files=None, cache_dir=None):
        return hf_dataset.tokenizer_for(data_cfg, launch_dir, cache_root(data_cfg, launch_dir, cache_dir),
                                        bpe_vocab_size(data_cfg), progress)

    def splits(self, data_cfg, vocab_size, launch_dir, progress, files=None, cache_dir=None) -> Splits:
        tokenizer = _tokenizer_within(self, vocab_size, data_cfg, launch_dir, progress, files, cache_dir)
        return hf_dataset.load_token_splits(data_cfg, tokenizer, launch_dir,
                                            cache_root(data_cfg, launch_dir, cache_dir), progress)

    def preflight(self, data_cfg, launch_dir):
        hf_dataset.preflight(data_cfg, launch_dir)  # the tokenizer too (a dir holding tokenizer.json is allowed)

    def source(self, data_cfg):
        return "data.paths", list(data_cfg.get("paths") or [])

    def split_source(self, data_cfg, launch_dir, split):
        key, value = ("data.val_paths", list(data_cfg.val_paths)) if split == "val" and data_cfg.val_paths else \
            ("data.paths", list(data_cfg.paths))
        return key, value, f" of data.text_field={data_cfg.text_field}"


class TextCorpus(Corpus):
    """Text files, split into train/val by file (:func:`hydratrain.data.corpora.split_files`): where they come from
    (:class:`FromStdlib`, :class:`FromPaths`) and how they become tokens (:class:`Bytes`, :class:`Bpe`)."""

    @abstractmethod
    def files(self, data_cfg, launch_dir: Path) -> tuple[Path, list[Path]]:
        """``(root, sorted files)``: the root that the train/val split hashes names relative to."""

    @property
    def named(self) -> str:
        """How a message about the text names it: ``data=<name>``."""
        return f"data={self.name}"


class FromStdlib(TextCorpus):
    """The running interpreter's standard-library ``.py`` files."""

    prompt = "def "

    def files(self, data_cfg, launch_dir):
        return stdlib_files()


class FromPaths(TextCorpus):
    """The files of ``data.paths`` (globs; relative ones to ``launch_dir``; root: their common dir)."""

    @property
    def named(self) -> str:
        return "data.paths"

    def files(self, data_cfg, launch_dir):
        """Raises :class:`ConfigError` naming ``data.paths`` when a pattern matches nothing."""
        try:
            files = expand_paths(list(data_cfg.paths), launch_dir)
        except FileNotFoundError as err:
            raise ConfigError("data.paths", list(data_cfg.paths), str(err).split(": ", 1)[1]) from None
        return Path(os.path.commonpath([str(f.parent) for f in files])), files

    def preflight(self, data_cfg, launch_dir):
        self.files(data_cfg, launch_dir)
        super().preflight(data_cfg, launch_dir)

    def source(self, data_cfg):
        return "data.paths", list(data_cfg.get("paths") or [])

    def split_source(self, data_cfg, launch_dir, split, shown: int = 5):
        """Names the split's files (the first ``shown``; ``(empty)`` after a file of 0 bytes), or the share of the
        one file."""
        key, value = self.source(data_cfg)
        root, files = self.files(data_cfg, launch_dir)
        if len(files) == 1:
            share = 1 - data_cfg.val_fraction if split == "train" else data_cfg.val_fraction
            return key, value, f" from the {'first' if split == 'train' else 'last'} {share:.0%} of {files[0]}"
        part = split_files(files, root, data_cfg.val_fraction)[split]
        named = [f"{f}{' (empty)' if f.stat().st_size == 0 else ''}" for f in part[:shown]]
        more = f" and {len(part) - shown} more" if len(part) > shown else ""
        return key, value, f" from {', '.join(named)}{more}"


class Bytes(TextCorpus):
    """The files' bytes, concatenated per split into a uint8 cache (vocab 256; their schemas say byte_level)."""

    def splits(self, data_cfg, vocab_size, launch_dir, progress, files=None, cache_dir=None) -> Splits:
        root, all_files = self.files(data_cfg, launch_dir)
        out = build_corpus(list(files) if files is not None else all_files, root, data_cfg.val_fraction,
                           cache_root(data_cfg, launch_dir, cache_dir), progress)
        splits: Splits = {s: np.memmap(out / f"{s}.bin", dtype=np.uint8, mode="r") for s in ("train", "val")}
        meta = json.loads((out / "meta.json").read_text())["splits"]
        log.info("data=%s: %s (train %d files / %d tokens, val %d files / %d tokens)", self.name, out,
                 meta["train"]["files"], meta["train"]["tokens"], meta["val"]["files"], meta["val"]["tokens"])
        return splits


class Bpe(TextCorpus):
    """The files tokenized with ``data.tokenizer``, or with a byte-level BPE of ``data.vocab_size`` trained on their
    training split (cached; the first call trains it: call on local rank 0 first, then barrier)."""

    trains_bpe = True

    def tokenizer(self, data_cfg, launch_dir, progress=False, files=None, cache_dir=None):
        """Raises :class:`ConfigError` (``data.tokenizer``, ``data.paths``, ``data.vocab_size``)."""
        if getattr(data_cfg, "tokenizer", None):
            return super().tokenizer(data_cfg, launch_dir)
        if bpe_vocab_size(data_cfg) < 257:
            raise ConfigError("data.vocab_size", data_cfg.vocab_size, "a byte-level BPE needs >= 257 (256 bytes + "
                              "<|endoftext|>)")
        root, all_files = self.files(data_cfg, launch_dir)
        return trained_tokenizer(list(files) if files is not None else all_files, root, data_cfg.val_fraction,
                                 bpe_vocab_size(data_cfg), cache_root(data_cfg, launch_dir, cache_dir), progress)

    def splits(self, data_cfg, vocab_size, launch_dir, progress, files=None, cache_dir=None) -> Splits:
        tokenizer = _tokenizer_within(self, vocab_size, data_cfg, launch_dir, progress, files, cache_dir)
        root, all_files = self.files(data_cfg, launch_dir)
        out = build_token_cache(list(files) if files is not None else all_files, root, data_cfg.val_fraction,
                                tokenizer, cache_root(data_cfg, launch_dir, cache_dir), progress)
        meta = json.loads((out / "meta.json").read_text())
        splits: Splits = {s: open_token_bin(out / f"{s}.bin", meta["dtype"], f"{s} cache") for s in ("train", "val")}
        log.info("data=%s: %s (train %d files / %d tokens, val %d files / %d tokens, vocab %d)", self.name, out,
                 meta["splits"]["train"]["files"], meta["splits"]["train"]["tokens"], meta["splits"]["val"]["files"],
                 meta["splits"]["val"]["tokens"], tokenizer.vocab_size)
        warn_replaced(self.named, root, meta.get("replaced", {}))
        asked = bpe_vocab_size(data_cfg)
        if not getattr(data_cfg, "tokenizer", None) and tokenizer.vocab_size < asked:
            log.warning("data.vocab_size=%d: the BPE trained on the training split has %d tokens, not %d: its text "
                        "ran out of byte pairs to merge (more text, or a data.vocab_size <= %d, gives what is asked); "
                        "the model's vocab is %d (%s)", asked, tokenizer.vocab_size, asked, tokenizer.vocab_size,
                        vocab_size, tokenizer.path)
        return splits

    def preflight(self, data_cfg, launch_dir):
        if data_cfg.tokenizer:
            load_tokenizer(launch_dir / Path(data_cfg.tokenizer).expanduser())


class PythonStdlib(FromStdlib, Bytes):
    name = "python_stdlib"


class TextFiles(FromPaths, Bytes):
    name = "text_files"


class PythonStdlibBpe(FromStdlib, Bpe):
    name = "python_stdlib_bpe"


class TokenizedText(FromPaths, Bpe):
    name = "tokenized_text"


CORPORA: dict[str, Corpus] = {c.name: c for c in (Synthetic(), PythonStdlib(), TextFiles(), TokenBin(),
                                                   TokenizedText(), PythonStdlibBpe(), HfDataset())}


def corpus(name) -> Corpus:
    """The entry of the built-in corpus ``name`` (``data.name``: a str or a ``DataName``). Raises
    :class:`ConfigError` naming ``data`` when there is none."""
    found = CORPORA.get(str(name))
    if found is None:
        raise ConfigError("data", str(name), f"not a built-in corpus; allowed: {', '.join(CORPORA)}, or a dataset "
                          "node (_target_)")
    return found


def is_byte_level(name) -> bool:
    """Whether ``name`` (``data.name``, None for a dataset node) is a built-in corpus whose tokens are the 256 byte
    values."""
    found = CORPORA.get(str(name))
    return found is not None and found.byte_level
