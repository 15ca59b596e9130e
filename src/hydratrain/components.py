"""The researcher's components, built from their Hydra nodes: the model, the loss, the eval metrics and a data
factory. Each is a node with ``_target_`` (a dotted path to a class or function) and its keyword arguments
(``_partial_: true`` for a function that takes more later), built with ``hydra.utils.instantiate``; the built-in GPT,
next-token loss and the torchmetrics metrics go through the same path::

    # my_conf/model/mlp.yaml                      python train.py --config-dir my_conf model=mlp
    _target_: mypkg.nets.MLP
    hidden: 256

The model node also holds hydratrain's own keys (:data:`MODEL_KEYS`: where to build it, a weights file to start
from), which are not passed to the constructor; a ``vocab_size: null`` keyword is filled with the data's vocabulary.

What can be known without a process group is checked by :func:`check_components` before any process starts (the
target imports, the keywords fit its signature and the types it annotates, the model's own config checks, the
metrics build); what only a real build or a batch tells (a constructor that raises, a forward that refuses the
batch) is a :class:`~hydratrain.errors.ConfigError` at the build or the first step, the same on every rank. Every
error is one line naming the config key. What the checks built, the run's build in the same process takes over
(:func:`checked_build`) instead of building it again: the loss, the metrics, and the meta model where the run
needs one on meta (``init_device=meta``, FSDP's meta build, the FLOP count); a config without metrics imports no
torchmetrics. A user's package is importable from the launch dir (:func:`importable`),
as ``python -m`` would make it, in every rank and launcher worker.
"""
from __future__ import annotations

import inspect
import sys
import typing
from typing import Any, Callable, Mapping, Optional

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from hydratrain.config.schema import LOADER_KEYS, MODEL_KEYS
from hydratrain.config.settings import ModelSettings
from hydratrain.errors import ConfigError, Placeholder
from hydratrain.paths import launch_dir

INIT_DEVICES = ("auto", "meta", "cpu", "cuda")
_ABSENT = Placeholder("<absent>")
_HYDRA_KEYS = ("_target_", "_partial_", "_recursive_", "_convert_", "_args_")
# what check_components built, for the run's build in this process to take over instead of building it again (the
# meta model, the loss, the metrics): each under the resolved content of the node it was built from, so a build of
# another config (a sweep's next job checks its own first) builds its own; taken once (checked_build)
_CHECKED: dict[str, tuple[str, Any]] = {}


def importable() -> None:
    """Put the launch dir (:func:`hydratrain.paths.launch_dir`) first on ``sys.path`` when it is not there,
    so ``_target_: mypkg.nets.MLP`` finds ``mypkg/`` beside the command (``python train.py`` puts the script's dir
    there instead)."""
    here = str(launch_dir())
    if here not in sys.path:
        sys.path.insert(0, here)


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def _content(*parts: Any) -> str:
    import json

    return json.dumps(parts, sort_keys=True, default=repr)


def checked_build(what: str, content: str, keep: bool = False) -> Any:
    """What :func:`check_components` built as ``what`` (``model``, ``loss``, ``metrics``) from a node of this
    ``content``, handed over once (``keep``: left for a later taker), else None."""
    kept = _CHECKED.get(what) if keep else _CHECKED.pop(what, None)
    return kept[1] if kept is not None and kept[0] == content else None


def keep_checked(cfg: DictConfig, target: str, vocab: Optional[int], model: Any, loss: Any, metrics: dict) -> None:
    """Keep what the checks before the run built (:func:`hydratrain.config.validate.check_components`: the meta
    model, the loss, the metrics) for the run's build in this process to take over (:func:`checked_build`)."""
    if model is not None:
        _CHECKED["model"] = (_content(_model_node(cfg, target, model_kwargs(cfg, vocab))), model)
    _CHECKED["loss"] = (_content(_plain(cfg.get("loss"))), loss)
    if metrics:
        _CHECKED["metrics"] = (_content(_plain(cfg.get("metrics"))), metrics)


def forget_checked() -> None:
    """Drop what :func:`check_components` built and no build took (the run's build has what it needs)."""
    _CHECKED.clear()


