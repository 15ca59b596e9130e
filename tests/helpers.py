"""The one set of test helpers: the fast-override list, one way to run train.py (or a twin, or any command) as a
subprocess, and readers of what a run leaves behind (TensorBoard scalars, results.json, logs, checkpoints, sweep
reports), and the shared 2-rank runs (SHARED_RUNS, sweep_runs). Fixtures (``compose``, ``cli``, ``make_job``,
``shared_sweep``) live in ``conftest.py``."""
from __future__ import annotations

import contextlib
import csv
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
TRAIN = str(ROOT / "train.py")
SCRIPTS = ROOT / "tests" / "scripts"
# train.py twin that injects one fault: HT_FAULT* for one rank and step, HT_FAULT_JOBS for sweep jobs (its docstring)
FAULTY = str(SCRIPTS / "faulty_train.py")
OWN = ROOT / "examples" / "own_model"  # the own-model example: its package mypkg and its option files
FIXTURE_V1 = ROOT / "tests" / "fixtures" / "ckpt_v1_fsdp2_step3"  # 2 ranks, FSDP, fp32, step 3: the first format
# A run of seconds: synthetic data, 2 layers, 10 steps, no progress bar, sample or weights, no matmul benchmark for
# MFU; FAST adds fp32 (exact on CPU; bf16/fp16 are slow on some CPUs). DEBUG alone where a precision= comes later from
# a config overlay (a command-line choice would override the overlay's).
DEBUG = ["+debug=fast_gpt", "device=cpu", "logger.peak_flops=1e11"]
FAST = [*DEBUG, "precision=fp32"]

# The 2-rank training runs several tests assert on: the jobs of one sweep inside 2 torchrun ranks, made once per
# session (conftest.shared_sweep), each started with DEBUG + its overrides. The four fp32 trajectory runs differ only
# in how the same 8 samples per step are cut (ranks x micro-batches) and in the strategy; one FSDP run also offloads
# to the CPU and keeps parameters unsharded after forward, neither of which may change the math.
_COMMON = ["trainer.max_steps=12", "trainer.eval_every_n_steps=3", "optim.lr=1e-2", "scheduler.warmup_steps=2"]
_ACCUM = ["data.batch_size=2", "trainer.grad_accum_steps=2"]
SHARED_RUNS = {
    "fsdp_fp32": [*_COMMON, "strategy=fsdp", "precision=fp32", "wrap_policy=none", "strategy.cpu_offload=true",
                  "strategy.reshard_after_forward=false"],
    "ddp_fp32": [*_COMMON, "strategy=ddp", "precision=fp32", "wrap_policy=none"],
    "ddp_fp32_reduce_bf16": [*_COMMON, "strategy=ddp", "precision=fp32", "precision.reduce_dtype=bfloat16"],
    "fsdp_fp32_accum": [*_COMMON, "strategy=fsdp", "precision=fp32", "wrap_policy=none", *_ACCUM],
    "ddp_fp32_accum": [*_COMMON, "strategy=ddp", "precision=fp32", "wrap_policy=none", *_ACCUM],
    "ddp_bf16": [*_COMMON, "strategy=ddp", "precision=bf16", "wrap_policy=none"],
    "ddp_fp16": [*_COMMON, "strategy=ddp", "precision=fp16", "wrap_policy=none"],
    "fsdp_bf16": [*_COMMON, "strategy=fsdp", "precision=bf16", "wrap_policy=transformer_block",
                  "activation_checkpointing=true"],
    "fsdp_fp16": [*_COMMON, "strategy=fsdp", "precision=fp16", "wrap_policy=size_based",
                  "wrap_policy.min_num_params=5000"],
    # tests/e2e/test_checkpoint.py's run A: checkpoints at steps 10 and 20, final weights
    "ckpt_a": ["strategy=fsdp", "precision=fp32", "trainer.eval_samples=8", "trainer.max_steps=20",
               "checkpoint.every_n_steps=10", "trainer.save_weights=true"],
    # the old-format checkpoint fixture resumed for 2 steps (its model and data)
    "ckpt_v1": ["strategy=fsdp", "precision=fp32", "model.d_model=32", "model.n_layer=1", "model.n_head=2",
                "data.synthetic_tokens=100000", "trainer.max_steps=5", "checkpoint.every_n_steps=0",
                "trainer.log_every_n_steps=1", f"checkpoint.resume_from={FIXTURE_V1}"],
}
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "HYDRATRAIN_STAMP")


