"""Hugging Face ``transformers`` causal language models as hydratrain models (extra ``[hf]``).

``model=hf_causal_lm`` builds any ``AutoModelForCausalLM`` architecture from a config given inline
(``model.config: {model_type: llama, hidden_size: 256, ...}``), from a dir or file holding ``config.json``, or from a
pretrained dir written by ``save_pretrained`` (``model.pretrained``: its config.json, and its weights)::

    python train.py model=hf_causal_lm model.config.model_type=llama model.config.hidden_size=256
    torchrun --nproc_per_node 2 train.py model=hf_causal_lm model.pretrained=/models/tiny-llama strategy=fsdp

What the model gets, and how it meets hydratrain's conventions (:mod:`hydratrain.parallel.init`,
:mod:`hydratrain.parallel.blocks`):

- the model is an instance of the architecture's own class (``LlamaForCausalLM``...), with :class:`HFCausalLM`
  mixed in: its parameter names, ``forward`` (``(B, T)`` ids -> ``.logits`` ``(B, T, vocab)``; with ``labels`` its
  own ``.loss``), ``_no_split_modules`` (the FSDP and activation-checkpointing units) and ``save_pretrained`` are the
  architecture's;
- initial weights follow the per-parameter protocol (``init_param_``): each parameter is drawn by the model's own
  ``transformers`` init (``initialize_weights``, which runs every module's ``_init_weights``) while every other
  tensor is marked initialised (``transformers``' ``_is_hf_initialized`` flags), with the global RNG seeded by
  (``trainer.seed``, the parameter's name). So a meta build sharded over any number of ranks, and an eager build,
  start from the same numbers, and no rank holds more than one full parameter at a time. Non-persistent buffers
  (rotary tables) are recomputed by the same init (``init_buffers``), as ``transformers`` does after its own meta
  builds;
- with ``model.pretrained``, ``init_param_`` reads each parameter from the dir's safetensors file(s) instead (a
  lazy, per-tensor read on every rank: the whole model is never in one rank's memory); the file's keys and shapes are
  checked against the model when it is built (before any process group), one line naming what differs;
- ``export_to(dir, state_dict, tokenizer)`` writes a ``save_pretrained`` dir (config.json, model.safetensors, the
  tokenizer) that ``AutoModelForCausalLM.from_pretrained(dir)`` loads.

Nothing is downloaded: configs, weights and tokenizers are read from local files only.
"""
from __future__ import annotations

import contextlib
import difflib
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Union

import torch
from torch import nn

from hydratrain.data.tokenizer import EOT, copy_atomic, load_tokenizer, padded_vocab_size, transformers_tokenizer_files
from hydratrain.errors import ConfigError
from hydratrain.parallel.init import canonical_name

WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
_CLASSES: dict[type, type] = {}


def _transformers():
    try:
        import transformers
    except ImportError:
        # (key "model", not "model._target_": the config check waits for the real build on the latter)
        raise ConfigError("model", "hf_causal_lm", "needs transformers, which is not installed: pip install -e "
                          "'.[hf]'") from None
    return transformers


def _first_line(err: BaseException, limit: int = 300) -> str:
    """``err``'s message in one line: its first line, and the next one too when the first ends with a colon (the
    reason of a ``transformers`` validation error sits there)."""
    lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()] or [""]
    line = f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]
    return line[:limit]


# --------------------------------------------------------------------------------------------------- config
def _config_file(value: Union[str, Path], key: str) -> Path:
    path = Path(value).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(key, str(value), "no such config.json (a dir holding one, or the file itself)")
    return path


def _read_config(path: Path, key: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path.parent if path.name == "config.json" else path),
                                          local_files_only=True)
    except Exception as err:  # noqa: BLE001 (transformers raises ValueError, OSError, KeyError...)
        raise ConfigError(key, str(path), f"not a transformers config ({type(err).__name__}: "
                          f"{_first_line(err)})") from None


