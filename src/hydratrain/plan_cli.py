"""``python -m hydratrain.plan``: the memory plan of a launch before making it, from train.py's overrides.

    python -m hydratrain.plan model=gpt_small strategy=fsdp precision=bf16 data.batch_size=8 data.seq_len=1024 \\
        activation_checkpointing=true plan.world_size=8 device=cuda plan.memory_gb=80
    python -m hydratrain.plan +experiment=digits_cnn strategy=ddp plan.world_size=2
    cd examples/own_model && python -m hydratrain.plan --config-dir my_conf +experiment=spirals

The first line says what was planned for: the device, the world size, the micro-batch and its sequence length (or
sample shape), the precision; warnings follow when ``device=auto`` planned this host's CPU, or the sequence is far
shorter than the model's ``max_seq_len``; then what the plan does not cover, the table of the peak
and, against the budget (``plan.memory_gb``, or this host's), the verdict and the cheapest changes that fit.
``--config-dir DIR`` adds a dir of the user's option files, as train.py's does; the user's package is imported from
the current dir. Exit status: 0 fits, 1 exceeds the budget, 2 a bad override or value, 3 the model cannot be
planned (e.g. it does not build on the meta device; a run of it goes on without a plan).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from omegaconf import OmegaConf

from hydratrain.config import register_configs
from hydratrain.config.settings import plus_as_force
from hydratrain.config.validate import validate
from hydratrain.data.loader import is_dataset_node, load_datasets, loader_fetch
from hydratrain.data.registry import bpe_vocab_size, corpus
from hydratrain.data.tokenized import vocab_size_for
from hydratrain.data.tokenizer import load_tokenizer, padded_vocab_size
from hydratrain.dist.run_dir import register_resolvers
from hydratrain.errors import EXIT_CONFIG, ConfigError, Placeholder, say
from hydratrain.parallel.build import build_strategy
from hydratrain.parallel.precision import Precision
from hydratrain.paths import Paths
from hydratrain.plan import (
    GiB,
    Plan,
    PlanUnavailable,
    Setup,
    budget_bytes,
    error_margin,
    resident_bytes,
    setup_for,
    suggestions,
    with_baseline,
)

# a sequence this many times shorter than the model's max_seq_len is "far below" it: activations (and attention's
# scores, quadratically) grow with the length, so a plan there says little about the lengths the model is made for
FAR_BELOW = 4
EXIT_UNPLANNED = 3  # the model could not be planned (a one-line reason); the run itself would go on without a plan


def planned_vocab_size(cfg, launch_dir) -> Optional[int]:
    """The vocabulary a run of ``cfg`` would resolve, without building data: ``model.vocab_size``, else the
    tokenizer file's size or the BPE's ``data.vocab_size`` padded to 64, else 256 (bytes, synthetic); a dataset
    node's is ``model.vocab_size`` (None when unset)."""
    data, explicit = cfg.data, cfg.model.get("vocab_size")
    if is_dataset_node(data):
        return explicit
    if data.get("tokenizer"):
        path = Path(launch_dir) / Path(data.tokenizer).expanduser()
        path = path / "tokenizer.json" if path.is_dir() else path  # hf_dataset: a pretrained model's dir
        return vocab_size_for(data, load_tokenizer(path), explicit)
    if corpus(data.name).trains_bpe:
        return explicit or padded_vocab_size(bpe_vocab_size(data))
    return vocab_size_for(data, None, explicit)


def example_of(cfg) -> Optional[Callable[[int], Any]]:
    """``example(n)``: the first ``n`` samples of the train split of a dataset node, collated as the run's loader
    collates them (in this process); None for token data (the plan makes a token batch of ``data.seq_len``). Raises
    :class:`~hydratrain.errors.ConfigError` naming ``data._target_`` when the datasets do not build."""

    if not is_dataset_node(cfg.data):
        return None
    # (a DictConfig's container: a dict): why the ignore below
    data = OmegaConf.create({**OmegaConf.to_container(cfg.data, resolve=True), "num_workers": 0,  # type: ignore[dict-item]
                             "prefetch_factor": None, "persistent_workers": False})  # loaded in this process
    train = load_datasets(data)["train"]
    fetch = loader_fetch(train, data, torch.device("cpu"))
    return lambda n: next(iter(fetch([list(range(min(n, len(train))))])))


def _compose(overrides: list[str], config_dir: Optional[str] = None):
    from hydra import compose, initialize_config_dir


    register_configs()
    register_resolvers()
    if config_dir is not None:  # what train.py's --config-dir does: the dir joins the search path, first
        overrides = [f"hydra.searchpath=[file://{Path(config_dir).expanduser().resolve()}]", *overrides]
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return compose("train", overrides=plus_as_force(overrides))