def clean_env(**extra: str) -> dict:
    """This process's environment without any launcher's variables, one thread per rank, unbuffered output."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCH_VARS and not k.startswith(("TORCHELASTIC_", "SUBMITIT_", "SLURM_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def command(args: Sequence[str], nproc: int = 1, script: str = TRAIN, fast: bool = True,
            torchrun: Optional[Sequence[str]] = None) -> list[str]:
    """``python SCRIPT [FAST] ARGS``, under ``torch.distributed.run --standalone --nproc_per_node=N`` when ``nproc`` >
    1, or under ``torch.distributed.run TORCHRUN...`` when ``torchrun`` is given (``-m`` is put first, as Hydra's
    argparse wants)."""
    flags = [a for a in args if a == "-m"]
    rest = [a for a in args if a != "-m"]
    if torchrun is None and nproc > 1:
        torchrun = ["--standalone", f"--nproc_per_node={nproc}"]
    launcher = ["-m", "torch.distributed.run", *torchrun] if torchrun is not None else []
    return [sys.executable, *launcher, script, *flags, *(FAST if fast else []), *rest]


@dataclass
class Run:
    returncode: int
    output: str  # stdout and stderr, interleaved
    seconds: float
    cmd: list

    def ok(self) -> "Run":
        assert self.returncode == 0, f"exit {self.returncode}: {' '.join(self.cmd)}\n{self.output[-5000:]}"
        return self


def spawn(cmd: Sequence[str], cwd: Optional[Path] = None, env: Optional[dict] = None) -> subprocess.Popen:
    """Start any command in its own session (so :func:`finish` can kill it and every child on a timeout), with
    :func:`clean_env` plus ``env``; stdout and stderr interleaved. SIGINT has its default handling in it, as a
    terminal starts a command, also when the tests run where SIGINT is ignored (a background job of a script).
    ``cwd`` (the launch dir) defaults to the current dir, which conftest makes a temporary dir of each test's own,
    so a run without ``hydra.run.dir`` lands there, not in the clone."""
    proc = subprocess.Popen(list(cmd), cwd=str(cwd or Path.cwd()), env=clean_env(**(env or {})),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    proc.cmd, proc.t0 = list(cmd), time.monotonic()
    return proc


def start(args: Sequence[str], run_dir: Optional[Path] = None, nproc: int = 1, script: str = TRAIN,
          env: Optional[dict] = None, cwd: Optional[Path] = None, fast: bool = True,
          torchrun: Optional[Sequence[str]] = None) -> subprocess.Popen:
    """Start train.py (or a twin) with :data:`FAST` + ``args`` (+ ``hydra.run.dir=run_dir``); see :func:`command`."""
    cmd = command([*args, *([f"hydra.run.dir={run_dir}"] if run_dir is not None else [])], nproc, script, fast,
                  torchrun)
    return spawn(cmd, cwd, env)


def finish(proc: subprocess.Popen, timeout: float = 300) -> Run:
    """Wait for a :func:`start`-ed (or :func:`spawn`-ed) process; on timeout kill its whole session and fail."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"timed out after {timeout} s (a hang?): {' '.join(proc.cmd)}\n{out[-4000:]}") from None
    return Run(proc.returncode, out, time.monotonic() - proc.t0, proc.cmd)


def run(args: Sequence[str], run_dir: Optional[Path] = None, nproc: int = 1, script: str = TRAIN,
        env: Optional[dict] = None, cwd: Optional[Path] = None, timeout: float = 300, fast: bool = True,
        torchrun: Optional[Sequence[str]] = None) -> Run:
    """Run train.py (or a twin) with :data:`FAST` + ``args`` to completion; check with ``.ok()``."""
    return finish(start(args, run_dir, nproc, script, env, cwd, fast, torchrun), timeout)


def sh(cmd: Sequence[str], cwd: Optional[Path] = None, env: Optional[dict] = None, timeout: float = 300) -> Run:
    """Run any command (``python -m hydratrain.export ...``, ``bash bench/gpu.sh``) to completion."""
    return finish(spawn(cmd, cwd, env), timeout)