def _allowed_keys(config_class: type) -> list[str]:
    import inspect

    names = [n for n in inspect.signature(config_class.__init__).parameters  # type: ignore[misc]  # (a class's)
             if n not in ("self", "kwargs")]
    return sorted(set(names) | set(getattr(config_class, "attribute_map", {}) or {}))


def _unknown_keys(config, given: dict) -> list[str]:
    """Keys of ``given`` that ``config``'s class neither takes nor consumed (a key it keeps as a plain attribute of
    the same value is one nothing reads: ``transformers`` stores unknown keys without a word)."""
    allowed = set(_allowed_keys(type(config))) | {"model_type"}
    return [k for k, v in given.items() if k not in allowed and k in vars(config) and vars(config)[k] == v]


def hf_config(config: Union[None, str, dict], pretrained: Optional[str]) -> Any:
    """The ``transformers`` config ``model.config`` and ``model.pretrained`` describe: ``config`` a dict (inline keys;
    ``model_type`` needed unless ``pretrained`` gives the base), a path (a dir or file with config.json), or null
    (``pretrained``'s config.json). Inline keys override ``pretrained``'s. Raises :class:`ConfigError` naming
    ``model.config.model_type`` (unknown architecture), ``model.config.<key>`` (a key the architecture does not take),
    ``model.config`` or ``model.pretrained`` (no config.json there)."""
    from transformers import CONFIG_MAPPING

    base = None
    if pretrained:
        base = _read_config(_config_file(pretrained, "model.pretrained"), "model.pretrained")
    if isinstance(config, (str, Path)):
        return _read_config(_config_file(config, "model.config"), "model.config")
    given = dict(config or {})
    if base is None and "model_type" not in given:
        raise ConfigError("model.config.model_type", None, "the architecture is needed (llama, gpt2, mistral, qwen2, "
                          "...), or model.pretrained=DIR or model.config=DIR with a config.json")
    model_type = given.pop("model_type", None) or base.model_type  # type: ignore[union-attr]  # (base: given)
    if model_type not in CONFIG_MAPPING:
        close = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING.keys()), n=4)
        raise ConfigError("model.config.model_type", model_type, "unknown to transformers "
                          f"{_transformers().__version__}" + (f"; did you mean {', '.join(close)}?" if close else ""))
    if base is not None and model_type != base.model_type:
        raise ConfigError("model.config.model_type", model_type, f"model.pretrained holds a {base.model_type} model")
    cls = CONFIG_MAPPING[model_type]
    try:
        made = cls.from_dict({**base.to_dict(), **given}) if base is not None else cls(**given)
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 (the config class's own checks: ValueError, TypeError...)
        raise ConfigError("model.config", given, f"{cls.__name__} refused it ({type(err).__name__}: "
                          f"{_first_line(err)})") from None
    unknown = _unknown_keys(made, given)
    if unknown:
        allowed = _allowed_keys(cls)
        close = difflib.get_close_matches(unknown[0], allowed, n=3)
        raise ConfigError(f"model.config.{unknown[0]}", given[unknown[0]], f"not a key of {cls.__name__} (nothing "
                          "would read it)" + (f"; did you mean {', '.join(close)}?" if close else "") +
                          f"; allowed: {', '.join(allowed)}")
    return made


# ------------------------------------------------------------------------------------------------ pretrained
class PretrainedWeights:
    """The safetensors weights of a ``save_pretrained`` dir: ``model.safetensors``, or the shards listed by
    ``model.safetensors.index.json``. Reads one tensor at a time (memory-mapped), never the whole model. Raises
    :class:`ConfigError` naming ``model.pretrained`` when the dir holds neither."""

    def __init__(self, directory: Union[str, Path]):
        from safetensors import safe_open

        self.dir = Path(directory).expanduser()
        if (self.dir / WEIGHTS).is_file():
            files = {self.dir / WEIGHTS}
            self.where: dict[str, Any] = {}
        elif (self.dir / INDEX).is_file():
            try:
                weight_map = json.loads((self.dir / INDEX).read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as err:
                raise ConfigError("model.pretrained", str(directory), f"{INDEX} is not a safetensors index "
                                  f"({type(err).__name__}: {err})") from None
            files = {self.dir / f for f in weight_map.values()}
            self.where = {}
        else:
            has = sorted(p.name for p in self.dir.iterdir()) if self.dir.is_dir() else []
            raise ConfigError("model.pretrained", str(directory), f"holds no weights: no {WEIGHTS} or {INDEX} "
                              "(save_pretrained writes them; only safetensors are read)" +
                              (f"; it has: {', '.join(has[:8])}" if has else ""))
        self.shapes: dict[str, tuple] = {}
        for f in sorted(files):
            if not f.is_file():
                raise ConfigError("model.pretrained", str(directory), f"its index names {f.name}, which is missing")
            try:
                with safe_open(str(f), "pt", device="cpu") as handle:
                    for k in handle.keys():
                        self.shapes[k] = tuple(handle.get_slice(k).get_shape())
                        self.where[k] = f
            except Exception as err:  # noqa: BLE001 (safetensors' own error types)
                raise ConfigError("model.pretrained", str(directory), f"{f.name} is not a safetensors file "
                                  f"({type(err).__name__}: {err})") from None

    def key_for(self, names: list[str], prefix: str) -> Optional[str]:
        """The file's key for a tensor known by ``names`` (its names in the model, tied ones included): a name as
        it is, or without the architecture's base-model prefix (``model.``, ``transformer.``: a checkpoint of the base
        model)."""
        for name in names:
            if name in self.shapes:
                return name
        for name in names:
            if prefix and name.startswith(prefix + ".") and name[len(prefix) + 1:] in self.shapes:
                return name[len(prefix) + 1:]
        return None

    def read(self, key: str):
        """The tensor stored under ``key`` (CPU, its stored dtype)."""
        from safetensors import safe_open

        with safe_open(str(self.where[key]), "pt", device="cpu") as handle:
            return handle.get_tensor(key)


def _aliases(model, canonical: bool = True) -> dict[int, list[str]]:
    """``id(tensor) -> every name`` of each parameter and persistent buffer of ``model`` (tied weights have several),
    in model order, wrapper prefixes removed."""
    out: dict[int, list[str]] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + \
            [(n, b) for n, b in model.named_buffers(remove_duplicate=False) if n in model.state_dict()]:
        out.setdefault(id(t), []).append(canonical_name(name) if canonical else name)
    return out


def check_pretrained(model, weights: PretrainedWeights) -> None:
    """Every parameter and persistent buffer of ``model`` (a meta build is enough) has a tensor of its shape in
    ``weights``, and every tensor there is used (but those ``transformers`` ignores for the architecture). Raises
    :class:`ConfigError` naming ``model.pretrained``: the missing or unexpected keys, or the first shape that differs
    (a model.config that does not match the weights)."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    state = model.state_dict(keep_vars=True)
    used, missing, wrong = set(), [], []
    for names in _aliases(model).values():
        key = weights.key_for(names, prefix)
        if key is None:
            missing.append(names[0])
            continue
        used.add(key)
        want = tuple(state[names[0]].shape) if names[0] in state else None
        if want is not None and weights.shapes[key] != want:
            wrong.append((key, weights.shapes[key], want))
    ignore = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())]
    unexpected = sorted(k for k in set(weights.shapes) - used if not any(p.search(k) for p in ignore))
    if missing or unexpected:
        raise ConfigError("model.pretrained", str(weights.dir), f"its weights do not fit the model: missing "
                          f"{missing[:4]}{' ...' if len(missing) > 4 else ''}, unexpected {unexpected[:4]}"
                          f"{' ...' if len(unexpected) > 4 else ''} (a model.config of another architecture?)")
    if wrong:
        key, got, want = wrong[0]
        raise ConfigError("model.pretrained", str(weights.dir), f"{key} has shape {list(got)} in its weights, the "
                          f"model.config gives {list(want)}" + (f" ({len(wrong)} tensors differ)" if len(wrong) > 1
                                                                else "") + ": drop the model.config keys that change "
                          "the sizes (hidden_size, num_hidden_layers, vocab_size, ...)")


# ----------------------------------------------------------------------------------------------------- model
class HFCausalLM:
    """What hydratrain adds to a ``transformers`` causal LM (mixed into the architecture's class by
    :func:`causal_lm`): the per-parameter init protocol (:meth:`init_param_`, :meth:`init_buffers`), reading
    ``model.pretrained``'s weights in it, and :meth:`export_to`. ``_hf_class`` is the architecture's own class."""

    _hf_class: Any = None  # set on each mixed class
    _hydratrain_weights: Optional[PretrainedWeights] = None  # model.pretrained's, read by init_param_

    if TYPE_CHECKING:  # what the transformers class it is mixed into (a PreTrainedModel) provides
        config: Any
        initialize_weights: Callable[[], None]
        named_buffers: Callable[..., Iterator[tuple[str, Any]]]
        state_dict: Callable[..., dict[str, Any]]
        get_parameter: Callable[[str], Any]

    @property
    def max_seq_len(self) -> Optional[int]:
        """Positions the model has learned embeddings for (``n_positions``: GPT-2 and its kin), checked against
        ``data.seq_len`` before any process group; None for rotary models (Llama...), which take any length."""
        value = getattr(self.config, "n_positions", None)
        return value if isinstance(value, int) else None

    def init_param_(self, name: str, tensor, generator) -> None:
        """Fill ``tensor`` (the full shape of parameter ``name``; a name may carry wrapper prefixes) with its initial
        values: ``model.pretrained``'s tensor when given (cast to ``tensor``'s dtype), else the architecture's own
        init drawn from the global RNG seeded with ``generator``'s seed (forked: the caller's RNG state is kept)."""
        if self._hydratrain_weights is not None:
            names = self._names_of(name)
            key = self._hydratrain_weights.key_for(names, getattr(self, "base_model_prefix", "") or "")
            tensor.copy_(self._hydratrain_weights.read(key))  # type: ignore[arg-type]  # (None fails in read)
            return
        with _only_this(self, name, tensor), _forked_rng(tensor.device):
            torch.manual_seed(generator.initial_seed())
            self.initialize_weights()

    def init_buffers(self) -> None:
        """Recompute every buffer by the architecture's own init (rotary tables, after ``to_empty`` hold garbage),
        parameters untouched; then ``model.pretrained``'s persistent buffers, if it stores any."""
        with _only_this(self, None, None):
            self.initialize_weights()
        if self._hydratrain_weights is not None:
            prefix = getattr(self, "base_model_prefix", "") or ""
            for name, buf in self.named_buffers():
                key = self._hydratrain_weights.key_for([name], prefix)
                if key is not None and name in self.state_dict():
                    with torch.no_grad():
                        buf.copy_(self._hydratrain_weights.read(key))

    def _names_of(self, name: str) -> list[str]:
        target = self.get_parameter(name)
        for names in _aliases(self).values():
            if canonical_name(name) in names:
                return names
        return [canonical_name(name)] if target is not None else []

    def export_to(self, out_dir: Union[str, Path], state_dict: dict, tokenizer: Optional[Union[str, Path]] = None
                  ) -> Path:
        """Write ``out_dir`` as ``save_pretrained`` does (config.json, generation_config.json, model.safetensors;
        tied weights stored once) from ``state_dict`` (full CPU tensors by this model's parameter names, as
        hydratrain's weights file holds them), plus the tokenizer (``tokenizer``: a tokenizer.json) saved as a
        ``transformers`` fast tokenizer, so ``AutoModelForCausalLM.from_pretrained(out_dir)`` and
        ``AutoTokenizer.from_pretrained(out_dir)`` load them. Returns ``out_dir``."""
        return export_pretrained(self.config, self._hf_class, state_dict, out_dir, tokenizer)


