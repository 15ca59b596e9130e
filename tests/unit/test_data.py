"""Corpora, caching, sharding across ranks, reproducible per-epoch order, resumable position."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from hydratrain.config.data import DataName
from hydratrain.data.build import data_fingerprint
from hydratrain.data.corpora import build_corpus, expand_paths, stdlib_files, synthetic_stream
from hydratrain.data.registry import CORPORA, corpus, is_byte_level
from hydratrain.data.streams import LoaderState, ShardedBatches, TokenDataset
from hydratrain.data.tokenized import preflight_data
from hydratrain.errors import ConfigError


def test_token_dataset_windows_shift_by_one():
    ds = TokenDataset(np.arange(100, dtype=np.uint8), seq_len=10)
    assert len(ds) == 9
    x, y = ds.batch([0, 3])
    assert x.shape == y.shape == (2, 10) and x.dtype == torch.int64
    assert x[1, 0] == 30 and y[1, -1] == 40 and torch.equal(x[:, 1:], y[:, :-1])


def _indices(batches: ShardedBatches, n: int) -> list[int]:
    it = iter(batches)
    return [int(x[i, 0]) for _ in range(n) for x, _ in [next(it)] for i in range(x.shape[0])]


def test_ranks_get_disjoint_shares_that_cover_the_epoch():
    ds = TokenDataset(np.arange(4000, dtype=np.int64), seq_len=10)  # x[0] == 10 * sample index
    seen = []
    for rank in range(2):
        b = ShardedBatches(ds, batch_size=4, rank=rank, world_size=2, seed=7)
        seen.append(set(_indices(b, b.batches_per_epoch)))
    assert not seen[0] & seen[1]
    assert len(seen[0] | seen[1]) == 2 * 4 * (399 // 2 // 4)


def test_order_is_seeded_changes_every_epoch_and_resumes():
    ds = TokenDataset(np.arange(4000, dtype=np.int64), seq_len=10)
    a = ShardedBatches(ds, batch_size=4, rank=0, world_size=2, seed=7)
    per_epoch = a.batches_per_epoch
    two_epochs = _indices(a, 2 * per_epoch)
    assert two_epochs[:4 * per_epoch] != two_epochs[4 * per_epoch:]
    b = ShardedBatches(ds, batch_size=4, rank=0, world_size=2, seed=7)
    assert _indices(b, 5) == two_epochs[:20]
    c = ShardedBatches(ds, batch_size=4, rank=0, world_size=2, seed=7)
    c.state = LoaderState(epoch=0, batch_in_epoch=5)
    assert _indices(c, per_epoch) == two_epochs[20:20 + 4 * per_epoch]
    assert _indices(ShardedBatches(ds, 4, 0, 2, seed=8), 5) != two_epochs[:20]


def test_too_little_data_is_a_clear_error():
    with pytest.raises(ValueError, match="data.batch_size"):
        ShardedBatches(TokenDataset(np.arange(50), seq_len=10), batch_size=8, rank=0, world_size=2, seed=0)


@pytest.mark.parametrize("n, batch_size, line", [
    # 1 train sample for 2 ranks: the data is too small, whatever data.batch_size is
    (2, 1, "data._target_='mypkg.data.spirals': train split: the split has 1 samples, fewer than world_size=2: use "
           "more data"),
    # 4 train samples, 2 a rank, for batches of 4: that one is data.batch_size's
    (5, 4, "data.batch_size=4: train split (4 samples): each rank has 2 samples per epoch, fewer than "
           "data.batch_size=4: use more data or a smaller data.batch_size"),
])
def test_a_dataset_node_too_small_for_the_ranks_names_the_data_not_the_batch_size(own, monkeypatch, n, batch_size,
                                                                                  line):
    from types import SimpleNamespace

    from hydratrain.data import loader

    monkeypatch.setattr(loader, "unlike_rank0", lambda *a: None)  # (rank 1's datasets: the same, no process group)
    cfg = OmegaConf.create({"data": {"_target_": "mypkg.data.spirals", "n": n, "batch_size": batch_size,
                                     "num_workers": 0},
                            "trainer": {"seed": 0}, "checkpoint": {"restore_data_position": True}})
    info = SimpleNamespace(rank=0, world_size=2, device=torch.device("cpu"))
    with pytest.raises(ConfigError) as err:
        loader.build_dataset_batches(cfg, info)
    assert str(err.value) == line


def test_stdlib_corpus_is_split_by_file_cached_and_reused(tmp_path):
    root, files = stdlib_files()
    assert len(files) > 500 and files == sorted(files)
    subset = files[:40]
    out = build_corpus(subset, root, 0.1, tmp_path, progress=False)
    meta = (out / "meta.json").read_text()
    train = np.memmap(out / "train.bin", dtype=np.uint8, mode="r")
    val = np.memmap(out / "val.bin", dtype=np.uint8, mode="r")
    assert len(train) + len(val) == sum(f.stat().st_size + 2 for f in subset)
    assert len(val) > 0 and len(train) > len(val)
    first_val_bytes = bytes(val[:200])
    assert any(f.read_bytes().startswith(first_val_bytes[:100]) for f in subset)  # val starts at a file boundary
    mtime = (out / "train.bin").stat().st_mtime_ns
    assert build_corpus(subset, root, 0.1, tmp_path, progress=False) == out
    assert (out / "train.bin").stat().st_mtime_ns == mtime and (out / "meta.json").read_text() == meta


@pytest.mark.parametrize("damage", ["truncated", "empty", "meta"])
def test_a_damaged_byte_corpus_is_rebuilt_with_one_warning(tmp_path, caplog, damage):
    """A corpus file truncated after its build no longer matches the size meta.json records: it is rebuilt with one
    warning naming it, not read as it is (a quarter of the data, silently)."""
    root, files = stdlib_files()
    out = build_corpus(files[:10], root, 0.1, tmp_path, progress=False)
    want = (out / "train.bin").read_bytes()
    target = out / ("meta.json" if damage == "meta" else "train.bin")
    if damage == "meta":
        target.write_text("{")
    else:
        os.truncate(target, 0 if damage == "empty" else len(want) // 4 * 2)
    caplog.clear()
    assert build_corpus(files[:10], root, 0.1, tmp_path, progress=False) == out
    assert (out / "train.bin").read_bytes() == want
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and str(target) in warnings[0] and "rebuilding" in warnings[0], warnings


def test_text_files_globs_resolve_against_launch_dir(tmp_path):
    (tmp_path / "a").mkdir()
    for i in range(3):
        (tmp_path / "a" / f"f{i}.txt").write_text(f"file {i}\n" * 50)
    files = expand_paths(["a/*.txt"], tmp_path)
    assert [f.name for f in files] == ["f0.txt", "f1.txt", "f2.txt"]
    with pytest.raises(FileNotFoundError, match="data.paths: 'b/\\*.txt' matches no file"):
        expand_paths(["b/*.txt"], tmp_path)
    out = build_corpus(files, tmp_path, 0.3, tmp_path / "cache", progress=False)
    assert (out / "train.bin").stat().st_size > 0 and (out / "val.bin").stat().st_size > 0


def test_synthetic_stream_is_deterministic_and_in_vocab():
    a, b = synthetic_stream(5000, 256), synthetic_stream(5000, 256)
    assert np.array_equal(a, b) and len(a) == 5000 and a.max() < 256
    assert synthetic_stream(5000, 32000).dtype == np.uint16


def test_each_data_option_has_one_registry_entry_that_answers_for_it(tmp_path):
    """The registry holds one entry per built-in data option (config.schema's DataName) and nothing else, found by the
    option as by its name; an unknown name is a one-line error naming data; the byte-level and BPE-training corpora
    are those the other checks expect; text_files' globs are checked before the run, as tokenized_text's are."""
    assert sorted(CORPORA) == sorted(DataName.values())
    assert all(corpus(DataName(name)) is entry and entry.name == name for name, entry in CORPORA.items())
    assert [n for n in CORPORA if is_byte_level(n)] == ["python_stdlib", "text_files"] and not is_byte_level(None)
    assert [n for n, c in CORPORA.items() if c.trains_bpe] == ["tokenized_text", "python_stdlib_bpe", "hf_dataset"]
    with pytest.raises(ConfigError, match=r"^data='digits': not a built-in corpus; allowed: synthetic, python_stdlib"):
        corpus("digits")
    for name in ("text_files", "tokenized_text"):
        with pytest.raises(ConfigError, match=rf"^data.paths=\['b/\*.txt'\]: 'b/\*.txt' matches no file "
                                              rf"\(looked in {tmp_path}\)$"):
            preflight_data(OmegaConf.create({"name": name, "paths": ["b/*.txt"], "tokenizer": None}), tmp_path)


@pytest.mark.parametrize("empty", ["val", "train"])
def test_a_split_too_short_names_its_key_and_files(compose, tmp_path, empty):
    """Two text files, one empty: the split it lands in is a one-line error naming data.paths and that file (the
    last file goes to val when the hash leaves val empty); a short token_bin file names data.val_path and its path."""
    from hydratrain.data.build import build_data
    from hydratrain.dist.env import DistInfo
    from hydratrain.errors import ConfigError

    (tmp_path / "d").mkdir()
    full, hollow = ("a.txt", "b.txt") if empty == "val" else ("b.txt", "a.txt")
    (tmp_path / "d" / full).write_text("hello world\n" * 300)
    (tmp_path / "d" / hollow).write_text("")
    info = DistInfo(device=torch.device("cpu"))
    cfg = compose(["+debug=fast_gpt", "data=text_files", "data.paths=[d/*.txt]"])
    with pytest.raises(ConfigError) as err:
        build_data(cfg, info, tmp_path, False, 256, cache_dir=tmp_path / "cache")
    assert str(err.value).startswith(f"data.paths=['d/*.txt']: {empty} split (2 tokens) from "
                                     f"{tmp_path / 'd' / hollow} (empty): the split has ")
    if empty == "val":
        np.arange(3000, dtype=np.uint16).tofile(tmp_path / "train.bin")
        np.arange(10, dtype=np.uint16).tofile(tmp_path / "val.bin")
        cfg = compose(["+debug=fast_gpt", "data=token_bin", "data.train_path=train.bin", "data.val_path=val.bin",
                       "model.vocab_size=3000"])
        with pytest.raises(ConfigError, match=rf"^data.val_path='val.bin': val split \(10 tokens\) from "
                                              rf"{tmp_path / 'val.bin'}: the split has no sample"):
            build_data(cfg, info, tmp_path, False, 3000, cache_dir=tmp_path / "cache")


def test_a_pattern_matching_nothing_says_where_it_looked(compose, tmp_path, monkeypatch):
    """A relative pattern looked in the base dir; an absolute one (or one under ~) looked for itself, not in the launch
    dir; the same for checkpoint.resume_from / model.init_from at the job check."""
    from hydratrain.config.validate import check_environment
    from hydratrain.errors import ConfigError

    (tmp_path / "home" / "notes").mkdir(parents=True)
    (tmp_path / "home" / "notes" / "a.md").write_text("x\n")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    launch = tmp_path / "launch"
    assert expand_paths(["~/notes/*.md"], launch) == [tmp_path / "home" / "notes" / "a.md"]
    for pattern, where in [("b/*.txt", f"looked in {launch}"),
                           (f"{tmp_path}/nowhere/*.txt", f"looked for the absolute pattern {tmp_path}/nowhere/*.txt"),
                           ("~/other/*.md", f"looked for the absolute pattern {tmp_path}/home/other/*.md")]:
        with pytest.raises(FileNotFoundError) as err:
            expand_paths([pattern], launch)
        assert str(err.value) == f"data.paths: {pattern!r} matches no file ({where})"
    cfg = compose(["+debug=fast_gpt", "strategy=single", "device=cpu",
                   f"checkpoint.resume_from={tmp_path}/ckpt/step_1"])
    with pytest.raises(ConfigError, match=rf"^checkpoint.resume_from='{tmp_path}/ckpt/step_1': no such path "
                                          rf"\(looked for {tmp_path}/ckpt/step_1\)$"):
        check_environment(cfg, 1, launch)


def test_a_datasets_fingerprint_holds_images_and_augmentation_and_draws_nothing_from_the_global_rng():
    """Ranks compare their datasets' fingerprints before the model is built from the global RNG: samples that are
    PIL images (whose repr holds a memory address) or drawn through a random augmentation fingerprint alike in every
    process, the global RNG moves not at all, and other pixels are another figure."""
    from PIL import Image

    from hydratrain.data.loader import dataset_fingerprint

    class Augmented:
        def __init__(self, shade: int = 0):
            self.shade = shade

        def __len__(self):
            return 12

        def __getitem__(self, i):
            jitter = torch.rand(3)  # a random transform, as torchvision's draw from torch's global RNG
            return Image.new("RGB", (4, 4), (i + self.shade, 0, 0)), jitter, i % 3

    splits = {"train": Augmented(), "val": Augmented()}
    torch.manual_seed(5)
    before = torch.get_rng_state()
    first = dataset_fingerprint(splits)
    assert torch.equal(torch.get_rng_state(), before)
    assert dataset_fingerprint({"train": Augmented(), "val": Augmented()}) == first  # other objects, same samples
    assert dataset_fingerprint({"train": Augmented(1), "val": Augmented()}) != first


def test_fingerprints_tell_copies_apart_by_length_or_a_sampled_window(tmp_path):
    """The data and weights fingerprints that ranks compare (node-local copies may differ) share one
    sampler: equal copies agree, and a changed length, dtype or item inside a sampled window changes the figure."""
    from hydratrain.checkpoint.io import file_fingerprint

    rng = np.random.default_rng(0)
    splits = {"train": rng.integers(0, 50_000, 100_000, dtype=np.uint16), "val": np.arange(5_000, dtype=np.uint16)}
    same = {k: v.copy() for k, v in splits.items()}
    assert data_fingerprint(same) == data_fingerprint(splits)
    assert data_fingerprint(splits).startswith("train 100,000 tokens, val 5,000 tokens, ")
    changed = {k: v.copy() for k, v in splits.items()}
    changed["train"][-1] += 1  # the last window always counts
    shorter = {"train": splits["train"][:-1], "val": splits["val"]}
    wider = {"train": splits["train"].astype(np.uint32), "val": splits["val"]}
    figures = {data_fingerprint(d) for d in (splits, changed, shorter, wider)}
    assert len(figures) == 4

    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    payload = rng.bytes(3 << 20)
    a.write_bytes(payload)
    b.write_bytes(payload)
    assert file_fingerprint(a) == file_fingerprint(b)
    b.write_bytes(b"x" + payload[1:])  # the first window (a safetensors header) always counts
    assert file_fingerprint(b) != file_fingerprint(a)
    assert file_fingerprint(a).startswith(f"{3 << 20:,} bytes, ")


def test_double_star_does_not_walk_symlinked_dirs(tmp_path):
    """Two links to a parent dir made ``**`` walk 2^40 paths, a silent hang at start. ``**`` now skips
    symlinked dirs (and hidden names, as before); a symlinked file, or a symlinked dir named in the pattern, counts."""
    import time

    (tmp_path / "sub").mkdir()
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "real").mkdir()
    for name in ("a.py", "sub/b.py", ".hidden/h.py", "real/r.py"):
        (tmp_path / name).write_text("x = 1\n")
    for link, target in (("sub/up", ".."), ("sub/up2", ".."), ("linked", "real"), ("sub/rl.py", "../real/r.py")):
        (tmp_path / link).symlink_to(target)
    started = time.monotonic()
    assert expand_paths(["**/*.py"], tmp_path) == [tmp_path / "a.py", tmp_path / "real/r.py", tmp_path / "sub/b.py"]
    assert time.monotonic() - started < 5
    assert expand_paths(["linked/*.py"], tmp_path) == [tmp_path / "real/r.py"]


def test_a_failed_cache_build_leaves_no_partial_file(tmp_path):
    """A corpus build that a full disk stopped kept its partial ``train.bin.tmp<pid>``, the file that filled the
    disk, until a later build. A failed build removes it; the error goes on."""
    import errno

    from hydratrain.data.cache import build_lock

    out = tmp_path / "cache" / "abc"
    with pytest.raises(OSError):
        with build_lock(out):
            out.mkdir(parents=True)
            (out / "train.bin.tmp42").write_bytes(b"x" * 1000)
            raise OSError(errno.ENOSPC, "No space left on device")
    assert list(out.iterdir()) == []


def test_a_complete_cache_is_used_without_a_write(tmp_path, monkeypatch):
    """A corpus cache built once on a shared or read-only dir stopped every later run at its lock file (``Read-only
    file system`` / ``Permission denied`` on ``.<key>.lock``) before the complete cache was even read."""
    import errno
    from pathlib import Path

    from hydratrain.data import cache, corpora

    root = tmp_path / "text"
    root.mkdir()
    files = []
    for name in ("a.txt", "b.txt", "c.txt"):
        (root / name).write_text(name * 200)
        files.append(root / name)
    out = corpora.build_corpus(files, root, 0.34, tmp_path / "cache", progress=False)

    def refused(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(Path, "mkdir", refused)
    monkeypatch.setattr(cache.fcntl, "flock", refused)
    monkeypatch.setattr(Path, "write_bytes", refused)
    assert corpora.build_corpus(files, root, 0.34, tmp_path / "cache", progress=False) == out


def test_a_datasets_position_resumes_exactly_on_another_world_size_and_batch_with_loader_workers():
    """Map-style datasets through DataLoader workers (data/loader.py): samples are chosen in this process, so the
    position a checkpoint saves continues on any world size and batch size with nothing repeated or skipped, and
    every epoch's order is new (set_epoch) without a worker holding a stale one."""
    import torch
    from omegaconf import OmegaConf
    from torch.utils.data import TensorDataset

    from hydratrain.data.loader import loader_fetch
    from hydratrain.data.streams import ShardedBatches

    dataset = TensorDataset(torch.arange(40), torch.arange(40))
    node = OmegaConf.create({"_target_": "x", "num_workers": 2})

    def batches(rank, world, batch, state=None):
        b = ShardedBatches(dataset, batch, rank, world, seed=7, fetch=loader_fetch(dataset, node, torch.device("cpu")))
        if state is not None:
            b.load_state_dict(state)
        return b

    ranks = [batches(r, 2, 3) for r in range(2)]
    seen = []
    for b in ranks:  # 3 micro-batches per rank: 18 samples of epoch 0
        it = iter(b)
        seen += [int(i) for _ in range(3) for i in next(it)[0]]
    state = ranks[0].state_dict()
    assert state["samples_in_epoch"] == 18 and len(set(seen)) == 18
    rest = batches(0, 1, 4, state)  # one rank, micro-batches of 4: the 20 samples of epoch 0 that are left (2 spare)
    it = iter(rest)
    later = [int(i) for _ in range(5) for i in next(it)[0]]
    assert not set(later) & set(seen) and len(set(seen) | set(later)) == 38
    nxt = [int(i) for _ in range(10) for i in next(it)[0]]  # epoch 1: another order, all 40 again
    assert sorted(nxt) == list(range(40)) and nxt != seen + later[:2]


def test_persistent_workers_serve_every_eval_and_a_probe_does_not_take_them():
    """``data.persistent_workers=true``: every eval of a run is served by the same loader workers (a loader made per
    eval started new ones each time, so the setting did nothing); a fetch made while another is under way (a probe
    next to the epoch's batches) gets a loader of its own; an eval abandoned midway leaves the next one whole."""
    import os

    import torch
    from omegaconf import OmegaConf

    from hydratrain.data.loader import loader_fetch
    from hydratrain.data.streams import EvalBatches

    class Pids(torch.utils.data.Dataset):  # each sample: its index and the pid of the process that loaded it
        def __len__(self):
            return 12

        def __getitem__(self, i):
            return torch.tensor(i), torch.tensor(os.getpid())

    def run(persistent):
        node = OmegaConf.create({"_target_": "x", "num_workers": 1, "persistent_workers": persistent})
        fetch = loader_fetch(Pids(), node, torch.device("cpu"))
        evals = EvalBatches(Pids(), 12, 4, 0, 1, device=torch.device("cpu"), fetch=fetch)
        pids, indices = [], []
        for _ in range(2):
            batches = [b for b, _ in evals]
            pids.append({int(p) for _, ps in batches for p in ps})
            indices.append([int(i) for i, _ in batches for i in i])
        half = iter(evals)
        next(half)  # an eval that stops after its first batch
        during = next(iter(fetch([[0, 1]])))  # a probe while it is held
        del half
        after = [int(i) for (b, _), _ in evals for i in b]
        return pids, indices, int(during[1][0]), after

    pids, indices, probe, after = run(True)
    assert len(pids[0]) == 1 and pids[0] == pids[1] and os.getpid() not in pids[0]  # one worker served both evals
    assert sorted(indices[0]) == list(range(12)) and indices[1] == after == indices[0]
    assert probe not in pids[0] | {os.getpid()}  # the probe's own loader
    pids, *_ = run(False)
    assert pids[0] != pids[1]  # a new worker per eval
