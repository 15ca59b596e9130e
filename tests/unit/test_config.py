"""Every config option composes, validates and instantiates; bad values fail early with one line naming the key.

All in this process: ``compose`` for the config, ``cli`` for train.py's own command line (exit status and the one
stderr line)."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from helpers import CONF, ROOT, requires
from hydratrain.config.validate import validate
from hydratrain.errors import ConfigError

GROUPS = ["model", "data", "loss", "strategy", "precision", "wrap_policy", "launcher", "optim", "scheduler", "trainer",
          "logger"]
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


def test_every_group_has_options():
    have = {g for g, _ in OPTIONS}
    assert have == set(GROUPS)
    assert {"gpt_tiny", "gpt_small", "llama_1b"} <= {o for g, o in OPTIONS if g == "model"}
    assert len(EXPERIMENTS) >= 2


def _extra(group: str, option: str, tmp_path: Path) -> list[str]:
    if (group, option) in (("data", "text_files"), ("data", "tokenized_text")):
        extra = ["data.vocab_size=300", "model.vocab_size=320"] if option == "tokenized_text" else []
        return [f"data.paths=[{ROOT / 'pyproject.toml'},{ROOT / 'train.py'}]", *extra]
    if (group, option) == ("data", "token_bin"):
        for split in ("train", "val"):
            (tmp_path / f"{split}.bin").write_bytes(bytes(b for i in range(200) for b in (i, 0)) * 20)  # uint16 < 200
        return [f"data.train_path={tmp_path / 'train.bin'}", f"data.val_path={tmp_path / 'val.bin'}"]
    if (group, option) == ("data", "python_stdlib_bpe"):
        return ["data.vocab_size=300", "model.vocab_size=320"]
    if (group, option) == ("data", "hf_dataset"):
        import json

        lines = [json.dumps({"text": f"record {i}: " + "the quick brown fox jumps over the lazy dog. " * 20})
                 for i in range(40)]
        (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
        return [f"data.paths=[{tmp_path / 'd.jsonl'}]", "data.vocab_size=300", "model.vocab_size=320"]
    if (group, option) == ("data", "instruct"):
        from hydratrain.examples.arith import LLAMA, arith_records, tiny_llama, write_records

        records = write_records(tmp_path / "arith.jsonl", arith_records(40))
        tiny = tiny_llama(tmp_path / "tiny", [r["prompt"] for r in arith_records(40)], {**LLAMA, "vocab_size": 300})
        return [f"data.paths=[{records}]", f"data.tokenizer={tiny}"]
    return []


# the options (and experiments) that need an extra of pyproject.toml: skipped, with the reason, without it
NEEDS = {("model", "hf_causal_lm"): "hf", ("data", "hf_dataset"): "hf", ("model", "digits_cnn"): "examples",
         ("data", "digits"): "examples", ("optim", "adamw8bit"): "lowbit", ("experiment", "hf_llama_tiny"): "hf",
         ("data", "instruct"): "hf", ("experiment", "hf_sft_tiny"): "hf",
         ("launcher", "slurm"): "slurm", ("launcher", "submitit_local"): "slurm",
         ("experiment", "hf_llama_lora_tiny"): "hf,peft", ("experiment", "hf_sft_lora_tiny"): "hf,peft"}


def _cases(group_options):
    return [pytest.param(*case, id="=".join(case), marks=[requires(*NEEDS[case].split(","))] if case in NEEDS else [])
            for case in group_options]


@pytest.mark.parametrize("group,option", _cases(OPTIONS))
def test_option_composes_validates_and_instantiates(compose, group, option, tmp_path):
    from hydratrain import components
    from hydratrain.models.gpt import GPT, GPTConfig
    from hydratrain.optim import build_optimizer, build_scheduler
    from hydratrain.parallel.precision import Precision
    from hydratrain.parallel.wrap_policy import shard_units

    cfg = compose([f"{group}={option}", *_extra(group, option, tmp_path)])
    assert OmegaConf.select(cfg, f"{group}.name") in (option, None) or group in ("trainer", "logger")
    validate(cfg)
    model = components.build_model(cfg, "meta", cfg.model.get("vocab_size") or 256)
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params > 0
    if group == "model":
        expected = {"gpt_tiny": 0.89e6, "gpt_small": 85e6, "llama_1b": 1.1e9, "llama_8b": 7.3e9,
                    "digits_cnn": 28.5e3, "hf_causal_lm": 0.4e6}[option]
        assert abs(n_params / expected - 1) < 0.1, n_params
    if group == "loss":
        loss = components.build_loss(cfg)
        logits, labels = torch.randn(4, 3), torch.tensor([0, 2, 1, 0])
        value = loss(logits, labels) if option != "mse" else loss(logits, torch.randn(4, 3))
        assert value.dim() == 0 and torch.isfinite(value)
    small = GPT(GPTConfig(d_model=32, n_layer=2, n_head=2))
    if group == "precision":
        precision = Precision.resolve(cfg.precision, torch.device("cpu"))
        assert precision.name in ("fp32", "bf16", "fp16", "fp8") and (option == "auto" or precision.name == option)
        precision.mixed_precision_policy()
        assert precision.grad_scaler(torch.device("cpu")).is_enabled() == (option == "fp16")
        with precision.autocast(torch.device("cpu")):
            small(torch.zeros(1, 4, dtype=torch.long))
    if group == "wrap_policy":
        units = shard_units(small, cfg.wrap_policy)
        assert len(units) == {"none": 0, "transformer_block": 2, "auto": 2}.get(option, len(units))
    if group in ("optim", "scheduler"):
        opt = build_optimizer(small, cfg.optim)
        sched = build_scheduler(opt, cfg.scheduler, total_steps=10)
        opt.step()
        sched.step()
    if group == "data" and option in ("digits", "instruct"):
        from hydratrain.data.loader import load_datasets

        splits = load_datasets(cfg.data)
        assert (len(splits["train"]), len(splits["val"])) == {"digits": (1437, 360), "instruct": (38, 2)}[option]
    elif group == "data":
        from hydratrain.data.build import load_splits
        from hydratrain.data.corpora import stdlib_files

        files = stdlib_files()[1][:20] if option == "python_stdlib_bpe" else None  # a BPE on 20 files: seconds
        splits = load_splits(cfg.data, cfg.model.get("vocab_size") or 256, ROOT, progress=False, files=files)
        assert len(splits["train"]) > 0 and len(splits["val"]) > 0


@pytest.mark.parametrize("group,name", _cases(("experiment", name) for name in EXPERIMENTS))
def test_experiment_overlays_compose(compose, group, name):
    if name in ("hf_sft_tiny", "hf_sft_lora_tiny"):  # its data and model dir, written into the (temporary) launch dir
        from hydratrain.examples.arith import main

        assert main(["arith", "--records", "100"]) == 0
    cfg = compose([f"+experiment={name}"])
    validate(cfg)
    base = compose([])
    assert OmegaConf.to_container(cfg) != OmegaConf.to_container(base)


@pytest.mark.parametrize("args,line", [
    (["bad_key=1"], "Could not override 'bad_key': Key 'bad_key' not in 'TrainConfig' (to append to your config use "
                    "+bad_key=1)"),
    (["model=nope"], "In 'train': Could not find 'model/nope' (available: digits_cnn, gpt_small, gpt_tiny, "
                     "hf_causal_lm, llama_1b, llama_8b)"),
    (["optim.lr=abc"], "Error merging override optim.lr=abc: Value 'abc' of type 'str' could not be converted to "
                       "Float"),
    (["--cfg", "job", "bad_key=1"], "Could not override 'bad_key'"),
    (["-m", "model=nope", "optim.lr=1e-3,2e-3"], "In 'train': Could not find 'model/nope'"),  # the sweep's own
    (["data=10"], "Config group override must be a string or a list. Got int (an option name that Hydra's grammar "
                  "reads as a number, as in data=10 or loss=nan, needs quotes: data=\"'10'\")"),
])
def test_an_error_hydra_finds_while_composing_is_a_one_line_config_error(cli, args, line):
    """An unknown key or option, a wrong type: Hydra's few lines (on every rank under torchrun) and exit status 1;
    now the one line of any config error, exit status 2; and Hydra reports its own errors again once composed."""
    import os

    r = cli(args)
    assert r.returncode == 2 and r.out == "" and r.err.startswith(f"hydratrain: config error: {line}"), r.output
    assert r.err.count("\n") == 1 and "HYDRA_FULL_ERROR" not in r.err and "HYDRA_FULL_ERROR" not in os.environ


def test_cfg_job_prints_composed_config(cli):
    r = cli(["--cfg", "job", "strategy=ddp", "optim.lr=3e-4"], fast=False)
    assert r.returncode == 0, r.output
    cfg = OmegaConf.create(r.out)
    assert cfg.strategy.name == "ddp" and cfg.optim.lr == 3e-4 and cfg.model._target_ == "hydratrain.models.GPT"
    assert r.err.strip().splitlines()[-1].startswith("hydratrain: config checks passed (1 rank(s))"), r.err


@pytest.mark.parametrize("overrides", [
    ["model._target_=mypkg.Net"],                                    # a component that does not import
    ["optim.lr=-1"],                                                  # a cross-field / value rule (validate)
    ["data=text_files", "data.paths=[nope.txt]"],                     # an input path (the environment's checks)
    ["launcher=torchrun", "launcher.nproc_per_node=2", "strategy=single"],  # on the ranks its launcher starts
    ["launcher=torchrun", "launcher.nproc_per_node=0"],                       # the launcher's own keys
])
def test_cfg_job_checks_the_printed_config_as_the_run_does(cli, overrides):
    """``--cfg job`` printed a config that the run then refused (exit 0, then exit 2): it now runs the run's checks
    on what it printed and ends as the run ends, with the same one line and exit status 2. Under
    ``launcher=torchrun`` the run is a sweep of one job, which ends as a run does: that line (no sweep report) and
    2, and no dir left behind."""
    shown = cli(["--cfg", "job", *overrides])
    assert shown.returncode == 2 and OmegaConf.create(shown.out)["trainer"], shown.output[-3000:]
    line = shown.err.strip()
    assert line.startswith("hydratrain: config error: ") and "\n" not in line, shown.err
    ran = cli(overrides)
    assert ran.returncode == 2 and line in ran.output, (line, ran.output[-3000:])
    assert "sweep" not in ran.err and not list(Path.cwd().iterdir()), (ran.err, list(Path.cwd().iterdir()))
    assert cli(["--cfg", "all", *overrides]).returncode == 2
    assert cli(["--cfg", "hydra", *overrides]).returncode == 0  # Hydra's own part: nothing of the run's to check


@pytest.mark.parametrize("overrides", [["launcher=torchrun", "hydra.run.dir=runs/a"],
                                       ["-m", "optim.lr=1e-3,2e-3", "hydra.run.dir=runs/a"],
                                       ["launcher=torchrun", "hydra.run={dir:runs/a}"]])
def test_a_run_dir_given_to_a_sweep_is_refused_naming_the_key_that_places_it(cli, overrides):
    """Hydra puts a multirun's jobs under ``hydra.sweep.dir`` and ignores ``hydra.run.dir``: ``launcher=torchrun
    hydra.run.dir=runs/a`` trained in ``multirun/<date>/<time>/0``. Refused before anything is made."""
    r = cli(overrides)
    why = " (launcher=torchrun runs even one run as a sweep of one job)" if "launcher=torchrun" in overrides else ""
    assert r.returncode == 2 and r.err.strip() == (
        f"hydratrain: config error: hydra.run.dir='runs/a': not used by a sweep{why}, which puts each job in a "
        "sub-dir of hydra.sweep.dir (hydra.sweep.subdir, by default the job number): give hydra.sweep.dir=runs/a"), \
        r.output[-3000:]
    assert not list(Path.cwd().iterdir())


@pytest.mark.parametrize("overrides", [["launcher=torchrun", "hydra.run.dir=runs/a"],
                                       ["launcher=torchrun", "hydra.run={dir:runs/a}", "optim.lr=-1"],
                                       pytest.param(["launcher=slurm"], marks=[requires("slurm"), pytest.mark.skipif(
                                           bool(shutil.which("sbatch")), reason="SLURM here: the run would submit")])])
def test_cfg_job_makes_the_checks_of_the_launch_the_run_makes(cli, overrides):
    """``launcher=torchrun hydra.run.dir=runs/a --cfg job`` exited 0 while the run refused it: the checks of the
    sweep's start (``hydratrain.sweep``: a run dir the sweep would not use, what the submitting machine needs for
    the launcher) were not made on the printed config. Now it prints the config, then the run's one line (the first
    check that fails in the run: the sweep's start before the job's), and exits 2, leaving nothing behind."""
    shown = cli(["--cfg", "job", *overrides])
    assert shown.returncode == 2 and OmegaConf.create(shown.out)["trainer"], shown.output[-3000:]
    line = shown.err.strip()
    assert line.startswith("hydratrain: config error: ") and "\n" not in line, shown.err
    ran = cli(overrides)
    assert ran.returncode == 2 and ran.err.strip() == line, (line, ran.output[-3000:])
    assert not list(Path.cwd().iterdir())


def test_cfg_job_of_a_sweep_prints_and_checks_every_job(cli, tmp_path_factory):
    """``-m ... --cfg job`` (Hydra refuses the pair): every job the basic sweeper would run (the product of an
    experiment's ``hydra.sweeper.params`` and the command line's swept keys) is printed after a ``# job N:`` line and
    checked as ``--cfg job`` checks a run; each job says its line, a total ends it, exit status 2 when a job fails.
    A job that does not compose says Hydra's reason on its line. Nothing is made in the launch dir."""
    conf = tmp_path_factory.mktemp("my_conf")
    (conf / "experiment").mkdir()
    (conf / "experiment" / "lrs.yaml").write_text(
        "# @package _global_\nhydra:\n  sweeper:\n    params:\n      optim.lr: 1e-3,-1\n")
    r = cli(["-m", "--config-dir", str(conf), "+experiment=lrs", "strategy=single,ddp", "--cfg", "job"],
            fast=False)
    assert r.returncode == 2, r.output[-3000:]
    headers = [line for line in r.out.splitlines() if line.startswith("# job ")]
    assert headers == [f"# job {n}: optim.lr={lr} +experiment=lrs strategy={s}"
                       for n, (lr, s) in enumerate([("0.001", "single"), ("0.001", "ddp"), ("-1", "single"),
                                                    ("-1", "ddp")])], headers
    configs = [OmegaConf.create(text) for text in re.split(r"^# job \d+: .*$", r.out, flags=re.M)[1:]]
    assert [(c.optim.lr, c.strategy.name) for c in configs] == [(1e-3, "single"), (1e-3, "ddp"), (-1, "single"),
                                                                 (-1, "ddp")]
    assert r.err.strip().splitlines() == [
        "hydratrain: job 0: config checks passed (1 rank(s))", "hydratrain: job 1: config checks passed (1 rank(s))",
        "hydratrain: job 2: config error: optim.lr=-1.0: must be finite and > 0",
        "hydratrain: job 3: config error: optim.lr=-1.0: must be finite and > 0",
        "hydratrain: 4 job(s) checked: job(s) 2, 3 failed"], r.err

    r = cli(["-m", "model=gpt_tiny,nope", "--cfg", "job"], fast=False)
    lines = r.err.strip().splitlines()
    assert r.returncode == 2 and lines[0] == "hydratrain: job 0: config checks passed (1 rank(s))", r.output[-3000:]
    assert lines[1].startswith("hydratrain: job 1: config error: In 'train': Could not find 'model/nope'"), lines
    assert lines[2:] == ["hydratrain: 2 job(s) checked: job(s) 1 failed"]
    ok = cli(["-m", "optim.lr=1e-3,2e-3", "--cfg", "job"], fast=False)
    assert ok.returncode == 0 and ok.err.strip().splitlines()[-1] == "hydratrain: 2 job(s) checked: all passed"
    assert not list(Path.cwd().iterdir())