def target_of(node: Any, key: str) -> str:
    """The ``_target_`` of the component node at ``key``. Raises :class:`ConfigError` when the node is missing or
    names no target (a model file holding only ``name: mlp`` would otherwise build nothing it names)."""
    if node is None or not OmegaConf.is_dict(node) and not isinstance(node, Mapping):
        raise ConfigError(key, node if node is not None else _ABSENT, "must be a node with _target_ (a dotted path "
                          "to a class or function) and its keyword arguments")
    target = node.get("_target_")
    if not isinstance(target, str) or not target.strip():
        owned = MODEL_KEYS if key == "model" else LOADER_KEYS if key == "data" else ()  # (every such node has them)
        keys = [k for k in node.keys() if k not in _HYDRA_KEYS and k not in owned]
        return _no_target(key, target, keys)
    return target


def _no_target(key: str, target: Any, keys: list) -> str:
    example = {"model": "mypkg.nets.MLP", "loss": "torch.nn.CrossEntropyLoss", "data": "mypkg.data.make_datasets"}
    top = key.split(".")[0]
    raise ConfigError(f"{key}._target_", target if target is not None else _ABSENT,
                      f"the {key} node names no class or function to build (its keys: "
                      f"{', '.join(map(str, keys)) or 'none'}); "
                      f"give one, e.g. _target_: {example.get(top, 'torchmetrics.classification.MulticlassAccuracy')}")


