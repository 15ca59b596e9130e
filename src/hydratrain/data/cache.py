"""On-disk caches of built data (corpora, token files, tokenizers): built once under a file lock, written to
temporary names and renamed, with a ``meta.json`` written last that records every file's size (and SHA-256 where
asked) and marks the cache complete; each use checks the files against it (:func:`cache_fault`).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

log = logging.getLogger(__name__)

@contextmanager
def build_lock(out: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``.<out name>.lock`` beside ``out`` (another process building ``out`` waits, then
    finds it built); stale temporary files in ``out`` from a killed build are removed, and so are this build's when
    it fails (a full disk kept the partial file that filled it). A complete cache (:func:`cache_fault`)
    is used without any write, no lock either: a cache built once on a read-only or another user's shared dir
    stopped every run at its lock file."""
    if cache_fault(out)[0] is not None:
        yield
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(f".{out.name}.lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            for stale in out.glob("*.tmp*") if out.is_dir() else ():
                stale.unlink()
            yield
        except BaseException:
            for partial in out.glob("*.tmp*") if out.is_dir() else ():
                partial.unlink(missing_ok=True)
            raise
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def write_manifest(out: Path, meta: dict, files: Sequence[str], digest: Sequence[str] = ()) -> None:
    """Write ``out/meta.json`` (``meta`` plus ``"files"``: each of ``files``' byte size, and the SHA-256 of those in
    ``digest``), last and atomically: it marks the cache complete and is what :func:`cache_fault` checks."""
    record: dict[str, dict[str, Any]] = {}
    for name in files:
        record[name] = {"bytes": (out / name).stat().st_size}
        if name in digest:
            record[name]["sha256"] = hashlib.sha256((out / name).read_bytes()).hexdigest()
    tmp = out / f"meta.json.tmp{os.getpid()}"
    tmp.write_text(json.dumps({**meta, "files": record}, indent=1))
    os.replace(tmp, out / "meta.json")


def cache_fault(out: Path) -> tuple[Optional[dict], Optional[str]]:
    """``(meta, None)`` when the cache dir ``out`` is complete: its meta.json (see :func:`write_manifest`) reads and
    every file it lists has the recorded size (and SHA-256 where recorded); ``(None, None)`` when it was never
    completed (no meta.json); else ``(None, why)``: the file and what is wrong with it, for a rebuild warning."""
    if not (out / "meta.json").exists():
        return None, None
    try:
        meta = json.loads((out / "meta.json").read_text())
        files = meta["files"]
    except (ValueError, KeyError, TypeError):
        return None, f"{out / 'meta.json'} is corrupt or from an older version (no record of its files)"
    for name, want in files.items():
        path = out / name
        size = path.stat().st_size if path.is_file() else None
        if size is None:
            return None, f"{path} is missing"
        if size != want["bytes"]:
            how = "truncated" if size < want["bytes"] else "corrupt"
            return None, f"{path} is {how}: {size} bytes, its build wrote {want['bytes']}"
        if "sha256" in want and hashlib.sha256(path.read_bytes()).hexdigest() != want["sha256"]:
            return None, f"{path} is corrupt: its SHA-256 is not the one its build recorded"
    return meta, None


def verified_cache(out: Path) -> Optional[dict]:
    """The meta of the cache dir ``out`` when it is complete and intact (:func:`cache_fault`), else None, with one
    warning line naming the file and why when it is damaged (the caller then rebuilds it)."""
    meta, why = cache_fault(out)
    if why is not None:
        log.warning("cache %s: %s; rebuilding it", out, why)
    return meta
