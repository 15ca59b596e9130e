"""Token caches of text: a byte-level BPE trained once on a corpus's training split, and the corpus tokenized once
into token files, for the built-in corpora that tokenize text (``tokenized_text``, ``python_stdlib_bpe``: see
:mod:`hydratrain.data.registry`), plus the start-up check of token ids against the model's vocabulary.

Text is split into train/val by file exactly as the byte corpora are (:func:`hydratrain.data.corpora.split_files`),
tokenized once in parallel (``tokenizers``' own thread pool: on the stdlib corpus on 2 cores it was as fast as a
process pool over files, without starting processes) and written as ``<cache>/tok-<key>/{train,val}.bin``
(headerless, uint16 when the vocab fits, else uint32), keyed by the files' names, sizes and mtimes and the
tokenizer's hash. A trained tokenizer is cached the same way (``<cache>/bpe-<key>/tokenizer.json``). Every cache is
built under a file lock (concurrent builders wait and reuse it), written to temporary names and renamed;
``meta.json`` is written last, records every file's size (and tokenizer.json's SHA-256) and marks it complete; each
use checks the files against it and rebuilds a damaged cache with one warning
(:func:`hydratrain.data.cache.verified_cache`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from hydratrain.data.cache import build_lock, verified_cache, write_manifest
from hydratrain.data.corpora import relative_name, split_files
from hydratrain.data.tokenizer import (
    PIECE_BYTES,
    TextTokenizer,
    line_cut,
    load_tokenizer,
    read_pieces,
    train_bpe,
)
from hydratrain.errors import ConfigError

log = logging.getLogger(__name__)

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
    """Whether ``tokens`` (a memmap of :func:`hydratrain.data.token_bin.open_token_bin`) has no llm.c header, which
    would give its dtype."""
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


def warn_replaced(named: str, root: Path, replaced: dict[str, list], shown: int = 3) -> None:
    """One warning line, opening with ``named`` (``data.paths``, ``data=<name>``), when the corpus had bytes that are
    not UTF-8 (``replaced``: ``{file relative to root: [bytes, lines]}``, from a token cache's meta.json): how many,
    on how many lines, in which files (the first ``shown`` by bytes), all trained and tokenized as U+FFFD."""
    if not replaced:
        return
    worst = sorted(replaced.items(), key=lambda kv: -kv[1][0])
    where = ", ".join(f"{root / name} ({b} bytes on {n} lines)" for name, (b, n) in worst[:shown])
    more = f" and {len(worst) - shown} more file(s)" if len(worst) > shown else ""
    log.warning("%s: %d bytes on %d lines of %d file(s) are not UTF-8 and were read as U+FFFD (the replacement "
                "character): %s%s", named, sum(b for b, _ in replaced.values()), sum(n for _, n in replaced.values()),
                len(replaced), where, more)


def files_of(splits: dict[str, list[Segment]]) -> list[Segment]:
    """All segments of ``splits``, train first (what the cache key lists)."""
    return [seg for segs in splits.values() for seg in segs]
