"""What a finished run leaves in its run dir: ``model.safetensors`` (full weights, the model's own parameter names, so
``model.load_state_dict(load_file(path), strict=True)`` loads them into its class) and, for a model with an
``export_to`` hook (:data:`hydratrain.checkpoint.export.EXPORT_HOOK`), its own format under ``export/``; a generated
sample (language models on token data), the hparams row in TensorBoard and ``results.json``. A ``+peft=lora`` run
writes ``adapter/`` (peft's own format) and the adapters merged into ``model.safetensors`` and ``export/``. Every
rank calls :func:`write_outputs` (gathering weights and sampling are collective); rank 0 writes the files."""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
import traceback
import unicodedata
from enum import Enum
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from hydratrain import components
from hydratrain.checkpoint.export import export_model, write_safetensors
from hydratrain.checkpoint.layout import list_checkpoints
from hydratrain.config.settings import LoraSettings
from hydratrain.config.trainer import language_model
from hydratrain.data.registry import CORPORA
from hydratrain.data.tokenizer import transformers_tokenizer_files
from hydratrain.dist.launch import unwritable_message
from hydratrain.errors import HydratrainError, OutputError, unwritable_cause
from hydratrain.parallel import lora
from hydratrain.parallel.ac_compile import eager
from hydratrain.train.batch import prediction

log = logging.getLogger("hydratrain")

HPARAM_KEYS = ["data.seq_len", "data.batch_size", "strategy.name", "precision.name", "wrap_policy.name", "optim.lr",
               "optim.weight_decay", "scheduler.name", "trainer.max_steps", "trainer.grad_accum_steps", "trainer.seed",
               "activation_checkpointing"]


def _plain(value):
    return value.value if isinstance(value, Enum) else value


def hparams_of(cfg: DictConfig, world_size: int, precision_name: str) -> dict:
    """The flat hyper-parameters written once per run to TensorBoard's hparams table and results.json: a fixed set,
    the resolved precision, the world size, and every command-line override of this Hydra job (so any swept key is
    a column), with the config's typed value (``optim.lr`` -> 0.001, ``activation_checkpointing`` -> True, a null
    -> None) or the chosen option (``strategy`` -> ddp). None stays None (null in results.json, a blank cell in
    TensorBoard), so a key swept over null and numbers is one number column, not numbers beside a string "null".
    The components are columns too: ``model`` (its option or class), every scalar keyword of the model node
    (``model.d_model``, a user model's ``model.hidden``), ``data`` and ``loss``. A fixed key the config does not
    hold (``data.seq_len`` of a dataset node) is left out."""
    out: dict[str, Any] = {"model": components.model_name(cfg)}
    for key, value in components.model_kwargs(cfg).items():
        if value is None or isinstance(value, (int, float, str, bool)):
            out[f"model.{key}"] = value
    out["data"] = _choice("data", cfg.data.get("name") or cfg.data.get("_target_"))
    out["loss"] = _choice("loss", cfg.loss.get("_target_"))
    absent = object()  # a key this run's config does not hold (data.seq_len of a dataset node): no column
    out.update({k: _plain(v) for k in HPARAM_KEYS if (v := OmegaConf.select(cfg, k, default=absent)) is not absent})
    out["precision.resolved"] = precision_name
    out["world_size"] = world_size

    if HydraConfig.initialized():
        for item in HydraConfig.get().overrides.task:
            key, sep, value = str(item).partition("=")
            key = key.lstrip("+")
            if sep and not key.startswith(("hydra.", "~")):
                typed = _plain(OmegaConf.select(cfg, key, default=value))
                out[key] = typed if typed is None or isinstance(typed, (int, float, str, bool)) else value
    return out


def _choice(group: str, default) -> str:
    """The option chosen for ``group`` (Hydra's runtime choices), else ``default``."""
    if HydraConfig.initialized() and HydraConfig.get().runtime.choices.get(group):
        return str(HydraConfig.get().runtime.choices[group])
    return str(_plain(default))


def model_record(cfg: DictConfig, vocab_size: Optional[int]) -> dict:
    """The model as built: ``_target_`` and its keyword arguments, the data's vocabulary filled in (hydratrain's own
    keys left out): what rebuilds it without the run config (``hydra.utils.instantiate(record)``)."""
    return {"_target_": cfg.model.get("_target_"), **components.model_kwargs(cfg, vocab_size)}


def model_config_json(cfg: DictConfig, vocab_size: Optional[int]) -> str:
    """:func:`model_record` as JSON (``model.json`` in every checkpoint, ``model_config`` in the weights file's
    header)."""
    return json.dumps(model_record(cfg, vocab_size), default=str)


