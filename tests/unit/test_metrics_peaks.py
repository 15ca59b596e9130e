"""Peak FLOP/s for MFU (hydratrain.metrics.peak_flops): the GPU table by exact device name, the cached CPU
measurement, unknown devices; and the per-job peak memory window (reset_peak_memory / peak_memory_bytes)."""
from __future__ import annotations

import json
import logging
import math
import time

import pytest
import torch

from hydratrain import metrics
from hydratrain.metrics import GPU_PEAKS, gpu_peak, peak_flops, peak_memory_bytes, reset_peak_memory

T = 1e12
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# (device name as torch.cuda.get_device_name() returns it, dtype, tf32, dense peak FLOP/s or NaN)
KNOWN = [
    ("NVIDIA H100 80GB HBM3", BF16, False, 989.5 * T),
    ("NVIDIA H100 80GB HBM3", FP32, True, 494.5 * T),
    ("NVIDIA H100 80GB HBM3", FP32, False, 67 * T),
    ("NVIDIA H100 PCIe", BF16, False, 756.5 * T),  # trap: not the SXM figure
    ("NVIDIA H100 PCIe", FP32, True, 378 * T),
    ("NVIDIA H100 NVL", BF16, False, 835.5 * T),  # trap: not the SXM figure
    ("NVIDIA H200", BF16, False, 989.5 * T),
    ("NVIDIA H200", FP16, False, 989.5 * T),
    ("NVIDIA H200 NVL", BF16, False, 835.5 * T),  # trap: not the H200 SXM figure
    ("NVIDIA GH200 480GB", BF16, False, 990 * T),  # trap: "H200" is a substring of "GH200"
    ("NVIDIA GH200 144G HBM3e", FP32, False, 67 * T),
    ("NVIDIA B200", BF16, False, 2250 * T),
    ("NVIDIA A100-SXM4-80GB", BF16, False, 312 * T),
    ("NVIDIA A100-SXM4-40GB", FP32, True, 156 * T),
    ("NVIDIA A100-PCIE-40GB", FP32, False, 19.5 * T),
    ("NVIDIA A100 80GB PCIe", FP16, False, 312 * T),
    ("NVIDIA L40S", BF16, False, 362.05 * T),
    ("NVIDIA L40", BF16, False, 181.05 * T),  # trap: not L4's
    ("NVIDIA L40", FP32, False, 90.5 * T),
    ("NVIDIA L4", BF16, False, 121 * T),  # trap: not L40's or L40S's
    ("NVIDIA L4", FP32, True, 60 * T),
    ("NVIDIA A10", BF16, False, 125 * T),
    ("NVIDIA A10G", BF16, False, math.nan),  # trap: not A10's; no published figure
    ("NVIDIA A30", BF16, False, 165 * T),
    ("NVIDIA A40", FP32, True, 74.8 * T),
    ("Tesla V100-SXM2-16GB", FP16, False, 125 * T),
    ("Tesla V100-SXM2-16GB", BF16, False, math.nan),  # no bf16 tensor cores
    ("Tesla V100-SXM2-16GB", FP32, True, 15.7 * T),  # no TF32: fp32 matmuls run as plain fp32
    ("Tesla V100-PCIE-32GB", FP16, False, 112 * T),
    ("Tesla V100S-PCIE-32GB", FP16, False, 130 * T),
    ("Tesla T4", FP16, False, 65 * T),
    ("Tesla T4", FP32, False, 8.1 * T),
    ("NVIDIA GeForce RTX 4090", BF16, False, 165.2 * T),
    ("NVIDIA GeForce RTX 3090", BF16, False, 71 * T),
    ("NVIDIA GeForce RTX 3090", FP32, True, 35.6 * T),
]
UNKNOWN = ["NVIDIA GeForce RTX 5090", "NVIDIA GeForce RTX 4090 D", "NVIDIA GeForce RTX 3090 Ti", "NVIDIA H800",
           "NVIDIA A100-SXM4-40GB MIG 1g.5gb", "NVIDIA H100 80GB HBM3 MIG 3g.40gb", "AMD Instinct MI300X",
           "NVIDIA L20", "NVIDIA A1000", "Tesla V100-FHHL-16GB", ""]


