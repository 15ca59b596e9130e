"""MFU and memory figures, and the rank-0 TensorBoard writer (tokens/s is counted by the step logger).

MFU (model FLOPs utilisation, PaLM, Chowdhery et al. 2022, appendix B) = achieved model FLOP/s / peak FLOP/s, where
achieved = tokens/s x FLOPs per token (6*N + 12*L*H*Q*T, see ``GPT.flops_per_token``) and peak is the per-device peak
times world_size. :func:`peak_flops` chooses the per-device peak, in this order:

1. ``logger.peak_flops`` when set (FLOP/s of one device);
2. CUDA: :data:`GPU_PEAKS`, dense (no 2:4 sparsity) vendor-datasheet peaks keyed by the exact name
   ``torch.cuda.get_device_name()`` returns, one figure per compute mode (bf16, fp16, TF32, plain fp32). A GPU that is
   not in the table (or a MIG slice, or a mode the GPU has no figure for) gets no MFU (NaN) and one warning, never a
   guessed figure;
3. CPU: a matmul measured per machine in the compute dtype and cached in ``<cache dir>/cpu_peak_flops.json``, so
   runs on one machine report comparable MFU and do not pay the measurement at every start. The figure is the best
   of every measurement: the first :data:`CPU_PEAK_LAUNCHES` launches (at least a minute apart) measure, then one
   launch an hour (:data:`CPU_PEAK_RECHECK_S`), since contention only ever lowers a measurement. Three launches
   can all fall in one busy hour, and a low figure kept for good makes every later MFU on that machine read high
   (3.9x was seen).

Peak memory (``mem/peak``, bytes): :func:`peak_memory_bytes` since the last :func:`reset_peak_memory`.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import platform
import re
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Union

import torch

from hydratrain.dist.env import allowed_cores

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuPeak:
    """Dense (no sparsity) peak FLOP/s of one GPU model per compute mode; None where the GPU has no such mode or the
    vendor publishes no figure. ``pattern`` is matched against the whole device name (``re.fullmatch``, case and
    repeated spaces ignored), so "NVIDIA L4" never matches "NVIDIA L40"."""

    pattern: str
    bf16: Optional[float]  # bfloat16 tensor cores, FP32 accumulate
    fp16: Optional[float]  # float16 tensor cores, FP32 accumulate
    tf32: Optional[float]  # float32 matmuls with TF32 enabled (tensor cores)
    fp32: Optional[float]  # plain float32 (CUDA cores, no tensor cores)
    source: str


def _tflops(pattern: str, bf16: Optional[float], fp16: Optional[float], tf32: Optional[float],
            fp32: Optional[float], source: str) -> GpuPeak:
    """A :class:`GpuPeak` from figures in TFLOP/s (as datasheets print them)."""
    bf16, fp16, tf32, fp32 = (None if v is None else v * 1e12 for v in (bf16, fp16, tf32, fp32))
    return GpuPeak(pattern, bf16, fp16, tf32, fp32, source)


# Sources: NVIDIA datasheets and architecture whitepapers. Datasheets print tensor-core peaks "with sparsity" (2:4
# structured); models train dense, so those are halved here. Each source string quotes the document's own numbers in
# TFLOP/s, * marking a figure with sparsity.
_H100 = "NVIDIA H100 datasheet (resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet)"
_H200 = "NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200)"
_A100 = "NVIDIA A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf, SXM and PCIe, 40/80 GB)"
_V100 = "NVIDIA V100 datasheet (volta-v100-datasheet-update-us-1165301-r5.pdf), tensor = fp16 mixed precision"
# Most specific first; patterns match the whole name, so at most one matches (the order only breaks ties).
GPU_PEAKS: tuple[GpuPeak, ...] = (
    # Hopper
    _tflops(r"NVIDIA H100 PCIe", 756.5, 756.5, 378, 51, _H100 + ", H100 PCIe: BF16 1513*, TF32 756*, FP32 51"),
    _tflops(r"NVIDIA H100 NVL", 835.5, 835.5, 417.5, 60, _H100 + ", H100 NVL: BF16 1671*, TF32 835*, FP32 60"),
    _tflops(r"NVIDIA H100 80GB HBM3", 989.5, 989.5, 494.5, 67,
            _H100 + ", H100 SXM: BF16 1979*, TF32 989*, FP32 67"),
    _tflops(r"NVIDIA H200 NVL", 835.5, 835.5, 417.5, 60, _H200 + ", H200 NVL: BF16 1671*, TF32 835*, FP32 60"),
    _tflops(r"NVIDIA H200", 989.5, 989.5, 494.5, 67, _H200 + ", H200 SXM: BF16 1979*, TF32 989*, FP32 67"),
    _tflops(r"NVIDIA GH200 (480GB|144G HBM3e)", 990, 990, 494, 67,
            "NVIDIA GH200 datasheet (nvidia.com/en-us/data-center/grace-hopper-superchip): BF16 990, TF32 494, "
            "FP32 67"),
    # Blackwell
    _tflops(r"NVIDIA B200", 2250, 2250, 1100, 75,
            "NVIDIA HGX B200 specifications (nvidia.com/en-us/data-center/hgx), per GPU: BF16 4500*, TF32 2200*, "
            "FP32 75"),
    # Ampere
    _tflops(r"NVIDIA A100-(SXM4-40GB|SXM4-80GB|SXM-80GB|PCIE-40GB|PCIE-80GB)", 312, 312, 156, 19.5,
            _A100 + ": BF16 312, TF32 156, FP32 19.5"),
    _tflops(r"NVIDIA A100 80GB PCIe", 312, 312, 156, 19.5, _A100 + ": BF16 312, TF32 156, FP32 19.5"),
    _tflops(r"NVIDIA A10G", None, None, None, None, "AWS's A10G: NVIDIA publishes no datasheet for it"),
    _tflops(r"NVIDIA A10", 125, 125, 62.5, 31.2,
            "NVIDIA A10 datasheet (nvidia-a10-datasheet.pdf): BF16 125, TF32 62.5, FP32 31.2"),
    _tflops(r"NVIDIA A30", 165, 165, 82, 10.3,
            "NVIDIA A30 datasheet (nvidia-a30-datasheet.pdf): BF16 165, TF32 82, FP32 10.3"),
    _tflops(r"NVIDIA A40", 149.7, 149.7, 74.8, 37.4,
            "NVIDIA A40 datasheet (nvidia-a40-datasheet.pdf): BF16 149.7, TF32 74.8, FP32 37.4"),
    _tflops(r"NVIDIA GeForce RTX 3090", 71, 71, 35.6, 35.6,
            "NVIDIA Ampere GA102 GPU architecture whitepaper, RTX 3090: FP16/BF16 tensor with FP32 accumulate 71, "
            "TF32 35.6, FP32 35.6"),
    # Ada Lovelace
    _tflops(r"NVIDIA L40S", 362.05, 362.05, 183, 91.6, "NVIDIA L40S datasheet: BF16 362.05, TF32 183, FP32 91.6"),
    _tflops(r"NVIDIA L40", 181.05, 181.05, 90.5, 90.5, "NVIDIA L40 datasheet: BF16 181.05, TF32 90.5, FP32 90.5"),
    _tflops(r"NVIDIA L4", 121, 121, 60, 30.3,
            "NVIDIA L4 datasheet (nvidia.com/en-us/data-center/l4): BF16 242*, TF32 120*, FP32 30.3"),
    _tflops(r"NVIDIA GeForce RTX 4090", 165.2, 165.2, 82.6, 82.6,
            "NVIDIA Ada GPU architecture whitepaper, RTX 4090: FP16/BF16 tensor with FP32 accumulate 165.2, "
            "TF32 82.6, FP32 82.6"),
    # Volta, Turing: fp16 tensor cores only; no bf16, and no TF32 (fp32 matmuls run as plain fp32)
    _tflops(r"Tesla V100-(SXM2|SXM3)-(16|32)GB", None, 125, None, 15.7, _V100 + ", SXM2: tensor 125, FP32 15.7"),
    _tflops(r"Tesla V100S-PCIE-32GB", None, 130, None, 16.4, _V100 + ", V100S PCIe: tensor 130, FP32 16.4"),
    _tflops(r"Tesla V100-PCIE-(16|32)GB", None, 112, None, 14, _V100 + ", PCIe: tensor 112, FP32 14"),
    _tflops(r"Tesla T4", None, 65, None, 8.1,
            "NVIDIA T4 datasheet (t4-tensor-core-datasheet-951643.pdf): FP16/FP32 mixed precision 65, FP32 8.1"),
)

CPU_PEAK_CACHE = "cpu_peak_flops.json"  # in the cache dir ($HYDRATRAIN_CACHE or ~/.cache/hydratrain)
_CPU_MEASURE_VERSION = 1  # part of the cache key: bump when measure_matmul_flops changes what it measures
CPU_PEAK_LAUNCHES = 3  # launches that measure the CPU peak (the best counts) before the cached figure is final
_CPU_REMEASURE_AFTER_S = 60.0  # a launch's ranks measure at once: a new measurement only after this long
CPU_PEAK_RECHECK_S = 3600.0  # after CPU_PEAK_LAUNCHES measurements: one more, for the best, after this long
_WARNED: set = set()  # (device name, mode) pairs already warned about, so a sweep warns once per process


def _normalise(name: str) -> str:
    return " ".join(name.split())


def gpu_peak(name: str) -> Optional[GpuPeak]:
    """The :data:`GPU_PEAKS` entry whose pattern matches the whole of ``name`` (a ``torch.cuda.get_device_name()``
    string), or None. A MIG slice ("... MIG 1g.10gb") matches nothing: it has a fraction of the GPU's peak."""
    name = _normalise(name)
    for entry in GPU_PEAKS:
        if re.fullmatch(entry.pattern, name, flags=re.IGNORECASE):
            return entry
    return None


