"""``python -m torch.distributed.run ... -m hydratrain.commcheck`` on 2 and 4 gloo ranks: bandwidth table, bus
bandwidth factors, a rank made slow on purpose is flagged (and none in a normal run), a frozen or killed rank ends
every rank within commcheck.timeout_s. (The config parser, the pairing schedule and the scoring, in-process:
tests/unit/test_commcheck_scoring.py.) The 2-rank normal run and the 4-rank slow-rank run are the default selection;
the other two are marked slow."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from helpers import clean_env, finish, free_port, spawn

SMALL = ["commcheck.min_bytes=1K", "commcheck.max_bytes=1M"]  # 6 sizes per collective: a run takes seconds
ROW = re.compile(r"^(all_reduce|all_gather|reduce_scatter)\s+([\d.]+ \w+)\s+([\d.]+)\s+([\d.e+-]+)\s+([\d.e+-]+)$")
RANK_ROW = re.compile(r"^\s+(\d+)\s+\S+\s+([\d.]+)\s+([\d.e+-]+)\s+([\d.]+)x(  SLOW)?$")


def _torchrun(nproc: int, args: list[str]) -> subprocess.Popen:
    return spawn([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), "-m",
                  "hydratrain.commcheck", *args])


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    r = finish(proc, timeout)
    return r.returncode, r.output


def _check_table(out: str, n: int, sizes: int = 6) -> list[tuple[int, float, bool]]:
    """Assert the collective table is complete (``sizes`` rows per collective) and consistent; return the per-rank
    rows (rank, x median, SLOW)."""
    rows = [ROW.match(line).groups() for line in out.splitlines() if ROW.match(line)]
    assert {r[0] for r in rows} == {"all_reduce", "all_gather", "reduce_scatter"} and len(rows) == 3 * sizes, out
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n}
    for coll, _, t, algbw, busbw in rows:
        assert float(t) > 0 and float(algbw) > 0 and float(busbw) > 0, out
        assert float(busbw) / float(algbw) == pytest.approx(factor[coll], rel=2e-3), (coll, algbw, busbw)
    ranks = [(int(m[1]), float(m[4]), bool(m[5])) for m in map(RANK_ROW.match, out.splitlines()) if m]
    assert [r[0] for r in ranks] == list(range(n)), out
    return ranks


@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_normal_run_flags_nobody(n, tmp_path):
    out_file = tmp_path / "cc.jsonl"
    rc, out = _finish(_torchrun(n, SMALL + [f"commcheck.out={out_file}"]), timeout=120)
    assert rc == 0, out
    assert f"commcheck: {n} ranks on 1 node(s), backend gloo, device cpu" in out
    assert re.search(r"^barrier: median [\d.]+ us", out, re.M), out
    assert not [r for r in _check_table(out, n) if r[2]], out
    assert re.search(rf"^verdict: OK: {n} ranks within [\d.]+x of the median \(threshold 2x\)$", out, re.M), out
    # every rank's figures, exactly: busbw = algbw x the nccl-tests factor, one time per rank
    lines = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert lines[0]["kind"] == "run" and lines[0]["ok"] and lines[0]["world_size"] == n
    colls = [x for x in lines if x["kind"] == "collective"]
    assert len(colls) == 18 and all(len(x["rank_time_s"]) == n for x in colls)
    for x in colls:
        f = 2 * (n - 1) / n if x["collective"] == "all_reduce" else (n - 1) / n
        assert x["busbw_gbps"] == pytest.approx(x["algbw_gbps"] * f, rel=1e-12)
        assert x["algbw_gbps"] == pytest.approx(x["bytes"] / x["time_s"] / 1e9, rel=1e-12)
        assert x["time_s"] == max(x["rank_time_s"]) > 0
    assert sorted(x["rank"] for x in lines if x["kind"] == "rank") == list(range(n))


@pytest.mark.parametrize("n", [pytest.param(2, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_slow_rank_is_flagged(n):
    slow = n - 1
    args = ["commcheck.min_bytes=64K", "commcheck.max_bytes=1M", "commcheck.iters=10", "commcheck.warmup=2",
            f"commcheck.debug_slow_rank={slow}", "commcheck.debug_delay_s=0.02"]
    rc, out = _finish(_torchrun(n, args), timeout=120)
    assert rc != 0, out  # every rank exits 1; torchrun reports it
    ranks = {r: (x, flagged) for r, x, flagged in _check_table(out, n, sizes=3)}  # 64 KiB, 256 KiB, 1 MiB
    assert sorted(ranks) == list(range(n)), out
    assert ranks[slow][1] and ranks[slow][0] >= 2, out
    assert not any(flagged for r, (_, flagged) in ranks.items() if r != slow), out
    assert re.search(rf"^verdict: SLOW: rank {slow} \(\S+\) [\d.]+x the median", out, re.M), out
    assert "exitcode  : 1" in out


@pytest.mark.slow  # a sibling of it runs by default; CI runs this too (default suite near 4 minutes)
def test_frozen_rank_ends_every_rank_within_timeout():
    """Rank 1 of 3 freezes (SIGSTOP: alive, sockets open, like a hung GPU or a lost node): ranks 0 and 2, started
    as torchrun starts workers but without its agent (which would tear them down itself), must each end
    themselves within timeout_s, naming the step they were stuck in."""
    n, timeout_s, port = 3, 6, free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "hydratrain.commcheck", *SMALL, "commcheck.debug_hang_rank=1",
                               f"commcheck.timeout_s={timeout_s}"],
                              env=clean_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
                                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(n)]
    try:
        assert any("stops itself before all_gather" in line for line in procs[1].stderr)
        stopped = time.monotonic()
        for r in (0, 2):
            rc, err = procs[r].wait(timeout=timeout_s + 15), procs[r].stderr.read()
            assert time.monotonic() - stopped < timeout_s + 10, err
            # the watchdog (124), or a peer's exit seen as a closed connection (1): both name the step
            assert rc in (124, 1) and "step 'all_gather 1020 B'" in err, (rc, err)  # 1 KiB rounded to 4n
    finally:
        for p in procs:
            p.kill()
            p.communicate()


@pytest.mark.slow  # fail-fast of a killed rank stays in the default suite in test_fail_fast.py
def test_killed_rank_ends_the_torchrun_job():
    """A rank SIGKILLed mid-run (its sockets close): the job ends non-zero promptly."""
    proc = _torchrun(2, SMALL + ["commcheck.debug_hang_rank=1", "commcheck.timeout_s=5"])
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while not any("stops itself" in x for x in lines) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        line = next(x for x in lines if "stops itself" in x)
        os.kill(int(re.search(r"pid (\d+)", line)[1]), signal.SIGKILL)
        killed = time.monotonic()
        rc = proc.wait(timeout=5 + 15)
        out = "".join(lines)
        assert rc != 0 and time.monotonic() - killed < 5 + 10, out
        # rank 0 saw the closed connection and said where, or torchrun ended it first
        assert "rank 0: step 'all_gather 1 KiB' failed" in out or "exitcode  : -15" in out, out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        reader.join(5)
