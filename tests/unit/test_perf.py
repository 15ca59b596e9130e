"""Performance-related decisions: the FLOP count behind MFU against independent counts, the slow-precision warning,
the start-up timeline, and data generation that must stay bit-identical while getting faster."""
from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hydratrain import timing
from hydratrain.models.gpt import GPT, GPTConfig
from hydratrain.parallel.precision import PRESET_DTYPE, Precision


def shape_count(c: GPTConfig, seq_len: int) -> float:
    """Training FLOPs per token derived from the layer shapes alone (PaLM appendix B): 6 x the weights every token
    multiplies (each block's q, k, v, o and SwiGLU matrices, the output head; the embedding lookup multiplies
    nothing, unless tied to the head) and the norm gains, plus 12 x L x H x Q x T for the attention scores and
    their weighted sum (forward 2 matmuls of 2*T*Q FLOPs per head, backward twice that)."""
    d, h, kv, q, f, v, L = c.d_model, c.n_head, c.n_kv_head or c.n_head, c.d_model // c.n_head, c.ff_dim, \
        c.vocab_size, c.n_layer
    per_block = d * h * q + 2 * d * kv * q + h * q * d + 3 * d * f + 2 * d
    n = L * per_block + d + v * d  # + final norm + the output head (the tied embedding is the head's matrix)
    return 6 * n + 12 * L * h * q * seq_len


CONFIGS = [dict(d_model=128, n_layer=4, n_head=4), dict(d_model=128, n_layer=4, n_head=4, tie_embeddings=False),
           dict(d_model=96, n_layer=3, n_head=6, n_kv_head=2), dict(d_model=64, n_layer=2, n_head=2, d_ff=200)]


@pytest.mark.parametrize("kw", CONFIGS, ids=["tied", "untied", "gqa", "d_ff"])
def test_flops_per_token_agrees_with_counts_from_shapes_and_from_the_executed_matmuls(kw):
    seq = 64
    cfg = GPTConfig(vocab_size=256, max_seq_len=seq, **kw)
    torch.manual_seed(0)
    model = GPT(cfg)
    assert model.flops_per_token(seq) == pytest.approx(shape_count(cfg, seq), rel=1e-9)
    # the matmuls a training step executes, counted by torch (math SDPA so that attention shows as bmm; it computes
    # the full T x T scores, as PaLM's term counts them)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randint(0, 256, (2, seq + 1))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    executed = counter.get_total_flops() / x[:, :-1].numel()
    assert model.flops_per_token(seq) == pytest.approx(executed, rel=0.005)  # norm gains: the only difference


def test_gpt_small_flops_per_token_from_shapes():
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=256, max_seq_len=1024, d_model=768, n_layer=12, n_head=12))
    assert model.flops_per_token(1024) == pytest.approx(shape_count(model.cfg, 1024), rel=1e-9)


def test_logged_mfu_is_tokens_per_second_times_flops_over_the_peak(tmp_path):
    from hydratrain.train.step_logger import StepLogger

    logger = StepLogger(tmp_path, torch.device("cpu"), tokens_per_step=1000, flops_per_token=6e6,
                        peak_flops_total=2e11, log_every=2, max_steps=4, is_main=True, tensorboard=False,
                        progress_bar=False)
    logger.start(0)
    for step in (1, 2):
        time.sleep(0.05)
        logger.step_done(step, torch.tensor(1.0))
    logger.log(2, torch.tensor(0.5), 1e-3, timed=True)
    tps, mfu, _ = logger.rates[-1]
    assert mfu == pytest.approx(tps * 6e6 / 2e11, rel=1e-12)
    assert 2000 / 0.2 < tps < 2000 / 0.09  # two steps of ~50 ms


