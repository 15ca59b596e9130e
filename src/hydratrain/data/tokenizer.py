"""Subword tokenizers (Hugging Face ``tokenizers``): byte-level BPE training, loading, decoding, saving.

A tokenizer is one ``tokenizer.json`` file (the ``tokenizers`` library's format), wrapped in :class:`TextTokenizer`
together with its path and content hash (the hash keys the token caches built with it).

Train one on your training files from the command line (globs are expanded here, relative to the current dir)::

    python -m hydratrain.tokenizer train --vocab-size 8192 --out tok 'notes/**/*.md'
    python train.py data=tokenized_text 'data.paths=[notes/**/*.md]' data.tokenizer=tok/tokenizer.json

The CLI holds out the same files as ``data.val_fraction`` would (``--val-fraction``, default 0.05 as in
``conf/data/tokenized_text.yaml``), so the tokenizer never sees the val split.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence

import numpy as np

from hydratrain.errors import ConfigError
from hydratrain.paths import temporary_sibling

EOT = "<|endoftext|>"  # special token written between files; id 0 in the tokenizers we train
PIECE_BYTES = 1 << 20  # files are read (for training and tokenizing) in pieces of about this many bytes
VOCAB_MULTIPLE = 64  # the vocab a model gets from a tokenizer is padded up to a multiple of this


@dataclass
class TextTokenizer:
    """A ``tokenizers.Tokenizer`` loaded from ``path`` (a tokenizer.json); build with :func:`load_tokenizer`.

    ``vocab_size``: tokens including added/special ones (every id it emits is below it). ``sha``: 16 hex digits of
    the SHA-256 of the file's bytes. ``separator``: the ids written after each file (``<|endoftext|>`` when the
    tokenizer has it, else the encoding of ``"\\n\\n"``, as the byte corpora use).
    """

    path: Path
    tok: Any = field(repr=False)  # tokenizers.Tokenizer (untyped package)
    sha: str = ""

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    @property
    def separator(self) -> list[int]:
        eot = self.tok.token_to_id(EOT)
        return [eot] if eot is not None else self.tok.encode("\n\n", add_special_tokens=False).ids

    @property
    def dtype(self) -> np.dtype:
        """uint16 when every id fits (vocab <= 65536), else uint32."""
        return np.dtype(np.uint16 if self.vocab_size <= 1 << 16 else np.uint32)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Ids of each text, encoded in parallel by ``tokenizers`` (its Rust thread pool; offsets not computed)."""
        return [e.ids for e in self.tok.encode_batch_fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` (ints, or a 1-D integer array/tensor). Special tokens are kept (``<|endoftext|>`` shows
        where a file ended); ids the tokenizer does not have (the padding above :attr:`vocab_size`) are dropped;
        bytes that are not valid UTF-8 become U+FFFD."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, out_dir: Path) -> Path:
        """Copy tokenizer.json into ``out_dir`` (created if missing; written to a temporary name, then renamed), e.g.
        next to a run's ``model.safetensors``. Returns the new file's path."""
        return copy_atomic(self.path, Path(out_dir) / "tokenizer.json")


def load_tokenizer(path: Path | str, key: str = "data.tokenizer") -> TextTokenizer:
    """Load a tokenizer.json. Raises :class:`ConfigError` naming ``key`` when it is missing or not one."""
    from tokenizers import Tokenizer

    path = Path(path)
    if path.is_dir():
        inside = " (its tokenizer.json: give that file)" if (path / "tokenizer.json").is_file() else ""
        raise ConfigError(key, str(path), f"is a directory{inside}; a tokenizers tokenizer.json file is needed")
    if not path.is_file():
        raise ConfigError(key, str(path), "no such file (a tokenizers tokenizer.json; python -m hydratrain.tokenizer "
                          "train makes one)")
    data = path.read_bytes()
    try:
        tok = Tokenizer.from_str(data.decode("utf-8"))
    except Exception as err:  # tokenizers raises a bare Exception on a malformed file
        raise ConfigError(key, str(path), f"not a tokenizers tokenizer.json ({err})") from None
    return TextTokenizer(path, tok, hashlib.sha256(data).hexdigest()[:16])


#: what a ``transformers`` tokenizer's ``save_pretrained`` writes (and a pretrained model dir holds): carried with the
#: checkpoints and exports of a run whose tokenizer it is, so the special tokens and chat template travel too
TRANSFORMERS_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json",
                                "special_tokens_map.json")  # (this order keys data=instruct's caches)


def transformers_tokenizer_files(directory: Optional[Path]) -> dict[str, Path]:
    """``{name: path}`` of the :data:`TRANSFORMERS_TOKENIZER_FILES` in ``directory``; empty unless it holds both
    tokenizer.json and tokenizer_config.json (a ``transformers`` tokenizer, not a bare ``tokenizers`` file)."""
    if directory is None or not all((Path(directory) / f).is_file() for f in TRANSFORMERS_TOKENIZER_FILES[:2]):
        return {}
    return {f: Path(directory) / f for f in TRANSFORMERS_TOKENIZER_FILES if (Path(directory) / f).is_file()}


def run_tokenizer_dir(cfg, data_dir: Path, launch_dir: Path) -> Optional[Path]:
    """The ``transformers`` tokenizer dir of a run, if it has one: ``data.tokenizer`` when it names a dir (relative
    to ``data_dir``: data=instruct and hf_dataset default it to ``model.pretrained``), else ``model.pretrained``
    (relative to ``launch_dir``, as the model reads it) for data that names no tokenizer (a dataset node of one's
    own). None when that dir holds no ``transformers`` tokenizer (:func:`transformers_tokenizer_files`)."""
    data, model = cfg.get("data"), cfg.get("model")
    named = data.get("tokenizer") if data is not None and "tokenizer" in data else None
    if named:
        candidate = data_dir / Path(str(named)).expanduser()
    elif model is not None and model.get("pretrained") and not (data is not None and "tokenizer" in data):
        candidate = launch_dir / Path(str(model.pretrained)).expanduser()
    else:
        return None
    return candidate if transformers_tokenizer_files(candidate) else None


def padded_vocab_size(n: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (embedding and output matmuls run faster on such sizes)."""
    return -(-n // multiple) * multiple


def undecodable(chunk: bytes, text: str) -> tuple[int, int]:
    """``(bytes, lines)`` of ``chunk`` that are not UTF-8, where ``text`` is ``chunk.decode("utf-8",
    errors="replace")``: each undecodable run of 1-3 bytes became one U+FFFD (3 bytes in UTF-8) and the rest
    round-trips, so the byte count is exact; a U+FFFD the file itself holds is not counted."""
    marks = text.count("\ufffd") - chunk.count("\ufffd".encode())
    if not marks:
        return 0, 0
    lines = 0
    for line in chunk.split(b"\n"):
        try:
            line.decode("utf-8")
        except UnicodeDecodeError:
            lines += 1
    return len(chunk) - len(text.encode("utf-8")) + 3 * marks, lines


def read_pieces(path: Path, start: int = 0, stop: Optional[int] = None, piece_bytes: int = PIECE_BYTES,
                replaced: Optional[list] = None) -> Iterator[str]:
    """The text of bytes ``[start, stop)`` of ``path`` in pieces of about ``piece_bytes`` bytes, each extended to the
    end of its line (a line longer than ``piece_bytes`` is cut at a character boundary), so a file of any size
    streams through bounded memory and the pieces do not depend on anything but the file. UTF-8; undecodable bytes
    become U+FFFD (``replaced``, a ``[bytes, lines]`` list, is added their count, see :func:`undecodable`); line
    ends are kept as they are. ``start`` must be at a character boundary."""
    with open(path, "rb") as fh:
        fh.seek(start)
        pos = start
        while stop is None or pos < stop:
            chunk = fh.read(piece_bytes if stop is None else min(piece_bytes, stop - pos))
            if not chunk:
                return
            room = None if stop is None else stop - pos - len(chunk)
            if room is None or room > 0:
                chunk += fh.readline(piece_bytes if room is None else min(piece_bytes, room))
                # (stop is set where room is): why the ignore below
                while (room is None or pos + len(chunk) < stop) and 0x80 <= (fh.peek(1)[:1] or b"\0")[0] < 0xC0:  # type: ignore[operator]
                    chunk += fh.read(1)  # finish a UTF-8 character cut by the length limit
            pos += len(chunk)
            text = chunk.decode("utf-8", errors="replace")
            if replaced is not None:
                n_bytes, lines = undecodable(chunk, text)
                replaced[0] += n_bytes
                replaced[1] += lines
            yield text


def line_cut(path: Path, fraction: float) -> int:
    """Byte offset where a single file's val part starts: the first line start at or after ``fraction`` of its
    size (or, in a last line without an end, the next character boundary). Used when one file is split."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        fh.seek(int(size * fraction))
        rest = fh.readline()
        if rest.endswith(b"\n"):
            return fh.tell()
        fh.seek(int(size * fraction))
        pos = int(size * fraction)
        while 0x80 <= (fh.read(1) or b"\0")[0] < 0xC0:
            pos += 1
        return pos


def train_bpe(texts: Iterable[str], vocab_size: int, out_path: Path, progress: bool = False) -> TextTokenizer:
    """Train a byte-level BPE of ``vocab_size`` tokens (``<|endoftext|>`` = id 0, the 256 byte symbols, merges) on
    ``texts`` and write it to ``out_path`` (a temporary name, then renamed). Any text is encodable (no unknown
    token). A corpus too small for ``vocab_size`` yields fewer tokens. Raises ValueError when vocab_size < 257."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise ValueError(f"vocab_size={vocab_size}: a byte-level BPE needs >= 257 (256 bytes + {EOT})")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(bounded_words(texts), trainer)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(out_path)
    tok.save(str(tmp))
    os.replace(tmp, out_path)
    return load_tokenizer(out_path)


MAX_WORD = 1000  # characters of a whitespace-free run that BPE training sees as one piece (see bounded_words)
_LONG_RUN = re.compile(r"\S{%d,}" % (MAX_WORD + 1))


def bounded_words(texts: Iterable[str], limit: int = MAX_WORD) -> Iterator[str]:
    """``texts`` for BPE training, with every whitespace-free run longer than ``limit`` characters (a base64 blob, a
    minified file) handed over in pieces of ``limit``: the trainer's time grows faster than linearly in the length of
    one pre-token (a 100 KB run took 5 s, a 3 MB one more than 300 s). Merges inside such runs are all it loses;
    text without them passes unchanged."""
    for text in texts:
        if len(text) <= limit or _LONG_RUN.search(text) is None:
            yield text
            continue
        pos = 0
        for m in _LONG_RUN.finditer(text):
            if m.start() > pos:
                yield text[pos:m.start()]
            yield from (text[i:min(i + limit, m.end())] for i in range(m.start(), m.end(), limit))
            pos = m.end()
        if pos < len(text):
            yield text[pos:]


def copy_atomic(src: Path, dst: Path) -> Path:
    """Copy ``src`` to ``dst`` through a temporary name in ``dst``'s dir (created if missing). Returns ``dst``."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(dst)
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)
    return dst
