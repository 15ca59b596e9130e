"""Subword data: token_bin files (llm.c header or not), tokenized_text and python_stdlib_bpe caches, the tokenizer
CLI, vocab sizing, decoding. Tokenizers are trained on a few KB, so each test takes a second or two."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from hydratrain.data.build import load_splits
from hydratrain.data.corpora import split_files, stdlib_files
from hydratrain.data.token_bin import open_token_bin
from hydratrain.data.token_cache import SAMPLE_TOKENS, build_token_cache, check_token_ids, max_token_id
from hydratrain.data.tokenized import preflight_data, tokenizer_for, vocab_size_for
from hydratrain.data.tokenizer import EOT, load_tokenizer, padded_vocab_size, read_pieces, train_bpe, undecodable
from hydratrain.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TEXT = ("def add(a, b):\n    return a + b\n\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"
        "        self.y = y  # coordinates in metres, caf\u00e9 \u2713 \u00fcber \u65e5\u672c\n\n")


def data_cfg(**kw):
    """A data node with every data option's keys (untyped, so the functions' own checks see bad values)."""
    return OmegaConf.create({"seq_len": 256, "batch_size": 8, "val_fraction": 0.02, "cache_dir": None, "paths": [],
                             "train_path": None, "val_path": None, "dtype": None, "tokenizer": None,
                             "vocab_size": 4096, **kw})


def write_llmc(path: Path, tokens: np.ndarray, magic: int, version: int, count: int | None = None) -> None:
    """An llm.c-style data file: 256 little-endian int32 (magic, version, token count, zeros), then the tokens."""
    header = np.zeros(256, dtype="<i4")
    header[:3] = magic, version, len(tokens) if count is None else count
    path.write_bytes(header.tobytes() + tokens.tobytes())


def make_texts(root: Path, n: int = 12) -> list[Path]:
    (root / "docs").mkdir(parents=True, exist_ok=True)
    files = []
    for i in range(n):
        f = root / "docs" / f"part{i:02d}.txt"
        f.write_text(f"# part {i}\n" + TEXT.replace("Point", f"Point{i}") * (3 + i % 4), encoding="utf-8")
        files.append(f)
    return files


def decoded_split(tok, tokens) -> str:
    return tok.decode(np.asarray(tokens))


# --- token_bin ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,magic,version", [("uint16", 20240520, 1), ("uint32", 20240801, 7)])
@pytest.mark.parametrize("header", [False, True], ids=["plain", "llmc_header"])
def test_token_bin_reads_plain_and_llmc_files(tmp_path, dtype, magic, version, header):
    top = 60_000 if dtype == "uint16" else 120_000
    rng = np.random.default_rng(0)
    tokens = {s: rng.integers(0, top, 5000 + i).astype(dtype) for i, s in enumerate(["train", "val"])}
    for split, t in tokens.items():
        if header:
            write_llmc(tmp_path / f"{split}.bin", t, magic, version)
        else:
            (tmp_path / f"{split}.bin").write_bytes(t.tobytes())
    cfg = data_cfg(name="token_bin", train_path="train.bin", val_path="val.bin",
                   dtype=None if header else dtype)  # with a header the dtype comes from it
    splits = load_splits(cfg, top, tmp_path, progress=False)  # paths relative to the launch dir
    for split, t in tokens.items():
        assert isinstance(splits[split], np.memmap) and splits[split].dtype == np.dtype(dtype)
        assert splits[split].offset == (1024 if header else 0) and np.array_equal(splits[split], t)
    if header:  # an explicit dtype must agree with the header's
        other = "uint32" if dtype == "uint16" else "uint16"
        with pytest.raises(ConfigError, match=f"^data.dtype='{other}': data.train_path=.* has an llm.c header of "
                                              f"{dtype} tokens; allowed: {dtype}, null$"):
            load_splits(data_cfg(name="token_bin", train_path="train.bin", val_path="val.bin", dtype=other), top,
                        tmp_path, progress=False)


def test_token_bin_bad_files_are_one_line_errors(tmp_path):
    t = np.arange(1000, dtype=np.uint16)
    write_llmc(tmp_path / "short.bin", t, 20240520, 1, count=2000)  # header promises more than the file has
    with pytest.raises(ConfigError, match=r"^data.val_path='.*short.bin': its llm.c header says 2000 uint16 tokens "
                                          r"\(5024 bytes\) but the file has 3024 bytes$"):
        open_token_bin(tmp_path / "short.bin", None, "data.val_path")
    write_llmc(tmp_path / "v2.bin", t, 20240520, 2)
    with pytest.raises(ConfigError, match="version 2; known: 20240520 v1"):
        open_token_bin(tmp_path / "v2.bin")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(ConfigError, match="3 bytes of tokens is not a multiple of data.dtype=uint16's 2"):
        open_token_bin(tmp_path / "odd.bin")
    with pytest.raises(ConfigError, match="^data.train_path='.*nope.bin': no such file$"):
        open_token_bin(tmp_path / "nope.bin")
    with pytest.raises(ConfigError, match="^data.dtype='int8': allowed: uint16, uint32, null"):
        open_token_bin(tmp_path / "odd.bin", "int8")
    (tmp_path / "ok.bin").write_bytes(t.tobytes())
    with pytest.raises(ConfigError, match="^data.val_path=None: data=token_bin needs a token file for each split$"):
        preflight_data(data_cfg(name="token_bin", train_path="ok.bin"), tmp_path)


def test_max_id_check_on_a_sample_at_start_and_fully(tmp_path):
    n = 4 * SAMPLE_TOKENS
    t = np.zeros(n, dtype=np.uint16)
    width = SAMPLE_TOKENS // 64
    starts = np.linspace(0, n - width, 64).astype(np.int64)
    hidden = int(starts[10] + width + 5)  # between two sampled windows
    t[hidden] = 999
    (tmp_path / "train.bin").write_bytes(t.tobytes())
    (tmp_path / "val.bin").write_bytes(np.arange(100, dtype=np.uint16).tobytes())
    tokens = open_token_bin(tmp_path / "train.bin")
    assert max_token_id(tokens) == 0 and max_token_id(tokens, sample=None) == 999
    cfg = data_cfg(name="token_bin", train_path="train.bin", val_path="val.bin")
    load_splits(cfg, 512, tmp_path, progress=False)  # the start-up sample misses the one bad id
    with pytest.raises(ConfigError, match=r"^model.vocab_size=512: data.train_path=.*train.bin holds token id 999 "
                                          rf"\(in all of its {n} tokens\); allowed: model.vocab_size > 999$"):
        check_token_ids(tokens, 512, "data.train_path", tmp_path / "train.bin", sample=None)
    t[-1] = 700  # the last window is always sampled
    (tmp_path / "train.bin").write_bytes(t.tobytes())
    with pytest.raises(ConfigError, match=rf"^model.vocab_size=512: data.train_path=.* holds token id 700 \(in a "
                                          rf"sample of {SAMPLE_TOKENS} of its {n} tokens\)"):
        load_splits(cfg, 512, tmp_path, progress=False)
    t[-1] = 0
    (tmp_path / "train.bin").write_bytes(t.tobytes())
    with pytest.raises(ConfigError, match="^model.vocab_size=64: data.val_path=.*val.bin holds token id 99 "):
        load_splits(cfg, 64, tmp_path, progress=False)


def _rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs /proc")
def test_token_bin_is_memory_mapped_not_loaded(tmp_path):
    big = tmp_path / "train.bin"
    with open(big, "wb") as fh:  # 2 GiB of zeros, sparse on disk: far more than this test may take in RAM
        fh.truncate(2 << 30)
    (tmp_path / "val.bin").write_bytes(np.arange(100, dtype=np.uint16).tobytes())
    before = _rss_bytes()
    splits = load_splits(data_cfg(name="token_bin", train_path=str(big), val_path="val.bin"), 50304, tmp_path, False)
    grew = _rss_bytes() - before
    assert isinstance(splits["train"], np.memmap) and len(splits["train"]) == 1 << 30
    assert grew < 64 << 20, f"resident memory grew by {grew / 2**20:.0f} MiB opening a 2 GiB token file"
    window = np.asarray(splits["train"][123_456_789:123_456_789 + 257])  # a rank reads only its windows
    assert window.shape == (257,) and _rss_bytes() - before < 64 << 20


# --- tokenizer ----------------------------------------------------------------------------------------------------

def test_bpe_decodes_its_encoding_and_saves_next_to_weights(tmp_path):
    tok = train_bpe([TEXT * 20], 300, tmp_path / "a" / "tokenizer.json")
    assert tok.vocab_size <= 300 and tok.tok.token_to_id(EOT) == 0 and tok.dtype == np.uint16
    for text in (TEXT, "x = '\u00e9\u2713\U0001f600'\r\n\tz", ""):
        ids = tok.encode(text)
        assert tok.decode(ids) == text and tok.decode(np.asarray(ids, dtype=np.uint16)) == text
    assert tok.decode([*tok.encode("a = 1"), 0]) == "a = 1" + EOT  # special tokens stay visible
    assert tok.decode([tok.vocab_size + 5, *tok.encode("b")]) == "b"  # padding ids are dropped
    run_dir = tmp_path / "run"
    saved = tok.save(run_dir)
    assert saved == run_dir / "tokenizer.json" and saved.read_bytes() == tok.path.read_bytes()
    again = load_tokenizer(saved)
    assert again.sha == tok.sha and again.decode(again.encode(TEXT)) == TEXT
    assert not list(run_dir.glob("*.tmp*"))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match="^data.tokenizer='.*bad.json': not a tokenizers tokenizer.json"):
        load_tokenizer(tmp_path / "bad.json")


def test_read_pieces_cover_the_file_at_line_and_character_boundaries(tmp_path):
    f = tmp_path / "t.txt"
    text = TEXT * 7 + "\u65e5" * 50  # a last line longer than a piece, of 3-byte characters
    f.write_bytes(text.encode())
    pieces = list(read_pieces(f, piece_bytes=16))
    assert "".join(pieces) == text and len(pieces) > 10
    assert not any("\ufffd" in p for p in pieces)  # never cut inside a character
    assert all(len(p.encode()) <= 2 * 16 + 3 for p in pieces)  # a piece, the rest of its line up to a piece more
    assert all(p.endswith("\n") or len(p.encode()) >= 32 for p in pieces[:-1])
    assert list(read_pieces(f)) == [text]
    cut = len(TEXT.encode()) * 3
    assert "".join(read_pieces(f, 0, cut, piece_bytes=16)) + "".join(read_pieces(f, cut, piece_bytes=16)) == text


def test_vocab_size_padding_and_explicit_values(tmp_path):
    tok = train_bpe([TEXT * 20], 300, tmp_path / "tokenizer.json")
    n = tok.vocab_size
    cfg = data_cfg(name="tokenized_text", paths=["x"])
    assert padded_vocab_size(257) == 320 and padded_vocab_size(320) == 320 and padded_vocab_size(50257) == 50304
    assert vocab_size_for(cfg, tok, None) == padded_vocab_size(n) and vocab_size_for(cfg, tok, n) == n
    assert vocab_size_for(cfg, tok, 1000) == 1000
    with pytest.raises(ConfigError, match=rf"^model.vocab_size=256: smaller than the tokenizer's {n} tokens \(.*"
                                          rf"tokenizer.json\) of data=tokenized_text; allowed: >= {n}, or null for "
                                          rf"{padded_vocab_size(n)}$"):
        vocab_size_for(cfg, tok, 256)
    assert vocab_size_for(data_cfg(name="python_stdlib"), None, None) == 256
    with pytest.raises(ConfigError, match="^model.vocab_size=100: smaller than the 256 byte values"):
        vocab_size_for(data_cfg(name="text_files"), None, 100)
    with pytest.raises(ConfigError, match="^model.vocab_size=None: data=token_bin has no tokenizer"):
        vocab_size_for(data_cfg(name="token_bin"), None, None)
    assert vocab_size_for(data_cfg(name="token_bin"), None, 50304) == 50304
    assert vocab_size_for(data_cfg(name="token_bin"), tok, None) == padded_vocab_size(n)


# --- tokenized_text -----------------------------------------------------------------------------------------------

def test_tokenized_text_trains_a_bpe_on_the_train_split_and_caches(tmp_path, monkeypatch, caplog):
    files = make_texts(tmp_path)
    cfg = data_cfg(name="tokenized_text", paths=["docs/*.txt"], vocab_size=300, val_fraction=0.2,
                   cache_dir="cache")  # relative: to the launch dir
    with caplog.at_level(logging.INFO, "hydratrain.data"):
        tok = tokenizer_for(cfg, tmp_path)
        assert tok.path.parent.parent == tmp_path / "cache" and tok.vocab_size <= 300
        splits = load_splits(cfg, vocab_size_for(cfg, tok, None), tmp_path, progress=False)
    # each long phase says it starts (off a terminal there is no bar), then what it did
    said = [r.getMessage().split(" ")[0] for r in caplog.records if r.name == "hydratrain.data.token_cache"]
    assert said[:2] == ["training", "trained"] and said[2:4] == ["tokenizing", "tokenized"], said
    by_file = split_files(files, tmp_path / "docs", 0.2)
    assert by_file["val"] and by_file["train"]
    for split in ("train", "val"):
        assert isinstance(splits[split], np.memmap) and splits[split].dtype == np.uint16
        want = "".join(f.read_text(encoding="utf-8") + EOT for f in by_file[split])
        assert decoded_split(tok, splits[split]) == want  # split by file, lossless, a separator after each file
    out = Path(splits["train"].filename).parent
    assert (out / "tokenizer.json").read_bytes() == tok.path.read_bytes()
    stamps = {p.name: p.stat().st_mtime_ns for p in [*out.iterdir(), tok.path]}

    def fail(*a, **k):
        raise AssertionError("did the same work twice")

    monkeypatch.setattr("hydratrain.data.token_cache.train_bpe", fail)
    monkeypatch.setattr("hydratrain.data.tokenizer.TextTokenizer.encode_batch", fail)
    again = load_splits(cfg, 320, tmp_path, progress=False)  # reused: no retraining, no retokenizing
    assert Path(again["train"].filename).parent == out
    assert {p.name: p.stat().st_mtime_ns for p in [*out.iterdir(), tok.path]} == stamps


def test_tokenized_text_cache_follows_file_changes(tmp_path):
    files = make_texts(tmp_path, n=6)
    cfg = data_cfg(name="tokenized_text", paths=["docs/*.txt"], vocab_size=300, val_fraction=0.2, cache_dir="cache")
    first = load_splits(cfg, 320, tmp_path, progress=False)
    old = Path(first["train"].filename).parent
    train_file = split_files(files, tmp_path / "docs", 0.2)["train"][0]
    text = train_file.read_text(encoding="utf-8")
    train_file.write_text(text.replace("return a + b", "return a - b"), encoding="utf-8")  # same size
    st = train_file.stat()
    os.utime(train_file, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # an edit a second later
    second = load_splits(cfg, 320, tmp_path, progress=False)
    new = Path(second["train"].filename).parent
    assert new != old and (old / "meta.json").exists()  # old cache untouched
    tok = load_tokenizer(new / "tokenizer.json")
    assert "return a - b" in decoded_split(tok, second["train"])


def test_tokenized_text_with_a_given_tokenizer_json(tmp_path):
    files = make_texts(tmp_path, n=4)
    big = train_bpe([TEXT * 50], 400, tmp_path / "tok" / "tokenizer.json")
    cfg = data_cfg(name="tokenized_text", paths=["docs/part0*.txt"], tokenizer="tok/tokenizer.json",
                   val_fraction=0.3, cache_dir=str(tmp_path / "cache"))
    tok = tokenizer_for(cfg, tmp_path)
    assert tok.sha == big.sha
    splits = load_splits(cfg, vocab_size_for(cfg, tok, None), tmp_path, progress=False)
    assert decoded_split(tok, splits["train"]) + decoded_split(tok, splits["val"]) != ""
    by_file = split_files(files, tmp_path / "docs", 0.3)
    assert decoded_split(tok, splits["val"]) == "".join(f.read_text() + EOT for f in by_file["val"])
    assert not list((tmp_path / "cache").glob("bpe-*"))  # nothing trained
    with pytest.raises(ConfigError, match=rf"^model.vocab_size=300: smaller than the tokenizer's {tok.vocab_size}"):
        load_splits(cfg, 300, tmp_path, progress=False)
    with pytest.raises(ConfigError, match="^data.tokenizer='.*missing.json': no such file"):
        preflight_data(data_cfg(name="tokenized_text", paths=["docs/*.txt"], tokenizer="missing.json"), tmp_path)
    with pytest.raises(ConfigError, match=r"^data.paths=\['nothing/\*.md'\]: 'nothing/\*.md' matches no file"):
        preflight_data(data_cfg(name="tokenized_text", paths=["nothing/*.md"]), tmp_path)


def test_one_file_is_split_at_a_line_start(tmp_path):
    (tmp_path / "book.txt").write_text(TEXT * 40, encoding="utf-8")
    cfg = data_cfg(name="tokenized_text", paths=["book.txt"], vocab_size=300, val_fraction=0.1, cache_dir="c")
    tok = tokenizer_for(cfg, tmp_path)
    splits = load_splits(cfg, 320, tmp_path, progress=False)
    train, val = decoded_split(tok, splits["train"]), decoded_split(tok, splits["val"])
    assert train.endswith("\n" + EOT) and val.endswith(EOT)
    assert train[:-len(EOT)] + val[:-len(EOT)] == TEXT * 40
    assert 0.05 < len(val) / (len(train) + len(val)) < 0.15


def test_concurrent_builders_tokenize_once(tmp_path, monkeypatch):
    make_texts(tmp_path, n=6)
    tok = train_bpe([TEXT * 20], 300, tmp_path / "tokenizer.json")
    from hydratrain.data.corpora import expand_paths

    files = expand_paths(["docs/*.txt"], tmp_path)
    calls, real = [], type(tok).encode_batch

    def slow_counting(self, texts):
        calls.append(len(texts))
        time.sleep(0.3)
        return real(self, texts)

    monkeypatch.setattr(type(tok), "encode_batch", slow_counting)
    outs = []
    threads = [threading.Thread(target=lambda: outs.append(build_token_cache(files, tmp_path / "docs", 0.2, tok,
                                                                             tmp_path / "cache", False)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(outs)) == 1 and len(calls) == 2  # one batch per split, by one builder only


# --- the tokenizer CLI --------------------------------------------------------------------------------------------

def test_tokenizer_cli_trains_on_the_train_split(tmp_path):
    make_texts(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "hydratrain.tokenizer", "train", "--vocab-size", "300", "--out", "tok",
           "--val-fraction", "0.2", "--quiet", "docs/*.txt"]
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = tmp_path / "tok" / "tokenizer.json"
    n_train = len(split_files(sorted((tmp_path / "docs").glob("*.txt")), tmp_path / "docs", 0.2)["train"])
    assert res.stdout.strip().startswith(f"wrote {out} (") and f"trained on {n_train} of 12 file(s)" in res.stdout
    tok = load_tokenizer(out)
    assert tok.decode(tok.encode(TEXT)) == TEXT
    # the same tokenizer data=tokenized_text trains itself on the same files and split
    cfg = data_cfg(name="tokenized_text", paths=["docs/*.txt"], vocab_size=300, val_fraction=0.2, cache_dir="c")
    assert tokenizer_for(cfg, tmp_path).sha == tok.sha
    bad = subprocess.run(cmd[:-1] + ["nothing/*.md"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "'nothing/*.md' matches no file" in bad.stderr


def test_tokenizer_cli_checks_out_before_training_and_takes_a_json_file_name(tmp_path, monkeypatch, capsys):
    """--out naming a file gave a traceback after the whole training, and --out tok/tokenizer.json made a
    directory of that name, which data.tokenizer then called "no such file"."""
    from hydratrain.tokenizer import main

    make_texts(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("hydratrain.tokenizer.train_bpe",
                        lambda *a, **k: pytest.fail("trained before --out's check"))
    (tmp_path / "a_file").write_text("x")
    for out, why in (("a_file", "File exists"), ("a_file/tok.json", "Not a directory"), ("docs", None)):
        (tmp_path / "docs" / "tokenizer.json").mkdir(exist_ok=True) if why is None else None
        with pytest.raises(SystemExit) as err:
            main(["train", "--vocab-size", "300", "--out", out, "--quiet", "docs/*.txt"])
        assert err.value.code == 2
        assert f"error: --out {out}: cannot write " in capsys.readouterr().err
    (tmp_path / "docs" / "tokenizer.json").rmdir()
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--vocab-size", "300", "--out", "tk/my.json", "--quiet", "docs/*.txt"]) == 0
    assert load_tokenizer(tmp_path / "tk" / "my.json").vocab_size <= 300
    with pytest.raises(ConfigError, match=r"^data.tokenizer='.*tk': is a directory; a tokenizers tokenizer.json"):
        load_tokenizer(tmp_path / "tk")
    main(["train", "--vocab-size", "300", "--out", "tk2", "--quiet", "docs/*.txt"])
    with pytest.raises(ConfigError, match=r"is a directory \(its tokenizer.json: give that file\)"):
        load_tokenizer(tmp_path / "tk2")


# --- python_stdlib_bpe --------------------------------------------------------------------------------------------

def test_python_stdlib_bpe_on_a_few_stdlib_files(tmp_path):
    root, all_files = stdlib_files()
    files = all_files[:40]
    cfg = data_cfg(name="python_stdlib_bpe", vocab_size=320, val_fraction=0.1, cache_dir=str(tmp_path))
    tok = tokenizer_for(cfg, tmp_path, files=files)
    splits = load_splits(cfg, vocab_size_for(cfg, tok, None), tmp_path, progress=False, files=files)
    by_file = split_files(files, root, 0.1)  # the same files python_stdlib puts in val
    assert by_file["val"]
    for split in ("train", "val"):
        want = "".join(f.read_bytes().decode("utf-8", errors="replace") + EOT for f in by_file[split])
        assert decoded_split(tok, splits[split]) == want
    assert len(splits["train"]) < 0.7 * sum(f.stat().st_size for f in by_file["train"])  # subwords, not bytes


@pytest.mark.slow
def test_python_stdlib_bpe_full_corpus(tmp_path):
    cfg = data_cfg(name="python_stdlib_bpe", val_fraction=0.02, cache_dir=str(tmp_path))
    t0 = time.perf_counter()
    tok = tokenizer_for(cfg, tmp_path)
    trained = time.perf_counter() - t0
    splits = load_splits(cfg, vocab_size_for(cfg, tok, None), tmp_path, progress=False)
    total = time.perf_counter() - t0
    print(f"python_stdlib_bpe: BPE trained in {trained:.1f} s, corpus tokenized in {total - trained:.1f} s, "
          f"{len(splits['train'])} train / {len(splits['val'])} val tokens")
    assert tok.vocab_size == 4096 and vocab_size_for(cfg, tok, None) == 4096
    assert len(splits["train"]) > 5_000_000 and len(splits["val"]) > 50_000
    root, files = stdlib_files()
    first_train = split_files(files, root, 0.02)["train"][0]
    head = first_train.read_text(encoding="utf-8")[:200]
    assert decoded_split(tok, splits["train"][:200]).startswith(head[:50])
    assert max_token_id(splits["train"], sample=None) < tok.vocab_size


def test_a_large_vocab_tokenizer_gives_uint32_files(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(70_000)}}  # ids above uint16's range
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    word_level.save(str(tmp_path / "words.json"))
    (tmp_path / "a.txt").write_text("w69999 w1 w2\nw3 w68000\n" * 50)
    cfg = data_cfg(name="tokenized_text", paths=["a.txt"], tokenizer="words.json", val_fraction=0.2, cache_dir="c")
    tok = tokenizer_for(cfg, tmp_path)
    assert tok.vocab_size == 70_001 and tok.dtype == np.uint32 and tok.separator == []  # no EOT, "\n\n" -> no ids
    splits = load_splits(cfg, vocab_size_for(cfg, tok, None), tmp_path, progress=False)
    assert vocab_size_for(cfg, tok, None) == 70_016 and splits["train"].dtype == np.uint32
    assert list(splits["train"][:5]) == [70_000, 2, 3, 4, 68_001] and max_token_id(splits["val"], None) == 70_000


def test_undecodable_bytes_and_a_smaller_vocab_than_asked_are_each_one_warning(tmp_path, caplog):
    """Latin-1 bytes in a file are read as U+FFFD and a corpus too small for data.vocab_size gives a smaller BPE:
    each says so in one warning line (how many bytes on how many lines of which file; the size asked and had), on
    the run that builds the cache and on the ones that reuse it."""
    make_texts(tmp_path, n=4)
    bad = tmp_path / "docs" / "part01.txt"
    bad.write_bytes(bad.read_bytes() + "caf\u00e9 ok\nna\u00efve \u00fcber\n".encode("latin-1", "replace")
                    + "keep \ufffd\n".encode())  # 3 Latin-1 bytes on 2 lines; a real U+FFFD is not counted
    cfg = data_cfg(name="tokenized_text", paths=["docs/*.txt"], vocab_size=5000, val_fraction=0.3, cache_dir="c")
    tok = tokenizer_for(cfg, tmp_path)
    for _ in range(2):
        caplog.clear()
        with caplog.at_level(logging.WARNING, "hydratrain.data"):
            load_splits(cfg, 5000, tmp_path, progress=False)
        lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert lines == [
            f"data.paths: 3 bytes on 2 lines of 1 file(s) are not UTF-8 and were read as U+FFFD (the replacement "
            f"character): {bad} (3 bytes on 2 lines)",
            f"data.vocab_size=5000: the BPE trained on the training split has {tok.vocab_size} tokens, not 5000: its "
            f"text ran out of byte pairs to merge (more text, or a data.vocab_size <= {tok.vocab_size}, gives what "
            f"is asked); the model's vocab is 5000 ({tok.path})"]
    cut = b"a\xe6\x97b\n\xff\n\xef\xbf\xbd\n\xf0\x9f\x98"  # cut 3- and 4-byte characters, a stray byte, a real U+FFFD
    assert undecodable(cut, cut.decode("utf-8", errors="replace")) == (6, 3)


@pytest.mark.parametrize("stored, read", [("uint16", "uint32"), ("uint32", "uint16")])
def test_a_token_file_read_with_the_other_dtype_names_data_dtype(tmp_path, stored, read):
    """uint16 tokens read as uint32 used to blame model.vocab_size (and ask for a vocab above 65 million); uint32
    tokens read as uint16 trained silently on ids interleaved with zeros."""
    ids = np.random.default_rng(0).integers(2, 1000, 5000)
    for split in ("train", "val"):
        ids.astype(stored).tofile(tmp_path / f"{split}.bin")
    cfg = data_cfg(name="token_bin", train_path="train.bin", val_path="val.bin", dtype=read)
    with pytest.raises(ConfigError, match=rf"^data.dtype='{read}': data.train_path=.*train.bin read as {read} .*: it "
                                          rf"holds {stored} tokens; allowed: {stored}"):
        load_splits(cfg, 1000, tmp_path, progress=False)
    cfg = data_cfg(name="token_bin", train_path="train.bin", val_path="val.bin", dtype=stored)
    assert int(load_splits(cfg, 1000, tmp_path, progress=False)["train"][:5000].max()) == int(ids.max())


def test_bpe_training_is_bounded_on_a_huge_run_without_whitespace(tmp_path):
    """A 400 KB run of one letter (a blob in a text corpus) is one pre-token, on which BPE training took seconds per
    100 KB and minutes for megabytes; it is handed to the trainer in pieces of MAX_WORD characters. Text without
    such runs passes unchanged."""
    from hydratrain.data.tokenizer import MAX_WORD, bounded_words, train_bpe

    normal = ["def f(x):\n    return x\n", "word " * 5000]
    assert list(bounded_words(normal)) == normal
    pieces = list(bounded_words(["head " + "a" * (2 * MAX_WORD + 5) + " tail"]))
    assert pieces == ["head ", "a" * MAX_WORD, "a" * MAX_WORD, "aaaaa", " tail"]
    t0 = time.perf_counter()
    tok = train_bpe(["some words here\n" * 500, "a" * 400_000, "more words\n" * 500], 300, tmp_path / "t.json")
    assert time.perf_counter() - t0 < 20 and tok.vocab_size > 257


@pytest.mark.parametrize("damage", ["train.bin even", "train.bin odd", "val.bin empty", "tokenizer.json copy",
                                    "bpe tokenizer.json", "meta.json corrupt"])
def test_a_damaged_cache_is_rebuilt_with_one_warning(tmp_path, caplog, damage):
    """A cache file truncated, emptied or overwritten after its build does not match what meta.json records: it is
    rebuilt (not trained on as it is, nor a config error naming a key the user never set), with one warning."""
    make_texts(tmp_path, n=6)
    cfg = data_cfg(name="tokenized_text", paths=["docs/*.txt"], vocab_size=300, val_fraction=0.2, cache_dir="cache")
    first = load_splits(cfg, 320, tmp_path, progress=False)
    want = {s: np.asarray(first[s]).copy() for s in first}
    out = Path(first["train"].filename).parent
    bpe = next((tmp_path / "cache").glob("bpe-*")) / "tokenizer.json"
    del first
    name, how = damage.split(" ", 1)
    target = {"bpe": bpe, "tokenizer.json": out / "tokenizer.json"}.get(name, out / name)
    size = target.stat().st_size
    if how in ("even", "odd"):
        os.truncate(target, size // 2 // 2 * 2 + (how == "odd"))
    elif how == "empty":
        os.truncate(target, 0)
    else:
        target.write_bytes(target.read_bytes()[:-20] + b"corrupt" * 3)  # overwritten: corrupt json
    caplog.clear()
    again = load_splits(cfg, 320, tmp_path, progress=False)
    assert {s: len(again[s]) for s in again} == {s: len(want[s]) for s in want}
    assert all(np.array_equal(again[s], want[s]) for s in want)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and str(target) in warnings[0] and "rebuilding" in warnings[0], warnings
    caplog.clear()
    load_splits(cfg, 320, tmp_path, progress=False)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]  # repaired for good


def test_token_corpora_inputs_are_checked_with_the_environment_before_any_process_group(compose, tmp_path):
    """A missing token file, tokenizer or corpus is found by the launch's environment check, before the process
    group (it was found only when the data was built, after it), and the default BPE is 4096 tokens."""
    from hydratrain.config.validate import check_environment
    from hydratrain.data.registry import bpe_vocab_size

    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text(TEXT)
    for overrides, expect in [
        (["data=token_bin", "data.train_path=nope.bin", "data.val_path=nope.bin", "model.vocab_size=512"],
         rf"^data.train_path='{tmp_path}/nope.bin': no such file$"),
        (["data=tokenized_text", "data.paths=[nothing/*.md]"], r"^data.paths=\['nothing/\*.md'\]: 'nothing/\*.md' "),
        (["data=tokenized_text", "data.paths=[docs/*.txt]", "data.tokenizer=missing.json"],
         rf"^data.tokenizer='{tmp_path}/missing.json': no such file"),
    ]:
        cfg = compose(["+debug=fast_gpt", "strategy=single", "device=cpu", *overrides])
        with pytest.raises(ConfigError, match=expect):
            check_environment(cfg, 1, tmp_path)
    cfg = compose(["+debug=fast_gpt", "strategy=single", "device=cpu", "data=tokenized_text",
                   "data.paths=[docs/*.txt]"])
    check_environment(cfg, 1, tmp_path)
    assert cfg.data.vocab_size is None and bpe_vocab_size(cfg.data) == 4096
