"""The vocabulary of a built-in corpus and its checks before the run, asked of its entry in
:mod:`hydratrain.data.registry`: :func:`tokenizer_for` (the data's tokenizer, trained once when it is a BPE),
:func:`vocab_size_for` (the model's vocab size) and :func:`preflight_data` (cheap checks of files and settings,
before any process group). The token splits come from :func:`hydratrain.data.build.load_splits`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from hydratrain.data.registry import corpus
from hydratrain.data.tokenizer import TextTokenizer, padded_vocab_size
from hydratrain.errors import ConfigError


def tokenizer_for(data_cfg, launch_dir: Path, progress: bool = False, files: Optional[Sequence[Path]] = None,
                  cache_dir: Optional[Path] = None) -> Optional[TextTokenizer]:
    """The tokenizer of ``data_cfg``: ``data.tokenizer`` (relative to ``launch_dir``) when set; else, for
    tokenized_text / python_stdlib_bpe / hf_dataset, a BPE of ``data.vocab_size`` trained on the training split
    (cached; the first call trains it: call on local rank 0 first, then barrier). None for the byte corpora,
    synthetic, and token_bin without ``data.tokenizer``. ``files``: python_stdlib_bpe's files instead of the whole
    stdlib (tests). Raises :class:`ConfigError` (``data.tokenizer``, ``data.paths``, ``data.vocab_size``)."""
    return corpus(data_cfg.name).tokenizer(data_cfg, launch_dir, progress, files, cache_dir)


def vocab_size_for(data_cfg, tokenizer: Optional[TextTokenizer], explicit: Optional[int]) -> int:
    """The model's vocab size for ``data_cfg``: ``explicit`` (``model.vocab_size`` when the user set it) if given,
    else the tokenizer's size padded up to a multiple of 64 (256 for the byte corpora and synthetic). Raises
    :class:`ConfigError` naming ``model.vocab_size`` when an explicit value is below the tokenizer's size (or 256
    for bytes), or when token_bin has neither (nothing to take it from)."""
    entry = corpus(data_cfg.name)
    if tokenizer is None and not entry.byte_level:
        return entry.vocab_size_without_tokenizer(explicit)
    need, source = ((tokenizer.vocab_size, f"the tokenizer's {tokenizer.vocab_size} tokens ({tokenizer.path})")
                    if tokenizer is not None else (256, "the 256 byte values"))
    if explicit is None:
        return padded_vocab_size(need)
    if explicit < need:
        raise ConfigError("model.vocab_size", explicit, f"smaller than {source} of data={data_cfg.name}; allowed: "
                          f">= {need}, or null for {padded_vocab_size(need)}")
    return explicit


def preflight_data(data_cfg, launch_dir: Path) -> None:
    """Cheap checks of a built-in corpus's settings before any process group (nothing is trained or tokenized):
    token_bin's files open (headers, sizes, dtype), ``data.tokenizer`` loads, ``data.paths`` match files, relative
    paths resolve against ``launch_dir`` (``paths.data_dir``). Raises :class:`ConfigError`."""
    corpus(data_cfg.name).preflight(data_cfg, launch_dir)