def test_cfg_job_refuses_a_run_dir_the_logs_cannot_write(cli, tmp_path, monkeypatch):
    """A run dir whose path is not UTF-8 (launched from a dir named in Latin-1) is refused by the run
    (``test_hostile_inputs``); ``--cfg job`` says the run's line, and makes no run dir."""
    import os

    launch = tmp_path / os.fsdecode(b"lat\xe9n")
    launch.mkdir()
    monkeypatch.chdir(launch)
    shown = cli(["--cfg", "job"])
    assert shown.returncode == 2 and shown.err.startswith("hydratrain: config error: hydra.run.dir=") and \
        "holds bytes that are not UTF-8 (b'\\xe9': a dir name in another encoding?)" in shown.err, shown.output[-3000:]
    assert list(launch.iterdir()) == []


@pytest.mark.parametrize("overrides,key", [
    (["optim.lr=-1"], "optim.lr"),
    (["wrap_policy=size_based", "wrap_policy.min_num_params=0"], "wrap_policy.min_num_params"),
    (["wrap_policy=size_based", "wrap_policy.min_num_params=-5"], "wrap_policy.min_num_params"),
    (["model.n_head=3"], "model.n_head"),
    (["data.seq_len=4096"], "data.seq_len"),
    (["trainer.max_steps=null"], "trainer.max_steps"),
    (["strategy=ddp", "wrap_policy=size_based"], "wrap_policy"),
    (["strategy=single", "precision.reduce_dtype=bfloat16"], "precision.reduce_dtype"),
    (["strategy=fsdp", "strategy.name=ddp"], "strategy.name"),
    (["~activation_checkpointing"], "activation_checkpointing=<deleted>: removed with ~activation_checkpointing"),
    (["~device"], "device=<deleted>: removed with ~device, but the run reads it: give it a value instead, e.g. its "
                  "default: device=auto"),
    (["data=text_files"], "data.paths=???: has no value: give it one (data.paths=VALUE)"),  # was a traceback
    (["data=token_bin"], "data.train_path=???: has no value"),  # not "removed with ~data.train_path"
    (["~model"], "model=???: has no option: choose one with model=NAME (conf/model/), or give a file of your own "
                 "with _target_"),
    (["~data", "+debug=fast_gpt"], "data=???: has no option (removed with ~data, or a file of your own without "
                                   "its schema line?): choose one with data=NAME (conf/data/); an option file of your "
                                   "own begins with 'defaults: [/schema/data/SCHEMA@_here_, _self_]' and name: SCHEMA"),
    # ignored (the tokenizer's vocabulary is used), so refused rather than recorded as a hyper-parameter
    (["data=tokenized_text", "data.paths=[a.txt]", "data.tokenizer=tok.json", "data.vocab_size=999"],
     "data.vocab_size=999: unused with data.tokenizer=tok.json"),
    (["model=llama_1b", "model.ff_multiple_of=256"], "model.ff_multiple_of=256: unused with model.d_ff=8192"),
    # '' (key=$VAR with VAR unset) is no "not set": not a fresh run instead of a resume, not a new tokenizer
    (["checkpoint.resume_from="], "checkpoint.resume_from='': empty (from an unset shell variable, as in "
                                  "checkpoint.resume_from=$VAR?): give a path, or null for none"),
    (["data=tokenized_text", "data.paths=[a.txt]", "data.tokenizer="], "data.tokenizer='': empty"),
    (["paths.cache_dir="], "paths.cache_dir='': empty (from an unset shell variable, as in paths.cache_dir=$VAR?): "
                            "give a path, or '.' for the launch dir"),
    (["data=text_files", "data.paths=[a.txt,'']"], "data.paths=['a.txt', '']: holds an empty entry"),
    # one line, not tracebacks deep in the run (torch.manual_seed, the rotary tables); a list entry's own text
    (["trainer.seed=18446744073709551616"], "trainer.seed=18446744073709551616: out of range: integer keys take "
                                            "values that fit torch's int64"),
    (["model.max_seq_len=99999999999999999999"], "model.max_seq_len=99999999999999999999: out of range"),
    (["trainer.seed=${oc.decode:'18446744073709551616'}"], "trainer.seed=18446744073709551616: out of range"),
    (["paths=workspace", "paths.root="], "paths.root='': empty"),  # refused before the keys built on it
    (["data=token_bin", "data.train_path=", "data.val_path=v.bin"],
     "data.train_path='': empty (from an unset shell variable, as in data.train_path=$VAR?): give a path"),
    (["data=text_files", "data.paths=['${oc.env:HT_UNSET_VARIABLE}/*.md']"],
     "data.paths[0]='${oc.env:HT_UNSET_VARIABLE}/*.md': cannot be resolved"),
    # a nested list does not pass the List[str] schema (a TypeError traceback in the start-up)
    (["data=text_files", "data.paths=[[notes/*.md]]"],
     "data.paths=[['notes/*.md']]: each entry must be a str; entry 0 is a list"),
])
def test_validate_names_the_key(compose, overrides, key):
    with pytest.raises(ConfigError) as err:
        validate(compose(overrides))
    assert str(err.value).startswith(key) and "\n" not in str(err.value)


