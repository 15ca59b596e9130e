"""``torchrun ... -m hydratrain.commcheck [commcheck.KEY=VALUE ...]``: is the network between the ranks healthy?

Run it with the training job's launch command, e.g.::

    torchrun --standalone --nproc_per_node 8 -m hydratrain.commcheck
    torchrun --nnodes 2 --node_rank R --rdzv_backend c10d --rdzv_endpoint HOST:PORT --nproc_per_node 8 \\
        -m hydratrain.commcheck commcheck.max_bytes=1G commcheck.out=commcheck.jsonl

Backend nccl on CUDA, gloo on CPU (``commcheck.backend`` overrides). Units: seconds, bytes (KiB/MiB/GiB = powers of
1024), GB/s = 1e9 bytes/s. What it measures:

* **Barrier latency**: ``iters`` barriers, each timed alone.
* **all_reduce, all_gather, reduce_scatter** (float32, sum) for ``min_bytes``, ``min_bytes * factor``, ... up to
  ``max_bytes``, capped so that three buffers of the largest size fit in ``mem_fraction`` of the free memory (the
  GPU's; on CPU the available RAM shared by the node's ranks), rounded down to a multiple of ``4 * n`` bytes. Per
  size: ``warmup`` calls, a barrier, ``iters`` calls back to back; time = the slowest rank's mean per call. As in
  nccl-tests' doc/PERFORMANCE.md (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md), size is
  the whole array (all_gather's output, reduce_scatter's input), ``algbw = size / time`` and ``busbw = algbw x
  2(n-1)/n`` for all_reduce, ``algbw x (n-1)/n`` for all_gather and reduce_scatter: comparable with the link
  speed whatever n is.
* **Which rank or node is slow.** A collective ends at about the same moment on every rank, so its time cannot say
  who held it up. So the ranks also exchange ``rank_bytes`` pairwise, each with up to ``max_rounds`` partners
  from a round-robin schedule (circle method: n-1 rounds pair everyone with everyone once). A pass (each rank
  exchanges with each partner in turn) runs after every collective size, so samples spread over the whole run and
  a passing load burst hits few of them. Per exchange a rank records its *own* time (from its previous exchange
  to posting this one: where a late rank, an overloaded host or a slow launch, loses time) and its *wire* time
  (posting to done: the transfer plus any wait for a late partner). The exchange is charged as own + the smaller
  of the two ends' wire times (the end that posted last did not wait, so its wire time is the transfer). A rank's
  time with a partner is the median charge; its time is the median over partners, so one slow partner does not
  make it look slow. A rank is flagged when its time is >= ``slow_factor`` x the median over ranks, a node (a host
  name) when the median of its ranks' times is >= ``slow_factor`` x the median over nodes. Each median is the lower
  middle value, so one slow rank of two is compared with the fast one. Limit: a link slow both ways looks the same
  from both ends, so with two ranks (or two nodes) only lateness singles one out; with several nodes the output
  adds the median transfer time of pairs within and across nodes.

Rank 0 prints a table and a verdict; ``commcheck.out=FILE`` makes it also write every rank's figures as JSON lines.
Exit status, every rank: 0 ok; 1 a slow rank or node, or a failed call; 2 a bad key or value (one line, before
torch is imported); 124 one call (collective, exchange, barrier) blocked for ``timeout_s``, i.e. a peer is dead or
stuck: a watchdog thread logs the step and ends the process with ``os._exit``, as a call blocked in C++ never
returns to Python and NCCL's process-group timeout alone does not end it. Keys: the fields of CommCheckConfig.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any, Optional

from hydratrain.errors import say
from hydratrain.paths import prepare_output_file

EXIT_SLOW, EXIT_CONFIG, EXIT_TIMEOUT = 1, 2, 124
BUSBW_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
                "reduce_scatter": lambda n: (n - 1) / n}


@dataclass
class CommCheckConfig:
    min_bytes: str = "1K"  # smallest size, bytes; suffix K, M, G = 2**10, 2**20, 2**30
    max_bytes: str = "256M"  # largest size, bytes, before the memory cap
    factor: int = 4  # each size is the previous one x factor
    iters: int = 20  # timed calls per size; barriers; at least this many exchanges per partner
    warmup: int = 5  # untimed calls per size; untimed passes of exchanges at the start
    rank_bytes: str = "4M"  # bytes sent each way per pairwise exchange (at most the largest size)
    max_rounds: int = 16  # partners per rank at most (n-1 is every other rank)
    slow_factor: float = 2.0  # flag a rank or node whose time is >= slow_factor x the median
    timeout_s: float = 120.0  # seconds one call may block (a dead or stuck peer) before the rank exits 124
    mem_fraction: float = 0.5  # of the free GPU memory (CPU: available RAM / ranks on the node) for buffers
    backend: Optional[str] = None  # nccl | gloo | mpi; default nccl on CUDA, gloo on CPU
    device: str = "auto"  # auto | cpu | cuda (cuda:LOCAL_RANK)
    out: Optional[str] = None  # JSON-lines file that rank 0 writes with every rank's figures
    debug_slow_rank: Optional[int] = None  # testing only: this rank sleeps debug_delay_s before every call
    debug_delay_s: float = 0.0  # testing only, seconds
    debug_hang_rank: Optional[int] = None  # testing only: this rank stops itself (SIGSTOP) before all_gather


@dataclass
class _Root:
    commcheck: CommCheckConfig = field(default_factory=CommCheckConfig)


def parse_bytes(text: str) -> int:
    """``"4K"`` -> 4096: an int with an optional K/M/G (KB/KiB, ...) suffix, powers of 1024. Raises ValueError."""
    t = str(text).strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(t[-1:], 1)
    value = int(float(t[:-1] if mult > 1 else t) * mult)
    if value <= 0:
        raise ValueError("must be > 0")
    return value


def parse_args(argv: list[str]) -> CommCheckConfig:
    """``commcheck.KEY=VALUE`` items -> the config. Raises SystemExit(one line naming the item) on a bad one."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError

    def fail(key: str, why: str, value=None):
        item = next((a for a in argv if a.split("=", 1)[0] == key), f"{key}={value}")
        raise SystemExit(f"hydratrain: config error: {item}: {why}")

    cfg = OmegaConf.structured(_Root)
    for item in argv:  # one at a time, so that an error names its item
        try:
            if "=" not in item:
                raise ValueError("expected commcheck.KEY=VALUE")
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([item]))
        except Exception as e:  # omegaconf's and yaml's errors
            known = ", ".join("commcheck." + f.name for f in fields(CommCheckConfig))
            fail(item.split("=", 1)[0], f"unknown key (keys: {known})" if isinstance(e, ConfigKeyError)
                 else (str(e).strip().splitlines() or [type(e).__name__])[0])
    c = OmegaConf.to_object(cfg).commcheck  # type: ignore[union-attr]  # (a _Root object)
    for key in ("min_bytes", "max_bytes", "rank_bytes"):
        try:
            setattr(c, key, parse_bytes(getattr(c, key)))
        except (ValueError, IndexError) as e:
            fail(f"commcheck.{key}", f"a size in bytes like 4096, 64K, 256M ({e})", getattr(c, key))
    for key, ok, why in [("min_bytes", c.min_bytes <= c.max_bytes, "must be <= commcheck.max_bytes"),
                         ("factor", c.factor >= 2, "must be >= 2"), ("iters", c.iters >= 1, "must be >= 1"),
                         ("warmup", c.warmup >= 0, "must be >= 0"), ("max_rounds", c.max_rounds >= 1, "must be >= 1"),
                         ("slow_factor", c.slow_factor > 1, "must be > 1"),
                         ("timeout_s", c.timeout_s > 0, "must be > 0"),
                         ("mem_fraction", 0 < c.mem_fraction <= 1, "must be in (0, 1]"),
                         ("backend", c.backend in (None, "nccl", "gloo", "mpi"), "must be nccl, gloo or mpi"),
                         ("device", c.device in ("auto", "cpu", "cuda"), "must be auto, cpu or cuda"),
                         ("debug_delay_s", c.debug_delay_s >= 0, "must be >= 0")]:
        if not ok:
            fail(f"commcheck.{key}", why, getattr(c, key))
    return c