def export_pretrained(config, hf_class: type[Any], state_dict: dict, out_dir: Union[str, Path],
                      tokenizer: Optional[Union[str, Path]] = None) -> Path:
    """:meth:`HFCausalLM.export_to` for an architecture's ``config`` and class (a copy built on meta does the
    writing, so a sharded or wrapped model is never asked for its tensors)."""
    import copy


    out = Path(out_dir)
    config = copy.deepcopy(config)
    config.use_cache = True  # training turns the KV cache off; generation wants it
    with torch.device("meta"):
        shell = hf_class._from_config(config, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one file of a few shards: a bar on every export is noise in the run's log
    try:
        shell.save_pretrained(str(out), state_dict=tensors)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    if tokenizer is not None:
        save_tokenizer(tokenizer, out)
    return out


def save_tokenizer(tokenizer_json: Union[str, Path], out_dir: Path) -> None:
    """The tokenizer of ``tokenizer_json`` saved into ``out_dir`` for ``AutoTokenizer.from_pretrained``: the
    ``transformers`` tokenizer files beside it copied as they are (a pretrained model's, carried in the checkpoints:
    its special tokens and chat template kept), else the bare ``tokenizers`` file wrapped as a fast tokenizer
    (tokenizer.json, tokenizer_config.json), ``<|endoftext|>`` as its end-of-text token when it has one."""
    files = transformers_tokenizer_files(Path(tokenizer_json).parent)
    if files and files["tokenizer.json"].resolve() == Path(tokenizer_json).resolve():
        for name, path in files.items():
            copy_atomic(path, Path(out_dir) / name)
        return
    from transformers import PreTrainedTokenizerFast


    tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))
    if tok.convert_tokens_to_ids(EOT) is not None and EOT in tok.get_vocab():
        tok.eos_token = EOT
        tok.bos_token = EOT
    tok.save_pretrained(str(out_dir))