def _overlay(overrides: Sequence[str]) -> str:
    """``overrides`` as a ``# @package _global_`` config: group choices go to its defaults list, values below."""
    from omegaconf import OmegaConf

    groups = {p.name for p in CONF.iterdir() if p.is_dir()}
    pairs = [o.split("=", 1) for o in overrides]
    defaults = [f"  - override /{k}: {v}" for k, v in pairs if k in groups]
    values = OmegaConf.from_dotlist([f"{k}={v}" for k, v in pairs if k not in groups])
    return "# @package _global_\ndefaults:\n" + "\n".join(defaults) + "\n" + OmegaConf.to_yaml(values)


@dataclass
class Sweep:
    dir: Path  # the sweep dir
    result: Run  # the launch (its console)
    jobs: dict  # name -> job dir

    def job(self, name: str) -> Path:
        """The job dir of run ``name``, after checking that the job completed."""
        job = self.jobs[name]
        status = json.loads((job / "status.json").read_text()) if (job / "status.json").exists() else {}
        assert (job / "results.json").exists(), (name, status, self.result.output[-4000:])
        return job


def sweep_runs(runs: dict, base: Path, nproc: int = 2, sweep_dir: Optional[Path] = None, env: Optional[dict] = None,
               timeout: float = 900, common: Sequence[str] = DEBUG) -> Sweep:
    """Several train.py runs as the jobs of ONE sweep inside ``nproc`` torchrun ranks (``torchrun train.py -m
    +testrun=a,b,...``): each job builds its own process group, model and data in the same processes, so the
    interpreter, torch and Hydra start once instead of once per run. ``runs``: name -> overrides (after
    ``common``, default :data:`DEBUG`), written under ``base`` as config group ``testrun`` (a Hydra search path added
    for the sweep). Launched in ``base/launch``; without ``sweep_dir`` the sweep lands in its
    ``multirun/<date>/<time>``."""
    (base / "conf" / "testrun").mkdir(parents=True)
    for name, overrides in runs.items():
        (base / "conf" / "testrun" / f"{name}.yaml").write_text(_overlay(overrides))
    launch = base / "launch"
    launch.mkdir()
    result = run(["-m", *common, f"hydra.searchpath=[file://{base / 'conf'}]", f"+testrun={','.join(runs)}",
                  *([f"hydra.sweep.dir={sweep_dir}"] if sweep_dir else [])], nproc=nproc, cwd=launch, fast=False,
                 timeout=timeout, env=env)
    sweeps = [sweep_dir] if sweep_dir else sorted(p for p in launch.glob("multirun/*/*") if p.is_dir())
    assert len(sweeps) == 1, (sweeps, result.output[-4000:])
    return Sweep(sweeps[0], result, {name: sweeps[0] / str(i) for i, name in enumerate(runs)})


def cut_command(line: str) -> tuple[str, str]:
    """(``line`` before the command that resumes the run, which a line about resuming ends with; that command): the
    head ends with ``and resume from it with``, ``and relaunch`` or ``; to resume...``, the ``: `` cut."""
    import re

    found = list(re.finditer(r"(?: and resume from it with| and relaunch|; to resume[^:;]*): ", line))
    if not found:
        return line, ""
    last = found[-1]
    return line[:last.end() - 2], line[last.end():].rstrip("\n")


# ------------------------------------------------------------------------------- the clone stays as checked out
#: what running the tests leaves in the clone by design: Python's bytecode, pytest's, ruff's and mypy's caches, the
#: editable install's metadata, CI's virtual environment
_LEFT_BY_DESIGN = {".git", "__pycache__", ".pytest_cache", ".ruff_cache", ".mypy_cache", ".ci-venv", ".venv"}
#: where a test that writes into the clone most likely writes (a default run or sweep dir, a build): listed around
#: every test, cheaply, to name the test that did it (conftest)
LIKELY_WRITES = ("", "outputs", "multirun", "runs", "build", "dist", "tests", "tests/unit", "tests/e2e", "bench")


def _by_design(name: str) -> bool:
    return name in _LEFT_BY_DESIGN or name.endswith(".egg-info")


