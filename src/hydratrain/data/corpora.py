"""Byte-level corpora and the synthetic stream, as 1-D token arrays.

- ``python_stdlib``: the running interpreter's standard-library ``.py`` files, sorted by path, split into train/val
  by file (a stable hash of the relative path), concatenated as bytes (vocab 256). Built once into
  ``<cache_dir>/<key>/{train,val}.bin`` with a progress bar, written atomically, then reused.
- ``text_files``: the user's files or globs (``data.paths``), relative paths resolved against the launch dir.
- ``synthetic``: a generated, learnable stream (random "words" from a fixed lexicon), for tests and benchmarks.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import sysconfig
import time
import zlib
from pathlib import Path
from typing import Sequence

import numpy as np

from hydratrain.data.cache import build_lock, verified_cache, write_manifest

log = logging.getLogger(__name__)

FILE_SEPARATOR = b"\n\n"

def stdlib_files() -> tuple[Path, list[Path]]:
    """(stdlib root, sorted ``.py`` files under it, site-packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for here, dirs, names in os.walk(root):  # site-packages pruned, not walked (it can hold 10x the stdlib)
        dirs[:] = [d for d in dirs if d != "site-packages"]
        files += [Path(here) / n for n in names if n.endswith(".py") and os.path.isfile(os.path.join(here, n))]
    return root, sorted(files)


def expand_paths(patterns: Sequence[str], base_dir: Path) -> list[Path]:
    """Files matching ``patterns`` (globs, ``**`` allowed; ``~`` expanded as for the other path keys), relative ones
    resolved against ``base_dir``; sorted. Globbing is the stdlib's (``*`` and ``**`` skip hidden names) except that
    ``**`` does not descend into symlinked directories (``wcmatch``'s GLOBSTAR): two links to a parent made
    ``glob.glob`` walk 2^40 paths, a silent hang at start. A symlinked file, or a symlink named in the
    pattern itself, is followed.

    Raises FileNotFoundError naming ``data.paths`` and the pattern when a pattern matches no file, and where it
    looked: ``base_dir`` for a relative pattern, the (expanded) pattern itself for an absolute one.
    """
    from wcmatch import glob as wcglob

    files: set[Path] = set()
    for pattern in patterns:
        full = os.path.expanduser(pattern)
        absolute = os.path.isabs(full)
        full = full if absolute else str(base_dir / full)
        matched = [Path(p) for p in wcglob.glob(full, flags=wcglob.GLOBSTAR) if os.path.isfile(p)]
        if not matched:
            where = f"looked for the absolute pattern {full}" if absolute else f"looked in {base_dir}"
            raise FileNotFoundError(f"data.paths: {pattern!r} matches no file ({where})")
        files.update(p.resolve() for p in matched)
    return sorted(files)


def is_val_file(rel_path: str, val_fraction: float) -> bool:
    """Stable train/val assignment of one file: crc32 of its relative path, in units of 1/10000."""
    return zlib.crc32(rel_path.encode()) % 10_000 < val_fraction * 10_000


def relative_name(path: Path, root: Path) -> str:
    """``path`` relative to ``root`` when it is under it, else the full path: the name the train/val split hashes."""
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def split_files(files: Sequence[Path], root: Path, val_fraction: float) -> dict[str, list[Path]]:
    """``{"train": [...], "val": [...]}``: each file to one split by :func:`is_val_file` of its relative name.

    If the hash leaves one side empty, the last file goes to val (and the first stays in train). One file alone is
    listed in both: its contents are split instead (the first ``1 - val_fraction`` to train, the rest to val).
    """
    if len(files) == 1:
        return {"train": list(files), "val": list(files)}
    splits: dict[str, list[Path]] = {"train": [], "val": []}
    for f in files:
        splits["val" if is_val_file(relative_name(f, root), val_fraction) else "train"].append(f)
    if len(files) >= 2 and not splits["val"]:
        splits["val"].append(splits["train"].pop())
    if len(files) >= 2 and not splits["train"]:
        splits["train"].append(splits["val"].pop(0))
    return splits


def build_corpus(files: Sequence[Path], root: Path, val_fraction: float, cache_dir: Path, progress: bool) -> Path:
    """Write ``train.bin``/``val.bin`` (uint8) for ``files`` under a cache dir keyed by their paths, sizes and mtimes.

    Returns that dir. Rebuilt when the key changes or the cache does not match its meta.json (a truncated file:
    one warning, see :func:`verified_cache`); built under a file lock, each file written to a temporary name and
    renamed, meta.json last. Files are split as :func:`split_files` says.
    """
    listing = [(relative_name(f, root), f.stat().st_size, int(f.stat().st_mtime)) for f in files]
    key = hashlib.sha256(json.dumps([str(root), val_fraction, listing]).encode()).hexdigest()[:16]
    out = cache_dir / key
    with build_lock(out):
        if verified_cache(out) is not None:
            log.info("corpus: %d files, cached in %s", len(files), out)
            return out
        _write_corpus(out, files, root, val_fraction, listing, progress)
    return out


def _write_corpus(out: Path, files: Sequence[Path], root: Path, val_fraction: float, listing: list,
                  progress: bool) -> None:
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    splits = split_files(files, root, val_fraction)
    from tqdm.auto import tqdm

    counts = {}
    log.info("corpus: building %s from %d files (%.1f MB; once, cached) ...", out, len(files),
             sum(s for _, s, _ in listing) / 1e6)  # proportional to the data; said also off a terminal
    bar = tqdm(total=sum(s for _, s, _ in listing), unit="B", unit_scale=True, desc=f"building corpus {out}",
               disable=None if progress else True)  # None: only on a terminal
    for split, paths in splits.items():
        tmp = out / f"{split}.bin.tmp{os.getpid()}"
        n = 0
        with open(tmp, "wb") as fh:
            for f in paths:
                data = f.read_bytes()
                if len(files) == 1:  # the one-file case: first (1 - val_fraction) to train, rest to val
                    cut = int(len(data) * (1 - val_fraction))
                    data = data[:cut] if split == "train" else data[cut:]
                fh.write(data + FILE_SEPARATOR)
                n += len(data) + len(FILE_SEPARATOR)
                bar.update(f.stat().st_size if split == "train" or len(files) > 1 else 0)
        os.replace(tmp, out / f"{split}.bin")
        counts[split] = {"files": len(paths), "tokens": n}
    bar.close()
    write_manifest(out, {"root": str(root), "splits": counts}, ["train.bin", "val.bin"])
    log.info("corpus: built %s from %d files (%.1f MB) in %.1f s", out, len(files), sum(s for _, s, _ in listing) / 1e6,
             time.perf_counter() - t0)


def synthetic_stream(n_tokens: int, vocab_size: int, seed: int = 0) -> np.ndarray:
    """A learnable stream of ``n_tokens``: random picks from a fixed lexicon of 64 random "words" of 3-8 tokens.

    Within a word every next token is determined, so the loss can fall well below ``log(vocab_size)``.
    """
    rng = np.random.default_rng(seed)
    dtype = np.uint8 if vocab_size <= 256 else np.uint16
    words = [rng.integers(0, vocab_size, size=rng.integers(3, 9)).astype(dtype) for _ in range(64)]
    picks = rng.integers(0, len(words), size=n_tokens // 3 + 1)
    # the words of ``picks`` concatenated, gathered by index (a Python list of ~n/3 small arrays took ~0.1 s per 2M
    # tokens on every rank at start-up): token j of pick k is lexicon[start[word k] + j]
    lengths = np.array([len(w) for w in words])
    lexicon, starts = np.concatenate(words), np.cumsum(lengths) - lengths
    ends = np.cumsum(lengths[picks])
    picks = picks[:int(np.searchsorted(ends, n_tokens)) + 1]
    sizes, ends = lengths[picks], ends[:len(picks)]
    index = np.arange(int(ends[-1])) + np.repeat(starts[picks] - (ends - sizes), sizes)
    return lexicon[index][:n_tokens]
