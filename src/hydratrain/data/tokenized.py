"""Subword token corpora: pre-tokenized binaries, and text tokenized with a BPE and cached as such binaries.

- ``token_bin``: flat files of token ids made by another pipeline (``data.train_path``, ``data.val_path``), uint16
  or uint32 (``data.dtype``), with or without an llm.c header (detected and skipped), opened with ``np.memmap``.
- ``tokenized_text``: the user's text files (``data.paths``) tokenized with ``data.tokenizer`` (a tokenizer.json)
  or, when that is null, a byte-level BPE of ``data.vocab_size`` trained on their training split.
- ``python_stdlib_bpe``: the same, on the standard-library files ``python_stdlib`` uses, split the same way.

Text is split into train/val by file exactly as the byte corpora are (:func:`hydratrain.data.corpora.split_files`),
tokenized once in parallel (``tokenizers``' own thread pool: on the stdlib corpus on 2 cores it was as fast as a
process pool over files, without starting processes) and written as ``<cache>/tok-<key>/{train,val}.bin``
(headerless, uint16 when the vocab fits, else uint32), keyed by the files' names, sizes and mtimes and the
tokenizer's hash. A trained tokenizer is cached the same way (``<cache>/bpe-<key>/tokenizer.json``). Every cache is
built under a file lock (concurrent builders wait and reuse it), written to temporary names and renamed;
``meta.json`` is written last, records every file's size (and tokenizer.json's SHA-256) and marks it complete; each
use checks the files against it and rebuilds a damaged cache with one warning
(:func:`hydratrain.data.cache.verified_cache`).

Entry points: :func:`tokenizer_for`, :func:`vocab_size_for`, :func:`load_token_splits` (through
:func:`hydratrain.data.build.load_splits`) and :func:`preflight_data`. Each returned split is a 1-D ``np.memmap`` that
each rank reads only the windows of its share from.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, cast

import numpy as np

from hydratrain.data import hf_dataset
from hydratrain.data.cache import build_lock, verified_cache, write_manifest
from hydratrain.data.corpora import expand_paths, relative_name, split_files, stdlib_files
from hydratrain.data.token_bin import LLMC_FORMATS, LLMC_HEADER_BYTES, llmc_header, open_token_bin  # noqa: F401
from hydratrain.data.tokenizer import (
    PIECE_BYTES,
    TextTokenizer,
    line_cut,
    load_tokenizer,
    padded_vocab_size,
    read_pieces,
    train_bpe,
)
from hydratrain.errors import ConfigError
from hydratrain.paths import default_cache_dir

log = logging.getLogger(__name__)

TOKEN_CORPORA = ("token_bin", "tokenized_text", "python_stdlib_bpe", "hf_dataset")
BPE_VOCAB_SIZE = 4096  # tokens of the BPE trained when data.tokenizer and data.vocab_size are null
BYTE_CORPORA = ("python_stdlib", "text_files")
SAMPLE_TOKENS = 1 << 20  # tokens read by the start-up max-id check (64 windows spread over the file)
BATCH_BYTES = 16 << 20  # text handed to one encode_batch call
FORMAT = 1  # part of every cache key: bump when the cached layout or the text pieces change

Segment = tuple[Path, int, Optional[int]]  # a file and the byte range [start, stop) of it that a split holds


def max_token_id(tokens: np.ndarray, sample: Optional[int] = SAMPLE_TOKENS) -> int:
    """Largest id in ``tokens`` (1-D). ``sample``: read only about that many tokens, in 64 windows spread evenly
    from the first token to the last; None (or a shorter array) reads all of it, in chunks of 16M tokens."""
    n = len(tokens)
    if sample is None or n <= sample:
        return max(int(tokens[i:i + (1 << 24)].max()) for i in range(0, n, 1 << 24))
    width = max(1, sample // 64)
    starts = np.linspace(0, n - width, 64).astype(np.int64)
    return max(int(tokens[s:s + width].max()) for s in starts)


def _headerless(tokens: np.ndarray) -> bool:
    """Whether ``tokens`` (a memmap of :func:`open_token_bin`) has no llm.c header, which would give its dtype."""
    return getattr(tokens, "offset", 0) == 0


def check_token_ids(tokens: np.ndarray, vocab_size: int, key: str, path: Path,
                    sample: Optional[int] = SAMPLE_TOKENS) -> None:
    """Raise :class:`ConfigError` naming ``model.vocab_size`` and ``key`` when an id in ``tokens`` (a sample of
    them, see :func:`max_token_id`) is not below ``vocab_size``; naming ``data.dtype`` instead when a headerless
    file was read with the other width: uint32 ids too large that read as uint16 fit, or uint16 ids whose every
    second one (the high halves of little-endian uint32 ids) is 0 or 1 while the others are not (a uint32 file read as
    uint16 would otherwise train silently on ids interleaved with zeros)."""
    if tokens.dtype.itemsize == 2 and _headerless(tokens) and len(tokens) >= 64:
        head = np.asarray(tokens[:min(len(tokens), SAMPLE_TOKENS)])
        head = head[:len(head) // 2 * 2]
        if int(head[1::2].max()) <= 1 and np.count_nonzero(head[0::2] > 1) > head.size // 4:
            raise ConfigError("data.dtype", "uint16", f"{key}={path} read as uint16 has every second id 0 or 1 (in "
                              f"its first {head.size} tokens), the high halves of uint32 ids: it holds uint32 "
                              "tokens; allowed: uint32")
    top = max_token_id(tokens, sample)
    if top >= vocab_size:
        where = "all" if sample is None or len(tokens) <= sample else f"a sample of {sample}"
        if tokens.dtype.itemsize == 4 and _headerless(tokens):
            as16 = np.asarray(tokens[:SAMPLE_TOKENS // 2]).view(np.dtype("<u2"))
            if as16.size and int(as16.max()) < vocab_size:
                raise ConfigError("data.dtype", "uint32", f"{key}={path} read as uint32 holds token id {top} (not "
                                  f"below model.vocab_size={vocab_size}), but read as uint16 every id of its first "
                                  f"{as16.size} is: it holds uint16 tokens; allowed: uint16 (or null)")
        raise ConfigError("model.vocab_size", vocab_size, f"{key}={path} holds token id {top} (in {where} of its "
                          f"{len(tokens)} tokens); allowed: model.vocab_size > {top}")


def split_segments(files: Sequence[Path], root: Path, val_fraction: float) -> dict[str, list[Segment]]:
    """``{"train": [...], "val": [...]}`` segments: whole files split as
    :func:`hydratrain.data.corpora.split_files` does; one file alone is cut at a line start near
    ``1 - val_fraction`` of its bytes (:func:`line_cut`)."""
    if len(files) == 1:
        cut = line_cut(files[0], 1 - val_fraction)
        return {"train": [(files[0], 0, cut)], "val": [(files[0], cut, None)]}
    return {split: [(f, 0, None) for f in fs] for split, fs in split_files(files, root, val_fraction).items()}


def segment_texts(segments: Sequence[Segment]) -> Iterator[str]:
    """The text pieces of ``segments`` in order (:func:`hydratrain.data.tokenizer.read_pieces`)."""
    for path, start, stop in segments:
        yield from read_pieces(path, start, stop)


def cache_root(data_cfg, launch_dir: Path, cache_dir: Optional[Path] = None) -> Path:
    """``cache_dir`` when given (the run's, :class:`hydratrain.paths.Paths`), else ``data.cache_dir`` (relative: to
    ``launch_dir``), else $HYDRATRAIN_CACHE or ~/.cache/hydratrain."""
    if cache_dir is not None:
        return Path(cache_dir)
    return launch_dir / Path(data_cfg.cache_dir).expanduser() if data_cfg.cache_dir else default_cache_dir()


def _cache_key(*parts) -> str:
    return hashlib.sha256(json.dumps([FORMAT, PIECE_BYTES, *parts]).encode()).hexdigest()[:16]


def _listing(segments: Sequence[Segment], root: Path) -> list:
    return [(relative_name(f, root), start, stop, f.stat().st_size, f.stat().st_mtime_ns)
            for f, start, stop in segments]


def trained_tokenizer(files: Sequence[Path], root: Path, val_fraction: float, vocab_size: int, cache_dir: Path,
                      progress: bool) -> TextTokenizer:
    """A byte-level BPE of ``vocab_size`` trained on the training split of ``files`` (relative names to ``root``),
    cached as ``<cache_dir>/bpe-<key>/tokenizer.json`` keyed by those files' names, sizes, mtimes and vocab_size, with
    a meta.json of its size and SHA-256 (checked on every use: a damaged one is trained again, one warning)."""
    train = split_segments(files, root, val_fraction)["train"]
    out = cache_dir / f"bpe-{_cache_key('bpe', str(root), vocab_size, _listing(train, root))}"
    with build_lock(out):
        if verified_cache(out) is None:
            t0 = time.perf_counter()
            log.info("training a byte-level BPE of %d tokens on %d files into %s (once; cached) ...", vocab_size,
                     len(train), out)  # tens of seconds and more; said also off a terminal
            tok = train_bpe(segment_texts(train), vocab_size, out / "tokenizer.json", progress)
            write_manifest(out, {"vocab_size": tok.vocab_size}, ["tokenizer.json"], digest=["tokenizer.json"])
            log.info("trained a byte-level BPE of %d tokens on %d files in %.1f s: %s", tok.vocab_size, len(train),
                     time.perf_counter() - t0, out / "tokenizer.json")
    return load_tokenizer(out / "tokenizer.json")


def _batches(segments: Sequence[Segment], replaced: dict[Path, list]) -> Iterator[list[tuple[str, bool]]]:
    """``(text piece, ends its segment)`` pairs in batches of about :data:`BATCH_BYTES`; an empty segment yields
    one empty piece (so its separator is still written). ``replaced[path]``: ``[bytes, lines]`` made U+FFFD."""
    batch, size = [], 0
    for path, start, stop in segments:
        prev = None
        for piece in read_pieces(path, start, stop, replaced=replaced.setdefault(path, [0, 0])):
            if prev is not None:
                batch.append((prev, False))
                size += len(prev)
            prev = piece
        batch.append((prev or "", True))
        size += len(prev or "")
        if size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def build_token_cache(files: Sequence[Path], root: Path, val_fraction: float, tokenizer: TextTokenizer,
                      cache_dir: Path, progress: bool) -> Path:
    """Tokenize ``files`` (split by file, see :func:`split_segments`) with ``tokenizer`` into
    ``<cache_dir>/tok-<key>/{train,val}.bin`` (headerless, ``tokenizer.dtype``; the tokenizer's separator after
    each file) plus ``meta.json`` and a copy of tokenizer.json. Returns that dir; built once per key (files'
    names, sizes, mtimes, val_fraction, the tokenizer's hash), with a tqdm bar in bytes when ``progress``; rebuilt
    (one warning) when a file does not match the size (tokenizer.json: SHA-256) meta.json records for it.
    ``meta.json``'s ``replaced`` maps each file (relative to ``root``) with bytes that are not UTF-8 to ``[bytes,
    lines]`` that became U+FFFD (see :func:`warn_replaced`)."""
    from tqdm.auto import tqdm

    splits = split_segments(files, root, val_fraction)
    key = _cache_key("tok", str(root), val_fraction, _listing(files_of(splits), root), tokenizer.sha)
    out = cache_dir / f"tok-{key}"
    with build_lock(out):
        if verified_cache(out) is not None:
            return out
        out.mkdir(parents=True, exist_ok=True)
        dtype, sep_ids = tokenizer.dtype, tokenizer.separator
        sep = np.asarray(sep_ids, dtype=dtype).tobytes()
        total = sum((stop if stop is not None else f.stat().st_size) - start for seg in splits.values()
                    for f, start, stop in seg)
        log.info("tokenizing %.1f MB into %s (once; cached) ...", total / 1e6, out)  # (said also off a tty)
        bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"tokenizing into {out}",
                   disable=None if progress else True)  # None: only on a terminal
        replaced: dict[Any, Any]
        t0, counts, replaced = time.perf_counter(), {}, {}
        for split, segments in splits.items():
            tmp, n = out / f"{split}.bin.tmp{os.getpid()}", 0
            with open(tmp, "wb") as fh:
                for batch in _batches(segments, replaced):
                    for ids, (text, ends) in zip(tokenizer.encode_batch([t for t, _ in batch]), batch):
                        fh.write(np.asarray(ids, dtype=dtype).tobytes() + (sep if ends else b""))
                        n += len(ids) + (len(sep_ids) if ends else 0)
                        bar.update(len(text.encode("utf-8", errors="replace")))
            os.replace(tmp, out / f"{split}.bin")
            counts[split] = {"files": len(segments), "tokens": n}
        bar.close()
        seconds = time.perf_counter() - t0
        tokenizer.save(out)
        meta = {"root": str(root), "tokenizer": tokenizer.sha, "vocab_size": tokenizer.vocab_size,
                "dtype": dtype.name, "bytes": total, "seconds": round(seconds, 3), "splits": counts,
                "replaced": {relative_name(f, root): r for f, r in replaced.items() if r[0]}}
        write_manifest(out, meta, ["train.bin", "val.bin", "tokenizer.json"], digest=["tokenizer.json"])
        log.info("tokenized %.1f MB into %d tokens in %.1f s (%.2f MB/s): %s", total / 1e6,
                 sum(c["tokens"] for c in counts.values()), seconds, total / 1e6 / max(seconds, 1e-9), out)
    return out


def warn_replaced(data_cfg, root: Path, replaced: dict[str, list], shown: int = 3) -> None:
    """One warning line when the corpus had bytes that are not UTF-8 (``replaced``: ``{file relative to root:
    [bytes, lines]}``, from a token cache's meta.json): how many, on how many lines, in which files (the first
    ``shown`` by bytes), all trained and tokenized as U+FFFD."""
    if not replaced:
        return
    worst = sorted(replaced.items(), key=lambda kv: -kv[1][0])
    where = ", ".join(f"{root / name} ({b} bytes on {n} lines)" for name, (b, n) in worst[:shown])
    more = f" and {len(worst) - shown} more file(s)" if len(worst) > shown else ""
    key = "data.paths" if data_cfg.name == "tokenized_text" else f"data={data_cfg.name}"
    log.warning("%s: %d bytes on %d lines of %d file(s) are not UTF-8 and were read as U+FFFD (the replacement "
                "character): %s%s", key, sum(b for b, _ in replaced.values()), sum(n for _, n in replaced.values()),
                len(replaced), where, more)


def files_of(splits: dict[str, list[Segment]]) -> list[Segment]:
    """All segments of ``splits``, train first (what the cache key lists)."""
    return [seg for segs in splits.values() for seg in segs]


def corpus_files(data_cfg, launch_dir: Path) -> tuple[Path, list[Path]]:
    """``(root, sorted files)`` of a text corpus: the stdlib's ``.py`` files for python_stdlib(_bpe), else the
    files of ``data.paths`` (relative to ``launch_dir``; root = their common dir). Raises ConfigError naming
    ``data.paths`` when a pattern matches nothing."""
    if data_cfg.name in ("python_stdlib", "python_stdlib_bpe"):
        return stdlib_files()
    try:
        files = expand_paths(list(data_cfg.paths), launch_dir)
    except FileNotFoundError as err:
        raise ConfigError("data.paths", list(data_cfg.paths), str(err).split(": ", 1)[1]) from None
    return Path(os.path.commonpath([str(f.parent) for f in files])), files


def tokenizer_for(data_cfg, launch_dir: Path, progress: bool = False, files: Optional[Sequence[Path]] = None,
                  cache_dir: Optional[Path] = None) -> Optional[TextTokenizer]:
    """The tokenizer of ``data_cfg``: ``data.tokenizer`` (relative to ``launch_dir``) when set; else, for
    tokenized_text / python_stdlib_bpe, a BPE of ``data.vocab_size`` trained on the training split (cached; the
    first call trains it: call on local rank 0 first, then barrier). None for the byte corpora, synthetic, and
    token_bin without ``data.tokenizer``. ``files``: python_stdlib_bpe's files instead of the whole stdlib (tests).
    Raises :class:`ConfigError` (``data.tokenizer``, ``data.paths``, ``data.vocab_size``). hf_dataset:
    :func:`hydratrain.data.hf_dataset.tokenizer_for`."""
    if data_cfg.name == "hf_dataset":
        return hf_dataset.tokenizer_for(data_cfg, launch_dir, cache_root(data_cfg, launch_dir, cache_dir),
                                        bpe_vocab_size(data_cfg), progress)
    if getattr(data_cfg, "tokenizer", None):
        return load_tokenizer(launch_dir / Path(data_cfg.tokenizer).expanduser())
    if data_cfg.name not in ("tokenized_text", "python_stdlib_bpe"):
        return None
    if bpe_vocab_size(data_cfg) < 257:
        raise ConfigError("data.vocab_size", data_cfg.vocab_size, "a byte-level BPE needs >= 257 (256 bytes + "
                          "<|endoftext|>)")
    root, all_files = corpus_files(data_cfg, launch_dir)
    return trained_tokenizer(list(files) if files is not None else all_files, root, data_cfg.val_fraction,
                             bpe_vocab_size(data_cfg), cache_root(data_cfg, launch_dir, cache_dir), progress)


def bpe_vocab_size(data_cfg) -> int:
    """Tokens of the BPE trained when ``data.tokenizer`` is null: ``data.vocab_size``, or :data:`BPE_VOCAB_SIZE`
    when that is null too."""
    return BPE_VOCAB_SIZE if data_cfg.get("vocab_size") is None else data_cfg.vocab_size


def vocab_size_for(data_cfg, tokenizer: Optional[TextTokenizer], explicit: Optional[int]) -> int:
    """The model's vocab size for ``data_cfg``: ``explicit`` (``model.vocab_size`` when the user set it) if given,
    else the tokenizer's size padded up to a multiple of 64 (256 for the byte corpora and synthetic). Raises
    :class:`ConfigError` naming ``model.vocab_size`` when an explicit value is below the tokenizer's size (or 256
    for bytes), or when token_bin has neither (nothing to take it from)."""
    if tokenizer is None and data_cfg.name == "token_bin":
        if explicit is None:
            raise ConfigError("model.vocab_size", None, "data=token_bin has no tokenizer to take it from: set "
                              "model.vocab_size above the largest token id (e.g. 50304 for GPT-2's) or data.tokenizer")
        return explicit
    if tokenizer is None and data_cfg.name not in BYTE_CORPORA:  # synthetic: any size
        return explicit if explicit is not None else 256
    need, source = ((tokenizer.vocab_size, f"the tokenizer's {tokenizer.vocab_size} tokens ({tokenizer.path})")
                    if tokenizer is not None else (256, "the 256 byte values"))
    if explicit is None:
        return padded_vocab_size(need)
    if explicit < need:
        raise ConfigError("model.vocab_size", explicit, f"smaller than {source} of data={data_cfg.name}; allowed: "
                          f">= {need}, or null for {padded_vocab_size(need)}")
    return explicit


def load_token_splits(data_cfg, vocab_size: int, launch_dir: Path, progress: bool,
                      files: Optional[Sequence[Path]] = None, cache_dir: Optional[Path] = None) -> dict[str, np.memmap]:
    """``{"train", "val"}``: 1-D read-only token memmaps (uint16 or uint32) for token_bin, tokenized_text or
    python_stdlib_bpe. Builds missing caches (call on local rank 0 first, then barrier). ``files``: see
    :func:`tokenizer_for`. Raises :class:`ConfigError`: an id not below ``vocab_size`` (``model.vocab_size`` and
    the data key named), a bad file or setting."""
    if data_cfg.name == "token_bin":
        splits = {}
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
    tokenizer = cast(TextTokenizer, tokenizer_for(data_cfg, launch_dir, progress, files, cache_dir))  # (one for these)
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError("model.vocab_size", vocab_size, f"smaller than the tokenizer's {tokenizer.vocab_size} "
                          f"tokens ({tokenizer.path}); allowed: >= {tokenizer.vocab_size}")
    if data_cfg.name == "hf_dataset":
        return hf_dataset.load_token_splits(data_cfg, tokenizer, launch_dir,
                                            cache_root(data_cfg, launch_dir, cache_dir), progress)
    root, all_files = corpus_files(data_cfg, launch_dir)
    out = build_token_cache(list(files) if files is not None else all_files, root, data_cfg.val_fraction, tokenizer,
                            cache_root(data_cfg, launch_dir, cache_dir), progress)
    meta = json.loads((out / "meta.json").read_text())
    splits = {s: open_token_bin(out / f"{s}.bin", meta["dtype"], f"{s} cache") for s in ("train", "val")}
    log.info("data=%s: %s (train %d files / %d tokens, val %d files / %d tokens, vocab %d)", data_cfg.name, out,
             meta["splits"]["train"]["files"], meta["splits"]["train"]["tokens"], meta["splits"]["val"]["files"],
             meta["splits"]["val"]["tokens"], tokenizer.vocab_size)
    warn_replaced(data_cfg, root, meta.get("replaced", {}))
    asked = bpe_vocab_size(data_cfg)
    if not getattr(data_cfg, "tokenizer", None) and tokenizer.vocab_size < asked:
        log.warning("data.vocab_size=%d: the BPE trained on the training split has %d tokens, not %d: its text "
                    "ran out of byte pairs to merge (more text, or a data.vocab_size <= %d, gives what is asked); "
                    "the model's vocab is %d (%s)", asked, tokenizer.vocab_size, asked, tokenizer.vocab_size,
                    vocab_size, tokenizer.path)
    return splits


def preflight_data(data_cfg, launch_dir: Path) -> None:
    """Cheap checks of the token corpora's settings before any process group (nothing is trained or tokenized):
    token_bin's files open (headers, sizes, dtype), ``data.tokenizer`` loads, ``data.paths`` match files,
    relative paths resolve against ``launch_dir`` (``paths.data_dir``). Raises :class:`ConfigError`; does nothing
    for other data names."""
    if data_cfg.name not in TOKEN_CORPORA:
        return
    if data_cfg.name == "token_bin":
        for split in ("train", "val"):
            value = getattr(data_cfg, f"{split}_path")
            if not value:
                raise ConfigError(f"data.{split}_path", value, "data=token_bin needs a token file for each split")
            open_token_bin(launch_dir / Path(value).expanduser(), data_cfg.dtype, f"data.{split}_path")
    elif data_cfg.name == "tokenized_text":
        corpus_files(data_cfg, launch_dir)
    elif data_cfg.name == "hf_dataset":
        hf_dataset.preflight(data_cfg, launch_dir)  # the tokenizer too (a dir holding tokenizer.json is allowed)
        return
    if data_cfg.tokenizer:
        load_tokenizer(launch_dir / Path(data_cfg.tokenizer).expanduser())
