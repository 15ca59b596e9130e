"""Write the full (unsharded) model weights of a sharded checkpoint to one safetensors file, in one process.

    python -m hydratrain.export outputs/RUN/checkpoints/step_00000300 model.safetensors
    python -m hydratrain.export outputs/RUN model.safetensors          # the run's latest complete checkpoint
    python train.py model.init_from=model.safetensors ...              # fine-tune from it, on any strategy
    python -m hydratrain.export --model-dir /workspace/models outputs/RUN gpt.safetensors   # -> /workspace/models/

A relative output file is written under ``--model-dir`` (default ``$HYDRATRAIN_MODEL_DIR``, which ``paths.model_dir``
also reads, else the current dir), where a relative ``model.init_from`` is looked up.

No process group is needed: DCP loads the checkpoint's model entries into full-size tensors allocated from its
metadata (any number of saving ranks, any strategy). Keys are the model's parameter names; the file's metadata
holds the step and the resolved model config the checkpoint was saved with. A checkpoint of subword data carries its
tokenizer, written next to the weights as ``<name>.tokenizer.json`` (a byte-level one removes a stale file of that name,
an earlier export's). Exit status 3 when the checkpoint is unusable.

A model with an ``export_to(out_dir, state_dict, tokenizer)`` method (:data:`EXPORT_HOOK`) can also be written in its
own format: give a dir as OUT (``python -m hydratrain.export outputs/RUN hf_model/``: a Hugging Face model becomes a
``save_pretrained`` dir). The model is rebuilt on the meta device from the checkpoint's ``model.json``.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path
from typing import Optional

import torch

from hydratrain.checkpoint.manager import resolve_checkpoint, step_of
from hydratrain.components import locate
from hydratrain.data.tokenizer import copy_atomic
from hydratrain.errors import EXIT_CHECKPOINT, CheckpointError, HydratrainError, say, unwritable_cause
from hydratrain.parallel.init import returned_class
from hydratrain.paths import default_model_dir, prepare_output_file, temporary_sibling
from hydratrain.protocols import has_export_to

log = logging.getLogger(__name__)


def write_safetensors(tensors: dict, out: Path, metadata: dict) -> Path:
    """Write ``tensors`` (name -> CPU tensor) to ``out`` as safetensors: a temporary name, then a rename, so a
    reader never sees a partial file. Permissions follow the umask (like any new file). Returns ``out``."""
    from safetensors.torch import save_file

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(out)
    try:
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)  # no partial file left behind
        raise
    return out


def export(checkpoint: Path, out: Path) -> Path:
    """Write the model weights of ``checkpoint`` (a step dir, or a run/checkpoints dir: its latest) to ``out``.

    Written to a temporary name and renamed. A checkpoint of subword data also gets its tokenizer written next to
    ``out`` (:func:`tokenizer_path_for`); otherwise a file of that name (an earlier export's) is removed, so what sits
    next to ``out`` is always this model's. Returns ``out``. Raises :class:`~hydratrain.errors.CheckpointError`.
    """
    from hydratrain.checkpoint.io import read_model_weights  # (start-up: torch.distributed.checkpoint, ~0.3 s)

    ckpt = resolve_checkpoint(Path(checkpoint))
    weights = read_model_weights(ckpt)
    meta = {"format": "pt", "producer": "hydratrain", "checkpoint": str(ckpt.resolve()),
            "step": str(step_of(ckpt))}
    cfg_file = ckpt / "config.yaml"
    if (ckpt / "model.json").is_file():  # the resolved model config (vocab size included)
        meta["model_config"] = (ckpt / "model.json").read_text()
    elif cfg_file.is_file():
        from omegaconf import OmegaConf

        # (a run's config.yaml: a mapping): why the ignore below
        meta["model_config"] = json.dumps(OmegaConf.to_container(OmegaConf.load(cfg_file).get("model", {})))  # type: ignore[arg-type]
    tokenizer = tokenizer_path_for(out)
    if (ckpt / "tokenizer.json").is_file():
        meta["tokenizer"] = tokenizer.name
    write_safetensors(weights, out, meta)
    if (ckpt / "tokenizer.json").is_file():
        copy_atomic(ckpt / "tokenizer.json", tokenizer)
    else:  # a byte-level model: an earlier export's tokenizer of the same name would be taken as this model's
        tokenizer.unlink(missing_ok=True)
    return out


#: a model's method that writes the model in its own ecosystem's format: ``export_to(out_dir, state_dict,
#: tokenizer) -> out_dir``, with ``state_dict`` the full CPU weights by the model's parameter names and ``tokenizer``
#: the data's tokenizer.json (or None). hydratrain's Hugging Face models write a save_pretrained dir with it.
EXPORT_HOOK = "export_to"


def export_model(raw, out_dir: Path, tokenizer: Optional[Path], state: dict) -> Optional[Path]:
    """``raw.export_to(out_dir, state, tokenizer)`` when the model has :data:`EXPORT_HOOK` (logged), else None."""
    if not has_export_to(raw):
        return None
    out = raw.export_to(out_dir, state, tokenizer)
    log.info("exported the model in its own format to %s (%s.%s)", out, type(raw).__name__, EXPORT_HOOK)
    return out


def export_dir(checkpoint: Path, out_dir: Path) -> Path:
    """Write ``checkpoint``'s model in its own format into ``out_dir`` by its :data:`EXPORT_HOOK` (a Hugging Face
    model: a save_pretrained dir): the model is rebuilt on the meta device from the checkpoint's ``model.json`` (its
    ``_target_`` and keywords, as the run built it), given the full weights and the checkpoint's tokenizer. Returns
    ``out_dir``. Raises :class:`~hydratrain.errors.CheckpointError` when the checkpoint is unusable, has no model.json,
    or its model cannot be rebuilt or has no export hook."""
    from hydra.utils import instantiate

    from hydratrain.checkpoint.io import read_model_weights  # (start-up: torch.distributed.checkpoint, ~0.3 s)


    ckpt = resolve_checkpoint(Path(checkpoint))
    if not (ckpt / "model.json").is_file():
        raise CheckpointError(f"{ckpt}: has no model.json (written by older versions): its model cannot be rebuilt "
                              "to export its own format; give OUT as a .safetensors file")
    record = json.loads((ckpt / "model.json").read_text())
    try:
        with torch.device("meta"):
            model = instantiate(record, _convert_="all")
    except Exception as err:  # noqa: BLE001 (whatever the model's constructor raises)
        cause = err.__cause__ if err.__cause__ is not None and not isinstance(err, HydratrainError) else err
        raise CheckpointError(f"{ckpt}: its model ({record.get('_target_')}) could not be rebuilt from model.json: "
                              f"{type(cause).__name__}: {(str(cause).strip().splitlines() or [''])[0]}") from None
    if not has_export_to(model):
        raise CheckpointError(f"{ckpt}: its model ({record.get('_target_')}) has no {EXPORT_HOOK}() to write a "
                              "format of its own; give OUT as a .safetensors file")
    tokenizer = ckpt / "tokenizer.json" if (ckpt / "tokenizer.json").is_file() else None
    # (it has the hook: checked above): why the ignore below
    return export_model(model, Path(out_dir), tokenizer, read_model_weights(ckpt))  # type: ignore[return-value]


def tokenizer_path_for(weights: Path) -> Path:
    """Where :func:`export` puts the tokenizer of ``weights`` (``model.safetensors`` -> ``model.tokenizer.json``)."""
    weights = Path(weights)
    return weights.with_name(weights.stem + ".tokenizer.json")


def _has_export_hook(checkpoint: Path) -> bool:
    """Whether the model of ``checkpoint`` (its model.json's ``_target_``) can write its own format: a class with
    :data:`EXPORT_HOOK`, or a factory whose return annotation names one. False when anything is missing."""
    try:
        record = json.loads((resolve_checkpoint(Path(checkpoint)) / "model.json").read_text())
        target = locate(record["_target_"], "model")
        built = target if isinstance(target, type) else returned_class(target)
        return built is not None and has_export_to(built)
    except Exception:  # noqa: BLE001 (the usual .safetensors path then says what is wrong)
        return False


def _main_dir(checkpoint: Path, out: Path) -> int:
    """``main`` for an OUT dir: :func:`export_dir`, one line on failure (exit status 3)."""
    try:
        export_dir(checkpoint, out)
    except CheckpointError as err:
        say(f"hydratrain: checkpoint error: {err}")
        return EXIT_CHECKPOINT
    except OSError as err:
        say(f"hydratrain: output error: writing {out} failed ({type(err).__name__}: {err})")
        return EXIT_CHECKPOINT
    print(f"wrote {out}/ (the model's own format)")
    return 0


def main(argv=None) -> int:
    """Command line: ``python -m hydratrain.export CHECKPOINT_DIR OUT.safetensors`` (or ``OUT_DIR`` for a model with
    an ``export_to()`` of its own format, e.g. a Hugging Face save_pretrained dir). Exit status 2 for a bad argument,
    3 for a checkpoint that cannot be read or an OUT that cannot be written (one line each; OUT's dir is checked
    before the checkpoint is read)."""
    parser = argparse.ArgumentParser(prog="python -m hydratrain.export", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a step_XXXXXXXX dir, or a run or checkpoints dir (its latest)")
    parser.add_argument("out", type=Path, help="the .safetensors file to write (relative: under --model-dir), or a "
                        "dir for a model that writes its own format (a Hugging Face model: a save_pretrained dir)")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="where a relative OUT goes (default: $HYDRATRAIN_MODEL_DIR, else the current dir)")
    args = parser.parse_args(argv)

    out = args.out.expanduser()
    if not out.is_absolute():
        out = (args.model_dir.expanduser() if args.model_dir is not None else default_model_dir()) / out
    if out.is_dir() or out.suffix != ".safetensors":
        if not (out.exists() and not out.is_dir()) and _has_export_hook(args.checkpoint):
            return _main_dir(args.checkpoint, out)
        parser.error(f"out={out}: must be a file path ending in .safetensors" + (" (that is a directory)"
                                                                                 if out.is_dir() else "") +
                     " (a dir is written only for a model with an export_to() of its own format)")
    try:
        prepare_output_file(out)
    except OSError as err:  # one line, before the whole checkpoint is read
        say(f"hydratrain: output error: cannot write {out} ({type(err).__name__}: {err.strerror}: {err.filename}); "
            "nothing was written")
        return EXIT_CHECKPOINT
    try:
        out = export(args.checkpoint, out)
    except CheckpointError as err:
        say(f"hydratrain: checkpoint error: {err}")
        return EXIT_CHECKPOINT
    except Exception as err:  # the write itself: a full disk, a quota, a path the OS refuses (safetensors wraps the
        # OSError in its own SafetensorError)
        cause = unwritable_cause(err) or (err if isinstance(err, OSError) or type(err).__name__ == "SafetensorError"
                                          else None)
        if cause is None:
            raise
        say(f"hydratrain: output error: writing {out} failed ({type(cause).__name__}: "
            f"{str(cause).splitlines()[0]}); nothing was written")
        return EXIT_CHECKPOINT
    tokenizer = tokenizer_path_for(out)
    print(f"wrote {out}" + (f" and {tokenizer}" if tokenizer.is_file() else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