@pytest.fixture
def cuda_named(monkeypatch):
    """cuda_named(name): torch.cuda.get_device_name returns ``name`` (no GPU needed); warnings forgotten."""
    monkeypatch.setattr(metrics, "_WARNED", set())

    def _set(name: str) -> torch.device:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        return torch.device("cuda", 0)

    return _set


@pytest.mark.parametrize("name,dtype,tf32,expected", KNOWN)
def test_gpu_peak_by_exact_device_name(cuda_named, name, dtype, tf32, expected):
    got = peak_flops(cuda_named(name), dtype, None, tf32=tf32)
    assert (math.isnan(got) and math.isnan(expected)) or got == pytest.approx(expected), (name, dtype, tf32, got)


def test_every_known_name_matches_exactly_one_entry():
    for name in {n for n, *_ in KNOWN}:
        hits = [e.pattern for e in GPU_PEAKS if metrics.re.fullmatch(e.pattern, name, flags=metrics.re.IGNORECASE)]
        assert len(hits) == 1, (name, hits)
    assert all(e.source for e in GPU_PEAKS)


def test_names_are_normalised_not_substring_matched():
    assert gpu_peak("  NVIDIA   L40S ").pattern == "NVIDIA L40S"
    assert gpu_peak("nvidia h100 pcie").pattern == "NVIDIA H100 PCIe"
    assert gpu_peak("NVIDIA L40 something") is None
    assert gpu_peak("Foo NVIDIA L4") is None


@pytest.mark.parametrize("name", UNKNOWN)
def test_unknown_gpu_is_nan_with_one_warning(cuda_named, caplog, name):
    device = cuda_named(name)
    with caplog.at_level(logging.WARNING, logger="hydratrain.metrics"):
        assert math.isnan(peak_flops(device, BF16, None, tf32=False))
        assert math.isnan(peak_flops(device, BF16, None, tf32=False))  # a second job in the same process
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "logger.peak_flops" in warnings[0] and repr(name) in warnings[0]
    if "MIG" in name:
        assert "MIG" in warnings[0]


def test_override_wins_everywhere(cuda_named, monkeypatch):
    monkeypatch.setattr(metrics, "measure_matmul_flops", lambda *a, **k: pytest.fail("measured despite override"))
    assert peak_flops(cuda_named("NVIDIA GeForce RTX 5090"), BF16, 1.5e14) == 1.5e14
    assert peak_flops(cuda_named("NVIDIA H200"), BF16, 3e14) == 3e14
    assert peak_flops(torch.device("cpu"), FP32, 1e11) == 1e11


def test_tf32_follows_torch_setting(cuda_named):
    device = cuda_named("NVIDIA A100-SXM4-80GB")
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    try:
        matmul.fp32_precision = "tf32"
        assert metrics.tf32_enabled() and peak_flops(device, FP32) == pytest.approx(156 * T)
        matmul.fp32_precision = "ieee"
        assert not metrics.tf32_enabled() and peak_flops(device, FP32) == pytest.approx(19.5 * T)
    finally:
        matmul.fp32_precision = before
    assert not metrics.tf32_enabled()  # torch's default: fp32 matmuls in full fp32
    assert peak_flops(device, "bfloat16") == pytest.approx(312 * T)  # dtype by name, as in the config


def test_other_device_types_are_nan_not_measured(monkeypatch):
    monkeypatch.setattr(metrics, "_WARNED", set())
    monkeypatch.setattr(metrics, "measure_matmul_flops", lambda *a, **k: pytest.fail("measured a non-CPU device"))
    assert math.isnan(peak_flops(torch.device("mps"), FP32))


# ---------------------------------------------------------------------------------------------------- CPU cache
@pytest.fixture
def counted_measure(monkeypatch):
    calls = []

    def fake(device, dtype, *a, **k):
        calls.append(dtype)
        return {FP32: 1.0e11, BF16: 3.0e11}.get(dtype, 1e9)

    monkeypatch.setattr(metrics, "measure_matmul_flops", fake)
    return calls