def clone_files(root: Path = ROOT) -> set[str]:
    """Every file and dir under ``root`` (relative, ``/``-separated), but what running the tests leaves there by
    design (:data:`_LEFT_BY_DESIGN`, ``*.egg-info``). Compared before and after the session (conftest): a path that
    appeared is something a test wrote into the clone."""
    found = set()
    for top, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not _by_design(d)]
        rel = Path(top).relative_to(root)
        found.update((rel / name).as_posix() for name in [*dirs, *files])
    return found


def likely_writes(root: Path = ROOT) -> set[str]:
    """The entries of :data:`LIKELY_WRITES` under ``root`` (relative paths): a dozen directory listings, cheap enough
    to take around every test."""
    found = set()
    for sub in LIKELY_WRITES:
        with contextlib.suppress(OSError):
            found.update((Path(sub) / e.name).as_posix() for e in os.scandir(root / sub) if not _by_design(e.name))
    return found


# ------------------------------------------------------------------------------ optional extras (pyproject.toml)
#: each extra of ``[project.optional-dependencies]`` that some tests need, with the modules that tell it is installed
EXTRAS = {
    "lowbit": ("torchao",),
    "ray": ("ray",),
    "optuna": ("optuna", "hydra_plugins.hydra_optuna_sweeper"),
    "slurm": ("submitit", "hydra_plugins.hydra_submitit_launcher"),
    "examples": ("sklearn",),
    "report": ("matplotlib",),
    "hf": ("transformers", "datasets"),
    "peft": ("peft",),
    "docs": ("mkdocs", "material"),
}


def missing(extra: str) -> list[str]:
    """The modules of ``extra`` (:data:`EXTRAS`) that cannot be imported here; found without importing them."""
    import importlib.util

    absent = []
    for name in EXTRAS[extra]:
        try:
            found = importlib.util.find_spec(name) is not None
        except ImportError:  # a parent package is missing
            found = False
        if not found:
            absent.append(name)
    return absent


def why_missing(*extras: str) -> str:
    """Why a test that needs ``extras`` cannot run here ('' when they are all installed)."""
    absent = {extra: missing(extra) for extra in extras}
    return "; ".join(f"needs the extra [{extra}] ({', '.join(mods)} not installed: pip install -e '.[{extra}]')"
                     for extra, mods in absent.items() if mods)


def requires(*extras: str):
    """A mark (a test's decorator, a module's ``pytestmark``, a ``pytest.param``'s ``marks``) that skips what needs
    ``extras`` where one of them is not installed, saying which and how to install it: ``pip install -e ".[dev]"``
    alone passes the suite, with these skipped."""
    import pytest

    reason = why_missing(*extras)
    return pytest.mark.skipif(bool(reason), reason=reason or "installed")


def skip_without(*extras: str) -> None:
    """Skip the running test here when one of ``extras`` is not installed (for a case chosen inside the test)."""
    import pytest

    reason = why_missing(*extras)
    if reason:
        pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------ what a run leaves
def tb_all(run_dir: Path) -> dict[str, dict[int, float]]:
    """``{tag: {step: value}}`` of every scalar in every TensorBoard event file under ``run_dir`` (later files
    win)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    out: dict[str, dict[int, float]] = {}
    for f in sorted(Path(run_dir).rglob("events.out.tfevents.*"), key=os.path.getmtime):
        for event in EventFileLoader(str(f)).Load():
            for v in event.summary.value:
                if v.HasField("simple_value"):
                    out.setdefault(v.tag, {})[event.step] = v.simple_value
                elif v.HasField("tensor") and not v.metadata.plugin_data.plugin_name == "hparams":
                    array = tensor_util.make_ndarray(v.tensor)
                    if array.size == 1 and array.dtype.kind == "f":
                        out.setdefault(v.tag, {})[event.step] = float(array)
    return out


def tb_as_loaded(run_dir: Path, run: str = "tensorboard") -> dict[str, list[tuple[int, Optional[float]]]]:
    """``{tag: [(step, value), ...]}`` of ``<run_dir>/<run>`` as the TensorBoard server loads it (its
    ``plugin_event_accumulator.EventAccumulator``: all points kept, stale events purged by ``SessionLog.START`` in
    every tag; the legacy ``event_accumulator`` purges scalars alike but never text or hparams tensors): scalars with
    their value, other summaries (text, the hparams session) with None. Unlike :func:`tb_all`, a step logged twice
    shows twice."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(Path(run_dir) / run), size_guidance={"tensors": 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags()["tensors"]:
        scalar = acc.SummaryMetadata(tag).plugin_data.plugin_name == "scalars"
        out[tag] = [(e.step, float(tensor_util.make_ndarray(e.tensor_proto)) if scalar else None)
                    for e in acc.Tensors(tag)]
    return out