def model_files(cfg: DictConfig, vocab_size: Optional[int], tokenizer, tokenizer_dir: Optional[Path] = None) -> dict:
    """Files every checkpoint carries besides the tensors: ``model.json`` (:func:`model_config_json`) and the run's
    tokenizer (paths of the files to copy): a ``transformers`` tokenizer dir's files (``tokenizer_dir``:
    :func:`hydratrain.data.tokenizer.run_tokenizer_dir`; its tokenizer.json, config, special tokens, chat template)
    when the data's tokenizer, if any, is that dir's; else, for subword data, its tokenizer.json."""
    files: dict[str, Any] = {"model.json": model_config_json(cfg, vocab_size)}
    hf = transformers_tokenizer_files(tokenizer_dir)
    if hf and (tokenizer is None or Path(tokenizer.path).resolve() == hf["tokenizer.json"].resolve()):
        files.update(hf)
    elif tokenizer is not None:
        files["tokenizer.json"] = Path(tokenizer.path)
    return files


def save_weights(model: torch.nn.Module, path: Path, is_main: bool, metadata: Optional[dict] = None,
                 export: Optional[tuple[Any, Path, Optional[Path]]] = None) -> Optional[Path]:
    """Gather the full (unsharded) weights on rank 0 and write them to ``path`` as safetensors, atomically.

    Every rank must call (FSDP all-gathers). Keys are the model's own parameter names (no DDP/AC/compile prefixes);
    a tied weight is stored under each of its names. A module's extra state (``get_extra_state()``) is stored when it
    is a tensor; any other (a dict...) is left out, with a warning: safetensors holds tensors only (the DCP checkpoints
    keep it). ``metadata`` (str -> str) goes into the file's header.
    ``export``: ``(plain model, dir, tokenizer.json or None)``: a model with an ``export_to`` hook
    (:data:`hydratrain.checkpoint.export.EXPORT_HOOK`) also writes its own
    format into that dir from the same tensors (rank 0). Returns ``path`` on rank 0, None elsewhere.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict


    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not is_main:
        return None
    left_out = [f"{k} (a {type(v).__name__} from get_extra_state())" for k, v in state.items()
                if not isinstance(v, torch.Tensor)]
    if left_out:  # a module's get_extra_state() that is not a tensor: the checkpoints keep it, safetensors cannot
        log.warning("%s holds tensors only: left out the model's extra state %s; the checkpoints keep it; load the "
                    "file with load_state_dict(..., strict=False)", path.name, ", ".join(left_out))
    # tied weights share storage; safetensors wants one each
    state = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
    out = write_safetensors(state, path, {"format": "pt", "producer": "hydratrain", **(metadata or {})})
    if export is not None:
        export_model(*export, state)
    return out


def save_lora(model: torch.nn.Module, cfg: DictConfig, adapters: LoraSettings, run_dir: Path, is_main: bool,
              vocab_size: Optional[int], metadata: dict, tokenizer: Optional[Path]) -> Optional[Path]:
    """A ``+peft=lora`` run's weights (every rank calls: FSDP all-gathers; rank 0 writes): ``adapter/`` as
    ``PeftModel.save_pretrained`` writes it (``PeftModel.from_pretrained(base, dir)`` loads it onto the base), and
    the adapters merged into the base (``merge_and_unload``) as ``model.safetensors`` under the model's own names,
    plus ``export/`` for a model with an export hook. Rank 0 rebuilds the model on meta and takes the gathered
    tensors (``assign``), so it holds one full copy, as :func:`save_weights` does. Returns the weights file on
    rank 0, None elsewhere."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not is_main:
        return None
    wrapped = lora.apply(components.build_model(cfg, "meta", vocab_size), adapters)
    wrapped.load_state_dict(state, assign=True)
    wrapped.save_pretrained(str(run_dir / "adapter"))  # type: ignore[operator]  # (a PeftModel's)
    base = lora.merged(wrapped)
    merged = {k: v.detach().clone().contiguous() for k, v in base.state_dict().items()}  # (tied: one copy each)
    out = write_safetensors(merged, run_dir / "model.safetensors", {"format": "pt", "producer": "hydratrain",
                                                                     "peft": "lora merged", **metadata})
    export_model(base, run_dir / "export", tokenizer, merged)
    return out