@pytest.mark.parametrize("group,off", [("checkpoint", "checkpoint.every_n_steps=0"),
                                       ("logger", "logger.tensorboard=false"), ("trainer", None),
                                       ("distributed", None), ("plan", "plan.enabled=false")])
def test_removing_a_group_whose_schema_has_defaults_is_refused(compose, group, off):
    """``~checkpoint ~logger`` (to save disk in a sweep) left the schema's defaults in the groups' place: the run
    still wrote checkpoints and events, without a word. Every group of the defaults list is read by the
    run, so removing one is a config error that names the key turning its work off."""
    from hydratrain.config.structure import DEFAULT_GROUPS

    with pytest.raises(ConfigError) as err:
        validate(compose([f"~{group}"], return_hydra_config=True))
    assert str(err.value).startswith(f"{group}=<deleted>: removed with ~{group}, but the run reads every key of it")
    assert (off in str(err.value)) if off else "to turn it off" not in str(err.value)
    validate(compose([], return_hydra_config=True))  # nothing removed: fine
    defaults = OmegaConf.to_container(OmegaConf.load(CONF / "train.yaml").defaults)
    listed = [next(iter(d)) for d in defaults if isinstance(d, dict) and not next(iter(d)).startswith("override ")]
    assert list(DEFAULT_GROUPS) == listed