def assert_tb_clean(run_dir: Path) -> dict[str, list[tuple[int, Optional[float]]]]:
    """Every tag of ``<run_dir>/tensorboard`` has strictly increasing steps (no step twice, none going back) and every
    scalar is finite, as the TensorBoard server loads the dir (:func:`tb_as_loaded`) and, for scalars, as the legacy
    ``event_accumulator.EventAccumulator`` does. Returns :func:`tb_as_loaded`'s points."""
    import math

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    points = tb_as_loaded(run_dir)
    assert points, f"no TensorBoard events in {run_dir}"
    legacy = EventAccumulator(str(Path(run_dir) / "tensorboard"), size_guidance={"scalars": 0})
    legacy.Reload()
    scalars = {f"{tag} (legacy reader)": [(e.step, e.value) for e in legacy.Scalars(tag)]
               for tag in legacy.Tags()["scalars"]}
    for tag, pts in {**points, **scalars}.items():
        steps = [s for s, _ in pts]
        assert all(a < b for a, b in zip(steps, steps[1:])), f"{tag}: steps {steps}"
    bad = {t: pts for t, pts in {**points, **scalars}.items()
           if not all(v is None or math.isfinite(v) for _, v in pts)}
    assert not bad, f"non-finite scalars: {bad}"
    return points


def hparams_row(run_dir: Path) -> dict[str, list[tuple[int, Optional[float]]]]:
    """The run dir's one hparams row (``tensorboard/hparams/<time>``, the only dir there) as TensorBoard loads it
    (:func:`tb_as_loaded`): the session and the ``hparam/*`` scalars."""
    rows = sorted((Path(run_dir) / "tensorboard" / "hparams").iterdir())
    assert len(rows) == 1, rows
    return tb_as_loaded(run_dir, f"tensorboard/hparams/{rows[0].name}")


def tb_scalars(run_dir: Path, tag: str = "train/loss") -> dict[int, float]:
    """``{step: value}`` of ``tag`` (see :func:`tb_all`)."""
    return tb_all(run_dir).get(tag, {})


def results(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "results.json").read_text())


def log_of(run_dir: Path, rank: int = 0) -> str:
    return (Path(run_dir) / f"train_rank{rank}.log").read_text()


def ckpt_of(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:08d}"


def report_rows(sweep_dir: Path) -> list[dict]:
    """The rows of a sweep's ``sweep_report.csv`` (one per job)."""
    with (Path(sweep_dir) / "sweep_report.csv").open() as f:
        return list(csv.DictReader(f))