def _mode(dtype: torch.dtype, tf32: bool) -> Optional[str]:
    """The :class:`GpuPeak` field that bounds matmuls in ``dtype``: bf16 | fp16 | tf32 | fp32; None if unknown."""
    if dtype == torch.float32:
        return "tf32" if tf32 else "fp32"
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype)


def gpu_peak_flops(name: str, dtype: torch.dtype, tf32: bool) -> tuple[float, str]:
    """(dense peak FLOP/s of one GPU called ``name`` for matmuls in ``dtype``, where the figure comes from), or
    (NaN, why there is none). With ``tf32`` on a GPU without TF32 (Volta, Turing) fp32 matmuls run as plain fp32, so
    the fp32 peak applies."""
    entry, mode = gpu_peak(name), _mode(dtype, tf32)
    if entry is None:
        why = "a MIG slice has a fraction of its GPU's peak" if " MIG " in f" {name} " else "not in the table"
        return math.nan, f"no peak FLOP/s known for GPU {name!r} ({why})"
    if mode is None:
        return math.nan, f"no peak FLOP/s for compute dtype {dtype}"
    value = getattr(entry, mode)
    if value is None and mode == "tf32":
        mode, value = "fp32", entry.fp32
    if value is None:
        return math.nan, f"no {mode} peak FLOP/s for GPU {name!r} ({entry.source})"
    return value, f"{name}, {mode} dense peak from {entry.source}"


