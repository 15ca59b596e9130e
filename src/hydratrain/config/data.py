"""The ``data`` group: the keys every data node holds (:class:`LoaderKeys`), each built-in corpus's schema
(:mod:`hydratrain.data` reads them) and the checks of their values. A dataset node of one's own (``_target_``) is
checked with the components (:mod:`hydratrain.config.validate`). No torch import."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, List, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from hydratrain.config.values import Option, Ranges, number, present, select
from hydratrain.errors import ConfigError


class DataName(Option):
    python_stdlib = "python_stdlib"
    text_files = "text_files"
    synthetic = "synthetic"
    token_bin = "token_bin"
    tokenized_text = "tokenized_text"
    python_stdlib_bpe = "python_stdlib_bpe"
    hf_dataset = "hf_dataset"


class TokenDType(Option):
    uint16 = "uint16"
    uint32 = "uint32"

@dataclass
class LoaderKeys:
    """Keys of every data option, your own dataset node (`_target_`) included. They are in the composed config
    whether or not the option file lists them, so `data.num_workers=2` works on any option. A built-in corpus
    slices memory-mapped tokens in the training process: the DataLoader's keys (`num_workers` to `collate_fn`)
    keep their defaults there. (The one owner of these defaults; the run reads `hydratrain.config.settings`.)"""

    batch_size: Any = 8  # samples per micro-batch per rank (an int >= 1), or auto: the largest the memory plan fits
    val_fraction: float = 0.1  # share held out for eval when the data has no val split of its own
    num_workers: int = 0  # DataLoader worker processes per rank (a dataset node)
    pin_memory: Optional[bool] = None  # page-locked batches; null = on CUDA (a dataset node)
    persistent_workers: bool = False  # keep the workers between epochs and evals (a dataset node)
    prefetch_factor: Optional[int] = None  # batches each worker loads ahead; null = torch's default (a dataset node)
    collate_fn: Any = None  # a _target_ node of the collate function; null = torch's default_collate


#: the loader's keys, in the order the schema declares them
LOADER_KEYS = tuple(f.name for f in fields(LoaderKeys))
#: the loader's keys that only a dataset node (``_target_``) uses
DATASET_ONLY_KEYS = ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor", "collate_fn")


@dataclass
class DataConfig(LoaderKeys):
    """Keys every built-in ``data`` option has (see :mod:`hydratrain.data`)."""

    option: ClassVar[Optional[DataName]] = None
    # what the option is, read by the checks here and by the corpus registry (hydratrain.data.registry): its tokens
    # are the 256 byte values; its val split is a file of its own (data.val_path), so data.val_fraction is unused
    byte_level: ClassVar[bool] = False
    val_split_file: ClassVar[bool] = False
    name: DataName = MISSING
    seq_len: int = 256  # tokens per sample (the model sees seq_len tokens and predicts the next seq_len)


@dataclass
class SplitData(DataConfig):
    """Data split into train/val here: by file for corpora (a stable hash of each path), by position for a stream."""

    val_fraction: float = 0.02  # share of files (or of the synthetic stream) held out for eval


@dataclass
class PythonStdlibData(SplitData):
    option: ClassVar[DataName] = DataName.python_stdlib
    byte_level: ClassVar[bool] = True
    name: DataName = DataName.python_stdlib
    cache_dir: Optional[str] = None  # where built memmaps are kept; null = $HYDRATRAIN_CACHE or ~/.cache/hydratrain


@dataclass
class TextFilesData(SplitData):
    option: ClassVar[DataName] = DataName.text_files
    byte_level: ClassVar[bool] = True
    name: DataName = DataName.text_files
    paths: List[str] = MISSING  # files or globs (** allowed); relative ones resolve against the launch dir
    cache_dir: Optional[str] = None


@dataclass
class SyntheticData(SplitData):
    option: ClassVar[DataName] = DataName.synthetic
    name: DataName = DataName.synthetic
    synthetic_tokens: int = 2_000_000  # stream length in tokens


@dataclass
class TokenBinData(DataConfig):
    """Flat token-id files made by another pipeline (nanoGPT / llm.c layout), one per split."""

    option: ClassVar[DataName] = DataName.token_bin
    val_split_file: ClassVar[bool] = True
    name: DataName = DataName.token_bin
    train_path: str = MISSING  # the train split's token file (relative to the launch dir)
    val_path: str = MISSING  # the val split's token file
    dtype: Optional[TokenDType] = None  # null = the llm.c header's, else uint16
    tokenizer: Optional[str] = None  # the tokenizer.json that made the ids (for decoding samples); optional


@dataclass
class TokenizedTextData(SplitData):
    """The user's text files, tokenized once with a BPE and cached as token files."""

    option: ClassVar[DataName] = DataName.tokenized_text
    name: DataName = DataName.tokenized_text
    paths: List[str] = MISSING  # files or globs, relative to the launch dir
    tokenizer: Optional[str] = None  # a tokenizer.json; null = train a byte-level BPE of vocab_size tokens
    vocab_size: Optional[int] = None  # tokens of the BPE trained when tokenizer is null; null = 4096
    cache_dir: Optional[str] = None


