"""The torchrun launcher plugin on its own: Hydra's launcher test suites, per-job settings, the app's job check and
callbacks for failed jobs, the plugin importable without the app. Nothing here imports hydratrain: the apps are
Hydra's test apps and tests/plugin_app (a config that maps its own key onto ``hydra.launcher.nproc_per_node``). Its
config node and setting checks, in-process: tests/unit/test_torchrun_plugin_config.py.

Timing on 2 busy cores: the default selection ~30 s; Hydra's full suites (20 tests, marked slow) ~90 s.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.test_utils.launcher_common_tests import IntegrationTestSuite, LauncherTestSuite, sweep_2_jobs
from hydra.test_utils.test_utils import integration_test
from hydra.version import VersionBase

from hydra_plugins.hydratrain_launcher._checks import LauncherConfigError

PLUGIN_APP = str(Path(__file__).resolve().parents[1] / "plugin_app")  # its module: tests/_plugin_app.py
FLAGS = ["-m", "hydra/job_logging=hydra_debug", "hydra/job_logging=disabled", "hydra/launcher=torchrun"]


@pytest.fixture(autouse=True)
def _unset_version_base():
    """Hydra's suites expect the version base of an app that gives none (1.1: jobs chdir to their dir); other test
    modules of this session set 1.3 process-wide."""
    saved = VersionBase.instance()
    Singleton._instances.pop(VersionBase)  # VersionBase() would return the existing instance
    yield
    VersionBase.set_instance(saved)


def test_plugin_imports_no_app():
    """Every module of the plugin imports with ``hydratrain`` made unimportable."""
    code = ("import sys; sys.modules['hydratrain'] = None\n"
            "import hydra_plugins.hydratrain_launcher.config, hydra_plugins.hydratrain_launcher.torchrun_launcher\n"
            "import hydra_plugins.hydratrain_launcher._core, hydra_plugins.hydratrain_launcher._checks\n"
            "print('ok', [m for m in sys.modules if m.startswith('hydratrain')])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "ok ['hydratrain']" in proc.stdout, proc.stderr[-3000:]


# ------------------------------------------------------------------------- Hydra's launcher test suites
@pytest.mark.slow  # 9 tests, ~30 s on 2 busy cores
@pytest.mark.parametrize("launcher_name, overrides", [("torchrun", [])])
class TestTorchrunLauncher(LauncherTestSuite):
    pass


@pytest.mark.slow  # 11 tests, each a subprocess, ~60 s on 2 busy cores
@pytest.mark.parametrize("task_launcher_cfg, extra_flags", [({}, FLAGS)])
class TestTorchrunLauncherIntegration(IntegrationTestSuite):
    pass


# two suite tests on their own (~4 s each): a 2-job sweep in-process (slow: the same test as
# TestTorchrunLauncher::test_sweep_2_jobs), and a job dir given on the command line honoured by a subprocess app (not in
# the suites; in the default selection)
@pytest.mark.slow
@pytest.mark.usefixtures("hydra_restore_singletons")
def test_suite_sweep_2_jobs(hydra_sweep_runner, tmpdir):
    sweep_2_jobs(hydra_sweep_runner, overrides=["hydra/launcher=torchrun"], task_function=None, temp_dir=tmpdir)


@pytest.mark.slow
@pytest.mark.usefixtures("hydra_restore_singletons")
def test_suite_sweep_dir_from_the_command_line(tmpdir):
    integration_test(tmpdir=Path(tmpdir), task_config={}, prints="os.getcwd()",
                     overrides=FLAGS + ["hydra.sweep.dir=cli_dir", "hydra.sweep.subdir=cli_dir_${hydra.job.num}",
                                        "hydra.job.chdir=True"],
                     expected_outputs=str(Path(tmpdir) / "cli_dir" / "cli_dir_0"))


# ------------------------------------------------------------------------- tests/plugin_app
def _task(cfg):
    """The test app's task: fails as ``cfg.fail`` says, else returns where it ran."""
    if cfg.fail == "raise":
        raise ValueError("boom (test)")
    if cfg.fail == "oom":
        from hydratrain.errors import OutOfMemoryError

        raise OutOfMemoryError("injected (test)")
    if cfg.fail == "kill":  # rank 1 dies; rank 0 waits as if in a collective with it, until the agent stops it
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)
    (Path(os.environ["TEST_MARKS"]) / f"ran_job{HydraConfig.get().job.num}_rank{os.environ['RANK']}").touch()
    return {"rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}


def _sweep(hydra_sweep_runner, tmp_path, overrides):
    return hydra_sweep_runner(calling_file=__file__, calling_module=None, task_function=_task,
                              config_path=PLUGIN_APP, config_name="config", overrides=overrides,
                              temp_dir=tmp_path / "sweep")


@pytest.mark.slow
@pytest.mark.usefixtures("hydra_restore_singletons")
def test_each_job_gets_its_own_settings_from_its_config(hydra_sweep_runner, tmp_path, monkeypatch):
    """The app maps ``n`` onto ``hydra.launcher.nproc_per_node``; a sweep over n gives each job its own world."""
    monkeypatch.setenv("TEST_MARKS", str(tmp_path))
    with _sweep(hydra_sweep_runner, tmp_path, ["n=2,1"]) as sweep:
        rets = sweep.returns[0]
        assert [r.return_value for r in rets] == [{"rank": 0, "world_size": 2}, {"rank": 0, "world_size": 1}]
        assert [r.overrides for r in rets] == [["n=2"], ["n=1"]]
        assert [r.cfg.n for r in rets] == [2, 1] and "hydra" not in rets[0].cfg
        assert sorted(p.name for p in tmp_path.glob("ran_*")) == ["ran_job0_rank0", "ran_job0_rank1", "ran_job1_rank0"]


@pytest.mark.slow
@pytest.mark.usefixtures("hydra_restore_singletons")
def test_failed_jobs_are_returned_and_reported_to_callbacks_and_the_sweep_goes_on(hydra_sweep_runner, tmp_path,
                                                                                   monkeypatch):
    """Job 1 fails the app's check, job 2's check tries to change its config, job 3's task raises on both ranks,
    job 4's rank 1 dies, job 5's ranks run out of memory (a hydratrain error: the worker exits with its status, 6,
    not 1 with torch's traceback); jobs 0 and 6 complete. Failed jobs reach ``on_job_end`` in the launcher process
    once each, with the reason; 1 and 2 never start a worker; the basic sweeper raises the first failure at the
    end; torch's traceback of its own wait for the failed workers is not logged (the reasons say it all)."""
    import logging

    monkeypatch.setenv("TEST_MARKS", str(tmp_path))
    elastic, logged = logging.getLogger("torch.distributed.elastic.multiprocessing.api"), []
    handler = logging.Handler()
    handler.emit = logged.append
    elastic.addHandler(handler)
    try:
        with pytest.raises(ValueError, match="fail=check: rejected by the app's job check"):
            with _sweep(hydra_sweep_runner, tmp_path, ["n=2", "fail=none,check,mutate,raise,kill,oom,none"]):
                pass
    finally:
        elastic.removeHandler(handler)
    ran = {p.name for p in tmp_path.glob("ran_*")}
    assert ran == {f"ran_job{j}_rank{r}" for j in (0, 6) for r in (0, 1)}, ran
    records = [json.loads(line) for line in (tmp_path / "sweep" / "callbacks.jsonl").read_text().splitlines()]
    here = [r for r in records if r["pid"] == os.getpid()]
    assert [r["num"] for r in here] == [1, 2, 3, 4, 5], here
    assert all(r["status"] == "FAILED" and r["config_num"] == r["num"] and r["output_dir_exists"] for r in here)
    assert [r["output_dir"] for r in here] == [str(tmp_path / "sweep" / str(n)) for n in (1, 2, 3, 4, 5)]
    errors = [r["error"] for r in here]
    assert errors[0] == "ValueError: fail=check: rejected by the app's job check"
    assert errors[1].startswith("ReadonlyConfigError: Cannot change read-only config container")
    assert errors[2].startswith("LaunchError: job #3: rank ") and "ValueError: boom (test)" in errors[2]
    assert errors[3].startswith("LaunchError: job #4: rank 1 failed") and "SIGKILL" in errors[3]
    assert errors[4].startswith("LaunchError: job #5: rank ") and errors[4].endswith(
        "OutOfMemoryError: injected (test) (exit status 6)"), errors[4]
    assert not [r for r in logged if r.levelno >= logging.ERROR], [r.getMessage() for r in logged]
    # workers ran the callback themselves for the jobs they ran to the end of run_job (0, 3, 5 on both ranks)
    in_workers = sorted((r["num"], r["rank"], r["status"]) for r in records if r["pid"] != os.getpid())
    assert in_workers == [(n, rank, s) for n, s in ((0, "COMPLETED"), (3, "FAILED"), (5, "FAILED"), (6, "COMPLETED"))
                          for rank in ("0", "1")]


@pytest.mark.usefixtures("hydra_restore_singletons")
def test_bad_setting_fails_the_job_naming_the_key(hydra_sweep_runner, tmp_path, monkeypatch):
    monkeypatch.setenv("TEST_MARKS", str(tmp_path))
    with pytest.raises(LauncherConfigError, match=r"^hydra.launcher.nproc_per_node=0: must be >= 1$"):
        with _sweep(hydra_sweep_runner, tmp_path, ["n=0"]):
            pass
    assert not list(tmp_path.glob("ran_*"))


@pytest.mark.slow  # ~12 s
def test_a_rendezvous_that_fails_at_once_says_why_and_not_that_it_timed_out(tmp_path):
    """One node with 10 file descriptors (``ulimit -n 10``): the rendezvous store cannot bind, and the job fails
    within a second. Its line was "no rendezvous with all 1 node(s) within hydra.launcher.rdzv_timeout=600 s (is node
    0 running the same sweep?): RendezvousConnectionError: ... See inner exception for details.", the inner exception
    shown nowhere; now it says that the rendezvous failed, and why. (With 12, the store may bind and
    its client retry until the rendezvous timeout, 30 s here.)"""
    import resource

    app = tmp_path / "app.py"
    app.write_text("import sys\n\nimport hydra\n\n"
                   f"sys.path.insert(0, {str(Path(PLUGIN_APP).parent)!r})  # _plugin_app\n\n\n"
                   f"@hydra.main(version_base=None, config_path={PLUGIN_APP!r}, config_name='config')\n"
                   "def main(cfg):\n    return 0\n\n\nmain()\n")
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    proc = subprocess.run([sys.executable, str(app), "-m", "n=2", "hydra.launcher.rdzv_timeout=30",
                           f"hydra.sweep.dir={tmp_path / 'sweep'}"], capture_output=True, text=True, timeout=300,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (10, hard)))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    error = json.loads((tmp_path / "sweep" / "callbacks.jsonl").read_text().splitlines()[0])["error"]
    assert error.startswith("LaunchError: job #0: hydra.launcher.rdzv_endpoint=None: the rendezvous of 1 node(s) "
                            "failed: RendezvousConnectionError: "), error
    assert "; caused by " in error and "too many open files" in error.lower(), error
    assert "rdzv_timeout" not in out and "running the same sweep" not in out and error in out, out[-3000:]