@pytest.mark.parametrize("args,expect", [
    (["optim.lr=-1"], "optim.lr"),
    (["wrap_policy=size_based", "wrap_policy.min_num_params=0"], "wrap_policy.min_num_params"),
    (["strategy=fsdq"], "strategy"),
    (["optim.lrr=1"], "optim.lrr"),
    (["data=text_files", "data.paths=[no/such/*.txt]"], "data.paths"),
])
def test_bad_config_exits_with_one_line_before_process_group(cli, args, expect, tmp_path):
    r = cli(args, tmp_path, fast=False)
    assert r.returncode != 0
    first = r.err.strip().splitlines()[0]
    assert expect in first, r.err
    assert "process group" not in r.output


@pytest.mark.parametrize("rank,local_rank", [(0, 0), (1, 1), (1, 0)])
@pytest.mark.parametrize("args,expect", [
    (["optim.lr=-1"], "hydratrain: config error: optim.lr=-1.0: must be finite and > 0"),
    (["strategy=single"], "hydratrain: config error: strategy.name='single'"),
])
def test_a_config_error_under_torchrun_is_one_line_from_rank_0_before_any_process_group(cli, monkeypatch, tmp_path,
                                                                                         rank, local_rank, args,
                                                                                         expect):
    """As each of 2 torchrun ranks sees it (nothing listens at MASTER_ADDR:MASTER_PORT: a process group attempt would
    fail): exit status 2 on every rank, the one line from each node's first rank only (rank 1 as the first rank of a
    second node: that node's operator sees why too)."""
    for key, value in dict(RANK=rank, LOCAL_RANK=local_rank, WORLD_SIZE=2, LOCAL_WORLD_SIZE=2 - rank + local_rank,
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=9).items():
        monkeypatch.setenv(key, str(value))
    r = cli(args, tmp_path, fast=False)
    assert r.returncode == 2, r.output[-3000:]
    assert r.err.strip().splitlines() == ([] if local_rank else [r.err.strip()]) and "process group" not in r.output
    if local_rank == 0:
        assert r.err.startswith(expect), r.err