def tf32_enabled() -> bool:
    """Whether CUDA float32 matmuls may use TF32 tensor cores, as torch is configured now
    (``torch.backends.cuda.matmul.fp32_precision == "tf32"``, set by ``torch.set_float32_matmul_precision("high")``
    too; ``allow_tf32`` on torch versions without it)."""
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)
    if precision is not None:
        return precision == "tf32"
    return bool(matmul.allow_tf32)


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, m: int = 2048, n: int = 512,
                         budget_s: float = 0.5, min_iters: int = 3) -> float:
    """FLOP/s of ``F.linear`` on ``(m, n) x (n, n)`` in ``dtype`` on ``device`` (the kernels a model's Linear layers
    use) with this process's thread count: the best of repeated timed runs of ``2*m*n*n`` FLOPs, for about
    ``budget_s`` seconds (at least ``min_iters`` runs), so a moment of contention from other processes does not
    lower the peak much. Sustained contention still does: MFU on a shared CPU is indicative only. A dtype so slow
    that the warm-up call alone takes ``budget_s`` (fp16 on a CPU without native fp16: ~1 GFLOP/s) is timed once more
    instead of ``min_iters`` times, so the probe stays under a few seconds."""
    gen = torch.Generator(device=device).manual_seed(0)  # the run's RNG stays as seeded, measured or cached
    a = torch.randn(m, n, device=device, generator=gen).to(dtype)
    w = torch.randn(n, n, device=device, generator=gen).to(dtype)
    start = time.perf_counter()
    torch.nn.functional.linear(a, w)  # warm-up
    if time.perf_counter() - start > budget_s:
        min_iters = 1
    best, iters, start = float("inf"), 0, time.perf_counter()
    while iters < min_iters or time.perf_counter() - start < budget_s:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.nn.functional.linear(a, w)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
        iters += 1
    return 2 * m * n * n / best