def locate(target: str, key: str, full_key: Optional[str] = None, value: Any = None) -> Any:
    """The object ``target`` names (imported as Hydra's ``instantiate`` would). Raises :class:`ConfigError` naming
    ``<key>._target_`` (or ``full_key``, with ``value``) and the import error."""
    import logging

    from hydra.utils import get_object

    importable()
    quiet = logging.getLogger("hydra.utils")  # it logs the failure in 3 lines before raising; the line below says it
    was, quiet.disabled = quiet.disabled, True
    try:
        return get_object(target)
    except Exception as err:  # ImportError, AttributeError, a module that raises on import
        # Hydra wraps what the import raised in one ImportError("Error loading '<target>': ..."); the error under it
        # is the target's own, kept whole: a module that turns a missing package into advice is quoted with it
        wrapped = isinstance(err, ImportError) and str(err).startswith("Error loading ") and err.__cause__ is not None
        cause = err.__cause__ if wrapped else err
        kind, why = type(cause).__name__, (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        if isinstance(cause, ModuleNotFoundError) and cause.name and "is not a package" in why:
            # Hydra tried the missing name as a submodule of a plain module: the module lacks that name
            kind, (module, _, name) = "AttributeError", cause.name.rpartition(".")
            why = f"module '{module}' has no attribute '{name}'"
        named = "" if full_key is None else f"{target!r} "
        raise ConfigError(full_key or f"{key}._target_", target if full_key is None else value,
                          f"{named}cannot be imported ({kind}: {why}); is its package in the launch dir or on "
                          "PYTHONPATH?") from None
    finally:
        quiet.disabled = was


def _signature(obj: Any) -> Optional[inspect.Signature]:
    try:
        return inspect.signature(obj)
    except (TypeError, ValueError):  # builtins without a signature
        return None


def _hints(obj: Any) -> dict:
    fn = obj.__init__ if inspect.isclass(obj) else obj
    try:
        return typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 (forward references that do not resolve: no type checks)
        return {}


def _accepts(hint: Any, value: Any) -> Optional[str]:
    """None when ``value`` fits the simple annotation ``hint`` (int, float, bool, str, Optional/Union of them), else
    the name of the type; anything else is not checked."""
    simple = (int, float, bool, str)
    origin = typing.get_origin(hint)
    options = typing.get_args(hint) if origin is typing.Union or str(origin) == "<class 'types.UnionType'>" else (hint,)
    if not all(o in simple or o is type(None) for o in options):
        return None
    for o in options:
        if value is None and o is type(None):
            return None
        if o is bool and isinstance(value, bool):
            return None
        if o is int and isinstance(value, int) and not isinstance(value, bool):
            return None
        if o is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return None
        if o is str and isinstance(value, str):
            return None
    return " or ".join("null" if o is type(None) else o.__name__ for o in options)


def check_call(obj: Any, kwargs: Mapping, key: str, target: str, partial: bool = False, supplied: int = 0) -> None:
    """Raise :class:`ConfigError` naming ``<key>.<keyword>`` when ``obj(**kwargs)`` cannot bind (a keyword it does
    not take, a required one missing; ``partial``: missing ones come later) or a value does not fit the simple
    type ``obj`` annotates it with. ``supplied``: the leading positional parameters the run passes itself (a loss
    function's outputs and targets), which the config cannot set."""
    sig = _signature(obj)
    if sig is None:
        return
    params = sig.parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    positional = [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
             and n not in positional[:supplied]]
    if not takes_any:
        for k in kwargs:
            if k not in named:
                raise ConfigError(f"{key}.{k}", kwargs[k], f"not a keyword of {target}; allowed: "
                                  f"{', '.join(named) or 'none'}")
    if not partial:
        for n, p in params.items():
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty and n not in kwargs \
                    and n not in positional[:supplied]:
                raise ConfigError(f"{key}.{n}", _ABSENT, f"{target} requires it (add +{key}.{n}=VALUE, or the key in "
                                  "the option file)")
    hints = _hints(obj)
    for k, v in kwargs.items():
        if k in hints and not OmegaConf.is_config(v):
            wanted = _accepts(hints[k], v)
            if wanted is not None:
                raise ConfigError(f"{key}.{k}", v, f"must be {wanted} (as {target} annotates it)")


# ------------------------------------------------------------------------------------------------------ model
def model_settings(cfg: DictConfig) -> ModelSettings:
    """hydratrain's keys of the model node (:data:`~hydratrain.config.schema.MODEL_KEYS`), resolved."""
    return ModelSettings.of(cfg.get("model"))


def model_kwargs(cfg: DictConfig, vocab_size: Optional[int] = None) -> dict:
    """The model node as plain keyword arguments (``_target_`` and hydratrain's keys removed); a ``vocab_size``
    keyword that is null becomes ``vocab_size`` when given."""
    kwargs = {k: v for k, v in _plain(cfg.model).items() if k not in MODEL_KEYS and k not in _HYDRA_KEYS}
    if vocab_size is not None and "vocab_size" in kwargs and kwargs["vocab_size"] is None:
        kwargs["vocab_size"] = vocab_size
    return kwargs


def model_class(cfg: DictConfig) -> Any:
    """The class (or factory) ``model._target_`` names. Raises :class:`ConfigError`."""
    return locate(target_of(cfg.get("model"), "model"), "model")


def model_name(cfg: DictConfig) -> str:
    """The model's name for logs and reports: the ``model`` option chosen (``gpt_tiny``, a user's ``mlp``), else
    the last part of its ``_target_``."""
    if HydraConfig.initialized():
        choice = HydraConfig.get().runtime.choices.get("model")
        if choice:
            return str(choice)
    target = cfg.model.get("_target_") if cfg.get("model") is not None else None
    return str(target).rsplit(".", 1)[-1] if target else "model"


def build_model(cfg: DictConfig, device: Any, vocab_size: Optional[int] = None, checked: bool = False):
    """The model of ``cfg.model`` built with its constructor's tensors on ``device`` (a ``torch.device``, ``meta``
    included). Raises :class:`ConfigError`: the model's own (naming its key), or one naming ``model._target_`` with
    what the constructor raised, or a ``state_dict()`` that checkpoints cannot hold (:func:`check_state_dict`, on a
    build with storage; before any wrapper, whose own hooks rename keys). ``checked``: on meta, the model
    :func:`check_components` built of the same node and vocabulary, when no one took it yet (the run's own builds:
    the one it trains, the copy it counts FLOPs on)."""
    import torch

    target = target_of(cfg.get("model"), "model")
    cls = locate(target, "model")
    kwargs = model_kwargs(cfg, vocab_size)
    check_call(cls, kwargs, "model", target)
    node = _model_node(cfg, target, kwargs)
    if checked and torch.device(device).type == "meta":
        model = checked_build("model", _content(node))
        if model is not None:
            return model
    with torch.device(device):
        model = instantiate_node(node, "model._target_", target, "its constructor raised")
    if not isinstance(model, torch.nn.Module):
        raise ConfigError("model._target_", target, f"built a {type(model).__name__}, not a torch.nn.Module")
    if torch.device(device).type != "meta":  # a meta build is checked by check_components, before any process starts
        check_state_dict(model, target)
    return model


def _model_node(cfg: DictConfig, target: str, kwargs: dict) -> dict:
    """What :func:`build_model` instantiates: ``_target_``, Hydra's other keys of the node, the keywords."""
    return {"_target_": target, **{k: v for k, v in _plain(cfg.model).items() if k in _HYDRA_KEYS[1:]}, **kwargs}


def instantiate_node(node: dict, key: str, target: str, what: str, objects: Optional[dict] = None) -> Any:
    """``hydra.utils.instantiate(node)`` (containers as plain lists and dicts; ``objects``: keywords passed as they
    are, as tensors). What the target raises becomes a :class:`ConfigError` naming ``key``, ``target`` and ``<what>
    <ExceptionType>: <its first line>``; a ConfigError the target raises itself (a component's own check, naming its
    key) is raised as it is."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate(node, _convert_="all", **(objects or {}))
    except ConfigError:
        raise
    except Exception as err:
        cause: BaseException = err
        # Hydra's InstantiationException wraps the target's error; the target's own error stays whole, since its
        # message ("needs scikit-learn: pip install ...") says more than the error it chains ("No module named ...")
        while isinstance(cause, InstantiationException) and cause.__cause__ is not None:
            cause = cause.__cause__
        if isinstance(cause, ConfigError):
            raise cause from None
        why = (str(cause).strip().splitlines() or [""])[0]
        raise ConfigError(key, target, f"{what} {type(cause).__name__}: {why}") from None


# ------------------------------------------------------------------------------------------------ loss, metrics
def build_loss(cfg: DictConfig, device: Any = None, checked: bool = False) -> Callable:
    """The loss callable of ``cfg.loss`` (``loss(outputs, targets) -> 0-d mean``; :func:`build_callable`); an
    ``nn.Module`` loss is moved to ``device`` (its buffers: class weights). Raises :class:`ConfigError`, also for a
    loss module with trainable parameters: the optimizer, the gradient sync and the checkpoints cover the model's
    parameters only, so such a loss's parameters would silently stay as built (they belong in the model, whose
    forward can return the loss as ``.loss``), and for a ``reduction`` other than a mean (``sum`` scales the loss
    and its gradient with the batch size). ``checked``: the loss :func:`check_components` built of the same node, when
    no one took it yet (the run's build)."""
    import torch

    loss = checked_build("loss", _content(_plain(cfg.get("loss")))) if checked else None
    if loss is None:
        loss = build_callable(cfg.get("loss"), "loss", supplied=2)  # (outputs, targets)
    if isinstance(loss, torch.nn.Module):
        trained = [name for name, p in loss.named_parameters() if p.requires_grad]
        if trained:
            shown = ", ".join(trained[:3]) + (f" and {len(trained) - 3} more" if len(trained) > 3 else "")
            raise ConfigError("loss._target_", cfg.loss.get("_target_"),
                              f"has trainable parameters ({shown}) that nothing would train: only the model's "
                              "parameters are optimised, synced and saved; move them into the model and return the "
                              "loss from its forward as .loss (docs/own-model.md#the-loss), or freeze them "
                              "(requires_grad=False)")
        if device is not None:
            loss.to(device)
    reduction = getattr(loss, "reduction", "mean")
    if isinstance(reduction, str) and reduction not in ("mean", "batchmean"):
        raise ConfigError("loss.reduction", reduction, "allowed: mean (batchmean for KLDivLoss): the loss must be a "
                          "mean, which hydratrain weighs by the samples or targets it averages over, so that a step "
                          "and eval/loss are the same at any batch size, accumulation and world size")
    return loss


def checked_loss(cfg: DictConfig) -> Callable:
    """The loss :func:`check_components` built of ``cfg.loss``, left for the run's build to take; else one built
    now. Raises :class:`ConfigError`."""
    loss = checked_build("loss", _content(_plain(cfg.get("loss"))), keep=True)
    return build_loss(cfg) if loss is None else loss


def build_metrics(cfg: DictConfig, checked: bool = False) -> dict:
    """``{name: torchmetrics.Metric}`` of ``cfg.metrics`` (empty by default, which imports no torchmetrics), each
    logged as one number. Raises :class:`ConfigError` naming ``metrics.<name>``: for anything else, a
    ``MetricCollection`` (several values) too. ``checked``: the metrics :func:`check_components` built of the same
    nodes, when no one took them yet (the run's build)."""
    nodes = cfg.get("metrics") or {}
    if not nodes:
        return {}
    if checked:
        built = checked_build("metrics", _content(_plain(nodes)))
        if built is not None:
            return built
    from torchmetrics import Metric, MetricCollection

    out = {}
    for name, node in nodes.items():
        key = f"metrics.{name}"
        if str(name) in ("loss", "perplexity"):
            raise ConfigError(key, _plain(node), "is logged as eval/loss or eval/perplexity already: give the metric "
                              "another name")
        metric = _instantiate(node, key)
        if isinstance(metric, MetricCollection):
            names = list(metric.keys()) or ["acc", "f1"]
            listed = ", ".join(f"metrics.{n}._target_=..." for n in names[:3])
            raise ConfigError(f"{key}._target_", node.get("_target_"), "built a MetricCollection, which computes "
                              "several values, and each key of metrics: is one torchmetrics.Metric logged as one "
                              f"number (eval/<name>): list its metrics one per key under metrics: ({listed})")
        if not isinstance(metric, Metric):
            raise ConfigError(f"{key}._target_", node.get("_target_"), f"built a {type(metric).__name__}, not a "
                              "torchmetrics.Metric: give one (torchmetrics.classification.MulticlassAccuracy, a "
                              "subclass of torchmetrics.Metric), one per key under metrics:")
        out[str(name)] = metric
    return out


def build_callable(node: Any, key: str, supplied: int = 0) -> Callable:
    """A callable component (``loss``, ``data.collate_fn``): a class target is built with its keywords (an
    instance, as ``torch.nn.CrossEntropyLoss``), a function target is taken as it is, its keywords bound
    (``functools.partial``), so ``_partial_: true`` is not needed for a function; ``supplied``: its leading
    positional parameters that the run passes (:func:`check_call`). Raises :class:`ConfigError`."""
    import functools
    import inspect

    target = target_of(node, key)
    obj = locate(target, key)
    if inspect.isclass(obj) or _plain(node).get("_partial_") is not None:
        return _instantiate(node, key)
    kwargs = {k: v for k, v in _plain(node).items() if k not in _HYDRA_KEYS}
    check_call(obj, kwargs, key, target, partial=True, supplied=supplied)
    return functools.partial(obj, **kwargs) if kwargs else obj


def _instantiate(node: Any, key: str) -> Any:
    target = target_of(node, key)
    obj = locate(target, key)
    plain = _plain(node)
    kwargs = {k: v for k, v in plain.items() if k not in _HYDRA_KEYS}
    check_call(obj, kwargs, key, target, partial=bool(plain.get("_partial_")))
    tensors = tensor_keywords(obj, kwargs)
    return instantiate_node({k: v for k, v in plain.items() if k not in tensors}, f"{key}._target_", target,
                            "building it raised", tensors)


def tensor_keywords(obj: Any, kwargs: Mapping) -> dict:
    """The keywords ``obj`` annotates as a ``torch.Tensor`` (or an Optional one) whose value is a list of numbers (a
    YAML list, which a config cannot hold as a tensor: ``CrossEntropyLoss``'s class ``weight: [1.0, 2.0, 0.5]``),
    as float32 tensors."""
    import torch

    def numbers(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) or (
            isinstance(value, (list, tuple)) and len(value) > 0 and all(numbers(v) for v in value))

    out = {}
    for k, hint in _hints(obj).items():
        value = kwargs.get(k)
        options = typing.get_args(hint) or (hint,)  # (Optional[Tensor], Tensor | None)
        if torch.Tensor in options and isinstance(value, (list, tuple)) and numbers(value):
            out[k] = torch.tensor(value, dtype=torch.float32)
    return out


# --------------------------------------------------------------------------------------------------- checks
def check_parameters(model: Any, target: str) -> None:
    """Parameters hydratrain cannot train, as one line naming ``model._target_``: a lazy module's (``nn.LazyLinear``:
    no shape until a forward, so nothing can count, shard or plan it) and sparse gradients (``nn.Embedding(sparse=
    True)``: gradient clipping, fused AdamW and DDP/FSDP reduce dense gradients). Raises :class:`ConfigError`."""
    from torch import nn
    from torch.nn.parameter import UninitializedParameter

    lazy = [name for name, p in model.named_parameters() if isinstance(p, UninitializedParameter)]
    if lazy:
        raise ConfigError("model._target_", target, f"{', '.join(lazy[:4])} {'is a' if len(lazy) == 1 else 'are'} "
                          "lazy module parameter(s) without a shape (nn.LazyLinear, LazyConv...): give the module its "
                          "input size (nn.Linear(in_features, ...))")
    sparse = [name for name, m in model.named_modules()
              if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse]
    if sparse:
        raise ConfigError("model._target_", target, f"{', '.join(sparse[:4])} make(s) sparse gradients "
                          "(sparse=True), which gradient clipping, the optimizers and DDP/FSDP do not take: use "
                          "sparse=False")


def state_dict_names(model: Any) -> set:
    """The keys ``model.state_dict()`` holds when no hook changes them: every module's parameters and persistent
    buffers by their dotted names (a shared module's under each of its names, as ``state_dict`` gives them) and
    ``<module>._extra_state`` for a module whose class overrides ``get_extra_state``."""
    from torch import nn

    names: set[str] = set()
    for prefix, module in model.named_modules(remove_duplicate=False):
        pre = f"{prefix}." if prefix else ""
        names.update(pre + n for n, p in module._parameters.items() if p is not None)
        names.update(pre + n for n, b in module._buffers.items()
                     if b is not None and n not in module._non_persistent_buffers_set)
        if getattr(type(module), "get_extra_state", nn.Module.get_extra_state) is not nn.Module.get_extra_state:
            names.add(pre + nn.modules.module._EXTRA_STATE_KEY_SUFFIX)
    return names


def check_state_dict(model: Any, target: str, built_on_meta: bool = False) -> None:
    """What checkpoints, resume and the weights export need of ``model.state_dict()``, as one line naming
    ``model._target_``. Raises :class:`ConfigError`.

    - Its keys are the model's parameter and persistent-buffer names plus ``_extra_state`` entries
      (:func:`state_dict_names`): ``torch.distributed.checkpoint.state_dict`` (every save, resume and export, on any
      strategy) maps each key back to the module attribute of that name and loads strictly, so a state_dict hook
      or ``_save_to_state_dict`` that renames, adds or drops a key fails at the first save, or the resume, after
      training.
    - Each non-tensor extra state (``get_extra_state()``) survives ``torch.save`` then
      ``torch.load(weights_only=True)``: checkpoints store it pickled and resume reads it back that way (nothing in a
      checkpoint runs code on load), so a custom class or an unpicklable object would fail at the first save or the
      resume.

    ``built_on_meta``: a state_dict() that raises is not refused (the module may need storage); the real build is
    checked again."""
    import io

    import torch

    try:
        state = model.state_dict()
    except Exception as err:  # noqa: BLE001 (whatever the model's own state_dict code raises)
        if built_on_meta:
            return
        why = (str(err).strip().splitlines() or [""])[0]
        raise ConfigError("model._target_", target, f"its state_dict() raised {type(err).__name__}: {why}; "
                          "checkpoints and the weights export need it") from None
    names = state_dict_names(model)
    added, dropped = [k for k in state if k not in names], sorted(names - set(state))
    if added or dropped:
        what = "; ".join(part for part in (
            f"holds {', '.join(added[:4])}, not the name of a parameter or buffer" if added else "",
            f"lacks {', '.join(dropped[:4])}" if dropped else "") if part)
        raise ConfigError("model._target_", target, f"its state_dict() {what} (a state_dict hook or "
                          "_save_to_state_dict that renames, adds or drops keys): checkpoints, resume and the weights "
                          "export save and load the model by its parameter and buffer names "
                          "(torch.distributed.checkpoint), so the run would fail at its first save; remove the hook "
                          "and convert to another layout outside the model (e.g. in an export_to() method)")
    for key in sorted(k for k in names if k.endswith("_extra_state")):
        value = state.get(key)
        if isinstance(value, torch.Tensor):
            continue
        buffer, step = io.BytesIO(), "torch.save cannot pickle it"
        try:
            torch.save(value, buffer)
            buffer.seek(0)
            step = "torch.load(weights_only=True) refuses it"
            torch.load(buffer, weights_only=True)
        except Exception as err:  # noqa: BLE001 (pickling, or the weights-only unpickler refusing a global)
            lines = [line.strip() for line in str(err).splitlines() if line.strip()]
            why = next((line for line in lines if line.startswith("WeightsUnpickler error:")), lines[0] if lines
                       else "")
            why = why.split(" Please use")[0]  # torch's advice to trust the file: not what a model should do
            raise ConfigError("model._target_", target, f"its {key} (get_extra_state()) is a {type(value).__name__} "
                              f"that a checkpoint cannot restore: {step} ({type(err).__name__}: {why[:200]}); "
                              "return a tensor, or plain containers (dict, list, tuple) of tensors, numbers, "
                              "strings and None") from None