def hparams_runs(log_dir: Path) -> dict:
    """{run: hparams session-start bytes} as TensorBoard's hparams plugin reads ``log_dir`` (one row per run)."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    mux = EventMultiplexer()
    mux.AddRunsFromDirectory(str(log_dir))
    mux.Reload()
    content = mux.PluginRunToTagToContent("hparams")
    return {run: tags["_hparams_/session_start_info"] for run, tags in content.items()
            if "_hparams_/session_start_info" in tags}


def load_weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def assert_same_tensors(a: dict, b: dict, what: str) -> None:
    import torch

    assert sorted(a) == sorted(b), f"{what}: keys differ: {sorted(set(a) ^ set(b))[:5]}"
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"{what}: {len(bad)} tensors differ, e.g. {bad[:3]}"


def diff_checkpoints(a: Path, b: Path, skip=()) -> list[str]:
    """Flat keys whose values differ between checkpoints ``a`` and ``b`` (or exist in one only)."""
    import torch

    from hydratrain.checkpoint.io import read_all

    x, y = read_all(a), read_all(b)
    keys = {k for k in set(x) | set(y) if not k.startswith(tuple(skip))}
    out = []
    for k in sorted(keys):
        if k not in x or k not in y:
            out.append(f"only in one: {k}")
        elif isinstance(x[k], torch.Tensor):
            if not (isinstance(y[k], torch.Tensor) and x[k].dtype == y[k].dtype and torch.equal(x[k], y[k])):
                out.append(k)
        elif x[k] != y[k]:
            out.append(k)
    return out


# ------------------------------------------------------------------------------------------------ Optuna searches
def expected_optuna_rows(rows: list[dict], fail_plan: dict) -> list[tuple[str, str]]:
    """What each trial of a search over ``optim.weight_decay=interval(-0.2,0.2)`` must have come to: a config error
    for a sampled negative decay (under torchrun the launcher's job check rejects it before the test twin's planned
    failure can happen), else the planned failure (``HT_FAULT_JOBS``), else completed. Returns [(status, part of the
    error)]."""
    out = []
    for num, r in enumerate(rows):
        decay = float(r["overrides"].split("optim.weight_decay=")[1].split()[0])
        torchrun = "launcher=torchrun" in r["overrides"]
        if decay < 0 and (torchrun or num not in fail_plan):
            out.append(("FAILED", f"ConfigError: optim.weight_decay={decay!r}: must be finite and >= 0"))
        elif fail_plan.get(num) == "kill":
            out.append(("FAILED", f"LaunchError: job #{num}: rank 1 failed"))
        elif fail_plan.get(num) == "raise":
            out.append(("FAILED", "FloatingPointError: loss diverged (test)"))
        else:
            out.append(("COMPLETED", ""))
    return out


def check_optuna_search(rc: int, out: str, sweep: Path, n_trials: int, fail_plan: dict, kinds: Sequence[str]) -> None:
    """The search ran all its trials; each row is what :func:`expected_optuna_rows` says; the failures include each
    of ``kinds``; Optuna's best value is the best completed eval loss; the sweep exits 1 naming a failed job."""
    rows = report_rows(sweep)
    assert len(rows) == n_trials, (rows, out[-3000:])
    expected = expected_optuna_rows(rows, fail_plan)
    assert all(r["status"] == status and part in r["error"] for r, (status, part) in zip(rows, expected)), \
        ([(r["status"], r["error"]) for r in rows], expected)
    errors = " ".join(r["error"] for r in rows)
    assert all(k in errors for k in kinds) and ("COMPLETED", "") in expected, expected  # the seed samples both signs
    best = min(float(r["eval_loss"]) for r in rows if r["status"] == "COMPLETED")
    assert f"Best value: {best:.4f}"[:16] in out
    failed = sum(status == "FAILED" for status, _ in expected)
    assert rc == 1 and f"hydratrain: {failed} of {len(rows)} sweep job(s) failed" in out, out[-2000:]


def write_user_inputs(cli, launch_dir: Path) -> None:
    """notes/*.txt, a weights file (w.safetensors) and a run with a checkpoint (src/), all under ``launch_dir`` (the
    current dir), for tests that refer to them with relative paths. ``cli``: the conftest fixture."""
    (launch_dir / "notes").mkdir()
    for i in range(4):
        (launch_dir / "notes" / f"n{i}.txt").write_text(f"note {i}: the quick brown fox jumps over the lazy dog\n" * 80)
    cli(["strategy=single", "trainer.max_steps=2", "checkpoint.save_last=true"], launch_dir / "src").ok()
    from hydratrain.checkpoint.export import export

    export(launch_dir / "src", launch_dir / "w.safetensors")


def forget_mypkg() -> None:
    """Drop every imported ``mypkg`` module (another test's copy, from another dir) and the import system's
    directory caches, so the copy of the test at hand, and the modules it writes into it, are the ones imported."""
    import importlib

    for name in [m for m in sys.modules if m == "mypkg" or m.startswith("mypkg.")]:
        del sys.modules[name]
    importlib.invalidate_caches()


def own_launch_dir(path: Path, **modules: str) -> Path:
    """``path`` made a launch dir holding a copy of the own-model example (``mypkg``, ``my_conf``), with each of
    ``modules`` (``name=source``) written as ``mypkg/<name>.py``."""
    import shutil

    for part in ("mypkg", "my_conf"):
        shutil.copytree(OWN / part, path / part)
    for name, source in modules.items():
        (path / "mypkg" / f"{name}.py").write_text(source)
    return path