def test_cpu_peak_is_measured_once_then_cached(tmp_path, counted_measure):
    cpu = torch.device("cpu")
    assert peak_flops(cpu, FP32, None, cache_dir=tmp_path) == 1.0e11
    assert peak_flops(cpu, FP32, None, cache_dir=tmp_path) == 1.0e11
    assert counted_measure == [FP32]  # the second call read the cache
    assert peak_flops(cpu, BF16, None, cache_dir=tmp_path) == 3.0e11  # another dtype is another key
    assert counted_measure == [FP32, BF16]
    entries = json.loads((tmp_path / metrics.CPU_PEAK_CACHE).read_text())["entries"]
    key = metrics.cpu_peak_key(FP32)
    assert entries[key]["flops"] == 1.0e11
    for part in (metrics.cpu_model(), f"{torch.get_num_threads()} threads", "torch.float32", torch.__version__):
        assert part in key


def _stored(path, flops, *ages_s):
    stamps = [time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - age)) for age in ages_s]
    entry = {"flops": flops, "measured_at": stamps[-1], "measurements": stamps}
    (path / metrics.CPU_PEAK_CACHE).write_text(json.dumps({"entries": {metrics.cpu_peak_key(FP32): entry}}))


def test_cpu_peak_measured_while_busy_is_replaced_by_a_later_launchs_higher_figure(tmp_path, counted_measure, caplog):
    """A figure measured under load (4x low, as once seen) does not stay: the next launches (a minute or more
    later) measure again and the best counts; a lower measurement never lowers it; after CPU_PEAK_LAUNCHES
    measurements one launch an hour measures again (three launches can all fall in one busy hour)."""
    cpu = torch.device("cpu")
    _stored(tmp_path, 0.25e11, 120)
    with caplog.at_level("WARNING", logger="hydratrain.metrics"):
        assert peak_flops(cpu, FP32, None, cache_dir=tmp_path) == 1.0e11
    assert "4.0x the 2.5e+10 cached" in caplog.text and "read 4.0x high" in caplog.text
    assert counted_measure == [FP32]
    _stored(tmp_path, 2.0e11, 600, 120)  # a lower measurement keeps the stored best
    assert peak_flops(cpu, FP32, None, cache_dir=tmp_path) == 2.0e11
    entry = json.loads((tmp_path / metrics.CPU_PEAK_CACHE).read_text())["entries"][metrics.cpu_peak_key(FP32)]
    assert len(entry["measurements"]) == metrics.CPU_PEAK_LAUNCHES and counted_measure == [FP32, FP32]
    assert peak_flops(cpu, FP32, None, cache_dir=tmp_path) == 2.0e11  # measured just now: read, not measured
    _stored(tmp_path, 0.5e11, 10)  # a rank of the launch that measured 10 s ago reads it
    assert peak_flops(cpu, FP32, None, cache_dir=tmp_path) == 0.5e11
    assert counted_measure == [FP32, FP32]
    _stored(tmp_path, 0.5e11, 7300, 7200, 3700)  # three busy launches: over an hour after the last, once more
    assert peak_flops(cpu, FP32, None, cache_dir=tmp_path) == 1.0e11
    entry = json.loads((tmp_path / metrics.CPU_PEAK_CACHE).read_text())["entries"][metrics.cpu_peak_key(FP32)]
    assert len(entry["measurements"]) == metrics.CPU_PEAK_LAUNCHES and counted_measure == [FP32, FP32, FP32]
    assert peak_flops(cpu, FP32, None, cache_dir=tmp_path) == 1.0e11 and len(counted_measure) == 3


def test_where_the_cpu_peak_comes_from_reads_without_a_stray_quote(tmp_path, counted_measure):
    """The peak FLOP/s log line's source: measured now (its parentheses closed, no stray ``'``), then cached."""
    path, key = tmp_path / metrics.CPU_PEAK_CACHE, metrics.cpu_peak_key(FP32)
    assert metrics.cpu_peak_flops(FP32, tmp_path) == (1.0e11, f"measured now ({key}; best of 1 launches) and cached in "
                                                               f"{path}")
    assert metrics.cpu_peak_flops(FP32, tmp_path) == (1.0e11, f"cached in {path} ({key}, best of 1 launches' "
                                                               "measurements)")