@torch.no_grad()
def sample(model: torch.nn.Module, prompt: list[int], n_tokens: int, device: torch.device, autocast, seed: int,
           max_context: int, temperature: float = 0.8, top_k: int = 40) -> list[int]:
    """Generate ``n_tokens`` token ids after ``prompt`` with ``model`` (the module under any DDP wrapper; an FSDP
    module itself; ``(B, T)`` ids -> ``(B, T, vocab)`` logits, or an output with ``.logits``), feeding it at most the
    last ``max_context`` tokens; every rank calls, rank 0's draws win.

    Each token is drawn on rank 0 from the top-k softmax at ``temperature`` and broadcast, so sharded (FSDP)
    forwards stay in lockstep. Returns prompt + generated ids.
    """
    was_training = model.training
    model.eval()
    max_len = max_context
    idx = torch.tensor([prompt], dtype=torch.long, device=device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for _ in range(n_tokens):
        with autocast:
            out = model(idx[:, -max_len:])
        logits = prediction(out)[0, -1].float().cpu()
        vals, ids = torch.topk(logits / temperature, min(top_k, logits.numel()))
        nxt = ids[torch.multinomial(torch.softmax(vals, -1), 1, generator=gen)].to(device).view(1, 1)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(nxt, src=0)
        idx = torch.cat([idx, nxt], dim=1)
    model.train(was_training)
    return idx[0].tolist()


def sample_text(cfg: DictConfig, model: torch.nn.Module, device: torch.device, autocast, tokenizer=None) -> str:
    """The end-of-run sample as text: ``trainer.sample_tokens`` tokens after a prompt (``def `` on the Python
    corpora, a newline elsewhere), decoded with the data's tokenizer, as UTF-8 bytes for the byte corpora, or shown
    as token ids (synthetic data, token_bin without ``data.tokenizer``)."""
    entry = CORPORA[str(cfg.data.name)]
    text, byte_level = entry.prompt, entry.byte_level
    if tokenizer is not None:
        prompt = tokenizer.encode(text) or [0]
    else:
        prompt = list(text.encode()) if byte_level else [0]
    context = cfg.model.get("max_seq_len") or cfg.data.seq_len
    ids = sample(model, prompt, cfg.trainer.sample_tokens, device, autocast, cfg.trainer.seed, context)
    if tokenizer is not None:
        return tokenizer.decode(ids)
    if byte_level:
        return bytes(t % 256 for t in ids).decode("utf-8", errors="replace")
    return "token ids: " + " ".join(map(str, ids))


def printable(text: str) -> str:
    """``text`` with its control characters other than newline and tab shown as escapes (``\\x1b``): a byte-level
    model's sample held NUL, ESC, CR and backspace, which went raw into the console and the log, where ``grep`` then
    saw a binary file."""
    return "".join(ch if ch in "\n\t" or unicodedata.category(ch) not in ("Cc", "Cs")
                   else ch.encode("unicode_escape").decode("ascii") for ch in text)


def results_payload(result, hparams: dict, previous: Optional[Path] = None) -> tuple[dict, list[str]]:
    """(what ``results.json`` holds: the FitResult fields and the hparams, non-finite figures as null; the keys taken
    from ``previous``).

    A launch that trained no step (relaunched after the run had finished, e.g. a requeue) keeps the figures of the
    ``previous`` results.json (train loss, tokens/s, MFU, ...) where it has none of its own, and the larger peak
    memory, so nothing measured before is lost and no NaN takes its place; but only when that results.json is of the
    step it resumed at: one of a later step (the run went on past its newest checkpoint) describes steps that are
    no longer the run's, so those figures stay null."""
    def finite(v):
        return None if isinstance(v, float) and not math.isfinite(v) else v

    payload = {**result.__dict__, "hparams": hparams}
    payload = {k: ({m: finite(x) for m, x in v.items()} if k in ("eval_metrics", "test_metrics") else finite(v))
               for k, v in payload.items()}
    carried: list[str] = []
    if getattr(result, "steps_this_launch", 1) == 0 and previous is not None and previous.exists():
        try:
            before = json.loads(previous.read_text())
        except (OSError, ValueError):
            before = {}
        if before.get("steps") != payload["steps"]:
            return payload, carried
        carried = [k for k, v in before.items() if k in payload and payload[k] is None and v is not None]
        payload.update({k: before[k] for k in carried})
        if isinstance(before.get("peak_memory_bytes"), int):
            payload["peak_memory_bytes"] = max(payload["peak_memory_bytes"], before["peak_memory_bytes"])
    return payload, carried


def write_results(run_dir: Path, payload: dict) -> Path:
    """``<run_dir>/results.json`` holding ``payload`` (:func:`results_payload`), atomically."""
    tmp = run_dir / f".results.json.tmp{os.getpid()}"
    tmp.write_text(json.dumps(payload, indent=1, default=str, allow_nan=False))
    os.replace(tmp, run_dir / "results.json")
    return run_dir / "results.json"


def done_line(payload: dict, carried: list[str]) -> str:
    """The run's last log line, from :func:`results_payload`'s figures; a figure the run has not (null) is left out."""
    p = payload
    line = f"done: step {p['steps']} ({p['steps_this_launch']} steps in this launch, {p['seconds']:.1f} s)"
    parts = []
    if p.get("train_loss") is not None:
        parts.append(f"train loss {p['train_loss']:.4f}"
                     + (f" (step 1: {p['first_loss']:.4f})" if p.get("first_loss") is not None else ""))
    for key, fmt in (("eval_loss", "eval loss {:.4f}"), ("eval_perplexity", "perplexity {:.2f}")):
        if p.get(key) is not None:
            parts.append(fmt.format(p[key]))
    parts += [f"{name} {value:.4g}" for name, value in (p.get("eval_metrics") or {}).items() if value is not None]
    parts += [f"test {name} {value:.4g}" for name, value in (p.get("test_metrics") or {}).items() if value is not None]
    rate = ("tokens_per_sec", "{:.0f} tokens/s") if p.get("tokens_per_sec") is not None else \
        ("samples_per_sec", "{:.1f} samples/s")
    for key, fmt in (rate, ("mfu", "mfu {:.2%}")):
        if p.get(key) is not None:
            parts.append(fmt.format(p[key]))
    parts.append(f"peak memory {p['peak_memory_bytes'] / 1e6:.1f} MB, skipped steps {p['skipped_steps']}")
    line += "; " + ", ".join(parts)
    if carried:
        line += f" ({', '.join(carried)} from results.json: no step trained in this launch)"
    return line


def write_outputs(cfg: DictConfig, result, *, model, raw, strategy, precision, info, run_dir: Path, trackers,
                  tokenizer=None, vocab_size: Optional[int] = None, test=None,
                  tokenizer_json: Optional[Path] = None) -> None:
    """Weights (with the tokenizer next to them), sample, hparams row and results.json of a finished run (every rank
    calls), then close ``trackers`` (:class:`hydratrain.train.trackers.Trackers`: TensorBoard and the others). The
    hparams metrics are the figures results.json gets (:func:`results_payload`); the trackers' summary adds the
    objective.
    ``test(result)``: called once the weights and the sample are written (it may load other weights), before the
    figures are (:func:`hydratrain.train.testing.tester`). ``tokenizer_json``: the tokenizer.json the checkpoints
    carry (:func:`model_files`; beside a ``transformers`` tokenizer's other files), handed to a model's export hook.

    An output whose dir takes no writes (full, read-only, permissions: :func:`hydratrain.errors.unwritable_cause`)
    does not keep the others from being written: the first such error is raised once the rest are written (so a
    TensorBoard dir that refuses leaves results.json, the run's figures, written); other errors are raised at once."""
    refused: list = []
    adapters = LoraSettings.of(cfg)
    with _keep_going(refused, run_dir):
        if cfg.trainer.save_weights and adapters is not None:
            path = save_lora(model, cfg, adapters, run_dir, info.is_main, vocab_size,
                             {"model_config": model_config_json(cfg, vocab_size)}, tokenizer_json)
            if path:
                saved = f" and its tokenizer to {tokenizer.save(run_dir)}" if tokenizer is not None else ""
                log.info("wrote the LoRA adapter to %s and the merged model's weights to %s%s", run_dir / "adapter",
                         path, saved)
        elif cfg.trainer.save_weights:
            path = save_weights(model, run_dir / "model.safetensors", info.is_main,
                                {"model_config": model_config_json(cfg, vocab_size)},
                                export=(raw, run_dir / "export", tokenizer_json))
            if path:
                saved = f" and its tokenizer to {tokenizer.save(run_dir)}" if tokenizer is not None else ""
                log.info("wrote full model weights to %s%s", path, saved)
    if cfg.trainer.sample_tokens and language_model(cfg):
        started = time.perf_counter()
        log.info("sampling %d tokens (trainer.sample_tokens) ...", cfg.trainer.sample_tokens)  # seconds to minutes

        with eager():  # each new length would be compiled again (ac_compile.eager)
            text = printable(sample_text(cfg, strategy.unwrap(model), info.device,
                                         strategy.autocast(precision, info.device), tokenizer))
        log.info("sampled in %.1f s", time.perf_counter() - started)
        log.info("sample:\n%s", text)
        with _keep_going(refused, run_dir):
            trackers.text("sample", text, result.steps)
    if test is not None:
        test(result)
    hparams = hparams_of(cfg, info.world_size, precision.name)
    payload, carried = results_payload(result, hparams, run_dir / "results.json" if info.is_main else None)
    metrics = {k: payload[k] for k in ("train_loss", "eval_loss", "eval_perplexity", "tokens_per_sec",
                                       "samples_per_sec", "mfu")}
    metrics.update({f"eval/{k}": v for k, v in (payload.get("eval_metrics") or {}).items()})
    metrics.update({f"test/{k}": v for k, v in (payload.get("test_metrics") or {}).items()})
    metrics["peak_memory_bytes"] = float(payload["peak_memory_bytes"])
    with _keep_going(refused, run_dir):
        trackers.hparams(hparams, metrics, result.steps, summary={**metrics, "objective": payload["objective"]})
    with _keep_going(refused, run_dir):
        trackers.close()
    if info.is_main:
        with _keep_going(refused, run_dir):
            write_results(run_dir, payload)
    log.info(done_line(payload, carried))
    if refused:
        raise refused[0]


@contextlib.contextmanager
def _keep_going(refused: list, run_dir: Path):
    """Append to ``refused`` an error of the block that is an output refused by its dir under ``run_dir``
    (:func:`hydratrain.errors.unwritable_cause`), instead of raising it; raise any other."""
    try:
        yield
    except Exception as err:
        if isinstance(err, HydratrainError) or unwritable_cause(err, writes=(run_dir,)) is None:
            raise
        refused.append(err)


@contextlib.contextmanager
def unwritable_as_output_error(run_dir: Path, resume: Optional[Path], cache_dir: Path):
    """A write that a full, over-quota or read-only filesystem, or the permissions of a dir under ``run_dir`` or
    ``cache_dir``, refused anywhere in the run (TensorBoard's events, the weights, results.json, a data cache under
    ``cache_dir``; :func:`hydratrain.errors.unwritable_cause`) ends it as an :class:`~hydratrain.errors.OutputError`:
    one line naming what was written where, the cause and its remedy and the checkpoint to resume from, exit status 3,
    as a failed checkpoint save does, instead of the library's traceback. A permission error on another path (an
    input that cannot be read) is raised as it was."""
    try:
        yield
    except HydratrainError:
        raise
    except Exception as err:
        compile_cache = _compile_cache_dir()
        cause = unwritable_cause(err, writes=(run_dir, cache_dir) + ((compile_cache,) if compile_cache else ()))
        if cause is None:
            raise
        done = list_checkpoints(run_dir / "checkpoints")
        frames = [f.filename.replace(os.sep, "/") for f in traceback.extract_tb(err.__traceback__)]
        room = None
        # which output, from the code that wrote it (write() errors name no file; an open() error names a lock's)
        if any("/torch/_inductor/" in f for f in frames):  # (not "the run's outputs under <run dir>")
            what, where = "writing torch.compile's cache (trainer.compile=true)", compile_cache or "its cache dir"
            room = "set TORCHINDUCTOR_CACHE_DIR to a dir this process can write (or trainer.compile=false)"
        elif any("/hydratrain/data/" in f for f in frames):
            what, where = "writing the data cache (paths.cache_dir, or data.cache_dir, chooses where)", cache_dir
        elif any("/tensorboard/" in f for f in frames):
            what, where = "writing TensorBoard events", run_dir / "tensorboard"
        elif any("/safetensors/" in f or f.endswith("/hydratrain/checkpoint/export.py") for f in frames):
            what, where = "writing the weights", run_dir
        elif cause.filename:
            what, where = f"writing {Path(cause.filename).name}", Path(cause.filename).parent
        else:
            what, where = "writing the run's outputs", run_dir
        raise OutputError(unwritable_message(what, where, OSError(cause.errno, cause.strerror),
                                             done[-1][1] if done else resume, room=room,
                                             stopped="the run stopped", run_dir=run_dir)) from err



def _compile_cache_dir() -> Optional[Path]:
    """torch.compile's cache dir (``TORCHINDUCTOR_CACHE_DIR``, else inductor's default under the temp dir) when
    inductor has been imported (``trainer.compile=true``), else None."""
    utils = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    try:
        return Path(utils.cache_dir()) if utils is not None else None
    except Exception:  # noqa: BLE001 (only a name for the message)
        return None