def test_the_runs_tokens_per_second_is_its_tokens_over_its_time_not_the_mean_of_window_rates(tmp_path):
    """results.json's tokens/s, MFU and data-wait share take the timed windows together (the plain mean
    of the windows' rates said 1709 tokens/s for 903, weighing a fast 1-step window like a slow long one)."""
    from hydratrain.train.step_logger import StepLogger

    logger = StepLogger(tmp_path, torch.device("cpu"), tokens_per_step=1000, flops_per_token=6e6,
                        peak_flops_total=2e11, log_every=4, max_steps=5, is_main=True, tensorboard=False,
                        progress_bar=False)
    logger.start(0)
    started = time.perf_counter()
    for step in range(1, 5):  # a slow 4-step window: 4 x 60 ms
        time.sleep(0.06)
        logger.data_waited(0.01)
        logger.step_done(step, torch.tensor(1.0))
    logger.log(4, torch.tensor(0.5), 1e-3, timed=True)
    logger.step_done(5, torch.tensor(1.0))  # a fast 1-step window
    logger.log(5, torch.tensor(0.5), 1e-3, timed=True)
    elapsed = time.perf_counter() - started
    tps, mfu, wait = logger.run_rates()
    (slow, _, _), (fast, _, _) = logger.rates
    assert fast > 3 * slow  # the windows' rates differ, so their plain mean is far from the run's figure
    assert tps == pytest.approx(5000 / elapsed, rel=0.05)
    assert tps < (slow + fast) / 2 * 0.75
    assert mfu == pytest.approx(tps * 6e6 / 2e11, rel=1e-12)
    assert wait == pytest.approx(0.04 / elapsed, rel=0.05)


def _cfg(name: str):
    from omegaconf import OmegaConf

    return OmegaConf.create({"name": name, "reduce_dtype": "float32", "tf32": True})


@pytest.mark.parametrize("name, rates, warns", [
    ("fp16", {"fp16": 2e9, "bf16": 500e9, "fp32": 100e9}, True),   # 250x: the brief's example
    ("fp32", {"fp32": 110e9, "bf16": 500e9}, False),              # 4.5x: below SLOW_FACTOR
    ("fp32", {"fp32": 20e9, "bf16": 500e9}, True),                # 25x
    ("bf16", {"bf16": 500e9}, False),                             # what auto picks: nothing measured
])
def test_a_slow_precision_warns_once_with_the_measured_factor(monkeypatch, name, rates, warns):
    from hydratrain import metrics
    from hydratrain.parallel import precision as precision_module

    monkeypatch.setattr(precision_module, "cpu_has_native_bf16", lambda: True)
    asked = []

    def fake(dtype, cache_dir=None):
        key = {v: k for k, v in PRESET_DTYPE.items()}[dtype]
        asked.append(key)
        return rates[key], "test"

    monkeypatch.setattr(metrics, "cpu_peak_flops", fake)
    p = Precision.resolve(_cfg(name), torch.device("cpu"))
    line = p.slow_path(torch.device("cpu"))
    if not warns:
        assert line is None
        if name == "bf16":
            assert asked == []
        return
    factor = rates["bf16"] / rates[name]
    assert line is not None and "\n" not in line
    assert f"{factor:.0f}x slower" in line and "precision=bf16" in line and f"precision={name}" in line