@dataclass
class PythonStdlibBPEData(SplitData):
    """The python_stdlib corpus with subword tokens: a BPE trained once on its training split."""

    option: ClassVar[DataName] = DataName.python_stdlib_bpe
    name: DataName = DataName.python_stdlib_bpe
    tokenizer: Optional[str] = None  # a tokenizer.json; null = train a byte-level BPE of vocab_size tokens
    vocab_size: Optional[int] = None  # tokens of the BPE trained when tokenizer is null; null = 4096
    cache_dir: Optional[str] = None


@dataclass
class HFDatasetData(SplitData):
    """Local JSON(-lines), CSV, Parquet or text files read by Hugging Face ``datasets`` (extra ``[hf]``), one text
    column tokenized once and cached as token files (``hydratrain.data.hf_dataset``)."""

    option: ClassVar[DataName] = DataName.hf_dataset
    name: DataName = DataName.hf_dataset
    paths: List[str] = MISSING  # the train files (datasets' data_files), globs allowed, relative to the launch dir
    val_paths: Optional[List[str]] = None  # the val split's files; null = data.val_fraction of the records
    format: Optional[str] = None  # json | csv | parquet | text; null = from the files' extension
    text_field: str = "text"  # the column holding each record's text
    tokenizer: Optional[str] = None  # a tokenizer.json or a dir holding one; null = train a BPE of vocab_size tokens
    vocab_size: Optional[int] = None  # tokens of the BPE trained when tokenizer is null; null = 4096
    cache_dir: Optional[str] = None


RANGES = Ranges(positive=("data.seq_len", "data.synthetic_tokens"))


def batch_size_setting(value: Any) -> Any:
    """``data.batch_size``: a positive int, or ``auto`` (the largest micro-batch the memory planner says fits:
    :mod:`hydratrain.batch_size`). Raises :class:`ConfigError` otherwise."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError("data.batch_size", value, "allowed: a positive integer (samples per micro-batch per "
                          "rank), or auto (the largest the memory planner says fits)")
    return value


def check_batch_size(cfg: DictConfig) -> None:
    if present(cfg, "data.batch_size"):
        batch_size_setting(cfg.data.batch_size)


def check(cfg: DictConfig) -> None:
    """The data's values, and the model's keywords that must fit them (a context length, a byte vocabulary)."""
    max_seq_len, vocab_size, seq_len = select(cfg, "model.max_seq_len"), select(cfg, "model.vocab_size"), \
        select(cfg, "data.seq_len")
    if number(max_seq_len) and number(seq_len) and seq_len > max_seq_len:
        raise ConfigError("data.seq_len", seq_len, f"must be <= model.max_seq_len={max_seq_len}")
    if _schema_says(cfg.data, "byte_level") and number(vocab_size) and vocab_size < 256:
        raise ConfigError("model.vocab_size", vocab_size, f"byte-level data={cfg.data.name} needs >= 256")
    if "paths" in cfg.data and not cfg.data.paths:
        raise ConfigError("data.paths", list(cfg.data.paths), f"data={cfg.data.name} needs at least one file or glob")
    val_fraction = select(cfg, "data.val_fraction")
    if val_fraction is not None and not 0.0 < val_fraction < 1.0:
        raise ConfigError("data.val_fraction", val_fraction, "must be in (0, 1)")
    _refuse_loader_keys_on_a_corpus(cfg.data)
    if select(cfg, "data.vocab_size") is not None and cfg.data.vocab_size < 257:
        raise ConfigError("data.vocab_size", cfg.data.vocab_size, "a byte-level BPE needs more than the 256 byte "
                          "tokens; allowed: >= 257")
    if select(cfg, "data.vocab_size") is not None and select(cfg, "data.tokenizer"):
        raise ConfigError("data.vocab_size", cfg.data.vocab_size, f"unused with data.tokenizer={cfg.data.tokenizer}, "
                          "whose own vocabulary the run takes (a BPE of data.vocab_size is trained only when "
                          "data.tokenizer is null); drop one of the two (model.vocab_size sets a larger embedding)")


def _schema_says(data: Any, what: str) -> bool:
    """A class fact of the data node's option schema (``byte_level``, ``val_split_file``); False for a dataset node."""
    return OmegaConf.is_dict(data) and bool(getattr(OmegaConf.get_type(data), what, False))


def _refuse_loader_keys_on_a_corpus(data: Any) -> None:
    """A built-in corpus has the DataLoader's keys (every data option has them, :class:`LoaderKeys`) but batches
    memory-mapped tokens in the training process: a value other than the default would be ignored, so it is refused
    (and ``val_fraction`` of ``token_bin``, whose val split is ``data.val_path``)."""
    if not OmegaConf.is_dict(data) or "_target_" in data or data.get("name") is None:
        return
    name = data.name
    unused = DATASET_ONLY_KEYS + (("val_fraction",) if _schema_says(data, "val_split_file") else ())
    for key in unused:
        if key in data and data[key] != getattr(LoaderKeys, key):
            raise ConfigError(f"data.{key}", data[key], f"not used by data={name}, which slices memory-mapped tokens "
                              f"in the training process; allowed: {getattr(LoaderKeys, key)} (the DataLoader's keys "
                              "apply to a dataset node, _target_: docs/own-model.md)"
                              if key != "val_fraction" else "not used by data=token_bin, whose val split is "
                              "data.val_path; allowed: leave it out")
