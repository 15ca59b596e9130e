"""Fixtures that run things in this process: ``compose`` (the config train.py would get), ``cli`` (train.py itself,
or a twin, with a command line), ``make_job`` (a built single-process job to drive by hand); and ``shared_sweep`` /
``two_rank_run``: the 2-rank torchrun runs several tests assert on, made once per session. Subprocess helpers are in
``helpers.py``."""
from __future__ import annotations

import importlib.util
import inspect
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import pytest

# tests/ is on sys.path: pytest puts a rootdir conftest's dir there
from helpers import (
    CONF,
    FAST,
    OWN,
    ROOT,
    SHARED_RUNS,
    TRAIN,
    Run,
    Sweep,
    clone_files,
    forget_mypkg,
    likely_writes,
    sweep_runs,
)

_FLAGS_WITH_VALUE = ("--cfg", "-c", "--info", "-i", "--package", "-p", "--config-dir", "-cd", "--config-name", "-cn")


# ------------------------------------------------------------------------- tests write under temporary dirs only
@pytest.fixture(autouse=True)
def _launch_from_a_temporary_dir(tmp_path_factory, monkeypatch):
    """Every test starts in a fresh temporary dir, its launch dir: a run or sweep without ``hydra.run.dir`` /
    ``hydra.sweep.dir`` (``outputs/``, ``multirun/`` under the launch dir), a subprocess started without ``cwd``,
    anything written to a relative path, all land there, not in the clone. A test that wrote into the clone anyway
    (an absolute path under it: a build of the package, a run dir built on ``ROOT``) fails, naming what it wrote."""
    monkeypatch.chdir(tmp_path_factory.mktemp("launch"))
    before = likely_writes()
    yield
    written = sorted(likely_writes() - before)
    if written:
        pytest.fail(f"this test wrote into the clone {ROOT}: {', '.join(written)} (tests write under a temporary dir "
                    "only)", pytrace=False)


@pytest.fixture(autouse=True)
def _seeded(request):
    """Each test starts from its own fixed seed (torch, random, numpy; from its node id): what it draws is the same
    whatever ran before it in its process, so a test passes or fails alike under any order or xdist split."""
    import random
    import zlib

    import numpy as np
    import torch

    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


@pytest.fixture
def own(tmp_path, monkeypatch):
    """A launch dir holding the own-model example's package and option files (a copy, outside hydratrain); cwd is
    there, ``sys.path`` is restored after the test and ``mypkg`` is imported from this copy."""
    import shutil

    for part in ("mypkg", "my_conf"):
        shutil.copytree(OWN / part, tmp_path / part)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    forget_mypkg()
    yield tmp_path
    forget_mypkg()


def pytest_sessionstart(session):
    session.config._clone_before = clone_files() if (ROOT / ".git").exists() else None


def pytest_sessionfinish(session, exitstatus):
    """The session fails when the clone gained a path (anywhere in it; the per-test check looks at the likely places
    only), naming them: tests write under temporary dirs only."""
    before = getattr(session.config, "_clone_before", None)
    if before is None:
        return
    written = sorted(clone_files() - before)
    if written:
        more = f" and {len(written) - 10} more" if len(written) > 10 else ""
        session.config.get_terminal_writer().line(
            f"tests wrote into the clone {ROOT}: {', '.join(written[:10])}{more} (tests write under a temporary dir "
            "only)", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config):
    """A pytest-xdist worker gets its share of the cores as its intra-op threads (``OMP_NUM_THREADS``, unless set):
    two workers of 2 threads each on 2 cores would make every in-process run slower. Subprocess ranks get 1 thread
    each anyway (helpers.clean_env)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // workers))
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


#: the file where the workers leave each test's group for the controller's scheduler (pytest_configure_node)
GROUPS = "hydratrain_xdist_groups"


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``-n 2 --dist loadgroup``, pyproject's addopts) a shared launch runs once: the tests that
    read the session's shared 2-rank sweep run in one worker, so do the tests of a module with a module-scoped
    fixture (its own shared sweep), and the Ray tests (one local Ray cluster at a time). Every other test goes to
    whichever worker is free. xdist 3.8's loadgroup cannot group under pytest 9 (it marks a group by rewriting
    ``item._nodeid``, which pytest 9 no longer reads): each worker writes the groups to a file that
    :func:`pytest_xdist_make_scheduler`'s scheduler reads, once every worker has collected."""
    groups = {}
    for item in items:
        infos = getattr(item, "_fixtureinfo", None)
        defs = [d for ds in (infos.name2fixturedefs.values() if infos else ()) for d in ds]
        if {"shared_sweep", "two_rank_run"} & set(getattr(item, "fixturenames", ())):
            group = "shared_sweep"
        elif "ray" in item.path.stem:
            group = "ray"
        elif any(d.scope == "module" and d.baseid and item.nodeid.startswith(d.baseid) for d in defs):
            group = item.path.stem
        else:
            continue
        item.add_marker(pytest.mark.xdist_group(group))
        groups[item.nodeid] = group
    where = getattr(config, "workerinput", {}).get(GROUPS)
    if where:  # every worker collects the same tests: the last write is as good as the first
        tmp = Path(f"{where}.{os.getpid()}")
        tmp.write_text(json.dumps(groups))
        os.replace(tmp, where)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist's controller, for each worker: where to write the groups."""
    if not hasattr(node.config, "_hydratrain_groups"):
        node.config._hydratrain_groups = Path(tempfile.mkdtemp(prefix="pytest-groups-")) / "groups.json"
    node.workerinput[GROUPS] = str(node.config._hydratrain_groups)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup``: xdist's scope scheduling with the groups the workers wrote (a test in no group is a
    scope of its own, as in xdist's loadgroup): a group's tests run in one worker, one after another, so a shared
    launch runs once."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling  # (xdist's: only under xdist)

    class GroupScheduling(LoadScopeScheduling):
        groups: Optional[dict] = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:
                where = getattr(config, "_hydratrain_groups", None)
                self.groups = json.loads(where.read_text()) if where and where.exists() else {}
            return self.groups.get(nodeid, nodeid)

    return GroupScheduling(config, log)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One corpus cache for the session (HYDRATRAIN_CACHE), so the stdlib memmap is built once: under pytest-xdist
    one for all workers (a corpus build takes a lock; a second builder finds it built)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return tmp_path_factory.mktemp("cache")
    shared = tmp_path_factory.getbasetemp().parent / "cache"
    shared.mkdir(exist_ok=True)
    return shared