def test_fp16_without_native_bf16_compares_with_fp32(monkeypatch):
    from hydratrain import metrics
    from hydratrain.parallel import precision as precision_module

    monkeypatch.setattr(precision_module, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(metrics, "cpu_peak_flops",
                        lambda dtype, cache_dir=None: ({torch.float16: 1e9, torch.float32: 100e9}[dtype], "test"))
    line = Precision.resolve(_cfg("fp16"), torch.device("cpu")).slow_path(torch.device("cpu"))
    assert "100x slower than float32" in line and "precision=fp32" in line


def test_startup_timeline_charges_each_phase_the_time_since_the_previous_mark(monkeypatch):
    monkeypatch.setattr(timing, "_ORIGIN", None)
    monkeypatch.setattr(timing, "_FROM", "process start")
    monkeypatch.setattr(timing, "_MARKS", [])
    timing.begin()
    time.sleep(0.02)
    timing.mark("imports")
    timing.mark("data")
    time.sleep(0.01)
    timing.mark("imports")
    p = timing.phases()
    assert list(p) == ["python + hydra + compose", "imports", "data", "total"]
    assert p["imports"] >= 0.03 and p["data"] < 0.01
    assert p["total"] == pytest.approx(sum(v for k, v in p.items() if k != "total"), abs=1e-6)
    rec = timing.record()
    assert rec["ended_at"] - rec["process_started_at"] == pytest.approx(rec["total"])
    assert timing.summary().startswith(f"{rec['total']:.2f} s from process start to the first optimizer step (")
    assert 0 < time.time() - timing.process_start_time() < 24 * 3600
    timing.begin()  # a later job of the process (a local sweep) counts from its own start, and says so
    timing.mark("imports")
    assert " s from the job's start to the first optimizer step (imports " in timing.summary()


def _synthetic_stream_reference(n_tokens, vocab_size, seed=0):
    """The original implementation (a Python list of words, concatenated): the vectorised one must match it."""
    rng = np.random.default_rng(seed)
    dtype = np.uint8 if vocab_size <= 256 else np.uint16
    words = [rng.integers(0, vocab_size, size=rng.integers(3, 9)).astype(dtype) for _ in range(64)]
    picks = rng.integers(0, len(words), size=n_tokens // 3 + 1)
    return np.concatenate([words[i] for i in picks])[:n_tokens]


@pytest.mark.parametrize("n, vocab, seed", [(200_000, 256, 0), (1, 256, 0), (7, 300, 3), (12_345, 50_000, 1)])
def test_synthetic_stream_is_bit_identical_to_the_original(n, vocab, seed):
    from hydratrain.data.corpora import synthetic_stream

    got, want = synthetic_stream(n, vocab, seed), _synthetic_stream_reference(n, vocab, seed)
    assert got.dtype == want.dtype and np.array_equal(got, want)


def test_measure_matmul_flops_times_a_very_slow_dtype_once(monkeypatch):
    from hydratrain import metrics

    calls = []

    def slow_linear(a, w):
        calls.append(1)
        time.sleep(0.03)

    monkeypatch.setattr(torch.nn.functional, "linear", slow_linear)
    flops = metrics.measure_matmul_flops(torch.device("cpu"), torch.float32, m=8, n=8, budget_s=0.01)
    assert len(calls) == 2 and math.isfinite(flops) and flops > 0  # warm-up + one timed call


@pytest.mark.parametrize("env, mask, ranks, threads", [
    ({}, {0, 1, 2, 3, 4, 5, 6, 7}, 2, 4),                                   # the node's allowed cores, shared
    ({}, {0}, 1, 1),                                                         # taskset -c 0 on a larger host
    ({"OMP_NUM_THREADS": "3"}, {0, 1, 2, 3}, 1, 3),                         # the user's own setting is kept
    ({"OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "x"}, {0, 1, 2, 3}, 2, 2),  # torchrun's default is not
    ({"OMP_NUM_THREADS": "2", "TORCHELASTIC_RUN_ID": "x"}, {0, 1, 2, 3}, 2, 2),
    ({"SLURM_PROCID": "1"}, {4, 5, 6, 7}, 4, 4),                            # a SLURM task's mask is its own
    ({"SLURM_PROCID": "1"}, set(range(16)), 4, 4),                          # unbound tasks share the host
    ({"SLURM_PROCID": "1", "SLURM_CPUS_PER_TASK": "6"}, set(range(16)), 2, 6),
    ({"SLURM_PROCID": "1", "TORCHELASTIC_RUN_ID": "x"}, {0, 1, 2, 3}, 4, 1),  # torchrun inside a SLURM task
])
def test_cpu_threads_follow_the_affinity_mask_and_an_explicit_omp_num_threads(monkeypatch, env, mask, ranks,
                                                                               threads):
    import os

    from hydratrain.dist import process_group

    for key in ("OMP_NUM_THREADS", "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_CPUS_PER_TASK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: mask)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)  # the host
    assert process_group.cpu_threads(ranks) == threads


@pytest.mark.parametrize("argv, says", [
    (["overhead.py", "--model", "nope"], "argument --model: invalid choice: 'nope'"),
    (["overhead.py", "--rounds", "0"], "argument --rounds: invalid int >= 1 value: '0'"),
    (["overhead.py", "--precisions", "fp33"], "argument --precisions: invalid comma-separated list of fp32, bf16"),
    (["overhead.py", "--steps", "5", "--warm", "5"], "--warm 5: must be below --steps 5"),
    (["memory.py", "--ranks", "0"], "argument --ranks: invalid comma-separated list of int >= 1 value: '0'"),
    (["plan_accuracy.py", "--only", "nope"], "argument --only: invalid choice: 'nope'"),
    (["plan_accuracy.py", "--steps", "1"], "argument --steps: invalid int >= 2 value: '1'"),
    (["startup.py", "--ranks", "0"], "argument --ranks: invalid comma-separated list of int >= 1 value: '0'"),
    (["fastpaths.py", "--rounds", "0"], "argument --rounds: invalid int >= 1 value: '0'"),
])
def test_bench_scripts_refuse_bad_arguments_before_any_run(argv, says):
    """A typo ran every launch of every round (each failing with a traceback), --ranks 0 divided by zero
    at the end, --only nope failed on an empty max(): each is now argparse's one line, status 2, at once."""
    import subprocess
    import sys

    from helpers import ROOT

    r = subprocess.run([sys.executable, str(ROOT / "bench" / argv[0]), *argv[1:]], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