def test_cpu_cache_key_changes_with_threads(tmp_path, counted_measure):
    threads = torch.get_num_threads()
    try:
        peak_flops(torch.device("cpu"), FP32, None, cache_dir=tmp_path)
        torch.set_num_threads(threads + 1)
        peak_flops(torch.device("cpu"), FP32, None, cache_dir=tmp_path)
    finally:
        torch.set_num_threads(threads)
    assert counted_measure == [FP32, FP32]
    assert len(json.loads((tmp_path / metrics.CPU_PEAK_CACHE).read_text())["entries"]) == 2


def test_corrupt_or_unwritable_cache_still_gives_a_figure(tmp_path, counted_measure):
    (tmp_path / metrics.CPU_PEAK_CACHE).write_text("{not json")
    assert peak_flops(torch.device("cpu"), FP32, None, cache_dir=tmp_path) == 1.0e11
    assert json.loads((tmp_path / metrics.CPU_PEAK_CACHE).read_text())["entries"]  # rewritten
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the cache dir should be: nothing can be written under it
    assert peak_flops(torch.device("cpu"), FP32, None, cache_dir=blocked / "cache") == 1.0e11


def test_real_cpu_measurement_is_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("HYDRATRAIN_CACHE", str(tmp_path))  # the default cache dir
    first = peak_flops(torch.device("cpu"), FP32)
    assert first > 1e8
    monkeypatch.setattr(metrics, "measure_matmul_flops", lambda *a, **k: pytest.fail("measured again"))
    assert peak_flops(torch.device("cpu"), FP32) == first


# ---------------------------------------------------------------------------------------------------- peak memory
def _rss_bytes() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))


def test_cpu_peak_memory_window_can_be_reset():
    cpu = torch.device("cpu")
    if not reset_peak_memory(cpu):
        pytest.skip("this kernel does not let /proc/self/clear_refs reset the peak RSS")
    base = peak_memory_bytes(cpu)
    big = torch.ones(64 * 2**20)  # 256 MiB, every page touched
    during = peak_memory_bytes(cpu)
    assert during >= base + 200 * 2**20
    del big
    # freeing does not lower a peak (the kernel's RSS counters lag by a few pages, hence the slack)
    assert peak_memory_bytes(cpu) >= during - 2**20
    assert reset_peak_memory(cpu)
    after = peak_memory_bytes(cpu)
    assert after < during - 150 * 2**20, (base, during, after)  # the earlier job's peak no longer counts
    assert after >= _rss_bytes() - 16 * 2**20  # the new window starts at the current RSS


def test_cpu_peak_memory_falls_back_to_ru_maxrss(monkeypatch, tmp_path):
    monkeypatch.setattr(metrics, "_PROC_STATUS", str(tmp_path / "missing"))
    monkeypatch.setattr(metrics, "_CLEAR_REFS", str(tmp_path / "missing-dir" / "clear_refs"))
    assert not reset_peak_memory(torch.device("cpu"))
    import resource

    assert peak_memory_bytes(torch.device("cpu")) == resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def test_cuda_peak_memory_reset_calls_torch(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append(device))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 1234)
    device = torch.device("cuda", 0)
    assert reset_peak_memory(device)
    assert calls == [device] and peak_memory_bytes(device) == 1234


@pytest.mark.parametrize("ranks, threads, cores, per_rank", [(4, 1, 2, 50e9), (2, 1, 2, 100e9), (1, 2, 2, 200e9),
                                                             (2, 2, 2, 100e9), (1, 4, 2, 200e9), (2, 4, 2, 100e9)])
def test_cpu_ranks_that_oversubscribe_the_cores_share_their_peak(monkeypatch, ranks, threads, cores, per_rank):
    """A rank's CPU peak is measured on its own threads; 4 ranks of 1 thread on 2 cores do not have 4 one-thread
    peaks, so MFU read 2x low. The node's ranks together get at most its cores' figure."""

    # measured on min(threads, cores) cores: 100 GFLOP/s a core (one rank of 4 threads on 2 cores measures 2 cores,
    # and is not scaled again)
    monkeypatch.setattr(metrics, "cpu_peak_flops", lambda dtype, cache_dir=None: (100e9 * min(threads, cores),
                                                                                  "measured"))
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    monkeypatch.setattr(metrics, "allowed_cores", lambda: cores)  # (metrics imports it from dist.env)
    assert peak_flops(torch.device("cpu"), FP32, local_world_size=ranks) == pytest.approx(per_rank)
