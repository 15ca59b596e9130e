"""Instruction data (``data=instruct``, extra ``[hf]``): prompt/response records with the loss on the response only.

A dataset node (:mod:`hydratrain.data.loader`): :func:`instruct_datasets` reads JSON-lines, JSON or parquet files of
records holding ``prompt`` and ``completion`` (strings), or ``messages`` (a chat: ``[{role, content}, ...]``, its last
message the response), and tokenizes each record once with the ``transformers`` tokenizer of ``tokenizer`` (a dir:
``model.pretrained`` by default). A chat is rendered by the tokenizer's own chat template
(``apply_chat_template``): the prompt is the messages before the last one with the generation prompt, the record the
whole chat. A prompt/completion record is the prompt's ids, then the completion's, then the end-of-text token.

The ids and a per-token "counted" flag (the response's tokens) are cached under ``cache_dir`` in
``instruct-<key>/`` (:mod:`hydratrain.data.cache`: built once under a lock, checked on every use); the key holds the
files' names, sizes and mtimes, the format and the tokenizer files' hash. ``seq_len``, ``truncation`` and
``packing`` are applied when the cache is read, so changing them rebuilds nothing.

A sample is a dict for ``model(**batch)``: ``input_ids``, ``labels`` (the ids where counted, else -100: the model's
own loss, and so ``train/loss`` and ``eval/loss``, average over response tokens only) and, packed,
``position_ids``. Without packing a sample is one record, and :func:`collate` pads a batch to its longest record
(``attention_mask`` 0 on the padding). With packing a sample is one window of ``seq_len`` tokens holding whole
records in file order (greedily: a record that does not fit starts the next window), the rest padding; its
``position_ids`` restart at 0 at each record (and at the padding), which ``transformers``' masks read as packed
sequences: attention never crosses from one record into another, and the first token of each record is not a
target. Samples are drawn by index from the loader's global order, so resume is exact on any world size.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch
from omegaconf import OmegaConf

from hydratrain.data import hf_dataset
from hydratrain.data.cache import build_lock, verified_cache, write_manifest
from hydratrain.data.tokenizer import TRANSFORMERS_TOKENIZER_FILES
from hydratrain.errors import ConfigError
from hydratrain.paths import default_cache_dir

log = logging.getLogger(__name__)

IGNORE = -100  # the label transformers' loss (and torch's cross_entropy) skips
TRUNCATION = ("cut", "drop")
FORMAT_VERSION = 1  # part of the cache key: bump when the cached layout changes


def instruct_datasets(paths: Sequence[str], val_paths: Optional[Sequence[str]] = None, format: Optional[str] = None,
                      tokenizer: Optional[str] = None, seq_len: int = 256, truncation: str = "cut",
                      packing: bool = False, data_dir: str = ".", cache_dir: Optional[str] = None) -> Any:
    """The instruction datasets of ``paths`` (globs; relative ones to ``data_dir``): ``{"train", "val"}`` with
    ``val_paths``, else one dataset that the loader splits by ``data.val_fraction``. Examples longer than
    ``seq_len`` tokens are cut to their first ``seq_len`` (``truncation=cut``: the end of the response goes) or
    dropped (``drop``); an example with no response token left is dropped either way. Raises
    :class:`ConfigError` naming the key."""
    if truncation not in TRUNCATION:
        raise ConfigError("data.truncation", truncation, f"allowed: {', '.join(TRUNCATION)}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise ConfigError("data.seq_len", seq_len, "must be an integer >= 2")
    root = Path(str(data_dir)).expanduser()
    tok_dir = tokenizer_dir(tokenizer, root)
    cache = Path(str(cache_dir)).expanduser() if cache_dir else default_cache_dir()
    node = OmegaConf.create({"paths": list(paths), "val_paths": list(val_paths) if val_paths else None,
                             "format": format})
    out = build_cache(node, root, cache if cache.is_absolute() else root / cache, tok_dir)
    meta = json.loads((out / "meta.json").read_text())
    splits = {s: InstructDataset(out, s, seq_len, truncation, packing, meta["pad_id"]) for s in meta["splits"]}
    for name, ds in splits.items():
        log.info("data=instruct %s: %d records -> %d %s (%d response tokens); %d cut, %d dropped (data.seq_len=%d, "
                 "data.truncation=%s; or no response token left)", name, ds.records, len(ds),
                 "windows" if packing else "examples", ds.response_tokens, ds.cut, ds.dropped, seq_len,
                 truncation)
        if len(ds) == 0:
            raise ConfigError("data.seq_len", seq_len, f"leaves no example in the {name} split "
                              f"({ds.records} records, {ds.dropped} dropped)")
    return splits if "val" in splits else splits["train"]


def tokenizer_dir(value: Optional[str], root: Path) -> Path:
    """The dir of the ``transformers`` tokenizer ``data.tokenizer`` names (relative to ``root``). Raises
    :class:`ConfigError` naming ``data.tokenizer``."""
    if not value:
        raise ConfigError("data.tokenizer", value, "data=instruct needs a transformers tokenizer dir (its "
                          "tokenizer.json, tokenizer_config.json, chat template): model.pretrained's by default")
    path = root / Path(str(value)).expanduser()
    if not (path / "tokenizer.json").is_file():
        raise ConfigError("data.tokenizer", str(value), "not a dir holding tokenizer.json (save_pretrained of a "
                          "transformers tokenizer writes one)")
    return path


def _hf_tokenizer(path: Path):
    try:
        from transformers import AutoTokenizer  # the [hf] extra: imported when a cache is built
    except ImportError:
        raise ConfigError("data", "instruct", "needs transformers, which is not installed: pip install -e '.[hf]'") \
            from None
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _tokenizer_hash(path: Path) -> str:
    digest = hashlib.sha256()
    for name in TRANSFORMERS_TOKENIZER_FILES:
        if (path / name).is_file():
            digest.update(name.encode() + (path / name).read_bytes())
    return digest.hexdigest()[:16]


def encode(record: dict, tok) -> tuple[list[int], int]:
    """``(ids, prompt length)`` of one record: ``messages`` rendered by the chat template (the prompt: every message
    but the last, with the generation prompt), else ``prompt`` then ``completion`` then the end-of-text token. Raises
    ValueError when the record has neither, or the template renders the prompt as something else than the start of
    the whole chat."""
    messages = record.get("messages")
    if messages:
        full = list(tok.apply_chat_template(messages, tokenize=True)["input_ids"])
        prompt = list(tok.apply_chat_template(messages[:-1], tokenize=True, add_generation_prompt=True)["input_ids"])
        if full[:len(prompt)] != prompt:
            raise ValueError("the chat template renders the messages before the last one (with the generation "
                             "prompt) as other tokens than the start of the whole chat")
        return full, len(prompt)
    if record.get("prompt") is None or record.get("completion") is None:
        raise ValueError(f"a record without prompt/completion or messages (its keys: {', '.join(record)})")
    prompt = list(tok(str(record["prompt"]))["input_ids"])
    response = list(tok(str(record["completion"]), add_special_tokens=False)["input_ids"])
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    return prompt + response + eos, len(prompt)


def build_cache(node, root: Path, cache_dir: Path, tok_dir: Path) -> Path:
    """Tokenize every split of ``node``'s files into ``<cache_dir>/instruct-<key>/``: per split ``<split>.ids``
    (uint32), ``<split>.counted`` (uint8: 1 on response tokens) and ``<split>.offsets`` (int64, one more than the
    records), with meta.json. Returns that dir; built once per key (see the module docstring)."""
    files = hf_dataset.split_files(node, root)
    kind = hf_dataset.builder(node, [f for fs in files.values() for f in fs])
    listing = [(s, str(f), f.stat().st_size, f.stat().st_mtime_ns) for s, fs in files.items() for f in fs]
    key = hashlib.sha256(json.dumps([FORMAT_VERSION, listing, kind, _tokenizer_hash(tok_dir)]).encode()) \
        .hexdigest()[:16]
    out = cache_dir / f"instruct-{key}"
    with build_lock(out):
        if verified_cache(out) is not None:
            return out
        t0 = time.perf_counter()
        tok = _hf_tokenizer(tok_dir)
        loaded = hf_dataset.read_files(node, root, cache_dir)
        out.mkdir(parents=True, exist_ok=True)
        counts, names = {}, []
        for split, dataset in loaded.items():
            key_name = "data.paths" if split == "train" else "data.val_paths"
            ids_all: list[int] = []
            counted: list[int] = []
            offsets = [0]
            for i, record in enumerate(dataset):
                try:
                    ids, n_prompt = encode(record, tok)
                except ValueError as err:
                    raise ConfigError(key_name, list(node[key_name.split(".")[1]]), f"record {i}: {err}") from None
                ids_all += ids
                counted += [0] * n_prompt + [1] * (len(ids) - n_prompt)
                offsets.append(len(ids_all))
            for suffix, values, dtype in (("ids", ids_all, np.uint32), ("counted", counted, np.uint8),
                                          ("offsets", offsets, np.int64)):
                tmp = out / f"{split}.{suffix}.tmp{os.getpid()}"
                np.asarray(values, dtype=dtype).tofile(tmp)
                os.replace(tmp, out / f"{split}.{suffix}")
                names.append(f"{split}.{suffix}")
            counts[split] = {"records": len(offsets) - 1, "tokens": len(ids_all)}
        pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        write_manifest(out, {"format": kind, "tokenizer": str(tok_dir), "pad_id": int(pad), "splits": counts,
                             "seconds": round(time.perf_counter() - t0, 3)}, names)
        log.info("tokenized %d instruction records in %.1f s: %s", sum(c["records"] for c in counts.values()),
                 time.perf_counter() - t0, out)
    return out


class InstructDataset:
    """One split of the cache :func:`build_cache` wrote, as examples (``packing`` false) or packed windows of
    ``seq_len`` tokens. ``cut`` / ``dropped``: records cut to ``seq_len`` (and kept) / dropped (see
    :func:`instruct_datasets`); ``response_tokens``: the tokens counted in the loss over the split."""

    def __init__(self, out: Path, split: str, seq_len: int, truncation: str, packing: bool, pad_id: int):
        self.seq_len, self.packing, self.pad_id = seq_len, packing, pad_id
        self.ids = np.fromfile(out / f"{split}.ids", dtype=np.uint32)
        self.counted = np.fromfile(out / f"{split}.counted", dtype=np.uint8)
        offsets = np.fromfile(out / f"{split}.offsets", dtype=np.int64)
        self.records = len(offsets) - 1
        spans, self.cut, self.dropped = [], 0, 0
        for start, end in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
            long = end - start > seq_len
            if long and truncation == "drop":
                self.dropped += 1
                continue
            end = min(end, start + seq_len)
            if not self.counted[start + 1:end].any():  # nothing left to learn (the first token is never a target)
                self.dropped += 1
                continue
            self.cut += long
            spans.append((start, end))
        self.spans = spans
        self.response_tokens = int(sum(int(self.counted[s + 1:e].sum()) for s, e in spans))
        self.windows: list[list[tuple[int, int]]] = []
        if packing:
            for span in spans:
                if self.windows and sum(e - s for s, e in self.windows[-1]) + span[1] - span[0] <= seq_len:
                    self.windows[-1].append(span)
                else:
                    self.windows.append([span])

    def __len__(self) -> int:
        return len(self.windows) if self.packing else len(self.spans)

    def _piece(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.from_numpy(self.ids[start:end].astype(np.int64))
        labels = torch.where(torch.from_numpy(self.counted[start:end].astype(bool)), ids, IGNORE)
        labels[0] = IGNORE  # nothing before it in its record predicts it
        return ids, labels

    def __getitem__(self, index: int) -> dict:
        if not self.packing:
            ids, labels = self._piece(*self.spans[index])
            return {"input_ids": ids, "labels": labels}
        pieces = [self._piece(s, e) for s, e in self.windows[index]]
        pad = self.seq_len - sum(len(ids) for ids, _ in pieces)
        ids = torch.cat([p[0] for p in pieces] + [torch.full((pad,), self.pad_id, dtype=torch.int64)])
        labels = torch.cat([p[1] for p in pieces] + [torch.full((pad,), IGNORE, dtype=torch.int64)])
        # positions restart at each record (and at the padding): transformers masks attention per restart
        positions = torch.cat([torch.arange(len(p[0])) for p in pieces] + [torch.arange(pad)])
        return {"input_ids": ids, "labels": labels, "position_ids": positions}


def collate(samples: list[dict], pad_id: int = 0) -> dict:
    """A batch of :class:`InstructDataset` samples: packed windows stacked; examples padded on the right to the
    longest (``input_ids`` with ``pad_id``, ``labels`` with -100, ``attention_mask`` 0 there)."""
    if "position_ids" in samples[0]:
        return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
    longest = max(len(s["input_ids"]) for s in samples)
    batch: dict[str, torch.Tensor] = {
        "input_ids": torch.full((len(samples), longest), pad_id, dtype=torch.int64),
        "labels": torch.full((len(samples), longest), IGNORE, dtype=torch.int64),
        "attention_mask": torch.zeros((len(samples), longest), dtype=torch.int64)}
    for row, s in enumerate(samples):
        n = len(s["input_ids"])
        batch["input_ids"][row, :n], batch["labels"][row, :n], batch["attention_mask"][row, :n] = \
            s["input_ids"], s["labels"], 1
    return batch