@contextlib.contextmanager
def _forked_rng(device) -> Iterator[None]:
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        yield


@contextlib.contextmanager
def _only_this(model, name: Optional[str], tensor) -> Iterator[None]:
    """For the duration, every parameter and buffer of ``model`` is marked initialised (``_is_hf_initialized``,
    which ``transformers``' init functions skip) except: parameter ``name``, whose holders (tied ones too) hold
    ``tensor`` instead (unmarked); with ``name`` None, the buffers. Modules' own marks are cleared so the init visits
    every module. Everything is put back after."""
    params = {id(p): p for p in model.parameters()}
    buffers = [b for b in model.buffers()]
    target = model.get_parameter(name) if name is not None else None
    holders = [(m, k) for m in model.modules() for k, p in m._parameters.items() if target is not None and p is target]
    lent = None
    if target is not None:
        lent = tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor, requires_grad=False)
    marked = [p for i, p in params.items() if p is not lent] + ([] if name is None else buffers)
    for t in marked:
        t._is_hf_initialized = True
    for m in model.modules():
        m.__dict__.pop("_is_hf_initialized", None)
    for m, k in holders:
        m._parameters[k] = lent
    try:
        yield
    finally:
        for m, k in holders:
            m._parameters[k] = target
        for t in marked + ([lent] if lent is not None else []) + buffers:
            t.__dict__.pop("_is_hf_initialized", None)
        for m in model.modules():
            m.__dict__.pop("_is_hf_initialized", None)