def cpu_model() -> str:
    """This machine's CPU model ("AMD EPYC 7763 64-Core Processor"; on ARM Linux the implementer and part ids)."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    if fields.get("model name"):
        return fields["model name"]
    if fields.get("CPU part"):
        return f"{platform.machine()} implementer {fields.get('CPU implementer', '?')} part {fields['CPU part']}"
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_peak_key(dtype: torch.dtype) -> str:
    """Cache key of a CPU measurement: what the figure depends on (CPU model, logical CPUs, threads, dtype, torch)."""
    return (f"{cpu_model()} | {os.cpu_count()} cpus | {torch.get_num_threads()} threads | {str(dtype)} | "
            f"torch {torch.__version__} | v{_CPU_MEASURE_VERSION}")


def default_cache_dir() -> Path:
    """``$HYDRATRAIN_CACHE`` or ``~/.cache/hydratrain`` (the corpus cache of :mod:`hydratrain.data` too)."""
    return Path(os.environ.get("HYDRATRAIN_CACHE", Path.home() / ".cache" / "hydratrain"))


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (created), so ranks on one machine measure once; no lock where that fails."""
    fh = None
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(path, "a")
        fcntl.flock(fh, fcntl.LOCK_EX)
    except (ImportError, OSError) as e:
        log.debug("no lock on %s (%s): ranks may measure the CPU peak concurrently", path, e)
    try:
        yield
    finally:
        if fh is not None:
            fh.close()  # releases the lock