@pytest.mark.parametrize("args,expect", [
    (["optim.lr=inf"], "hydratrain: config error: optim.lr=inf: must be finite and > 0"),
    (["trainer.grad_clip=nan"], "hydratrain: config error: trainer.grad_clip=nan: must be finite and >= 0"),
    (["device=cuda"] if not torch.cuda.is_available() else ["optim.lr=-1"], "hydratrain: config error: "),
    (["strategy=ddp", "strategy.backend=nccl"] if not torch.distributed.is_nccl_available() else ["optim.lr=-1"],
     "hydratrain: config error: "),
    (["data.synthetic_tokens=0"], "hydratrain: config error: data.synthetic_tokens=0: must be finite and > 0"),
    (["data.synthetic_tokens=300"], "hydratrain: config error: data='synthetic': val split (15 tokens)"),
    (["trainer.max_steps=null", "trainer.max_epochs=1", "trainer.grad_accum_steps=1000",
      "data.synthetic_tokens=100000"], "hydratrain: config error: trainer.max_epochs=1: gives 0 optimizer steps"),
])
def test_bad_values_found_at_run_time_are_one_line_config_errors(cli, args, expect, tmp_path):
    r = cli(["+debug=fast_gpt", "precision=fp32", "strategy=single", *args], tmp_path, fast=False)
    assert r.returncode == 2, r.output[-2000:]
    assert r.err.strip().splitlines()[-1].startswith(expect), r.output[-2000:]
    assert "Traceback" not in r.output


