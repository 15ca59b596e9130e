"""``data=hf_dataset``: local JSON(-lines), CSV, Parquet or text files read with Hugging Face ``datasets``, one text
column tokenized once and fed to the token-stream path (extra ``[hf]``)::

    python train.py data=hf_dataset 'data.paths=[corpus/*.jsonl]' data.text_field=text
    python train.py model=hf_causal_lm model.pretrained=/models/tiny data=hf_dataset 'data.paths=[a.parquet]'

``datasets.load_dataset(format, data_files=...)`` reads ``data.paths`` (and ``data.val_paths``, the val split's
files, when given; else ``data.val_fraction`` of the records, a fixed shuffle with seed 0), keeping its Arrow cache
under hydratrain's cache dir. Each record's ``data.text_field`` is tokenized with the run's tokenizer
(``data.tokenizer``: a tokenizer.json or a dir holding one, by default ``model.pretrained``'s; null: a byte-level BPE of
``data.vocab_size`` trained on the train split) and the tokens of a split are written as one stream, the tokenizer's
separator after each record, into ``<cache>/hfds-<key>/{train,val}.bin`` (:mod:`hydratrain.data.cache`: built once
under a lock, written atomically, checked on every use). The key holds the files' names, sizes and mtimes, the
format, text field, split settings and the tokenizer's hash, so a change to any of them builds a new cache. The
splits then go through :class:`~hydratrain.data.streams.TokenDataset` windows like every token corpus, with the same
exact, world-size-independent resume.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Iterator, Optional, cast

import numpy as np

from hydratrain.data.cache import build_lock, verified_cache, write_manifest
from hydratrain.data.corpora import expand_paths, relative_name
from hydratrain.data.token_bin import open_token_bin
from hydratrain.data.tokenizer import TextTokenizer, load_tokenizer, train_bpe
from hydratrain.errors import ConfigError

log = logging.getLogger(__name__)

#: file extensions -> the ``datasets`` packaged builder that reads them (``data.format`` when null)
FORMATS = {".json": "json", ".jsonl": "json", ".ndjson": "json", ".csv": "csv", ".tsv": "csv", ".parquet": "parquet",
           ".txt": "text", ".text": "text", ".md": "text"}
BATCH_RECORDS = 1000  # records handed to one encode_batch call
FORMAT_VERSION = 1  # part of every cache key: bump when the cached layout changes


def _datasets():
    try:
        import datasets
    except ImportError:
        raise ConfigError("data", "hf_dataset", "needs datasets, which is not installed: pip install -e '.[hf]'") \
            from None
    return datasets


def split_files(data_cfg, launch_dir: Path) -> dict[str, list[Path]]:
    """``{"train": files[, "val": files]}`` of ``data.paths`` (and ``data.val_paths``), relative to ``launch_dir``.
    Raises :class:`ConfigError` naming the key whose pattern matches no file."""
    out = {}
    for split, key in (("train", "paths"), ("val", "val_paths")):
        patterns = data_cfg.get(key)
        if split == "val" and not patterns:
            continue
        try:
            out[split] = expand_paths(list(patterns), launch_dir)
        except FileNotFoundError as err:
            raise ConfigError(f"data.{key}", list(patterns), str(err).split(": ", 1)[1]) from None
    return out


def builder(data_cfg, files: list[Path]) -> str:
    """The ``datasets`` builder for ``files``: ``data.format``, else the one their extensions name. Raises
    :class:`ConfigError` naming ``data.format`` (unknown, or files of several formats without it)."""
    if data_cfg.get("format"):
        if data_cfg.format not in set(FORMATS.values()):
            raise ConfigError("data.format", data_cfg.format, f"allowed: {', '.join(sorted(set(FORMATS.values())))}")
        return str(data_cfg.format)
    kinds = {FORMATS.get(f.suffix.lower()) for f in files}
    if None in kinds or len(kinds) != 1:
        raise ConfigError("data.format", None, f"cannot tell from the files' extensions "
                          f"({', '.join(sorted({f.suffix or '(none)' for f in files}))}); set data.format: "
                          f"{', '.join(sorted(set(FORMATS.values())))}")
    return cast(str, kinds.pop())  # (None is not among them)


def _listing(files: dict[str, list[Path]]) -> list:
    root = Path(os.path.commonpath([str(f.parent) for fs in files.values() for f in fs]))
    return [(split, relative_name(f, root), f.stat().st_size, f.stat().st_mtime_ns)
            for split, fs in files.items() for f in fs]


def _key(*parts) -> str:
    return hashlib.sha256(json.dumps([FORMAT_VERSION, *parts], default=str).encode()).hexdigest()[:16]


def _check_field(columns: list[str], data_cfg, where: str) -> None:
    if data_cfg.text_field not in columns:
        raise ConfigError("data.text_field", data_cfg.text_field, f"not a column of {where} (its columns: "
                          f"{', '.join(map(str, columns)) or 'none'})")


def preflight(data_cfg, launch_dir: Path) -> None:
    """Cheap checks before any process group: the files exist, their format is known, their first record has
    ``data.text_field`` (read by ``datasets`` in streaming mode: nothing else is read or cached), ``data.tokenizer``
    loads. Raises :class:`ConfigError` naming the key."""
    files = split_files(data_cfg, launch_dir)
    kind = builder(data_cfg, [f for fs in files.values() for f in fs])
    for split, fs in files.items():
        stream = _load(kind, {split: [str(f) for f in fs]}, None, streaming=True)[split]
        try:
            first = next(iter(stream))
        except StopIteration:
            raise ConfigError("data.paths" if split == "train" else "data.val_paths", [str(f) for f in fs],
                              "holds no record") from None
        except Exception as err:  # noqa: BLE001 (pyarrow's and datasets' parse errors)
            raise _unreadable(split, fs, kind, err) from None
        _check_field(list(first), data_cfg, f"the {kind} files of data.{'paths' if split == 'train' else 'val_paths'}")
    if data_cfg.get("tokenizer"):
        tokenizer_file(data_cfg.tokenizer, launch_dir)


def _unreadable(split: str, files: list[Path], kind: str, err: Exception) -> ConfigError:
    return ConfigError("data.paths" if split == "train" else "data.val_paths", [str(f) for f in files],
                       f"not readable as {kind} ({type(err).__name__}: "
                       f"{(str(err).strip().splitlines() or [''])[0][:200]}); data.format says which builder reads "
                       "them")


def _load(kind: str, data_files: dict, cache_dir: Optional[Path], streaming: bool = False):
    datasets = _datasets()
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity_error()  # its per-call info lines and progress bars would fill every run's log
    datasets.disable_progress_bars()
    try:
        return datasets.load_dataset(kind, data_files=data_files, streaming=streaming,
                                     cache_dir=str(cache_dir) if cache_dir is not None else None)
    finally:
        datasets.logging.set_verbosity(verbosity)


def tokenizer_file(value, launch_dir: Path) -> TextTokenizer:
    """The tokenizer ``data.tokenizer`` names: a tokenizer.json, or a dir holding one (a pretrained model's), relative
    to ``launch_dir``. Raises :class:`ConfigError` naming ``data.tokenizer``."""
    path = launch_dir / Path(str(value)).expanduser()
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise ConfigError("data.tokenizer", str(value), "a dir without tokenizer.json (a pretrained model dir "
                              "needs its tokenizer saved beside it; or give a tokenizer.json, or null to train a BPE)")
        path = path / "tokenizer.json"
    return load_tokenizer(path)


def read_files(data_cfg, launch_dir: Path, cache_dir: Path) -> dict:
    """``{"train"[, "val"]}``: ``datasets.Dataset`` of ``data.paths`` (and ``data.val_paths``), read by
    :func:`builder`'s builder. Raises :class:`ConfigError` naming ``data.paths`` when they do not parse."""
    files = split_files(data_cfg, launch_dir)
    kind = builder(data_cfg, [f for fs in files.values() for f in fs])
    try:
        return dict(_load(kind, {s: [str(f) for f in fs] for s, fs in files.items()}, cache_dir / "hf-datasets"))
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 (pyarrow's and datasets' parse errors)
        raise _unreadable("train", files["train"], kind, err) from None


def records(data_cfg, launch_dir: Path, cache_dir: Path) -> dict:
    """``{"train", "val"}``: ``datasets.Dataset`` splits of the files (``data.val_paths``', or ``data.val_fraction``
    of the records, at least one, by a fixed shuffle with seed 0). Raises :class:`ConfigError` (``data.text_field``
    not a column, a split with no record, files that do not parse)."""
    loaded = read_files(data_cfg, launch_dir, cache_dir)
    kind = builder(data_cfg, [f for fs in split_files(data_cfg, launch_dir).values() for f in fs])
    _check_field(loaded["train"].column_names, data_cfg, f"the {kind} files of data.paths")
    if "val" in loaded:
        return {"train": loaded["train"], "val": loaded["val"]}
    train = loaded["train"]
    if len(train) < 2:
        raise ConfigError("data.paths", list(data_cfg.paths), f"holds {len(train)} record(s): a val split of "
                          "data.val_fraction needs >= 2 (or give data.val_paths)")
    n_val = min(len(train) - 1, max(1, math.ceil(data_cfg.val_fraction * len(train))))
    parts = train.train_test_split(test_size=n_val, seed=0, shuffle=True)
    return {"train": parts["train"], "val": parts["test"]}


def _texts(dataset, field: str) -> Iterator[list[str]]:
    """Batches of :data:`BATCH_RECORDS` texts of ``dataset``'s ``field`` (null as empty, other values as str)."""
    for batch in dataset.iter(batch_size=BATCH_RECORDS):
        yield ["" if t is None else t if isinstance(t, str) else str(t) for t in batch[field]]


def trained_tokenizer(data_cfg, launch_dir: Path, cache_dir: Path, vocab_size: int, progress: bool) -> TextTokenizer:
    """A byte-level BPE of ``vocab_size`` trained on the train split's texts, cached as
    ``<cache_dir>/hfbpe-<key>/tokenizer.json`` (keyed by the files, format, field, split settings and vocab_size)."""
    files = split_files(data_cfg, launch_dir)
    key = _key("bpe", _listing(files), builder(data_cfg, [f for fs in files.values() for f in fs]),
               data_cfg.text_field, data_cfg.val_fraction, vocab_size)
    out = cache_dir / f"hfbpe-{key}"
    with build_lock(out):
        if verified_cache(out) is None:
            t0 = time.perf_counter()
            log.info("training a byte-level BPE of %d tokens on data.paths' %s (once; cached) ...", vocab_size,
                     data_cfg.text_field)
            train = records(data_cfg, launch_dir, cache_dir)["train"]
            texts = (t for batch in _texts(train, data_cfg.text_field) for t in batch)
            tok = train_bpe(texts, vocab_size, out / "tokenizer.json", progress)
            write_manifest(out, {"vocab_size": tok.vocab_size}, ["tokenizer.json"], digest=["tokenizer.json"])
            log.info("trained a byte-level BPE of %d tokens in %.1f s: %s", tok.vocab_size, time.perf_counter() - t0,
                     out / "tokenizer.json")
    return load_tokenizer(out / "tokenizer.json")


def tokenizer_for(data_cfg, launch_dir: Path, cache_dir: Path, vocab_size: int, progress: bool) -> TextTokenizer:
    """``data.tokenizer`` (:func:`tokenizer_file`) when set, else :func:`trained_tokenizer` (call on local rank 0
    first, then barrier)."""
    if data_cfg.get("tokenizer"):
        return tokenizer_file(data_cfg.tokenizer, launch_dir)
    return trained_tokenizer(data_cfg, launch_dir, cache_dir, vocab_size, progress)


def build_cache(data_cfg, launch_dir: Path, cache_dir: Path, tokenizer: TextTokenizer, progress: bool) -> Path:
    """Tokenize both splits into ``<cache_dir>/hfds-<key>/{train,val}.bin`` (``tokenizer.dtype``, headerless; the
    separator after each record) with meta.json (token and record counts) and a copy of tokenizer.json. Returns that
    dir; built once per key (see the module docstring), rebuilt with one warning when damaged."""
    from tqdm.auto import tqdm

    files = split_files(data_cfg, launch_dir)
    kind = builder(data_cfg, [f for fs in files.values() for f in fs])
    key = _key("tok", _listing(files), kind, data_cfg.text_field, data_cfg.val_fraction, tokenizer.sha)
    out = cache_dir / f"hfds-{key}"
    with build_lock(out):
        if verified_cache(out) is not None:
            return out
        splits = records(data_cfg, launch_dir, cache_dir)
        out.mkdir(parents=True, exist_ok=True)
        dtype, sep = tokenizer.dtype, np.asarray(tokenizer.separator, dtype=tokenizer.dtype).tobytes()
        t0, counts = time.perf_counter(), {}
        log.info("tokenizing data.paths' %s (%d + %d records) into %s (once; cached) ...", data_cfg.text_field,
                 len(splits["train"]), len(splits["val"]), out)
        bar = tqdm(total=sum(len(s) for s in splits.values()), unit="records", desc=f"tokenizing into {out}",
                   disable=None if progress else True)
        for split, dataset in splits.items():
            tmp, n = out / f"{split}.bin.tmp{os.getpid()}", 0
            with open(tmp, "wb") as fh:
                for texts in _texts(dataset, data_cfg.text_field):
                    for ids in tokenizer.encode_batch(texts):
                        fh.write(np.asarray(ids, dtype=dtype).tobytes() + sep)
                        n += len(ids) + len(tokenizer.separator)
                    bar.update(len(texts))
            os.replace(tmp, out / f"{split}.bin")
            counts[split] = {"records": len(dataset), "tokens": n}
        bar.close()
        tokenizer.save(out)
        write_manifest(out, {"format": kind, "text_field": data_cfg.text_field, "tokenizer": tokenizer.sha,
                             "vocab_size": tokenizer.vocab_size, "dtype": dtype.name, "splits": counts,
                             "seconds": round(time.perf_counter() - t0, 3)},
                       ["train.bin", "val.bin", "tokenizer.json"], digest=["tokenizer.json"])
        log.info("tokenized %d records into %d tokens in %.1f s: %s", sum(c["records"] for c in counts.values()),
                 sum(c["tokens"] for c in counts.values()), time.perf_counter() - t0, out)
    return out


def load_token_splits(data_cfg, tokenizer: TextTokenizer, launch_dir: Path, cache_dir: Path,
                      progress: bool) -> dict[str, np.ndarray]:
    """``{"train", "val"}``: the cached token streams (read-only 1-D memmaps) of :func:`build_cache` (call on local
    rank 0 first, then barrier)."""
    out = build_cache(data_cfg, launch_dir, cache_dir, tokenizer, progress)
    meta = json.loads((out / "meta.json").read_text())
    splits: dict[str, np.ndarray] = {s: open_token_bin(out / f"{s}.bin", meta["dtype"], f"{s} cache")
                                     for s in ("train", "val")}
    log.info("data=hf_dataset: %s (train %d records / %d tokens, val %d records / %d tokens, vocab %d)", out,
             meta["splits"]["train"]["records"], meta["splits"]["train"]["tokens"],
             meta["splits"]["val"]["records"], meta["splits"]["val"]["tokens"], tokenizer.vocab_size)
    return splits
