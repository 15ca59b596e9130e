"""Token streams (byte-level corpora cached as uint8 memmaps) and a resumable, rank-sharded batch iterator.

- ``python_stdlib``: the running interpreter's standard-library ``.py`` files, sorted by path, split into train/val
  by file (a stable hash of the relative path), concatenated as bytes (vocab 256). Built once into
  ``<cache_dir>/<key>/{train,val}.bin`` with a progress bar, written atomically, then reused.
- ``text_files``: the user's files or globs (``data.paths``), relative paths resolved against the launch dir.
- ``synthetic``: a generated, learnable stream (a fixed random order-2 Markov chain), for tests and benchmarks.
- ``token_bin``, ``tokenized_text``, ``python_stdlib_bpe``: subword tokens (uint16/uint32), see
  :mod:`hydratrain.tokenized`; :func:`load_splits` is the one entry point for all of them.

Each rank reads only its share: sample indices come from ``torch.utils.data.DistributedSampler`` (shuffled with the
run seed, ``set_epoch`` every epoch), so the order is reproducible and changes every epoch; the position in it is
one global sample count, which checkpoints store and a resume on another world size continues from.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import sysconfig
import time
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional, Sequence

import numpy as np

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

FILE_SEPARATOR = b"\n\n"


@contextmanager
def build_lock(out: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``.<out name>.lock`` beside ``out`` (another process building ``out`` waits, then
    finds it built); stale temporary files in ``out`` from a killed build are removed, and so are this build's when
    it fails (a full disk kept the partial file that filled it; tester 14). A complete cache (:func:`cache_fault`)
    is used without any write, no lock either: a cache built once on a read-only or another user's shared dir
    stopped every run at its lock file (tester 14)."""
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
    record = {}
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


def default_cache_dir() -> Path:
    return Path(os.environ.get("HYDRATRAIN_CACHE", Path.home() / ".cache" / "hydratrain"))


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
    ``glob.glob`` walk 2^40 paths, a silent hang at start (tester 8). A symlinked file, or a symlink named in the
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
             sum(s for _, s, _ in listing) / 1e6)  # proportional to the data, silent off a terminal (tester 13)
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


