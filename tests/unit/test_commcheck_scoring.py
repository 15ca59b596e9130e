"""hydratrain.commcheck in this process: the config parser's one-line errors, the round-robin pairing schedule and
the scoring that singles out a late rank, a slow link end or a slow node. (Runs on 2-4 gloo ranks:
tests/e2e/test_commcheck.py.)"""
from __future__ import annotations

import pytest

from hydratrain import commcheck
from hydratrain.commcheck import lower_median, main, parse_args, round_robin, score_ranks


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
    monkeypatch.setenv("RANK", "1")  # the same arguments on every rank: rank 0 alone says what is wrong
    assert main(["commcheck.itrs=5"]) == 2 and capsys.readouterr().err == ""
    monkeypatch.delenv("RANK")
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


def test_an_out_file_that_cannot_be_written_is_refused_before_the_check(tmp_path, monkeypatch, capsys):
    """Like export's OUT: the JSON-lines file rank 0 writes at the end is checked first, one line and
    status 2, instead of a failure after the whole check."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    (tmp_path / "afile").write_text("x")
    for out, why in ((tmp_path / "afile" / "c.jsonl", "File exists"), (tmp_path, "is a directory")):
        assert main([f"commcheck.out={out}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"hydratrain: commcheck: out={out}: cannot write it ({why}: ") and err.count("\n") == 1