def conf_dir() -> Path:
    """The ``conf/`` that ``train.py`` composes its run config from: ``$HYDRATRAIN_CONF`` when set, else the clone's
    that this package is installed from in editable mode, else ``./conf`` (a non-editable install, ``pip install .``,
    run from the clone: the wheel holds the package, not ``train.py`` and its ``conf/``).

    Raises:
        ConfigError: none of them holds ``train.yaml`` (Hydra's own "Primary config directory not found" named
            neither the place nor the way out).
    """
    if os.environ.get("HYDRATRAIN_CONF"):
        places = [Path(os.environ["HYDRATRAIN_CONF"])]
    else:
        places = [Path(__file__).resolve().parents[2] / "conf", Path.cwd() / "conf"]
    for place in places:
        if (place / "train.yaml").is_file():
            return place.resolve()  # (Hydra's initialize_config_dir takes an absolute path only)
    if os.environ.get("HYDRATRAIN_CONF"):
        raise ConfigError("$HYDRATRAIN_CONF", str(places[0]), "no train.yaml there: give the conf/ dir of a hydratrain "
                          "clone (the one next to its train.py)")
    unset = Placeholder("<unset>")
    raise ConfigError("$HYDRATRAIN_CONF", unset, f"no train.yaml in {places[0]} (this package's source tree) or "
                      f"{places[1]} (the current dir): run python -m hydratrain.plan from the clone that holds "
                      "train.py and conf/ (pip install . installs neither), or set HYDRATRAIN_CONF=<clone>/conf")


def _run_imports() -> None:
    """Import what a run has imported when it makes its plan, so this process's resident set (the CPU baseline)
    resembles a rank's."""