class TokenDataset:
    """Fixed windows over a 1-D token array: sample ``i`` is tokens ``[i*seq_len, i*seq_len + seq_len + 1)``.

    ``batch(indices)`` returns ``(x, y)``, each ``(len(indices), seq_len)`` int64, ``y`` shifted by one. With
    ``vocab_size``, a batch holding an id >= it raises :class:`~hydratrain.errors.ConfigError` naming
    ``model.vocab_size`` and ``source`` (the start-up check of a large token file reads a sample only; an embedding
    lookup out of range would be an opaque IndexError on CPU and a device-side assert on CUDA). The check is one
    ``max`` over the batch's B x (T + 1) ids on the host.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, vocab_size: Optional[int] = None, source: str = "data"):
        self.tokens, self.seq_len, self.vocab_size, self.source = tokens, seq_len, vocab_size, source
        self.n = max(0, (len(tokens) - 1) // seq_len)

    def __len__(self) -> int:
        return self.n

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        starts = np.asarray(indices, dtype=np.int64)[:, None] * self.seq_len
        import torch

        window = np.asarray(self.tokens[starts + np.arange(self.seq_len + 1)], dtype=np.int64)
        if self.vocab_size is not None and window.size and int(window.max()) >= self.vocab_size:
            from hydratrain.errors import ConfigError

            bad = int(window.max())
            at = int(starts[int(np.argwhere(window == bad)[0][0]), 0]) + int(np.argwhere(window == bad)[0][1])
            raise ConfigError("model.vocab_size", self.vocab_size, f"{self.source} holds token id {bad} (at token "
                              f"{at}), which needs model.vocab_size > {bad}")
        t = torch.from_numpy(window)
        return t[:, :-1], t[:, 1:]


@dataclass
class LoaderState:
    """Position of a :class:`ShardedBatches` iterator: ``epoch`` and micro-batches already taken in it.

    ``start_sample``: samples of the epoch's global order consumed (by all ranks together) before its micro-batch 0;
    0 except after :meth:`ShardedBatches.seek` to a position that another world size or batch size reached.
    """

    epoch: int = 0
    batch_in_epoch: int = 0
    start_sample: int = 0


class ShardedBatches:
    """This rank's micro-batches of a :class:`TokenDataset`, epoch after epoch, resumable from a LoaderState.

    Each epoch has one global order of samples: ``DistributedSampler(shuffle, seed, drop_last=True)`` with
    ``set_epoch(epoch)`` over one replica, i.e. a permutation that does not depend on the world size, cut to
    ``len(dataset) // world_size * world_size`` samples. Micro-batch ``k`` of rank ``r`` takes positions
    ``start + k*B*W + r + W*j`` (``j < B``), which is exactly what a per-rank ``DistributedSampler`` gives rank ``r``
    (every rank ``len(dataset) // world_size`` samples per epoch, disjoint from the other ranks'). So after any
    number of micro-batches all ranks together have consumed a prefix of the order, :meth:`position` is one number,
    and :meth:`seek` continues at that sample on any world size or batch size: nothing skipped or repeated.
    An epoch has ``batches_per_epoch`` micro-batches (a trailing partial global batch is dropped).
    """

    def __init__(self, dataset: TokenDataset, batch_size: int, rank: int, world_size: int, seed: int,
                 shuffle: bool = True, device: Optional[torch.device] = None, strict_position: bool = True):
        from torch.utils.data import DistributedSampler  # imported here: the corpus helpers need no torch

        if len(dataset) < world_size:
            raise ValueError(f"the split has {len(dataset)} samples of data.seq_len tokens, fewer than "
                             f"world_size={world_size}: use more data or a smaller data.seq_len")
        self.dataset, self.batch_size, self.device = dataset, batch_size, device
        self.rank, self.world_size, self.seed, self.strict_position = rank, world_size, seed, strict_position
        self.sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed,
                                          drop_last=True)
        # The global order: the same permutation the per-rank samplers slice, independent of world_size.
        self.order = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=shuffle, seed=seed, drop_last=True)
        self.epoch_samples = len(self.sampler) * world_size  # samples of the order used per epoch
        self.state = LoaderState()
        self.batches_per_epoch = len(self.sampler) // batch_size
        if self.batches_per_epoch == 0:
            raise ValueError(f"each rank has {len(self.sampler)} samples per epoch, fewer than data.batch_size="
                             f"{batch_size}: use more data or a smaller data.batch_size / data.seq_len")

    def batches_left_in_epoch(self) -> int:
        """Micro-batches per rank still to come in the current epoch."""
        total = max(0, self.epoch_samples - self.state.start_sample) // (self.batch_size * self.world_size)
        return max(0, total - self.state.batch_in_epoch)

    def batches_left(self, until_epoch: int) -> int:
        """Micro-batches per rank from the current position to the end of epoch ``until_epoch - 1`` (0-based)."""
        epoch = self.state.epoch
        if epoch >= until_epoch:
            return 0
        return self.batches_left_in_epoch() + (until_epoch - epoch - 1) * self.batches_per_epoch

    def position(self) -> tuple[int, int]:
        """(epoch, samples of its global order consumed by all ranks together)."""
        s = self.state
        return s.epoch, s.start_sample + s.batch_in_epoch * self.batch_size * self.world_size

    def seek(self, epoch: int, samples_consumed: int) -> None:
        """Continue at sample ``samples_consumed`` of epoch ``epoch``'s global order (see :meth:`position`)."""
        self.state = LoaderState(epoch, 0, samples_consumed)

    # --------------------------------------------------------------------------------------------- Stateful
    def state_dict(self) -> dict:
        """The data position and what the order depends on (so a resume can check it is the same order)."""
        epoch, consumed = self.position()
        return {"epoch": epoch, "samples_in_epoch": consumed, "world_size": self.world_size,
                "batch_size": self.batch_size, "seed": self.seed, "train_samples": len(self.dataset),
                "seq_len": self.dataset.seq_len}

    def load_state_dict(self, state: dict) -> None:
        """Continue at the saved position, remapped to this world size and batch size (nothing skipped or repeated).

        Raises :class:`~hydratrain.errors.CheckpointError` when the saved order differs (another ``trainer.seed``,
        ``data.seq_len`` or train split), unless the iterator was made with ``strict_position=False``: then the
        saved epoch starts over from its first sample.
        """
        from hydratrain.errors import CheckpointError

        mismatch = [(key, state[name], now) for key, name, now in (
            ("trainer.seed", "seed", self.seed), ("data.seq_len", "seq_len", self.dataset.seq_len),
            ("data (train split size, in samples)", "train_samples", len(self.dataset))) if state[name] != now]
        if mismatch and self.strict_position:
            what = "; ".join(f"{k} was {a}, now {b}" for k, a, b in mismatch)
            raise CheckpointError(f"cannot restore the data position ({what}): the sample order would differ and "
                                  "samples would be skipped or repeated. Use the saved values, or set "
                                  "checkpoint.restore_data_position=false to start that epoch over")
        if not self.strict_position:
            log.warning("checkpoint.restore_data_position=false: epoch %d starts over from its first sample "
                        "(samples already seen in it will be seen again)", state["epoch"])
            self.seek(int(state["epoch"]), 0)
            return
        self.seek(int(state["epoch"]), int(state["samples_in_epoch"]))
        if state["world_size"] != self.world_size or state["batch_size"] != self.batch_size:
            log.warning("data position remapped: %d ranks x batch %d -> %d ranks x batch %d; epoch %d continues at "
                        "sample %d of its order (nothing skipped or repeated); %d micro-batches per rank left in it",
                        state["world_size"], state["batch_size"], self.world_size, self.batch_size, state["epoch"],
                        state["samples_in_epoch"], self.batches_left_in_epoch())

    def _produce(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, LoaderState]]:
        """Micro-batches from the current position on, each with the position after it, already on the device."""
        B, W = self.batch_size, self.world_size
        cursor = LoaderState(**vars(self.state))
        pin = self.device is not None and self.device.type == "cuda"
        while True:
            self.order.set_epoch(cursor.epoch)
            order = list(self.order)
            while True:
                left = max(0, self.epoch_samples - cursor.start_sample) // (B * W) - cursor.batch_in_epoch
                if left <= 0:
                    break
                first = cursor.start_sample + cursor.batch_in_epoch * B * W + self.rank
                x, y = self.dataset.batch(order[first:first + B * W:W])
                cursor = LoaderState(cursor.epoch, cursor.batch_in_epoch + 1, cursor.start_sample)
                if self.device is not None:  # pinned + non_blocking: the copy overlaps the step before it
                    x = (x.pin_memory() if pin else x).to(self.device, non_blocking=True)
                    y = (y.pin_memory() if pin else y).to(self.device, non_blocking=True)
                yield x, y, cursor
            cursor = LoaderState(cursor.epoch + 1, 0)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches ``(x, y)``, each ``(batch_size, seq_len)`` int64, from the current position on.

        The next micro-batch is gathered and its copy to the device started before the current one is handed out
        (one batch ahead), so a step never waits for its data; :meth:`position` counts only batches handed out.
        """
        ahead = None
        for produced in self._produce():
            if ahead is not None:
                x, y, self.state = ahead
                yield x, y
            ahead = produced


class EvalBatches:
    """The eval set: the first ``n_samples`` samples (all when 0 or more than there are) of a fixed shuffled order
    of a split (seed 0, independent of the run), in global batches of ``world_size x batch_size``.

    Rank ``r`` takes positions ``g*W*B + r + W*j`` (``j < B``) of global batch ``g``; the last global batch is padded
    with sample 0 and the padding is flagged invalid, so every rank runs the same number of forwards (FSDP needs
    that) and each sample of the set counts exactly once, whatever the world size and batch size. Iterating yields
    ``(x, y, valid)``: ``x, y`` ``(B, seq_len)`` int64 and ``valid`` ``(B,)`` bool.
    """

    def __init__(self, dataset: TokenDataset, n_samples: int, batch_size: int, rank: int, world_size: int,
                 device: Optional[torch.device] = None):
        if len(dataset) == 0:
            raise ValueError("the split has no sample of data.seq_len + 1 tokens: use more data or a smaller "
                             "data.seq_len")
        from torch.utils.data import DistributedSampler

        self.dataset, self.batch_size, self.rank, self.world_size, self.device = (dataset, batch_size, rank,
                                                                                  world_size, device)
        order = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
        order.set_epoch(0)
        self.order = list(order)[:n_samples or None]
        self.n_samples = len(self.order)
        self.global_batches = -(-self.n_samples // (batch_size * world_size))

    def __len__(self) -> int:
        return self.global_batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        import torch

        B, W = self.batch_size, self.world_size
        for g in range(self.global_batches):
            positions = [g * W * B + self.rank + W * j for j in range(B)]
            valid = torch.tensor([p < self.n_samples for p in positions])
            x, y = self.dataset.batch([self.order[p] if p < self.n_samples else self.order[0] for p in positions])
            if self.device is not None:
                x, y, valid = (t.to(self.device, non_blocking=True) for t in (x, y, valid))
            yield x, y, valid


def load_splits(data_cfg, vocab_size: int, launch_dir: Path, progress: bool,
                files: Optional[Sequence[Path]] = None, cache_dir: Optional[Path] = None) -> dict[str, np.ndarray]:
    """Token arrays ``{"train", "val"}`` (1-D; read-only memmaps: uint8 for the byte corpora, uint16/uint32 for
    token_bin, tokenized_text and python_stdlib_bpe, see :mod:`hydratrain.tokenized`) for ``data_cfg`` (a
    DataConfig). ``files``: python_stdlib(_bpe)'s files instead of the whole stdlib (tests). Relative data paths
    resolve against ``launch_dir`` (the run passes ``paths.data_dir``); caches go to ``cache_dir`` (the run passes
    ``data.cache_dir`` or ``paths.cache_dir``, see :class:`hydratrain.paths.Paths`), by default
    :func:`hydratrain.tokenized.cache_root`'s.

    Builds the cache when it is missing: call it on local rank 0 first, then barrier, then on the other ranks.
    Raises FileNotFoundError when a text_files ``data.paths`` pattern matches no file, and ConfigError for the token
    corpora (an id not below ``vocab_size``, a bad file or setting).
    """
    if data_cfg.name == "synthetic":
        stream = synthetic_stream(data_cfg.synthetic_tokens, vocab_size)
        cut = int(len(stream) * (1 - data_cfg.val_fraction))
        return {"train": stream[:cut], "val": stream[cut:]}
    from hydratrain.tokenized import TOKEN_CORPORA, cache_root, load_token_splits

    if data_cfg.name in TOKEN_CORPORA:
        return load_token_splits(data_cfg, vocab_size, launch_dir, progress, files, cache_dir)
    if data_cfg.name == "python_stdlib":
        root, all_files = stdlib_files()
        files = list(files) if files is not None else all_files
    else:
        files = expand_paths(list(data_cfg.paths), launch_dir)
        root = Path(os.path.commonpath([str(f.parent) for f in files]))
    out = build_corpus(files, root, data_cfg.val_fraction, cache_root(data_cfg, launch_dir, cache_dir), progress)
    splits = {s: np.memmap(out / f"{s}.bin", dtype=np.uint8, mode="r") for s in ("train", "val")}
    meta = json.loads((out / "meta.json").read_text())["splits"]
    log.info("data=%s: %s (train %d files / %d tokens, val %d files / %d tokens)", data_cfg.name, out,
             meta["train"]["files"], meta["train"]["tokens"], meta["val"]["files"], meta["val"]["tokens"])
    return splits


def data_vocabulary(cfg, info, launch_dir: Path, progress: bool, cache_dir: Optional[Path] = None):
    """(the data's tokenizer or None, the model's vocab size): ``model.vocab_size`` when set, else the data's (256
    for bytes, the tokenizer's size padded to a multiple of 64). Local rank 0 trains a missing BPE first while the
    node's other ranks wait. Raises :class:`~hydratrain.errors.ConfigError` (see
    :func:`hydratrain.tokenized.vocab_size_for`)."""
    from hydratrain.dist.collectives import barrier
    from hydratrain.tokenized import tokenizer_for, vocab_size_for

    tokenizer = tokenizer_for(cfg.data, launch_dir, progress and info.is_main, cache_dir=cache_dir) \
        if info.local_rank == 0 else None
    barrier()
    if info.local_rank != 0:
        tokenizer = tokenizer_for(cfg.data, launch_dir, cache_dir=cache_dir)
    return tokenizer, vocab_size_for(cfg.data, tokenizer, cfg.model.vocab_size)


def build_data(cfg, info, launch_dir: Path, progress: bool, vocab_size: int,
               cache_dir: Optional[Path] = None) -> tuple[ShardedBatches, EvalBatches]:
    """This rank's train micro-batches and eval set for the run config ``cfg`` and the model's ``vocab_size``.

    Local rank 0 builds missing caches first while the node's other ranks wait at a barrier. ``info`` is the
    :class:`~hydratrain.dist.env.DistInfo` (with its device). Raises :class:`~hydratrain.errors.ConfigError` when a
    split is too small for ``data.seq_len`` x ``data.batch_size`` x world size (naming its files, see
    :func:`split_error`), or holds an id >= ``vocab_size``.
    """
    from hydratrain.dist.collectives import barrier

    kwargs = dict(data_cfg=cfg.data, vocab_size=vocab_size, launch_dir=launch_dir,
                  progress=progress and info.is_main, cache_dir=cache_dir)
    splits = load_splits(**kwargs) if info.local_rank == 0 else None
    barrier()
    if splits is None:
        splits = load_splits(**kwargs)
    if info.world_size > 1:
        check_same_data(cfg.data, splits)
    try:
        train = ShardedBatches(TokenDataset(splits["train"], cfg.data.seq_len, vocab_size, "the train split"),
                               cfg.data.batch_size, info.rank,
                               info.world_size, seed=cfg.trainer.seed, device=info.device,
                               strict_position=cfg.checkpoint.restore_data_position)
    except ValueError as err:
        raise split_error(cfg.data, launch_dir, "train", len(splits["train"]), err) from None
    try:
        evals = EvalBatches(TokenDataset(splits["val"], cfg.data.seq_len, vocab_size, "the val split"),
                            cfg.trainer.eval_samples,
                            cfg.data.batch_size, info.rank, info.world_size, device=info.device)
    except ValueError as err:
        raise split_error(cfg.data, launch_dir, "val", len(splits["val"]), err) from None
    return train, evals


def data_fingerprint(splits: dict, windows: int = 64, window_tokens: int = 4096) -> str:
    """``train N tokens, val M tokens, <hash>`` of the token splits ``{"train", "val"}`` (1-D arrays): their lengths
    and dtypes and :func:`~hydratrain.dist.collectives.sampled_digest` of ``windows + 1`` windows of
    ``window_tokens`` tokens of each (the first and last included). Tells two copies of a corpus apart in
    milliseconds whatever its size (a sample, not a proof of identity)."""
    from hydratrain.dist.collectives import sampled_digest

    digest = hashlib.blake2b(digest_size=8)
    for name in ("train", "val"):
        tokens = splits[name]
        digest.update(f"{name}:{len(tokens)}:{tokens.dtype}".encode())
        sampled_digest(lambda start, n, tokens=tokens: np.ascontiguousarray(tokens[start:start + n]).tobytes(),
                       len(tokens), window_tokens, windows, digest)
    return f"train {len(splits['train']):,} tokens, val {len(splits['val']):,} tokens, {digest.hexdigest()}"


def check_same_data(data_cfg, splits: dict) -> None:
    """Every rank of the process group read the same data (:func:`data_fingerprint`, compared over ranks): the data
    paths may differ per node (node-local copies), and a copy that differs (stale, partial, another Python's
    stdlib for ``data=python_stdlib``) had each node train on its own corpus without a word, and hang at an eval of
    another length. Raises :class:`~hydratrain.errors.ConfigError` on every rank, naming the data key, the first
    rank whose data differs from rank 0's and both fingerprints."""
    from hydratrain.dist.collectives import unlike_rank0
    from hydratrain.errors import ConfigError

    unlike = unlike_rank0("", data_fingerprint(splits))
    if unlike is None:
        return
    other, every = unlike
    key, value = {"token_bin": ("data.train_path", data_cfg.get("train_path")),
                  "text_files": ("data.paths", list(data_cfg.get("paths") or [])),
                  "tokenized_text": ("data.paths", list(data_cfg.get("paths") or []))}.get(
        data_cfg.name, ("data", data_cfg.name))
    raise ConfigError(key, value, f"rank {other} read other data than rank 0 ({every[other][1]}; rank 0: "
                      f"{every[0][1]}): every rank, on every node, must read the same data (a node-local copy that "
                      "differs, a stale cache, another Python's standard library)")