def test_a_users_own_option_needs_its_schema_line_and_the_error_says_so(cli, tmp_path):
    """An option file in the user's --config-dir without ``defaults: [/schema/<group>/<schema>@_here_, _self_]``
    was refused as 'removed with ~data?'; with the line it trains."""
    (tmp_path / "my_conf" / "data").mkdir(parents=True)
    (tmp_path / "my_conf" / "data" / "bare.yaml").write_text("name: synthetic\nsynthetic_tokens: 6000\n")
    (tmp_path / "my_conf" / "data" / "typed.yaml").write_text(
        "defaults:\n  - /schema/data/synthetic@_here_\n  - _self_\nname: synthetic\nsynthetic_tokens: 6000\n")
    config_dir = ["--config-dir", str(tmp_path / "my_conf"), "strategy=single", "precision=fp32"]
    r = cli([*config_dir, "data=bare"], tmp_path / "bare")
    assert r.returncode == 2 and r.err.strip() == (
        "hydratrain: config error: data.name='synthetic': the data option is on no schema: begin its file with "
        "'defaults: [/schema/data/synthetic@_here_, _self_]' (as conf/data/ does; schemas: python_stdlib, "
        "text_files, synthetic, token_bin, tokenized_text, python_stdlib_bpe, hf_dataset)"), r.output[-3000:]
    r = cli([*config_dir, "data=typed", "trainer.max_steps=1"], tmp_path / "typed")
    assert r.returncode == 0 and "synthetic_tokens: 6000" in (tmp_path / "typed" / ".hydra" / "config.yaml").read_text()