class Watchdog:
    """A daemon thread that ends the process with status 124 when no :meth:`step` came for ``timeout_s`` seconds."""

    def __init__(self, timeout_s: float, rank: int):
        self.timeout_s, self.rank, self.state = timeout_s, rank, ("start", time.monotonic())
        threading.Thread(target=self._watch, name="commcheck-watchdog", daemon=True).start()

    def step(self, name: str) -> None:
        self.state = (name, time.monotonic())  # one tuple: the watcher never pairs a name with another's start

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout_s / 20))
            name, start = self.state
            if time.monotonic() - start > self.timeout_s:
                sys.stderr.write(f"commcheck: rank {self.rank} ({socket.gethostname()}, pid {os.getpid()}): no "
                                 f"progress for {self.timeout_s:g} s in step '{name}' (commcheck.timeout_s): a "
                                 f"peer is dead or stuck; exiting with status {EXIT_TIMEOUT}\n")
                sys.stderr.flush()
                os._exit(EXIT_TIMEOUT)


def human(nbytes: float) -> str:  # type: ignore[return]  # (the loop returns at GiB)
    """4096 -> '4 KiB' (3 significant digits: 4092 bytes, a size rounded for 3 ranks, is '4 KiB' too)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} B" if unit == "B" else f"{nbytes:.3g} {unit}"
        nbytes /= 1024


def round_robin(n: int) -> list[dict[int, int]]:
    """Circle-method rounds: round k maps each rank to its partner (for odd n, one rank per round sits out)."""
    m = n + n % 2  # odd n: a phantom rank m-1
    rounds = []
    for k in range(m - 1):
        pairs = {k: m - 1, m - 1: k, **{r: (2 * k - r) % (m - 1) for r in range(m - 1) if r != k}}
        rounds.append({a: b for a, b in pairs.items() if a < n and b < n})
    return rounds


def lower_median(xs) -> float:
    s = sorted(xs)
    return s[(len(s) - 1) // 2]


def score_ranks(records: list[dict], slow_factor: float) -> dict:
    """Per-rank and per-node times (seconds) from every rank's pairwise exchanges, and which are >= slow_factor x
    the median (the method is in the module docstring)."""
    per_partner: list[list[Any]]
    wires: dict[str, list[Any]]
    nodes: dict[Any, Any]
    per_partner, wires, nodes = [[] for _ in records], {"intra": [], "inter": []}, {}
    for rec in records:
        for rnd, partner, own, wire in rec["pairs"]:
            theirs = next(p[3] for p in records[partner]["pairs"] if p[0] == rnd)
            transfer = [min(a, b) for a, b in zip(wire, theirs)]
            per_partner[rec["rank"]].append(statistics.median(o + t for o, t in zip(own, transfer)))
            if rec["rank"] < partner:
                wires["intra" if rec["node"] == records[partner]["node"] else "inter"].append(
                    statistics.median(transfer))
    rank_time = [lower_median(ts) for ts in per_partner]
    for rec in records:
        nodes.setdefault(rec["node"], []).append(rank_time[rec["rank"]])
    node_time = {h: lower_median(ts) for h, ts in nodes.items()}
    med, node_med = lower_median(rank_time), lower_median(node_time.values())
    return {"time": rank_time, "median": med, "slow": [r for r, t in enumerate(rank_time) if t >= slow_factor * med],
            "node_time": node_time, "pair_transfer": {k: statistics.median(v) for k, v in wires.items() if v},
            "slow_nodes": [h for h, t in node_time.items() if len(nodes) > 1 and t >= slow_factor * node_med]}


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(argv):
        import inspect

        print(__doc__ + "\nKeys, defaults and meaning (commcheck.KEY=VALUE):\n" + inspect.getsource(CommCheckConfig))
        return 0
    try:
        cfg = parse_args(argv)
    except SystemExit as e:
        if os.environ.get("RANK", "0") == "0":  # every rank has the same arguments: one line, not one per rank
            say(e)
        return EXIT_CONFIG
    rank, n = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.out and rank == 0:  # before the check, not after it: an OUT that cannot be written fails at once

        try:
            prepare_output_file(cfg.out)
        except OSError as err:
            say(f"hydratrain: commcheck: out={cfg.out}: cannot write it ({err.strerror}: {err.filename})")
            return EXIT_CONFIG
    if n < 2:
        say("hydratrain: commcheck needs 2 or more ranks: torchrun --nproc_per_node N -m hydratrain.commcheck")
        return EXIT_CONFIG
    import torch  # noqa: F401  (not timed by the watchdog: a slow file system is not a dead peer)

    dog = Watchdog(cfg.timeout_s, rank)
    try:
        return _run(cfg, dog, rank, n)
    except Exception as e:  # e.g. a peer died and closed its sockets: one line, then out
        say(f"commcheck: rank {rank}: step '{dog.state[0]}' failed: {type(e).__name__}: "
            f"{(str(e).strip().splitlines() or [''])[0]}")
        os._exit(EXIT_SLOW)  # not sys.exit: tearing down a broken process group can block


def _run(cfg: Any, dog: Watchdog, rank: int, n: int) -> int:  # (a CommCheckConfig whose sizes parse_args made ints)
    import torch
    import torch.distributed as dist

    cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = cfg.backend or ("nccl" if cuda else "gloo")
    dog.step("init_process_group")
    dist.init_process_group(backend, rank=rank, world_size=n, timeout=timedelta(seconds=cfg.timeout_s + 60),
                            # (a torch.device: NCCL only): why the ignore below
                            **({"device_id": device} if backend == "nccl" else {}))  # type: ignore[arg-type]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    delay = (lambda: time.sleep(cfg.debug_delay_s)) if rank == cfg.debug_slow_rank else (lambda: None)

    dog.step("memory cap")
    if cuda:
        free = torch.cuda.mem_get_info(device)[0]
    else:
        with open("/proc/meminfo") as f:
            kib = next((int(line.split()[1]) for line in f if line.startswith("MemAvailable:")), 2**22)
        free = kib * 1024 // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    capped = torch.tensor([min(cfg.max_bytes, int(free * cfg.mem_fraction) // 3)], device=device)
    dist.all_reduce(capped, op=dist.ReduceOp.MIN)  # every rank must run the same sizes
    sizes: Any  # the set of sizes, then the sorted list
    cap, unit, s, sizes = int(capped.item()), 4 * n, cfg.min_bytes, set()
    while s <= cap:
        sizes.add(max(unit, s // unit * unit))
        s *= cfg.factor
    sizes = sorted(sizes or {max(unit, cap // unit * unit)})
    notes = [] if cap >= cfg.max_bytes else [f"sizes capped at {human(cap)}: 3 buffers in commcheck.mem_fraction="
                                             f"{cfg.mem_fraction:g} of the free memory of the tightest rank"]

    def make(coll: str, nbytes: int, list_form: bool):
        """A call of ``coll`` on an array of ``nbytes``; ``list_form``: the older list-of-tensors API."""
        whole, part = torch.zeros(nbytes // 4, device=device), torch.zeros(nbytes // 4 // n, device=device)
        if coll == "all_reduce":
            return lambda: dist.all_reduce(whole)
        if coll == "all_gather":  # torch 2.13 renamed all_gather_into_tensor to all_gather_single
            one = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            return (lambda: dist.all_gather(list(whole.chunk(n)), part)) if list_form else (lambda: one(whole, part))
        one = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return (lambda: dist.reduce_scatter(part, list(whole.chunk(n)))) if list_form else (lambda: one(part, whole))

    chosen = {}  # collective -> list_form, for those the backend runs
    for coll in BUSBW_FACTOR:
        for list_form in (False, True):
            dog.step(f"probe {coll}")
            try:
                make(coll, unit, list_form)()
                chosen[coll] = list_form
                break
            except (RuntimeError, NotImplementedError, ValueError) as e:
                why = (str(e).strip().splitlines() or [""])[0][:100]
        if chosen.get(coll):
            notes.append(f"{backend} lacks the one-tensor {coll} ({why}): measured with the list form dist.{coll}")
        elif coll not in chosen:
            notes.append(f"{coll} skipped: {backend} runs neither form ({why})")

    rec: dict[str, Any] = {"rank": rank, "node": socket.gethostname(), "barrier": [], "coll": {}, "pairs": []}
    pair_bytes = min(cfg.rank_bytes, sizes[-1]) // 4 * 4
    send, recv = torch.zeros(pair_bytes // 4, device=device), torch.empty(pair_bytes // 4, device=device)
    rounds = round_robin(n)[: max(cfg.max_rounds, 1 + n % 2)]  # odd n: 2 rounds give everyone a partner
    rec["pairs"] = [(k, p[rank], [], []) for k, p in enumerate(rounds) if rank in p]

    def exchange_pass(after: str, timed: bool) -> None:
        """Exchange ``pair_bytes`` with each partner in turn; record own and wire times (see the docstring)."""
        t_prev = time.perf_counter()
        for _, partner, own, wire in rec["pairs"]:
            dog.step(f"exchange with rank {partner} after {after}")
            delay()
            t_post = time.perf_counter()
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, partner),
                                                dist.P2POp(dist.irecv, recv, partner)]):
                work.wait()
            sync()
            t_done = time.perf_counter()
            if timed:
                own.append(t_post - t_prev)
                wire.append(t_done - t_post)
            t_prev = t_done

    for _ in range(cfg.warmup):
        exchange_pass("start", timed=False)
    for i in range(cfg.warmup + cfg.iters):
        dog.step("barrier latency")
        t0 = time.perf_counter()
        dist.barrier()
        if i >= cfg.warmup:
            rec["barrier"].append(time.perf_counter() - t0)
    steps = [(coll, nbytes) for coll in chosen for nbytes in sizes]
    for coll, nbytes in steps:
        if coll == "all_gather" and nbytes == sizes[0] and rank == cfg.debug_hang_rank:
            say(f"commcheck: rank {rank} (pid {os.getpid()}) stops itself before all_gather "
                f"(commcheck.debug_hang_rank; testing only)")
            os.kill(os.getpid(), signal.SIGSTOP)
        op = make(coll, nbytes, chosen[coll])
        for i in range(cfg.warmup + cfg.iters):
            dog.step(f"{coll} {human(nbytes)}")  # every call: timeout_s bounds one call
            if i == cfg.warmup:
                sync()
                dist.barrier()
                t0 = time.perf_counter()
            delay()
            op()
        sync()
        rec["coll"].setdefault(coll, []).append((time.perf_counter() - t0) / cfg.iters)
        for _ in range(-(-cfg.iters // len(steps))):  # >= iters timed exchanges per partner in all
            exchange_pass(f"{coll} {human(nbytes)}", timed=True)

    dog.step("gather results")
    records: list[Any] = [None] * n
    dist.all_gather_object(records, rec)
    dog.step("destroy_process_group")
    dist.barrier()
    dist.destroy_process_group()
    result = score_ranks(records, cfg.slow_factor)
    if rank == 0:
        report(records, result, cfg, sizes, notes, f"backend {backend}, device {device.type}", pair_bytes)
    return EXIT_SLOW if result["slow"] or result["slow_nodes"] else 0


def report(records, result, cfg, sizes, notes, setup, pair_bytes) -> None:
    """Rank 0: print the tables and the verdict; write the JSON lines of ``cfg.out``."""
    import torch

    n, nodes, med = len(records), sorted({r["node"] for r in records}), result["median"]
    barrier = [statistics.median(r["barrier"]) for r in records]
    lines = [f"commcheck: {n} ranks on {len(nodes)} node(s), {setup}, torch {torch.__version__}, float32, "
             f"{cfg.iters} timed calls after {cfg.warmup} warm-up per size", *[f"  note: {x}" for x in notes],
             f"barrier: median {statistics.median(barrier) * 1e6:.1f} us (slowest rank {max(barrier) * 1e6:.1f} us)",
             f"\n{'collective':<15}{'size':>11}{'time (us)':>13}{'algbw (GB/s)':>14}{'busbw (GB/s)':>14}"]
    rows = []
    for coll in records[0]["coll"]:
        for i, nbytes in enumerate(sizes):
            times = [r["coll"][coll][i] for r in records]
            algbw = nbytes / max(times) / 1e9
            busbw = algbw * BUSBW_FACTOR[coll](n)
            lines.append(f"{coll:<15}{human(nbytes):>11}{max(times) * 1e6:>13.1f}{algbw:>14.4g}{busbw:>14.4g}")
            rows.append({"kind": "collective", "collective": coll, "bytes": nbytes, "time_s": max(times),
                         "algbw_gbps": algbw, "busbw_gbps": busbw, "rank_time_s": times})
    partners = len(records[0]["pairs"])
    lines += [f"\nper rank: {human(pair_bytes)} each way with {partners} partner(s); time = own delay + transfer, "
              f"median over exchanges, then over partners",
              f"{'rank':>5}  {'node':<20}{'time (us)':>11}{'GB/s':>10}{'x median':>10}"]
    for r in records:
        t, slow = result["time"][r["rank"]], r["rank"] in result["slow"]
        lines.append(f"{r['rank']:>5}  {r['node']:<20}{t * 1e6:>11.1f}{pair_bytes / t / 1e9:>10.4g}"
                     f"{t / med:>9.2f}x{'  SLOW' if slow else ''}")
        rows.append({"kind": "rank", "rank": r["rank"], "node": r["node"], "time_s": t, "x_median": t / med,
                     "slow": slow, "barrier_median_s": barrier[r["rank"]]})
    if len(nodes) > 1:
        lines += [f"node {h}: {t * 1e6:.1f} us{'  SLOW' if h in result['slow_nodes'] else ''}"
                  for h, t in result["node_time"].items()]
        lines += [f"pairs {k}-node: median transfer {t * 1e6:.1f} us ({pair_bytes / t / 1e9:.4g} GB/s)"
                  for k, t in result["pair_transfer"].items()]
    if result["slow"] or result["slow_nodes"]:
        what = [f"rank {r} ({records[r]['node']}) {result['time'][r] / med:.1f}x" for r in result["slow"]]
        verdict = (f"verdict: SLOW: {', '.join(what + [f'node {h}' for h in result['slow_nodes']])} the median "
                   f"(threshold {cfg.slow_factor:g}x)")
    else:
        verdict = (f"verdict: OK: {n} ranks within {max(result['time']) / med:.2f}x of the median "
                   f"(threshold {cfg.slow_factor:g}x)")
    print("\n".join(lines + ["", verdict]), flush=True)
    if cfg.out:
        with open(cfg.out, "w") as f:
            run = {"kind": "run", "world_size": n, "nodes": nodes, "setup": setup, "notes": notes,
                   "ok": not (result["slow"] or result["slow_nodes"]), "slow_ranks": result["slow"],
                   "slow_nodes": result["slow_nodes"], "verdict": verdict}
            f.writelines(json.dumps(row) + "\n" for row in [run] + rows)


if __name__ == "__main__":
    sys.exit(main())
