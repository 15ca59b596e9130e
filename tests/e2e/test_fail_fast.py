"""A rank that raises, dies or falls silent takes the whole job down within distributed.failure_timeout_s, with its
error on the console and in its log; elastic restarts then resume from the last checkpoint."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import time

import pytest

from helpers import FAULTY, command, finish, free_port, log_of, results, run, spawn
from hydratrain.errors import EXIT_OOM, EXIT_PEER_FAILED

RAISE_AT_3 = {"HT_FAULT": "raise", "HT_FAULT_STEP": "3", "HT_FAULT_RANK": "1"}
SILENT_AT_3 = {"HT_FAULT": "stop", "HT_FAULT_STEP": "3", "HT_FAULT_RANK": "1"}
LONG = ["trainer.max_steps=400", "trainer.eval_every_n_steps=0", "checkpoint.every_n_steps=0"]


def _exit_after_fault(run_dir, finished_at: float) -> float:
    marker = next(run_dir.glob("fault_rank*_step*"))
    return finished_at - marker.stat().st_mtime


@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_a_rank_that_raises_ends_every_rank_fast_and_shows_its_error(tmp_path, strategy):
    """Rank 0 is slow to unwind the collective rank 1's exit broke (2 s, as under load): torchrun's SIGTERM, sent as
    soon as rank 1 has exited, must not kill it before its log says why it stopped."""
    r = run([f"strategy={strategy}", *LONG, "distributed.failure_timeout_s=30"], tmp_path, nproc=2, script=FAULTY,
            env={**RAISE_AT_3, "HT_SLOW_FAILURE": "0:2"}, timeout=240)
    took = _exit_after_fault(tmp_path, time.time())
    assert r.returncode != 0 and took < 30, (took, r.output[-3000:])
    assert "RuntimeError: injected fault on rank 1 at step 3" in r.output  # on the console
    assert "injected fault on rank 1 at step 3" in log_of(tmp_path, 1)  # and in the failing rank's log
    log0 = log_of(tmp_path, 0)
    assert "rank 1: RuntimeError: injected fault on rank 1 at step 3" in log0, log0[-2000:]  # rank 0 says why
    assert "step 4/" not in log0


@pytest.mark.slow  # a sibling of it runs by default; CI runs this too (default suite near 4 minutes)
def test_a_divergence_every_rank_sees_alike_exits_as_a_divergence_on_every_rank(tmp_path):
    """fsdp (DTensor shards, fused AdamW dropping the update on the device) on real text, where each rank's loss
    differs: the guard decides from the same global gradient norm on every rank, so every rank raises a
    DivergenceError (each naming its own loss); none may report it as "another rank failed first" (exit 5),
    whichever recorded it first. (torchrun may still SIGTERM the rank that exits second: its own race.)"""
    r = run(["data=python_stdlib", "strategy=fsdp", "precision=fp32", "optim.lr=100", "scheduler=constant",
             "trainer.log_every_n_steps=5"], tmp_path, nproc=2, timeout=240)
    assert r.returncode != 0 and "exitcode  : 5" not in r.output, r.output[-3000:]
    # alike on both ranks: said once; torchrun's summary quotes it as each rank's traceback
    assert [ln.startswith("hydratrain: diverged:") for ln in r.output.splitlines()].count(True) == 1, r.output[-3000:]
    assert "traceback : hydratrain: diverged: non-finite gradient norm" in r.output, r.output[-3000:]
    for rank in (0, 1):
        log = log_of(tmp_path, rank)
        assert "hydratrain: diverged: non-finite gradient norm (nan) at step 2 (loss " in log, log[-2000:]
        assert "every update after it up to step 5, was not applied" in log and "failed first" not in log


def _spawn_ranks(args, env, port, n=2):
    """The ranks of a job started as torchrun starts workers but without its agent, which would SIGTERM the other
    ranks as soon as one has exited: each rank's own exit status is then seen."""
    return [spawn(command(args, script=FAULTY),
                  env={**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}) for r in range(n)]