def cpu_peak_flops(dtype: torch.dtype, cache_dir: Optional[Path] = None) -> tuple[float, str]:
    """(FLOP/s of this process's CPU matmul in ``dtype``, where it comes from): read from
    ``<cache_dir>/cpu_peak_flops.json`` under :func:`cpu_peak_key`, else measured with :func:`measure_matmul_flops`
    (about 0.5 s) and stored there. Until :data:`CPU_PEAK_LAUNCHES` measurements at least a minute apart are stored
    (so, by different launches), a launch measures again, and after that one launch an hour
    (:data:`CPU_PEAK_RECHECK_S`); the figure is the best so far: a machine busy during the first measurements does
    not fix a low peak (high MFU) for good. A new figure more than 25 % above the stored one is logged as a warning.
    Concurrent ranks on one machine take a file lock, so one measures and the others read its figure. Delete the
    file to measure again."""
    path = Path(cache_dir if cache_dir is not None else default_cache_dir()) / CPU_PEAK_CACHE
    key = cpu_peak_key(dtype)
    with _file_lock(path.with_name(path.name + ".lock")):
        entries: dict = {}
        with contextlib.suppress(OSError, ValueError, AttributeError):
            entries = json.loads(path.read_text()).get("entries", {})
        if not isinstance(entries, dict):
            entries = {}
        hit: Any = entries.get(key)
        valid = isinstance(hit, dict) and isinstance(hit.get("flops"), (int, float)) and hit["flops"] > 0
        taken = [t for t in (hit.get("measurements") or [hit.get("measured_at")]) if isinstance(t, str)] if valid \
            else []
        wait = _CPU_REMEASURE_AFTER_S if len(taken) < CPU_PEAK_LAUNCHES else CPU_PEAK_RECHECK_S
        if valid and not _measured_long_ago(taken, wait):
            return float(hit["flops"]), f"cached in {path} ({key}, best of {len(taken)} launches' measurements)"
        flops = measure_matmul_flops(torch.device("cpu"), dtype)
        if valid:
            if flops > 1.25 * hit["flops"]:
                log.warning("CPU peak FLOP/s measured now: %.3g, %.1fx the %.3g cached in %s (measured while the CPU "
                            "was busy?); MFU uses the higher figure from now on: earlier runs' MFU on this machine "
                            "read %.1fx high", flops, flops / hit["flops"], hit["flops"], path, flops / hit["flops"])
            flops = max(flops, float(hit["flops"]))
        now = time.strftime("%Y-%m-%dT%H:%M:%S")
        entries[key] = {"flops": flops, "measured_at": now, "measurements": (taken + [now])[-CPU_PEAK_LAUNCHES:]}
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        try:
            tmp.write_text(json.dumps({"entries": entries}, indent=1, sort_keys=True))
            os.replace(tmp, path)
            where = f"measured now ({key}; best of {len(taken) + 1} launches) and cached in {path}"
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            where = f"measured now ({key}); not cached ({e})"
    return flops, where


def _measured_long_ago(taken: list, seconds: float) -> bool:
    """Whether the newest of the ``measured_at`` stamps ``taken`` is at least ``seconds`` old (an unreadable stamp
    counts as old)."""
    try:
        newest = max(time.mktime(time.strptime(t, "%Y-%m-%dT%H:%M:%S")) for t in taken)
    except (ValueError, OverflowError):
        return True
    return time.time() - newest >= seconds


def matmul_flops(device: torch.device, dtype: torch.dtype, tf32: bool = False,
                 cache_dir: Optional[Path] = None) -> tuple[float, str]:
    """(FLOP/s of matmuls in ``dtype`` on ``device``, where the figure comes from, briefly): on CPU the cached
    measurement of :func:`cpu_peak_flops`; on CUDA the datasheet peak (:func:`gpu_peak_flops`), or a short
    measurement when the table has none for this GPU and dtype (e.g. bf16 on a V100, which emulates it); NaN for
    other devices. For comparing dtypes on one device (``Precision.slow_path``), not for MFU."""
    if device.type == "cpu":
        flops, _ = cpu_peak_flops(dtype, cache_dir)
        return flops, "measured on this CPU, cached"
    if device.type == "cuda":
        flops, _ = gpu_peak_flops(torch.cuda.get_device_name(device), dtype, tf32)
        if math.isfinite(flops):
            return flops, "datasheet peaks"
        return measure_matmul_flops(device, dtype, budget_s=0.2), "measured on this GPU"
    return math.nan, f"no figure for device type {device.type!r}"