def split_error(data_cfg, launch_dir: Path, split: str, tokens: int, err: Exception, shown: int = 5):
    """The :class:`~hydratrain.errors.ConfigError` for ``split`` ("train" or "val", ``tokens`` long) being too short
    (``err``), naming where its tokens come from: ``data.train_path`` / ``data.val_path`` and the file for
    token_bin; ``data.paths`` and the split's files (the first ``shown``; ``(empty)`` after a file of 0 bytes) for
    text_files and tokenized_text; ``data`` and its name for the built-in corpora."""
    from hydratrain.errors import ConfigError

    key, value, source = "data", data_cfg.name, ""
    if data_cfg.name == "token_bin":
        key, value = f"data.{split}_path", getattr(data_cfg, f"{split}_path")
        source = f" from {launch_dir / Path(value).expanduser()}"
    elif data_cfg.name in ("text_files", "tokenized_text"):
        key, value = "data.paths", list(data_cfg.paths)
        files = expand_paths(value, launch_dir)
        if len(files) == 1:
            share = 1 - data_cfg.val_fraction if split == "train" else data_cfg.val_fraction
            source = f" from the {'first' if split == 'train' else 'last'} {share:.0%} of {files[0]}"
        else:
            part = split_files(files, Path(os.path.commonpath([str(f.parent) for f in files])),
                               data_cfg.val_fraction)[split]
            named = [f"{f}{' (empty)' if f.stat().st_size == 0 else ''}" for f in part[:shown]]
            more = f" and {len(part) - shown} more" if len(part) > shown else ""
            source = f" from {', '.join(named)}{more}"
    return ConfigError(key, value, f"{split} split ({tokens} tokens){source}: {err}")