def _split_argv(argv: list[str]) -> tuple[list[str], Optional[str], Optional[str]]:
    """(overrides, the ``--config-dir`` / ``-cd`` dir or None, the first flag refused or None)."""
    overrides: list[str]
    overrides, config_dir, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--config-dir", "-cd") and i + 1 < len(argv):
            config_dir, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--config-dir="):
            config_dir = arg.split("=", 1)[1]
        elif arg.startswith("-"):
            return overrides, config_dir, arg
        else:
            overrides.append(arg)
        i += 1
    return overrides, config_dir, None


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m hydratrain.plan [--config-dir DIR] [OVERRIDES]``: print the plan of the run ``train.py
    [--config-dir DIR] OVERRIDES`` would start (on ``plan.world_size`` ranks), its budget and, when it does not fit,
    the changes that do. Exit status: 0 fits, 1 exceeds the budget, 2 a bad override or value, 3 no plan
    (:data:`EXIT_UNPLANNED`)."""
    argv = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0


    overrides, config_dir, flag = _split_argv(argv)
    if flag is not None:
        say(f"hydratrain: python -m hydratrain.plan takes train.py's overrides (KEY=VALUE) and -h, not {flag!r} "
            "(its one option is --config-dir DIR, as train.py's; to print the composed config: python train.py "
            "--cfg job)")
        return EXIT_CONFIG
    try:
        cfg = _compose(overrides, config_dir)
        OmegaConf.set_readonly(cfg, True)

        validate(cfg)
        return _report(cfg)
    except ConfigError as err:
        say(f"hydratrain: config error: {err}")
        return EXIT_CONFIG
    except PlanUnavailable as err:
        say(f"hydratrain: no memory plan: {err}")
        return EXIT_UNPLANNED
    except Exception as err:  # Hydra's composition errors name the override
        if type(err).__module__.startswith(("hydra", "omegaconf")):
            say(f"hydratrain: config error: {_one_line(err)}")
            return EXIT_CONFIG
        raise


def _one_line(err: BaseException) -> str:
    """A Hydra composition error in one line: its first line, the first line of its cause (OmegaConf's reason: "Value
    'abc' of type 'str' could not be converted to Float"), and a missing group option's alternatives."""
    text = str(err)
    line = text.splitlines()[0] if text else type(err).__name__
    if err.__cause__ is not None and str(err.__cause__):
        line = f"{line.rstrip('.')}: {str(err.__cause__).splitlines()[0]}"
    if "Available options in" in text:
        options = [o.strip() for o in text.split("Available options in", 1)[1].split("Config search path")[0]
                   .splitlines()[1:] if o.strip()]
        line += f" (available: {', '.join(options)})"
    return line


def assumptions(cfg, plan: Plan, host_has_cuda: bool) -> list[str]:
    """What ``plan`` was made for, as lines: first what was planned (device, world size, micro-batch and sequence
    length or sample shape, precision), then a ``warning:`` line each when the command names no device kind
    (``device=auto``) and this host's CPU was planned for, or the sequence is at most 1/:data:`FAR_BELOW` of the
    model's ``max_seq_len`` (a keyword of the model node, by convention), then what the plan does not cover.
    (``model.init_device`` naming another device kind than the run's is a config error already.)"""
    s = plan.setup
    named = str(cfg.device)
    if s.device == "cuda":
        where = "" if host_has_cuda else " (planned from this host, which has no GPU)"
    else:
        where = " (device=auto on this host, which has no GPU)" if named == "auto" else ""
    ranks = f"{s.world_size} rank{'s' if s.world_size > 1 else ''}"
    lines = [f"planned for: device {s.device}{where}, {ranks} (strategy={s.strategy}), {plan.batch_desc}, "
             f"precision={s.precision}"]
    if named == "auto" and s.device == "cpu":
        lines.append("warning: planned for this host's CPU because device=auto found no GPU here; to plan a launch "
                     "on GPUs give device=cuda (and plan.memory_gb for a verdict)")
    max_len = s.model.keywords().get("max_seq_len")
    if s.seq_len and isinstance(max_len, int) and s.seq_len * FAR_BELOW <= max_len:
        lines.append(f"warning: data.seq_len={s.seq_len} is far below model.max_seq_len={max_len}: activations grow "
                     f"with the sequence length (attention's scores with its square), so a launch at the model's "
                     f"length needs much more; plan the length you will train with (data.seq_len={max_len})")
    lines.append(f"not covered: {'; '.join(plan.not_covered())}")
    return lines


def _report(cfg) -> int:

    strategy = build_strategy(cfg)
    cuda = str(cfg.device) == "cuda" or (str(cfg.device) == "auto" and torch.cuda.is_available())
    world = int(cfg.plan.world_size or os.environ.get("WORLD_SIZE", 1))
    if strategy.name == "single" and world > 1:  # it was planned on 1 rank with the budget split by world

        raise ConfigError("plan.world_size", world, "strategy=single runs one process, as a run refuses it on more; "
                          "allowed with plan.world_size > 1: strategy=ddp, fsdp, hsdp")
    per_node = int(cfg.plan.ranks_per_node or (1 if cuda else world))  # CPU ranks share this node's RAM
    device = torch.device("cuda", 0) if cuda and torch.cuda.is_available() else torch.device("cuda" if cuda else "cpu")
    precision = Precision.resolve(cfg.precision, device).name
    elsewhere = device.type == "cuda" and not torch.cuda.is_available()  # planning for GPUs this host does not have
    if elsewhere and str(cfg.precision.name) == "auto":
        precision = "bf16"  # what auto picks on GPUs with native bf16 (Ampere and newer); the plan says so below
    _run_imports()
    setup: Setup = setup_for(cfg, strategy, world_size=world, precision=precision,
                             vocab_size=planned_vocab_size(cfg, Paths.resolve(cfg, Path.cwd()).data),
                             device=device.type, baseline=0, local_world_size=int(cfg.plan.ranks_per_node or world),
                             example=example_of(cfg))
    plan = with_baseline(setup, resident_bytes if device.type == "cpu" else lambda: 0)
    setup = plan.setup
    print("\n".join(assumptions(cfg, plan, torch.cuda.is_available())))
    print("\n".join(plan.table()))
    if elsewhere and str(cfg.precision.name) == "auto":
        print("precision=auto planned as bf16, what it picks on a GPU with native bf16 (Ampere and newer); "
              "set precision=fp32 for an older GPU")
    if elsewhere and not cfg.plan.memory_gb:
        print("budget: no CUDA device here to take it from; set plan.memory_gb for a verdict (exit status 0: none)")
        return 0
    budget, source = budget_bytes(cfg.plan.memory_gb, device, per_node, in_run=False)
    fits = plan.peak <= budget
    missing = " (without what it could not predict, above)" if plan.unpredicted else ""
    print(f"budget: {budget / GiB:.2f} GiB per rank ({source}): "
          f"{'fits' if fits else 'EXCEEDS it'} ({plan.peak / budget:.0%}){missing}")
    if not fits:
        margin = error_margin(setup.device)
        fixes = suggestions(setup, budget, margin=margin)
        kept = f" (with a x{margin:g} margin for the planner's error on {setup.device})"
        print(f"changes that fit{kept}, cheapest first:" if fixes else f"no change the planner tries fits{kept}")
        for fix in fixes:
            print(f"  {' '.join(fix.changes):<60} peak {fix.plan.peak / GiB:.2f} GiB at {fix.plan.moment}")
    return 0 if fits else 1