def peak_flops(device: torch.device, compute_dtype: Union[torch.dtype, str], override: Optional[float] = None,
               tf32: Optional[bool] = None, cache_dir: Optional[Path] = None, local_world_size: int = 1) -> float:
    """Peak FLOP/s of one device for matmuls in ``compute_dtype`` (torch dtype or "bfloat16"/"float16"/"float32"),
    or NaN when it is not known (then MFU is NaN; one warning per device and mode). See the module docstring.

    On CPU "one device" is one rank's threads, measured on this process's thread count (so on at most the cores it
    may use). When the node's ``local_world_size`` ranks together run more threads than those cores (4 ranks of 1
    thread on 2 cores), the figure is scaled by cores / (ranks x min(threads, cores)): the node's peak is its cores',
    not the sum of its ranks' (which made MFU read 2x low). One rank of more threads than cores measured
    the cores already and is not scaled.

    Args:
        override: ``logger.peak_flops``, FLOP/s of one device; wins when set.
        tf32: CUDA fp32 matmuls use TF32 tensor cores; None = as torch is configured (:func:`tf32_enabled`).
        cache_dir: where the CPU figure is cached; None = :func:`default_cache_dir`.
        local_world_size: ranks on this node (CPU only).
    """
    if override:
        return float(override)
    dtype = getattr(torch, compute_dtype) if isinstance(compute_dtype, str) else compute_dtype
    if device.type == "cpu":
        flops, where = cpu_peak_flops(dtype, cache_dir)

        cores = allowed_cores()
        busy = min(torch.get_num_threads(), cores) * local_world_size  # the figure measured min(threads, cores) cores
        if busy > cores:
            flops *= cores / busy
            where += (f"; x {cores}/{busy}: {local_world_size} ranks of {torch.get_num_threads()} thread(s) share "
                      f"{cores} cores")
        log.info("peak FLOP/s for MFU: %.1f GFLOP/s per rank, %s matmul %s; set logger.peak_flops to override",
                 flops / 1e9, dtype, where)
        return flops
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        flops, where = gpu_peak_flops(name, dtype, tf32_enabled() if tf32 is None else tf32)
    else:
        name, flops, where = device.type, math.nan, f"no peak FLOP/s known for device type {device.type!r}"
    if math.isnan(flops):
        if (name, str(dtype)) not in _WARNED:
            _WARNED.add((name, str(dtype)))
            log.warning("%s in %s: MFU is not reported; set logger.peak_flops=<dense FLOP/s of one device> "
                        "to get it", where, dtype)
    else:
        log.info("peak FLOP/s for MFU: %.1f TFLOP/s per device (%s); set logger.peak_flops to override",
                 flops / 1e12, where)
    return flops


_PROC_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def _proc_hwm_bytes() -> Optional[int]:
    """``VmHWM`` (peak resident set size) of this process from ``/proc/self/status``, in bytes; None without it."""
    with contextlib.suppress(OSError, ValueError):
        with open(_PROC_STATUS) as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB (KiB)
    return None


def reset_peak_memory(device: torch.device) -> bool:
    """Start a new peak-memory window, so start-up and earlier jobs of a sweep in this process do not count in the
    next :func:`peak_memory_bytes`. Returns whether the peak could be reset.

    * CUDA: ``torch.cuda.reset_peak_memory_stats`` (the peak restarts from what is allocated now).
    * CPU: ``getrusage``'s ``ru_maxrss`` is the peak over the process's whole life and cannot be reset. Linux keeps a
      resettable copy, ``VmHWM`` in ``/proc/self/status``: writing "5" to ``/proc/self/clear_refs`` sets it to the
      current resident set size (Linux >= 4.0; see proc(5)). Where that fails (no /proc, not Linux) the peak
      reported stays the lifetime maximum and this returns False.
    """
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    if device.type != "cpu":
        return False
    try:
        with open(_CLEAR_REFS, "w") as fh:
            fh.write("5")
        return True
    except OSError as e:
        log.debug("cannot reset the peak RSS through %s (%s): mem/peak is the process's lifetime peak",
                  _CLEAR_REFS, e)
        return False


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank in bytes since the last :func:`reset_peak_memory` (or since the process started).

    CUDA: ``torch.cuda.max_memory_allocated`` (tensors only; the caching allocator reserves more, and CUDA context
    and NCCL buffers are not counted). CPU: the peak resident set size of the whole process (``VmHWM``; weights,
    optimizer state, activations, but also the Python interpreter and the torch libraries, a few hundred MB), or
    ``ru_maxrss`` (not resettable) where ``/proc`` is missing.
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    hwm = _proc_hwm_bytes()
    if hwm is not None:
        return hwm
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def _quiet_writer_thread_errors() -> None:
    """Keep Python from printing the traceback of a write that failed on TensorBoard's writer thread (a full disk):
    the writer raises the same error again at the next write from the training loop, where the run reports it in one
    line (``hydratrain.run``). Other threads' errors print as before. Idempotent."""
    import threading

    previous = threading.excepthook
    if getattr(previous, "hydratrain", False):
        return

    def hook(args) -> None:
        if not (type(args.thread).__module__.startswith("tensorboard") and isinstance(args.exc_value, OSError)):
            previous(args)

    hook.hydratrain = True  # type: ignore[attr-defined]  # the mark of this hook (installed once)
    threading.excepthook = hook


