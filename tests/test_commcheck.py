"""``python -m torch.distributed.run ... -m hydratrain.commcheck`` on 2 and 4 gloo ranks: bandwidth table, bus
bandwidth factors, a rank made slow on purpose is flagged (and none in a normal run), a frozen or killed rank ends
every rank within commcheck.timeout_s. Plus the config parser, the pairing schedule and the scoring in-process."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from hydratrain import commcheck
from hydratrain.commcheck import lower_median, main, parse_args, round_robin, score_ranks

SMALL = ["commcheck.min_bytes=1K", "commcheck.max_bytes=1M"]  # 6 sizes per collective: a run takes seconds
ROW = re.compile(r"^(all_reduce|all_gather|reduce_scatter)\s+([\d.]+ \w+)\s+([\d.]+)\s+([\d.e+-]+)\s+([\d.e+-]+)$")
RANK_ROW = re.compile(r"^\s+(\d+)\s+\S+\s+([\d.]+)\s+([\d.e+-]+)\s+([\d.]+)x(  SLOW)?$")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "SLURM_", "SUBMITIT_"))
           and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def _torchrun(nproc: int, args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                             str(nproc), "-m", "hydratrain.commcheck", *args], env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"no exit within {timeout} s:\n{proc.communicate()[0][-3000:]}")
    return proc.returncode, out


def _check_table(out: str, n: int) -> list[tuple[int, float, bool]]:
    """Assert the collective table is complete and consistent; return the per-rank rows (rank, x median, SLOW)."""
    rows = [ROW.match(line).groups() for line in out.splitlines() if ROW.match(line)]
    assert {r[0] for r in rows} == {"all_reduce", "all_gather", "reduce_scatter"} and len(rows) == 18, out
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n}
    for coll, _, t, algbw, busbw in rows:
        assert float(t) > 0 and float(algbw) > 0 and float(busbw) > 0, out
        assert float(busbw) / float(algbw) == pytest.approx(factor[coll], rel=2e-3), (coll, algbw, busbw)
    ranks = [(int(m[1]), float(m[4]), bool(m[5])) for m in map(RANK_ROW.match, out.splitlines()) if m]
    assert [r[0] for r in ranks] == list(range(n)), out
    return ranks


@pytest.mark.parametrize("n", [2, 4])
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


@pytest.mark.parametrize("n", [2, 4])
def test_slow_rank_is_flagged(n):
    slow = n - 1
    args = ["commcheck.min_bytes=64K", "commcheck.max_bytes=1M", "commcheck.iters=10", "commcheck.warmup=2",
            f"commcheck.debug_slow_rank={slow}", "commcheck.debug_delay_s=0.02"]
    rc, out = _finish(_torchrun(n, args), timeout=120)
    assert rc != 0, out  # every rank exits 1; torchrun reports it
    ranks = {r: (x, flagged) for r, x, flagged in
             [(int(m[1]), float(m[4]), bool(m[5])) for m in map(RANK_ROW.match, out.splitlines()) if m]}
    assert sorted(ranks) == list(range(n)), out
    assert ranks[slow][1] and ranks[slow][0] >= 2, out
    assert not any(flagged for r, (_, flagged) in ranks.items() if r != slow), out
    assert re.search(rf"^verdict: SLOW: rank {slow} \(\S+\) [\d.]+x the median", out, re.M), out
    assert "exitcode  : 1" in out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_frozen_rank_ends_every_rank_within_timeout():
    """Rank 1 of 3 freezes (SIGSTOP: alive, sockets open, like a hung GPU or a lost node): ranks 0 and 2, started
    as torchrun starts workers but without its agent (which would tear them down itself), must each end
    themselves within timeout_s, naming the step they were stuck in."""
    n, timeout_s, port = 3, 6, _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "hydratrain.commcheck", *SMALL, "commcheck.debug_hang_rank=1",
                               f"commcheck.timeout_s={timeout_s}"],
                              env=_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
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


# ---- in-process: config, schedule, scoring -------------------------------------------------------------------


def test_config_errors_are_one_line(capsys, monkeypatch):
    c = parse_args(["commcheck.max_bytes=1G", "commcheck.min_bytes=4KiB", "commcheck.timeout_s=30"])
    assert (c.max_bytes, c.min_bytes, c.timeout_s, c.iters) == (2**30, 4096, 30.0, 20)
    for argv, msg in [(["commcheck.itrs=5"], "commcheck.itrs=5: unknown key (keys: commcheck.min_bytes, "),
                      (["commcheck.iters=x"], "commcheck.iters=x: Value 'x' of type 'str' could not be converted"),
                      (["commcheck.max_bytes=lots"], "commcheck.max_bytes=lots: a size in bytes"),
                      (["commcheck.min_bytes=2M", "commcheck.max_bytes=1M"], "commcheck.min_bytes=2M: must be <="),
                      (["commcheck.iters=[1"], "commcheck.iters=[1: while parsing"), (["iters"], "iters: expected"),
                      (["commcheck.backend=nccl2"], "commcheck.backend=nccl2: must be nccl, gloo or mpi")]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("hydratrain: config error: " + msg) and err.count("\n") == 1, err
    assert main(["--help"]) == 0 and "timeout_s: float = 120.0  # seconds one call" in capsys.readouterr().out
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main([]) == 2 and "needs 2 or more ranks" in capsys.readouterr().err


@pytest.mark.parametrize("n", range(2, 9))
def test_round_robin_pairs_every_rank_with_every_other_once(n):
    rounds = round_robin(n)
    assert len(rounds) == n - 1 + n % 2
    seen = set()
    for pairs in rounds:
        assert all(pairs[pairs[r]] == r != pairs[r] for r in pairs) and len(pairs) >= n - 1
        seen |= {frozenset((a, b)) for a, b in pairs.items()}
    assert len(seen) == n * (n - 1) // 2


def _records(n: int, own, wire) -> list[dict]:
    """Synthetic gathered records: ``own(r)`` and ``wire(r, partner)`` give seconds for 5 exchanges."""
    return [{"rank": r, "node": f"h{r // 2}", "pairs": [(k, p[r], [own(r)] * 5, [wire(r, p[r])] * 5)
                                                         for k, p in enumerate(round_robin(n)) if r in p]}
            for r in range(n)]


def test_scoring_singles_out_a_late_rank_and_a_slow_link_end():
    # rank 1 is late by 10 ms each exchange: its partners wait (long wire) but are not charged for it
    late = score_ranks(_records(4, lambda r: 0.01 if r == 1 else 0.0,
                                lambda r, p: 0.001 + (0.01 if p == 1 else 0.0)), 2.0)
    assert late["slow"] == [1] and late["time"][0] == pytest.approx(0.001)
    # rank 3's link is 5x slower in both directions: its partners see it too, but only with rank 3
    link = score_ranks(_records(4, lambda r: 0.0, lambda r, p: 0.005 if 3 in (r, p) else 0.001), 2.0)
    assert link["slow"] == [3] and link["slow_nodes"] == []
    # two nodes (h0: ranks 0-1, h1: ranks 2-3), both ranks of h1 late: the node is flagged
    node = score_ranks(_records(4, lambda r: 0.01 if r >= 2 else 0.0, lambda r, p: 0.001), 2.0)
    assert node["slow"] == [2, 3] and node["slow_nodes"] == ["h1"]
    assert lower_median([3, 1, 2, 4]) == 2 and commcheck.human(3 * 2**20) == "3 MiB"