def _mixed(hf_class: type) -> type[Any]:
    """``hf_class`` with :class:`HFCausalLM` mixed in, under the same name and module (so ``save_pretrained``
    records the architecture's own class and ``transformers`` treats it as its own), made once per class."""
    if hf_class not in _CLASSES:
        _CLASSES[hf_class] = type(hf_class.__name__, (HFCausalLM, hf_class),
                                  {"__module__": hf_class.__module__, "__qualname__": hf_class.__qualname__,
                                   "_hf_class": hf_class})
    return _CLASSES[hf_class]


def causal_lm(config: Union[None, str, dict] = None, pretrained: Optional[str] = None,
              vocab_size: Optional[int] = None, tokenizer: Optional[str] = None,
              attn_implementation: str = "sdpa") -> HFCausalLM:
    """A ``transformers`` causal LM (``AutoModelForCausalLM``'s class for the config) in float32, built on the
    current default device (meta included), its KV cache off for training.

    ``config``: see :func:`hf_config`. ``pretrained``: a ``save_pretrained`` dir (its config.json, and its weights
    read into the model by the init protocol). ``vocab_size``: the embedding rows when the config does not fix them
    (a config with vocab_size, or ``pretrained``'s, wins; hydratrain fills a null with the data's vocabulary).
    ``tokenizer``: the data's tokenizer.json (or a dir holding one), checked to fit the vocabulary.
    ``attn_implementation``: ``sdpa`` | ``eager`` | any ``transformers`` accepts.

    Shapes: ``model(ids)`` with ids ``(B, T)`` int64 -> ``.logits`` ``(B, T, vocab)``. Raises :class:`ConfigError`
    naming the key (see :func:`hf_config`, :class:`PretrainedWeights`, :func:`check_pretrained`; ``model.vocab_size``
    or ``data.tokenizer`` when the tokenizer has more tokens than the model's vocabulary).
    """
    transformers = _transformers()
    made = hf_config(config, pretrained)
    fixed = made.vocab_size if (pretrained or isinstance(config, (str, Path)) or
                                "vocab_size" in (config or {})) else None
    if fixed is None and vocab_size is not None:
        made.vocab_size = int(vocab_size)
    elif fixed is not None and vocab_size is not None and vocab_size > _padded(fixed):
        # vocab_size is the data's (its tokenizer's size padded to 64) or the user's: either way more token ids
        # than the fixed embedding has rows
        raise ConfigError("model.vocab_size", vocab_size, f"more than the model's {fixed} tokens (its "
                          f"{'pretrained' if pretrained else 'config'} vocab_size): the data's tokenizer does not fit "
                          "the model")
    if tokenizer:
        _check_tokenizer(tokenizer, made.vocab_size, fixed is not None)
    mapping = transformers.AutoModelForCausalLM._model_mapping
    if type(made) not in mapping:
        raise ConfigError("model.config.model_type", made.model_type, "has no causal-LM class in transformers "
                          f"{transformers.__version__} (AutoModelForCausalLM does not build it)")
    made.use_cache = False
    cls = _mixed(mapping[type(made)])
    try:
        model = cls._from_config(made, attn_implementation=attn_implementation, dtype=torch.float32)
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 (the architecture's own checks of its config)
        raise ConfigError("model.config", made.to_dict() if config is None or isinstance(config, (str, Path))
                          else config, f"{cls.__name__} refused it ({type(err).__name__}: "
                          f"{_first_line(err)})") from None
    if pretrained:
        weights = PretrainedWeights(pretrained)
        check_pretrained(model, weights)
        model._hydratrain_weights = weights
    return model


def _padded(n: int) -> int:
    return padded_vocab_size(n)


def _check_tokenizer(path: Union[str, Path], vocab: int, fixed: bool) -> None:
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        return  # the data's own check names it
    tok = load_tokenizer(path)
    if tok.vocab_size > vocab:
        key = "data.tokenizer" if fixed else "model.vocab_size"
        raise ConfigError(key, str(path) if fixed else vocab, f"the tokenizer {path} has {tok.vocab_size} tokens, "
                          f"more than the model's vocabulary of {vocab}: use the model's own tokenizer, or a model "
                          f"with vocab_size >= {tok.vocab_size}")