def test_an_experiment_may_write_its_model_and_data_inline_and_its_two_slips_say_how(cli, tmp_path):
    """docs/recipe-cnn.md: an experiment writes its model and data as ``_target_`` nodes after ``override /model:
    null`` (was refused as 'removed with ~model'). Without the null override, or without ``# @package _global_`` on
    the first line, Hydra's errors said nothing of either: each now says what to write."""
    pytest.importorskip("sklearn", reason="the digits example needs the [examples] extra")
    (tmp_path / "my_conf" / "experiment").mkdir(parents=True)
    body = ("defaults:\n  - override /model: null\n  - override /data: null\n  - override /loss: cross_entropy\n"
            "model: {_target_: hydratrain.examples.digits.DigitsCNN, channels: 8, depth: 2}\n"
            "data: {_target_: hydratrain.examples.digits.digits, batch_size: 16}\n")
    (tmp_path / "my_conf" / "experiment" / "inline.yaml").write_text("# @package _global_\n" + body)
    (tmp_path / "my_conf" / "experiment" / "nonull.yaml").write_text(
        "# @package _global_\n" + body.replace("  - override /data: null\n", ""))
    (tmp_path / "my_conf" / "experiment" / "nopackage.yaml").write_text(body)
    config_dir = ["--config-dir", str(tmp_path / "my_conf"), "strategy=single", "precision=fp32"]
    r = cli([*config_dir, "+experiment=inline", "trainer.max_steps=1"], tmp_path / "inline", fast=False)
    assert r.returncode == 0, r.output[-3000:]
    assert "DigitsCNN" in (tmp_path / "inline" / ".hydra" / "config.yaml").read_text()
    r = cli([*config_dir, "+experiment=nonull"], tmp_path / "nonull")
    assert r.returncode == 2 and r.err.strip().endswith(
        "(a data node with _target_ replaces the built-in data option: add '- override /data: null' to the "
        "experiment's defaults list, or put the node in <config dir>/data/NAME.yaml and choose it with data=NAME)"), \
        r.output[-3000:]
    r = cli([*config_dir, "+experiment=nopackage"], tmp_path / "nopackage")
    assert r.returncode == 2 and r.err.strip().endswith(
        "(an experiment file must begin with the line '# @package _global_')"), r.output[-3000:]


def test_a_runs_saved_config_composed_again_says_how_to_rerun_it(cli, tmp_path):
    """``--config-dir RUN/.hydra --config-name config`` (a Hydra habit) composes an untyped config: it was refused as
    'data=???: removed with ~data?'."""
    cli(["strategy=single", "trainer.max_steps=1"], tmp_path / "a").ok()
    r = cli(["--config-dir", str(tmp_path / "a" / ".hydra"), "--config-name", "config"], tmp_path / "b", fast=False)
    assert r.returncode == 2 and r.err.strip().startswith(
        "hydratrain: config error: --config-name=<another config>: not conf/train.yaml on its typed schema (a run's "
        "saved .hydra/config.yaml?): to run a past run again, give train.py its overrides"), r.output[-3000:]