@pytest.mark.slow  # a sibling of it runs by default; CI runs this too (default suite near 4 minutes)
def test_ranks_that_run_out_of_memory_one_after_another_each_exit_6(tmp_path):
    """Rank 1 runs out of memory at step 3 and records it first; rank 0 runs out 2 s later, while its failure
    watch is waiting for rank 1 to leave. Rank 0's own out-of-memory error is not a consequence of rank 1's: it
    exits 6 with its own message, not 5 ("another rank failed first")."""
    env = {"HT_FAULT": "oom", "HT_FAULT_STEP": "3", "HT_FAULT_RANK": "all", "HT_FAULT_DELAY": "0:2"}
    procs = _spawn_ranks(["strategy=ddp", *LONG, "distributed.failure_timeout_s=20", f"hydra.run.dir={tmp_path}"],
                         env, free_port())
    try:
        r1, r0 = finish(procs[1], timeout=180), finish(procs[0], timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    assert (r0.returncode, r1.returncode) == (EXIT_OOM, EXIT_OOM), (r0.output[-3000:], r1.output[-2000:])
    log0 = log_of(tmp_path, 0)
    assert "hydratrain: out of memory: CUDA out of memory (injected on rank 0 at step 3)" in log0, log0[-2000:]
    assert "failed first" not in log0 and "stopping rank" not in log0


def test_a_killed_rank_is_named_by_the_survivor_which_exits_5(tmp_path):
    """SIGKILL on rank 1 (what the kernel's OOM killer does): rank 0's collective fails at once with gloo's
    "Connection reset by peer"; rank 0 must not report that symptom as its own failure (exit 1, a traceback) but
    find the rank whose heartbeat stopped and exit 5 naming it."""
    kill = {"HT_FAULT": "kill", "HT_FAULT_STEP": "3", "HT_FAULT_RANK": "1"}
    procs = _spawn_ranks(["strategy=ddp", *LONG, "distributed.failure_timeout_s=20", f"hydra.run.dir={tmp_path}"],
                         kill, free_port())
    try:
        r0 = finish(procs[0], timeout=180)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    log0 = log_of(tmp_path, 0)
    assert r0.returncode == EXIT_PEER_FAILED and "Traceback" not in r0.output, r0.output[-3000:]
    assert "another rank failed first (rank 1 stopped responding" in log0, log0[-2000:]
    assert "rank 0 failed" not in log0


@pytest.mark.slow  # a sibling of it runs by default; CI runs this too (default suite near 4 minutes)
def test_a_silent_rank_is_found_by_its_heartbeat(tmp_path):
    """SIGSTOP on rank 1 (alive, sockets open, nothing said: what a dead peer behind NCCL looks like): rank 0, stuck
    in a collective, stops itself within failure_timeout_s with exit status 5 and says which rank went silent.

    The two ranks are started as torchrun starts workers but without its agent, which would need its 30 s SIGTERM
    grace to get rid of the stopped process: the test kills it as soon as rank 0 has exited."""
    procs = _spawn_ranks(["strategy=ddp", *LONG, "distributed.failure_timeout_s=10", f"hydra.run.dir={tmp_path}"],
                         SILENT_AT_3, free_port())
    try:
        r0 = finish(procs[0], timeout=180)
        exited_at = time.time()
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    took = _exit_after_fault(tmp_path, exited_at)
    assert r0.returncode == EXIT_PEER_FAILED and took < 10, (took, r0.output[-3000:])
    assert (tmp_path / "fault_rank1_step3").exists()
    assert "rank 1 stopped responding" in log_of(tmp_path, 0), log_of(tmp_path, 0)[-2000:]


@pytest.mark.slow
def test_launcher_restart_resumes_after_an_exception(tmp_path):
    """launcher=torchrun with max_restarts=1: rank 1 raises at step 3 on the first attempt; the agent restarts both
    workers, which resume from the step-2 checkpoint and finish."""
    sweep = tmp_path / "sweep"
    r = run(["launcher=torchrun", "launcher.nproc_per_node=2", "strategy=fsdp", "trainer.max_steps=6",
             "checkpoint.every_n_steps=2", "launcher.max_restarts=1", f"hydra.sweep.dir={sweep}"], script=FAULTY,
            env=RAISE_AT_3, cwd=tmp_path, timeout=300).ok()
    job = sweep / "0"
    assert (job / "fault_rank1_step3").exists() and results(job)["steps"] == 6, r.output[-3000:]
    assert "resumed from" in log_of(job) and "step_00000002: step 2 " in log_of(job)


def test_ranks_launched_with_different_configs_stop_before_training(tmp_path):
    """Two nodes' commands that differ (a stale command, an edited config file, an ${oc.env:...} that differs per
    node) used to train together without a word: each DDP replica took its own lr's steps, and the logged losses
    averaged two different models. Every rank now stops before any process group with one line naming the key."""
    port = free_port()
    procs = [spawn(command(["strategy=ddp", "trainer.max_steps=3", f"optim.lr={lr}", f"hydra.run.dir={tmp_path}"]),
                   env={"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for r, lr in enumerate(("1e-3", "5e-2"))]
    r0, r1 = (finish(p, timeout=180) for p in procs)
    assert (r0.returncode, r1.returncode) == (2, 2), (r0.output[-3000:], r1.output[-3000:])
    assert ("hydratrain: config error: optim.lr=0.001: rank 1 has optim.lr=0.05: every rank, on every node, must be "
            "launched with the same command and config files") in r0.output, r0.output[-3000:]
    assert "config error" not in r1.output and "process group:" not in r0.output + r1.output


def _two_nodes(tmp_path, per_rank: list) -> tuple:
    """Ranks 0 and 1 of one job, each its own node (LOCAL_RANK 0), started with the shared overrides + its own."""
    port = free_port()
    procs = [spawn(command(["strategy=ddp", "trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'run'}", *extra]),
                   env={"RANK": str(r), "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                        "HYDRATRAIN_CACHE": str(tmp_path / f"cache{r}")})
             for r, extra in enumerate(per_rank)]
    return tuple(finish(p, timeout=180) for p in procs)


@pytest.mark.slow  # three 2-rank launches; like the other simulated multi-node tests
def test_nodes_whose_per_node_inputs_differ_stop_with_one_line(tmp_path):
    """Data and weight paths may differ per node (node-local copies), so the config check exempts them; but a node
    given init_from when the other is not skipped the load's collectives (every rank hung for
    collective_timeout_s), and copies of the data that differ had each node train on its own corpus without a word.
    Whether such a path is given is compared with the config; the data itself by its fingerprint."""
    one, two = tmp_path / "one.txt", tmp_path / "two.txt"
    one.write_text("the same words again and again. " * 800)
    two.write_text("other words, another corpus here! " * 800)
    text = ["data=text_files", "data.val_fraction=0.5"]
    r0, r1 = _two_nodes(tmp_path, [[*text, f"data.paths=[{one}]"], [*text, f"data.paths=[{two}]"]])
    assert (r0.returncode, r1.returncode) == (2, 2), (r0.output[-3000:], r1.output[-3000:])
    assert f"hydratrain: config error: data.paths=['{one}']: rank 1 read other data than rank 0 (train " in r0.output
    assert "every rank, on every node, must read the same data" in r0.output and "step 1/" not in r0.output
    (tmp_path / "w.safetensors").write_bytes(b"")  # exists (checked before the ranks compare configs); never read
    r0, r1 = _two_nodes(tmp_path, [[f"model.init_from={tmp_path / 'w.safetensors'}"], []])
    assert (r0.returncode, r1.returncode) == (2, 2), (r0.output[-3000:], r1.output[-3000:])
    assert "hydratrain: config error: model.init_from='<given>': rank 1 has model.init_from=None" in r0.output, \
        r0.output[-3000:]


@pytest.mark.slow  # 2 single-process runs make the two weights files; its sibling above runs by default
def test_nodes_given_different_weights_to_start_from_stop_before_loading_them(tmp_path):
    """model.init_from naming another file on each node (or a stale node-local copy) was refused only after the
    load, as "21 loaded shards differ from the file (rank 0: [])", naming neither the rank nor the cause; and
    checkpoint.resume_from naming another run's checkpoint of the same step on each node trained a spliced model
    (each rank loaded its own shards, optimizer state and data position) and exited 0."""
    for seed in (1, 2):
        run(["strategy=single", "trainer.max_steps=1", "trainer.save_weights=true", f"trainer.seed={seed}",
             "checkpoint.every_n_steps=1"], tmp_path / f"w{seed}").ok()
    r0, r1 = _two_nodes(tmp_path, [[f"checkpoint.resume_from={tmp_path / f'w{r}' / 'checkpoints'}"] for r in (1, 2)])
    assert (r0.returncode, r1.returncode) == (3, 3), (r0.output[-3000:], r1.output[-3000:])
    assert (f"hydratrain: checkpoint error: ranks found different checkpoints to resume from (rank 0: "
            f"{tmp_path / 'w1' / 'checkpoints' / 'step_00000001'}; rank 1: ") in r0.output, r0.output[-3000:]
    r0, r1 = _two_nodes(tmp_path, [[f"model.init_from={tmp_path / f'w{r}' / 'model.safetensors'}"] for r in (1, 2)])
    assert (r0.returncode, r1.returncode) == (3, 3), (r0.output[-3000:], r1.output[-3000:])
    assert (f"hydratrain: checkpoint error: model.init_from={tmp_path / 'w1' / 'model.safetensors'}: rank 1's file "
            f"({tmp_path / 'w2' / 'model.safetensors'}: ") in r0.output, r0.output[-3000:]
    assert "must start from the same weights" in r0.output and "step 1/" not in r0.output


def _children(pid: int) -> list:
    return [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]


def _running(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow  # two 2-rank launches, ~20 s each
@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads the ranks' pids from /proc")
@pytest.mark.parametrize("launcher", ["torchrun", "launcher=torchrun"])
def test_ranks_stop_at_once_when_their_launcher_is_killed_and_a_relaunch_resumes(tmp_path, launcher):
    """``kill -9`` of torchrun (its agent passes no signal on): the ranks trained on until the failure watch noticed
    the lost store (~30 s with the default distributed.failure_timeout_s), wrote new checkpoints and pruned those of
    the kill, and a relaunch in that window was refused as "in use by another job". Now they stop at their next
    step, within seconds, the checkpoints stay as they were at the kill, the run dir is free, and the same command
    resumes from the newest of them. ``launcher=torchrun`` (killing the launching process) stops its workers at once
    too (torch's spawn gives them a parent-death SIGINT); keep that.

    Rank 1's teardown then hangs for good with the GIL held (``HT_HANG_TEARDOWN``), as freeing a gloo process group
    does when one of its worker threads waits for that GIL to finish a collective rank 0 left: no Python thread of
    rank 1 runs again, yet it too must be gone within seconds, its log saying where it hung."""
    plain = launcher == "torchrun"
    run_dir = tmp_path / "run" if plain else tmp_path / "sweep" / "0"
    # keep_last=0: a prune in flight when the kill lands would race the listing (the in-process test has the prune)
    args = ["strategy=ddp", "trainer.eval_every_n_steps=0", "checkpoint.every_n_steps=5", "checkpoint.keep_last=0",
            f"hydra.run.dir={run_dir}" if plain else f"hydra.sweep.dir={tmp_path / 'sweep'}",
            *([] if plain else ["launcher=torchrun", "launcher.nproc_per_node=2"])]
    cmd = command([*args, "trainer.max_steps=100000"], nproc=2 if plain else 1, script=FAULTY)
    proc = spawn(cmd, cwd=tmp_path, env={"HT_HANG_TEARDOWN": "1"})
    deadline = time.monotonic() + 180
    while not (run_dir / "checkpoints" / "step_00000015").is_dir():
        assert proc.poll() is None and time.monotonic() < deadline, finish(proc, 10).output[-3000:]
        time.sleep(0.05)
    ranks = _children(proc.pid)
    assert len(ranks) >= 2, ranks  # (the launching process of launcher=torchrun may hold helper children too)
    os.kill(proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    at_kill = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    in_flight = sorted(p.name.removeprefix(".tmp-") for p in (run_dir / "checkpoints").glob(".tmp-step_*"))
    try:
        while any(_running(r) for r in ranks) and time.monotonic() - killed < 30:
            time.sleep(0.05)
        took = time.monotonic() - killed
    finally:  # a rank left running holds the pipe open, and torchrun's workers are out of reach of finish's killpg
        for r in filter(_running, ranks):
            with contextlib.suppress(ProcessLookupError):
                os.kill(r, signal.SIGKILL)
    out = finish(proc, timeout=30).output
    assert took < 10, (took, out[-3000:])  # (old: ~30 s; a rank hung in its teardown: for good)
    log1 = log_of(run_dir, 1)
    hung = "Timeout (0:00:0" in log1 and "in destroy_process_group" in log1  # cut where it hung
    # launcher=torchrun's parent-death SIGINT may reach rank 1 before its teardown does: it then ends at once, its
    # KeyboardInterrupt cutting the teardown short before the hang (plain torchrun's agent sends no signal)
    assert hung or (not plain and "(KeyboardInterrupt followed)" in log1), log1[-3000:]
    # no save begun after the kill (one in flight at the kill may complete: its rename is atomic)
    after = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert set(at_kill) <= set(after) <= set(at_kill) | set(in_flight), (at_kill, in_flight, after)
    assert not (run_dir / "hydratrain.lock").exists()
    newest = int(after[-1][5:])
    again = finish(spawn(command([*args, f"trainer.max_steps={newest + 1}"], nproc=2 if plain else 1),
                         cwd=tmp_path), timeout=240)
    assert again.returncode == 0, again.output[-3000:]
    assert f"resumed from {run_dir}/checkpoints/{after[-1]}" in again.output, again.output[-3000:]


@pytest.mark.parametrize("override,line", [
    ("bad_key=1", "config error: Could not override 'bad_key': Key 'bad_key' not in 'TrainConfig'"),
    pytest.param("optim.lr=-1", "config error: optim.lr=-1.0: must be finite and > 0", marks=pytest.mark.slow),
])
def test_a_config_error_under_plain_torchrun_is_one_line_and_the_agents_root_cause(tmp_path, override, line):
    """``torchrun --nproc_per_node 2 train.py BAD=OVERRIDE``: Hydra's message was printed by every rank, unprefixed,
    and torch's summary said "To enable traceback see: ..." for rank 0's exit 1. Now one line, from rank 0, exit
    status 2, and the agent's summary names that line as the root cause (each rank's error file holds it). The agent
    itself (torch's code) still exits 1 with its ChildFailedError traceback: the docs recommend launcher=torchrun."""
    r = run([override, f"hydra.run.dir={tmp_path / 'r'}"], nproc=2, timeout=120)
    ours = [ln for ln in r.output.splitlines() if ln.startswith("hydratrain: ")]
    assert ours == [ln for ln in ours if ln.startswith(f"hydratrain: {line}")] and len(ours) == 1, r.output[-4000:]
    root = r.output.split("Root Cause (first observed failure):", 1)[1]
    # every rank finds the same error and writes it to its error file; the agent names the earliest file's rank, which
    # exited 2 or, when a peer exited first, was stopped by the agent (SIGTERM): either way the root cause is our line
    assert re.search(r"rank\s*: [01] \(local_rank: [01]\)\s*\n\s*exitcode\s*: (2|-15) ", root), root
    assert f"traceback : hydratrain: {line}" in root, root
    assert r.returncode == 1  # torchrun's own, whatever its workers' statuses