@pytest.fixture
def compose(cache_dir, monkeypatch):
    """compose(overrides) -> the DictConfig train.py would get (Hydra global state reset around it)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from hydratrain.config import register_configs
    from hydratrain.dist.run_dir import register_resolvers

    monkeypatch.setenv("HYDRATRAIN_CACHE", str(cache_dir))
    register_configs()
    register_resolvers()

    def _compose(overrides=(), return_hydra_config: bool = False):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return hydra_compose("train", overrides=list(overrides), return_hydra_config=return_hydra_config)

    yield _compose
    GlobalHydra.instance().clear()


def _entry_point(script: str):
    """The ``@hydra.main`` function of train.py (or a twin), loaded as Hydra sees a script run as ``__main__`` (its
    config_path is then relative to the script's file)."""
    spec = importlib.util.spec_from_file_location(f"_entry_{Path(script).stem}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    task = next(v for v in vars(module).values() if callable(v) and hasattr(v, "__wrapped__"))
    inspect.unwrap(task).__module__ = "__main__"  # the task function, under any wrapper of Hydra's main
    return task


@pytest.fixture
def cli(cache_dir, monkeypatch, capsys, hydra_restore_singletons):
    """cli(args, run_dir=None, script=TRAIN, fast=True) -> :class:`helpers.Run`: ``python SCRIPT [FAST] ARGS
    [hydra.run.dir=RUN_DIR]`` in this process (Hydra's command line, logging, run dir and sweeps, then
    ``hydratrain.run.main``), with its exit status and its stdout + stderr (``.output``; ``.out``, ``.err`` alone).

    For anything where processes are not the point: config errors, single-process runs, local sweeps. Seconds
    cheaper than a subprocess (no interpreter, torch or Hydra start-up). Logging and Hydra's singletons are restored
    afterwards; ``HYDRATRAIN_CACHE`` is the session's cache.
    """
    import torch

    from hydratrain.dist import run_dir as run_dir_module
    from hydratrain.exits import end_of_process

    monkeypatch.setenv("HYDRATRAIN_CACHE", str(cache_dir))
    monkeypatch.delenv("HYDRATRAIN_STAMP", raising=False)
    monkeypatch.setattr(run_dir_module, "_STAMP", None)
    monkeypatch.setattr(run_dir_module, "_UNIQUE_DIRS", {})
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    saved_disabled = {name: lg.disabled for name, lg in logging.root.manager.loggerDict.items()
                      if isinstance(lg, logging.Logger)}  # hydra/job_logging=disabled disables existing loggers
    saved_levels = {name: lg.level for name, lg in logging.root.manager.loggerDict.items()
                    if isinstance(lg, logging.Logger)}
    entries = {}

    def _cli(args: Sequence[str] = (), run_dir: Optional[Path] = None, script: str = TRAIN,
             fast: bool = True) -> Run:
        if script not in entries:
            entries[script] = _entry_point(script)
        flags, rest, it = [], [], iter(args)
        for a in it:  # Hydra's flags (-m, --cfg job, --info plugins) first, as its argparse wants
            if a in ("-m", "--multirun", "--resolve"):
                flags.append(a)
            elif a in _FLAGS_WITH_VALUE:
                flags += [a, next(it)]
            else:
                rest.append(a)
        argv = [*flags, *(FAST if fast else []), *rest, *([f"hydra.run.dir={run_dir}"] if run_dir else [])]
        monkeypatch.setattr(sys, "argv", [script, *argv])
        monkeypatch.delenv("HYDRATRAIN_STAMP", raising=False)  # each call a new launch, as a new process is
        monkeypatch.setattr(run_dir_module, "_UNIQUE_DIRS", {})
        capsys.readouterr()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as a subprocess starts (OMP_NUM_THREADS=1); the process group sets its own
        t0 = time.monotonic()
        try:
            entries[script]()
            status = 0
        except SystemExit as exit_:  # as the interpreter ends: an int is the status, anything else is printed
            status = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
            if not isinstance(exit_.code, (int, type(None))):
                print(exit_.code, file=sys.stderr)
        finally:
            torch.set_num_threads(threads)
            monkeypatch.setattr(run_dir_module, "_STAMP", None)
            end_of_process()  # the sweep's exit hook, as the interpreter would run it now (not at pytest's exit)
        out = capsys.readouterr()
        result = Run(status, out.out + out.err, time.monotonic() - t0, ["python", script, *argv])
        result.out, result.err = out.out, out.err
        return result

    yield _cli
    for handler in root.handlers:
        if handler not in saved_handlers:
            handler.close()
    root.handlers[:] = saved_handlers
    root.setLevel(saved_level)
    for name, level in saved_levels.items():
        logging.getLogger(name).setLevel(level)
    for name, lg in logging.root.manager.loggerDict.items():
        if isinstance(lg, logging.Logger):
            lg.disabled = saved_disabled.get(name, False)


@pytest.fixture
def make_job(compose):
    """make_job(run_dir, *overrides) -> a ``hydratrain.run.Job`` built in this process (tiny GPT, strategy=single,
    fp32 on CPU, no TensorBoard), to drive its trainer and checkpoints by hand."""
    import torch

    from hydratrain.dist.env import DistInfo
    from hydratrain.parallel.build import build_strategy
    from hydratrain.run import build

    def _make(run_dir: Path, *overrides: str):
        cfg = compose(["+debug=fast_gpt", "strategy=single", "precision=fp32", "device=cpu", "logger.tensorboard=false",
                       "logger.peak_flops=1e12", *overrides])
        return build(cfg, build_strategy(cfg), DistInfo(device=torch.device("cpu")), run_dir, run_dir)

    return _make


# ------------------------------------------------------------------------------ the shared 2-rank torchrun sweep
#: fixtures that read some shared runs only, by name: a session whose tests reach the shared sweep through these
#: alone (the slow suite: test_checkpoint's run_a) runs those jobs only
SHARED_READERS = {"run_a": ("ckpt_a",)}


def _shared_runs_needed(items) -> dict:
    """The jobs of :data:`SHARED_RUNS` the session's tests (after ``-m`` and ``-k``) read: all of them when a test
    asks for ``shared_sweep`` or ``two_rank_run`` itself, else those its :data:`SHARED_READERS` fixtures name."""
    names: set = set()
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        if not {"shared_sweep", "two_rank_run"} & used:
            continue
        direct = set(getattr(getattr(item, "_fixtureinfo", None), "initialnames", ()))
        readers = used & set(SHARED_READERS)
        if {"shared_sweep", "two_rank_run"} & direct or not readers:
            return dict(SHARED_RUNS)
        names.update(n for r in readers for n in SHARED_READERS[r])
    return {k: v for k, v in SHARED_RUNS.items() if k in names} or dict(SHARED_RUNS)


@pytest.fixture(scope="session")
def shared_sweep(request, tmp_path_factory, cache_dir) -> Sweep:
    """The 2-rank training runs several tests assert on (helpers.SHARED_RUNS; those the session's tests read), as
    the jobs of ONE sweep inside 2 torchrun ranks, started in an empty dir without hydra.sweep.dir (so the ranks
    must agree on its time stamp)."""
    runs = _shared_runs_needed(request.session.items)
    return sweep_runs(runs, tmp_path_factory.mktemp("shared"), env={"HYDRATRAIN_CACHE": str(cache_dir)})


@pytest.fixture(scope="session")
def two_rank_run(shared_sweep):
    """two_rank_run(name) -> the job dir of ``SHARED_RUNS[name]`` in the shared sweep (checked complete)."""
    return shared_sweep.job