def test_size_based_policy_never_picks_a_container_without_forward():
    from torch import nn

    from hydratrain.models.gpt import GPT, GPTConfig
    from hydratrain.parallel.wrap_policy import shard_units

    model = GPT(GPTConfig())  # gpt_tiny: ~212k parameters per block, ~850k in the ModuleList of blocks
    policy = OmegaConf.create({"name": "size_based", "min_num_params": 500_000})
    assert shard_units(model, policy) == []
    units = shard_units(model, OmegaConf.create({"name": "size_based", "min_num_params": 100_000}))
    assert units == [b.mlp for b in model.blocks]  # 147k each; the rest of a block (attention, 66k) stays below
    units = shard_units(model, OmegaConf.create({"name": "size_based", "min_num_params": 60_000}))
    assert units == [m for b in model.blocks for m in (b.attn, b.mlp)]
    assert not any(isinstance(u, nn.ModuleList) for u in units)


def test_help_lists_every_option_of_every_group_under_conf_and_no_schema(cli, tmp_path):
    """``--help`` listed the eight ``schema/*`` groups that its own header called "not choices", and nothing said
    that a ``_target_`` optimizer is allowed: it lists what a user chooses, read from the config search path
    (``conf/`` and a ``--config-dir``'s), the ``_target_`` form where one is allowed, the chosen option marked."""
    own = tmp_path / "my_conf" / "optim"
    own.mkdir(parents=True)
    (own / "sgd.yaml").write_text("_target_: torch.optim.SGD\nlr: 0.1\n")
    r = cli(["--help", "--config-dir", str(tmp_path / "my_conf"), "model=gpt_small"], fast=False)
    assert r.returncode == 0 and r.err == "", r.output[-2000:]
    assert r.out.startswith("hydratrain: distributed PyTorch training configured by Hydra")
    assert "Exit statuses: 0 done, 2 config error" in r.out and "python train.py --cfg job" in r.out
    chosen, rest = r.out[r.out.index("== Choices: group=option"):].split("== Added with +group=option ==")
    added, own = rest.split("== Named nodes of your own")
    chosen, added, own = (dict(line.strip().split(":", 1) for line in part.splitlines() if line.startswith("  "))
                          for part in (chosen, added, own))
    lines = {**chosen, **added, **own}
    groups = sorted(d.name for d in CONF.iterdir() if d.is_dir() and d.name != "hydra")
    assert sorted([*chosen, *added]) == groups and {"model", "optim"} <= set(chosen) and "experiment" in added
    for group in groups:
        listed = [o.strip().rstrip("*") for o in lines[group].split(",") if "your own" not in o]
        expected = sorted(p.stem for p in (CONF / group).glob("*.yaml")) + (["sgd"] if group == "optim" else [])
        assert listed == sorted(expected), (group, lines[group])
        assert ("or your own (_target_: ...)" in lines[group]) == (group in (
            "model", "data", "loss", "optim", "scheduler")), (group, lines[group])
    assert " gpt_small*," in lines["model"] and "schema" not in r.out and "hydra_logging" not in r.out
    assert lines["metrics.NAME"] == lines["callbacks.NAME"] == " your own (_target_: ...)"


@requires("slurm")
def test_a_job_whose_launcher_started_another_number_of_ranks_is_refused(compose, tmp_path):
    """A swept group or experiment that sets launcher.tasks_per_node per job: submitit's one executor per sweep ran
    every job on the sweep's count while each job's config and report row said its own."""
    from hydratrain.config.validate import check_environment

    cfg = compose(["launcher=submitit_local", "launcher.tasks_per_node=1", "strategy=ddp"])
    with pytest.raises(ConfigError) as err:
        check_environment(cfg, 2, tmp_path)
    assert err.value.key == "launcher.tasks_per_node" and "starts 1 rank(s), but it runs on 2" in str(err.value)
    check_environment(compose(["launcher=submitit_local", "strategy=ddp"]), 2, tmp_path)  # tasks_per_node=2


def test_with_hydras_logging_disabled_a_config_error_is_one_line(cli, tmp_path):
    r = cli(["hydra/job_logging=disabled", "optim.lr=-1"], tmp_path)
    assert r.returncode == 2 and r.err.strip().splitlines() == [
        "hydratrain: config error: optim.lr=-1.0: must be finite and > 0"], r.err  # not twice (logging's last resort)