class TensorBoardLogger:
    """Rank 0's ``SummaryWriter`` at ``<run_dir>/tensorboard``; on other ranks (or when disabled) every call is a no-op.

    The hparams row (:meth:`hparams`) goes to a run of its own, ``hparams/<launch>`` below ``log_dir``, which replaces
    the one an earlier launch into this run dir wrote: TensorBoard keeps the first session it reads in a run, so a
    row in the scalars' run would show the first launch's values forever. A sweep still reads as one table, one row
    per job.

    The ``SummaryWriter`` (and the tensorboard import, ~0.1 s) is made at the first write, after the first optimizer
    step, so it is not on the path to it.

    Earlier launches into the same run dir left their event files in ``log_dir``; TensorBoard reads them all as one
    run, in file order. Where this launch logs steps they already cover, :meth:`purge_from` has TensorBoard drop
    theirs, so no step shows twice.
    """

    def __init__(self, log_dir: Path, enabled: bool):
        self.log_dir, self.enabled, self._writer = log_dir, enabled, None
        self._purge_step: Optional[int] = None  # written first into this launch's event file (purge_from)
        self._carried: dict[str, float] = {}  # earlier scalars at _purge_step logged again after the purge

    @property
    def writer(self):
        """The ``SummaryWriter`` (made on first use), or None when disabled."""
        if self._writer is None and self.enabled:
            from torch.utils.tensorboard import SummaryWriter

            _quiet_writer_thread_errors()
            self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=self._purge_step)
            carried, self._carried = self._carried, {}
            for tag, value in carried.items():
                self._writer.add_scalar(tag, value, self._purge_step)
        return self._writer

    def has_earlier_events(self) -> bool:
        """Whether ``log_dir`` holds event files of earlier launches (ask before this logger's first write)."""
        return self.enabled and self._writer is None and any(Path(self.log_dir).glob("events.out.tfevents.*"))

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        if self.writer:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)

    def purge_from(self, step: int, keep: Optional[Callable[[str], bool]] = None) -> None:
        """Have TensorBoard drop every event of earlier launches at ``step`` and after, whatever its tag: a
        ``SessionLog.START`` event at ``step``, as ``SummaryWriter(purge_step=step)`` writes, first in this launch's
        event file (made at its first write: a launch that logs nothing drops nothing). ``keep``: the tags whose
        earlier point at exactly ``step`` (as TensorBoard loads ``log_dir`` now) is logged again right after it, so
        it survives (reads the earlier events, once).

        TensorBoard's readers: ``event_accumulator`` and the server's ``plugin_event_accumulator`` purge at a START
        (the latter at every START but a run's first, the start of its first session; its scalars, text and hparams
        alike, the former scalars only); the Rust data server drops, per tag, the points at and after each step
        that comes again, whatever the START events."""
        if not self.enabled:
            return
        carried = self._points_at(step, keep) if keep is not None else {}
        if self._writer is None:
            self._purge_step, self._carried = step, carried
            return
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        self._writer.file_writer.add_event(Event(step=step, session_log=SessionLog(status=SessionLog.START)))
        self.scalars(carried, step)

    def _points_at(self, step: int, keep: Callable[[str], bool]) -> dict[str, float]:
        """``{tag: value}`` of the scalars of tags ``keep`` accepts at ``step`` in ``log_dir``, as TensorBoard loads
        it (earlier purges applied)."""
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        quiet = logging.getLogger("tensorboard")
        level = quiet.level
        quiet.setLevel(max(level, logging.WARNING))  # not a line per event file read
        try:
            acc = EventAccumulator(str(self.log_dir), size_guidance={"scalars": 0})
            acc.Reload()
        except Exception as e:  # unreadable events lose a point, not the run
            log.warning("could not read the TensorBoard events in %s (%s): their scalars of step %d are dropped",
                        self.log_dir, e, step)
            return {}
        finally:
            quiet.setLevel(level)
        out = {}
        for tag in acc.Tags()["scalars"]:
            if keep(tag):
                at = [e.value for e in acc.Scalars(tag) if e.step == step]
                if at:
                    out[tag] = at[-1]
        return out

    def text(self, tag: str, text: str, step: int) -> None:
        if self.writer:
            self.writer.add_text(tag, text, step)

    def hparams(self, hparams: Mapping[str, object], metrics: Mapping[str, float], step: int) -> Optional[Path]:
        """One hparams row (a TensorBoard session): ``hparams`` (flat) against final ``metrics`` (scalars
        ``hparam/*``), written at ``step`` (the run's last) into ``<log_dir>/hparams/<time>``, a TensorBoard run of
        its own; the rows of earlier launches into this run dir (the other dirs there) are removed once it is
        written, so the table has one row per run dir, with the values of the launch that wrote it last (a
        TensorBoard server started before may show the earlier row too until it restarts). Returns the row's dir.

        Each value keeps its type, so a key swept over runs is one column of one type: bool -> a bool cell (torch's
        ``hparams()`` would write 1.0/0.0), int/float -> a number, str -> a string, None -> no cell (blank in the
        table, as TensorBoard shows a value a run does not have), anything else -> its ``str``; written as
        TensorBoard's own session summary (``tensorboard.plugins.hparams.summary_v2.hparams_pb``). No experiment
        summary is written: TensorBoard's hparams plugin then types each column from every run's values (mixed types
        read as strings) instead of taking one arbitrary run's column list and types for the whole table. A
        non-finite metric (MFU of a GPU with no known peak) is left out: no cell rather than NaN.
        """
        if not self.enabled:
            return None
        import shutil

        from tensorboard.plugins.hparams.summary_v2 import hparams_pb
        from torch.utils.tensorboard import SummaryWriter

        root = Path(self.log_dir) / "hparams"
        row = root / time.strftime("%Y-%m-%d_%H-%M-%S")
        n = 0
        while row.exists():
            n += 1
            row = root / f"{time.strftime('%Y-%m-%d_%H-%M-%S')}-{n}"
        typed = {k: (v if isinstance(v, (bool, int, float, str)) else str(v)) for k, v in hparams.items()
                 if v is not None}
        writer = SummaryWriter(log_dir=str(row))
        try:
            # (file_writer: set by SummaryWriter's constructor): why the ignore below
            writer.file_writer.add_summary(hparams_pb(typed, start_time_secs=time.time()), step)  # type: ignore[attr-defined]
            for k, v in metrics.items():
                if v is not None and math.isfinite(v):
                    writer.add_scalar(f"hparam/{k}", v, step)
        finally:
            writer.close()
        for earlier in root.iterdir():
            if earlier != row and earlier.is_dir():
                shutil.rmtree(earlier, ignore_errors=True)
        return row

    def flush(self) -> None:
        if self._writer:
            self._writer.flush()

    def close(self) -> None:
        if self._writer:
            self._writer.close()
