"""The memory planner: each rank's peak memory, predicted before anything is allocated, and the cheapest changes
that fit a budget.

Every run logs one line of it at the start (rank 0), a warning and the changes that fit when the prediction is over
the budget; a run that runs out of memory stops with the breakdown and those changes (exit status 6,
``hydratrain.errors.OutOfMemoryError``); ``python -m hydratrain.plan`` plans a launch before making it
(:mod:`hydratrain.plan_cli`). Bytes everywhere; GiB = 2**30 bytes.

What is counted, and how: :mod:`hydratrain.footprint` (any model: :mod:`hydratrain.stepsim`; hydratrain's GPT:
:mod:`hydratrain.models.gpt_memory`); activations on storage-less tensors: :mod:`hydratrain.memsim`.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Literal, Optional

import torch
from omegaconf import OmegaConf

from hydratrain import components
from hydratrain.components import locate
from hydratrain.config.schema import AdamW8bitConfig, AdamWConfig, FSDPStrategy, SizeBasedWrapPolicy
from hydratrain.config.settings import DataSettings, LoraSettings, option_value
from hydratrain.errors import ConfigError, OutOfMemoryError
from hydratrain.footprint import GiB, ModelSpec, Plan, PlanUnavailable, Setup
from hydratrain.protocols import has_memory_plan
from hydratrain.stepsim import describe, token_batch
from hydratrain.stepsim import predict as simulated

__all__ = ["GiB", "ModelSpec", "Plan", "PlanUnavailable", "Setup", "predict", "suggestions", "budget_bytes",
           "plan_run", "OutOfMemoryGuard"]
log = logging.getLogger("hydratrain.plan")


# ------------------------------------------------------------------------------------------------ suggestions
@dataclass(frozen=True)
class Suggestion:
    """A change (command-line overrides, launch changes) and the :class:`Plan` it gives."""

    changes: tuple
    plan: Plan

    def __str__(self) -> str:
        return f"{' '.join(self.changes)} -> peak {self.plan.peak / GiB:.2f} GiB"


def _micro_batches(s: Setup) -> list[Setup]:
    """Smaller micro-batches with more accumulation, the same tokens per optimizer step: largest first."""
    return [s.replace(batch_size=s.batch_size // k, grad_accum_steps=s.grad_accum_steps * k)
            for k in range(2, s.batch_size + 1) if s.batch_size % k == 0]


def _more_ranks(s: Setup, max_world: int = 4096) -> list[Setup]:
    """FSDP on this many ranks, then 2x, 4x, ... (FSDP on this world size first when there are several ranks)."""
    out = [s.replace(strategy="fsdp", shard_degree=None)] if s.strategy != "fsdp" and s.world_size > 1 else []
    w = s.world_size * 2
    while w <= max_world:
        out.append(s.replace(strategy="fsdp", world_size=w, shard_degree=None))
        w *= 2
    return out


def error_margin(device: str) -> float:
    """How many times the predicted part of its peak a run may need on ``device`` (``cpu``/``cuda``), from
    measurements (docs/memory-planner.md): 2.0 on a CPU with glibc's malloc as it comes (its heap keeps freed tensors:
    up to 1.8x the prediction by ``bench/plan_accuracy.py --malloc default``, 2.1x measured once with activation
    checkpointing), else 1.15 (CUDA, or a CPU with ``MALLOC_MMAP_THRESHOLD_`` set: at most 9 % measured)."""
    if device == "cpu" and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        return 2.0
    return 1.15


def suggestions(s: Setup, budget: int, limit: int = 4, margin: float = 1.0) -> list[Suggestion]:
    """The cheapest changes of ``s`` whose predicted peak, with ``margin`` (:func:`error_margin`) on its predicted part
    (:meth:`Plan.with_margin`), fits ``budget`` bytes, at most ``limit``, cheapest first.

    Cost order (what each costs in speed): bf16 (nothing where the hardware computes it natively), a smaller
    micro-batch with more accumulation (same tokens per step, smaller kernels), activation checkpointing (one more
    forward per step, about +33% FLOPs), more ranks (more hardware; FSDP shards parameters, gradients and optimizer
    state over them), CPU offload of FSDP's shards (bound by host-device copies; CUDA only). Single changes come
    first; when none fits alone, the cheap switches (bf16, activation checkpointing) are combined with the others.
    More ranks multiply the tokens per step unless the accumulation is lowered."""
    plans: dict = {}

    def plan_of(candidate: Setup) -> Plan:
        if candidate not in plans:
            plans[candidate] = predict(candidate)
        return plans[candidate]

    def first_fit(family: list[Setup]) -> Optional[Setup]:
        return next((c for c in family if plan_of(c).with_margin(margin) <= budget), None)

    def options(base: Setup) -> list[list[Setup]]:  # one change on top of base, cheapest first
        out = [[base.replace(precision="bf16")]] if base.precision == "fp32" else []
        out.append(_micro_batches(base))
        if not base.activation_checkpointing:
            out.append([base.replace(activation_checkpointing=True)])
        out.append(_more_ranks(base))
        if base.shards and base.device == "cuda" and not base.cpu_offload:
            out.append([base.replace(cpu_offload=True)])
        return out

    found = [c for family in options(s) if (c := first_fit(family)) is not None]
    if not found:  # two or three changes: the cheap switches, then one more change on top
        switched = [b for b in (s.replace(precision="bf16") if s.precision == "fp32" else None,
                                s.replace(activation_checkpointing=True) if not s.activation_checkpointing else None)
                    if b is not None]
        if len(switched) == 2:
            switched.append(s.replace(precision="bf16", activation_checkpointing=True))
        for base in switched:
            found += [c for family in options(base) if (c := first_fit(family)) is not None]
    unique = list(dict.fromkeys(found))
    return [Suggestion(tuple(s.overrides(c)), plan_of(c)) for c in unique][:limit]


# ------------------------------------------------------------------------------------------------- budgets
def _proc_kib(path: str, key: str) -> Optional[int]:
    """``key:`` of a /proc file in bytes (the kernel writes kB, i.e. KiB); None where there is none."""
    try:
        with open(path) as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def resident_bytes() -> int:
    """This process's resident set size (``VmRSS``, /proc/self/status), bytes; 0 where /proc is missing."""
    return _proc_kib("/proc/self/status", "VmRSS") or 0


def baseline_bytes(device) -> int:
    """What the process holds before the model: CUDA: ``torch.cuda.memory_allocated`` on ``device``; CPU: the
    resident set size (the interpreter, torch's libraries, the data, measured rather than guessed)."""
    if device.type == "cuda":
        import torch

        return torch.cuda.memory_allocated(device)
    return resident_bytes()


def budget_bytes(memory_gb: Optional[float], device, ranks_per_node: int, in_run: bool = True) -> tuple[int, str]:
    """(per-rank budget in bytes, where it comes from): ``plan.memory_gb`` (GiB) when set; CUDA: the total memory of
    ``device``; CPU: the tightest of the node's available memory (``MemAvailable``, /proc/meminfo), the room left
    under this process's cgroup memory limit (both shared by the node's ``ranks_per_node`` ranks) and under its
    address-space limit (``RLIMIT_AS``, its own), plus its own resident set when ``in_run`` (the ranks exist, so their
    memory is not "available"; a planning process's own resident set goes away with it)."""
    if memory_gb:
        return max(1, int(memory_gb * GiB)), "plan.memory_gb"  # at least a byte: 1e-12 GiB is a budget, not a crash
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_properties(device).total_memory, f"total memory of {device}"
    own = resident_bytes()
    available = _proc_kib("/proc/meminfo", "MemAvailable")
    if available is None:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    shared = [(available, "available RAM")]
    room = _cgroup_room()
    if room is not None:
        shared.append((room, "room under the cgroup memory limit"))
    candidates = [((own + room // ranks_per_node) if in_run else (room + own) // ranks_per_node,
                   f"{what} / {ranks_per_node} rank(s)" + (" + this rank's RSS" if in_run else ""))
                  for room, what in shared]
    import resource

    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit != resource.RLIM_INFINITY:
        virtual = _proc_kib("/proc/self/status", "VmSize") or 0
        candidates.append((own + max(0, limit - virtual), "room under RLIMIT_AS (address space) + this rank's RSS"))
    return min(candidates)


def _cgroup_room() -> Optional[int]:
    """Bytes left under this process's cgroup memory limit (v2 ``memory.max`` - ``memory.current``, or v1
    ``memory.limit_in_bytes`` - ``memory.usage_in_bytes``); None without a limit."""
    try:
        with open("/proc/self/cgroup") as fh:
            entries = [line.strip().split(":", 2) for line in fh]
    except OSError:
        return None
    for _, controllers, path in entries:
        if controllers == "":
            files = (f"/sys/fs/cgroup{path}/memory.max", f"/sys/fs/cgroup{path}/memory.current")
        elif "memory" in controllers.split(","):
            files = (f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes",
                     f"/sys/fs/cgroup/memory{path}/memory.usage_in_bytes")
        else:
            continue
        try:
            limit, usage = (Path(f).read_text().strip() for f in files)
        except OSError:
            continue
        if limit.isdigit() and int(limit) < 2 ** 60:
            return max(0, int(limit) - int(usage))
    return None


# ------------------------------------------------------------------------------------------------- the run
def setup_for(cfg, strategy, *, world_size: int, precision: str, vocab_size: Optional[int], device: str,
              baseline: int, local_world_size: int = 1, example: Optional[Callable[[int], Any]] = None) -> Setup:
    """The :class:`Setup` of the run config ``cfg`` with its :class:`~hydratrain.parallel.strategy.Strategy`, on
    ``world_size`` ranks (``local_world_size`` per node: hsdp's default shard group), with the resolved
    ``precision`` preset and vocabulary. ``example(n)``: a micro-batch of ``n`` samples of the run's data, whose
    shapes the generic plan runs the model on (without it, token data gives a ``(batch_size, data.seq_len)`` token
    batch). Raises :class:`PlanUnavailable` for a strategy the planner does not model, and
    :class:`~hydratrain.errors.ConfigError` for a model node that names no class."""

    if strategy.name not in ("single", "ddp", "fsdp", "hsdp"):
        raise PlanUnavailable(f"strategy={strategy.name} is not modelled by the planner")
    target = components.target_of(cfg.get("model"), "model")
    # (to_container of a DictConfig: a dict with str keys)
    node = {k: v for k, v in OmegaConf.to_container(cfg.model, resolve=True).items() if k.startswith("_")}  # type: ignore[union-attr,arg-type]
    node.update(components.model_kwargs(cfg, vocab_size))
    loss = OmegaConf.to_container(cfg.loss, resolve=True) if cfg.get("loss") is not None else {}
    data = DataSettings.of(cfg.data)
    batch_size, seq_len = int(data.batch_size), data.seq_len
    spec = ModelSpec(target, json.dumps(node, sort_keys=True, default=str),
                     json.dumps(loss, sort_keys=True, default=str), _example(example, batch_size, seq_len),
                     tuple(cfg.wrap_policy.get("block_classes") or ()), peft=_peft_json(cfg))
    return Setup(model=spec, strategy=strategy.name,
                 world_size=1 if strategy.name == "single" else world_size, precision=precision,
                 reduce_dtype=str(cfg.precision.reduce_dtype), wrap_policy=str(cfg.wrap_policy.name),
                 min_num_params=int(option_value(cfg.wrap_policy, "min_num_params", SizeBasedWrapPolicy)),
                 reshard_after_forward=bool(option_value(cfg.strategy, "reshard_after_forward", FSDPStrategy)),
                 cpu_offload=strategy.cpu_offload, activation_checkpointing=bool(cfg.activation_checkpointing),
                 batch_size=batch_size, seq_len=seq_len,
                 grad_accum_steps=int(cfg.trainer.grad_accum_steps), device=device, baseline=baseline,
                 shard_degree=strategy.shard_degree(world_size, local_world_size) if strategy.name == "hsdp" else None,
                 optim=str(cfg.optim.get("name") or "own"),
                 optim_block_size=int(option_value(cfg.optim, "block_size", AdamW8bitConfig)),
                 optim_impl=str(option_value(cfg.optim, "impl", AdamWConfig)), loader_workers=data.num_workers)


def _peft_json(cfg) -> str:
    """``+peft=lora``'s settings as :attr:`ModelSpec.peft` holds them ("" without)."""
    adapters = LoraSettings.of(cfg)
    return json.dumps(dataclasses.asdict(adapters), sort_keys=True) if adapters is not None else ""


def _example(example: Optional[Callable[[int], Any]], batch_size: int, seq_len: int) -> tuple:
    """The example micro-batch, described (:func:`hydratrain.stepsim.describe`): ``example(batch_size)``'s, a
    token batch of ``seq_len`` without it, else none (the generic plan then says it has no activations)."""
    if example is not None:
        try:
            return describe(example(batch_size))
        except ConfigError:  # the data's own fault (a batch outside the contract): the run's, not the plan's
            raise
        except Exception as err:  # noqa: BLE001 (the plan is advice: it says it has no example instead)
            log.warning("memory plan: no example batch (%s: %s)", type(err).__name__, err)
            return ()
    return token_batch(batch_size, seq_len) if seq_len else ()


@dataclass
class RunPlan:
    """A run's plan, its budget and the changes that fit (empty when it fits); see :func:`plan_run`."""

    plan: Plan
    budget: int
    budget_from: str
    fixes: list
    margin: float = 1.0  # the fixes' peaks with this margin on their predicted parts fit the budget (error_margin)

    @property
    def fits(self) -> bool:
        return self.plan.peak <= self.budget

    def line(self) -> str:
        """The start-of-run line."""
        verdict = "fits" if self.fits else "EXCEEDS the budget"
        return (f"memory plan: {self.plan.summary()}; budget {self.budget / GiB:.2f} GiB per rank "
                f"({self.budget_from}): {verdict}")

    def advice(self) -> str:
        """The changes that fit, one line: ``fits with (a x1.15 margin ...): a=1 (3.1 GiB); b=2 c=3 (2.9 GiB)``."""
        if not self.fixes:
            return "no single change the planner tries fits; see python -m hydratrain.plan"
        kept = f" (a x{self.margin:g} margin for the planner's error here)" if self.margin > 1 else ""
        fixes = "; ".join(f"{' '.join(f.changes)} ({f.plan.peak / GiB:.2f} GiB)" for f in self.fixes)
        return f"fits with{kept}: {fixes}"


# strategy.cpu_offload=true against false, tokens/s: 137,934 / 56,316 for gpt_small (8 x 1024 tokens, bf16, fsdp) on
# one H200 with torch 2.11 (bench/gpu.sh, bench/results/h200-2026-11-30/gpu.md): parameters, gradients and the AdamW
# step live on the CPU and cross PCIe every step.
OFFLOAD_SLOWDOWN = (137_934 / 56_316, "gpt_small, bf16, fsdp on one H200, bench/results/h200-2026-11-30")


def offload_slow_path(setup: Setup, budget: int) -> Optional[str]:
    """A one-line warning when ``strategy.cpu_offload=true`` on a GPU is not needed: the plan without offload fits
    ``budget`` (bytes per rank). Offload is a slow path (:data:`OFFLOAD_SLOWDOWN`) worth paying only to fit; None
    when offload is off, the device is a CPU, or the run does not fit without it."""
    if not setup.cpu_offload or setup.device == "cpu":
        return None
    without = predict(setup.replace(cpu_offload=False))
    if without.peak > budget:
        return None
    factor, where = OFFLOAD_SLOWDOWN
    return (f"strategy.cpu_offload=true is a slow path here: the memory plan fits without it ({without.peak / GiB:.2f} "
            f"of {budget / GiB:.2f} GiB per rank), and offload trained {factor:.1f}x slower than without ({where}); "
            "strategy.cpu_offload=false is faster")


def with_baseline(setup: Setup, baseline: Callable[[], int]) -> Plan:
    """The plan of ``setup`` with its baseline measured (``baseline()``, bytes) once the planner has simulated the
    model: the modules the simulation imports (51 MiB of meta kernels for the GPT's block; ``torch._dynamo``, 67 MiB,
    for most models) stay resident through the run, so they belong to what the process holds before the model."""
    predict(setup)
    return predict(setup.replace(baseline=baseline()))


def plan_run(cfg, strategy, info, precision, vocab_size: Optional[int],
             example: Optional[Callable[[int], Any]] = None) -> Optional[RunPlan]:
    """Predict this rank's peak before the model is built, log it (rank 0 prints one line; the table goes to each
    rank's log file) and warn with the changes that fit when it exceeds the budget. ``example(n)``: a micro-batch
    of ``n`` samples of the run's data (:meth:`hydratrain.data.streams.ShardedBatches.example`), for a model the
    planner simulates. Never stops the run for the planner's sake: returns None (and logs why) when the planner
    cannot predict this setup or ``plan.enabled`` is false; raises the :class:`ConfigError` of a config fault it
    meets (a data batch outside the batch contract), which the run would raise at its first step."""
    if not OmegaConf.select(cfg, "plan.enabled", default=True):
        return None

    # the run's random state stays as seeded: a DataLoader iterator (the example batch) draws its base seed from the
    # global generator, and the model is built after the plan (an eager build draws its initial weights from it)
    with torch.random.fork_rng(devices=[]):
        return _plan_run(cfg, strategy, info, precision, vocab_size, example)


def _plan_run(cfg, strategy, info, precision, vocab_size, example) -> Optional[RunPlan]:
    try:
        setup = setup_for(cfg, strategy, world_size=info.world_size, precision=precision.name,
                          vocab_size=vocab_size, device=info.device.type, baseline=0,
                          local_world_size=info.local_world_size, example=example)
        plan = with_baseline(setup, lambda: baseline_bytes(info.device))
        setup = plan.setup
        budget, source = budget_bytes(OmegaConf.select(cfg, "plan.memory_gb", default=None), info.device,
                                      info.local_world_size)
        run = RunPlan(plan, budget, source, [], error_margin(info.device.type))
        if not run.fits:
            run.fixes = suggestions(setup, budget, margin=run.margin)
        slow = offload_slow_path(setup, budget)
    except ConfigError:  # the run's own fault, found on the example batch: the same line the run would give
        raise
    except Exception as err:  # the plan is advice: a planner bug must not stop training
        log.warning("memory plan unavailable: %s: %s", type(err).__name__, err)
        return None
    for line in plan.table():
        log.info(line, extra={"file_only": True})
    if run.fits:
        log.info(run.line())
    else:
        log.warning("%s; %s", run.line(), run.advice())
    if slow:
        log.warning(slow)
    return run


def is_out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is an allocation failure: CUDA's ``torch.OutOfMemoryError``, the CPU allocator's
    ``RuntimeError`` ("DefaultCPUAllocator: can't allocate memory"), ``std::bad_alloc``, Python's MemoryError, or a
    lazy import whose shared library could not be mapped ("failed to map segment from shared object")."""
    if isinstance(err, MemoryError):
        return True
    if isinstance(err, ImportError) and ("failed to map segment" in str(err) or "Cannot allocate memory" in str(err)):
        return True
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(err, getattr(torch, "OutOfMemoryError", ())):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and ("can't allocate memory" in text or "bad_alloc" in text
                                              or "out of memory" in text.lower())


class OutOfMemoryGuard:
    """A context manager that turns an allocation failure (:func:`is_out_of_memory`) into
    :class:`hydratrain.errors.OutOfMemoryError` (exit status 6) whose one-line message gives what failed, the
    planner's breakdown and the changes that fit. ``run_plan`` is set once the run has made its plan."""

    def __init__(self):
        self.run_plan: Optional[RunPlan] = None

    def __enter__(self) -> "OutOfMemoryGuard":
        return self

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        if exc is None or not is_out_of_memory(exc):
            return False
        import traceback


        what = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        log.error("out of memory:\n%s", "".join(traceback.format_exception(exc)), extra={"file_only": True})
        # The failed step's frames hold its tensors as long as this traceback lives; drop them now, so the memory
        # comes back before the teardown (which needs some: under an address-space limit even a thread's stack).
        exc.__traceback__ = None
        del tb
        if self.run_plan is None:
            raise OutOfMemoryError(f"{what} (no memory plan was made for this run)") from None
        rp = self.run_plan
        if not rp.fixes and rp.fits:  # it fitted on paper: aim below its own prediction, by the margin
            rp.fixes = suggestions(rp.plan.setup, int(rp.plan.peak * 0.8), margin=1.0)
            rp.margin = 1.0
        log.error("memory plan of this run:\n%s", "\n".join(rp.plan.table()), extra={"file_only": True})
        raise OutOfMemoryError(f"{what}; planned {rp.plan.summary()}, budget {rp.budget / GiB:.2f} GiB per rank "
                               f"({rp.budget_from}); {rp.advice()}") from None


# -------------------------------------------------------------------------------------------------- predict
@lru_cache(maxsize=16)
def _memory_model(target: str) -> Optional[Any]:
    """The ``memory_plan`` classmethod of the class ``target`` names, or None (no such hook)."""
    cls = locate(target, "model")
    return cls.memory_plan if has_memory_plan(cls) else None


def predict(s: Setup) -> Plan:
    """The :class:`Plan` of setup ``s``: the model class's own ``memory_plan(s)`` where it has one that answers (and
    the run names no LoRA), else the generic plan (:func:`hydratrain.stepsim.predict`). Raises what they raise
    (:class:`hydratrain.plan.PlanUnavailable` when the model does not build on the meta device)."""
    hook = _memory_model(s.model.target) if not s.model.peft else None  # (a model's own plan: every weight trained)
    plan = hook(s) if hook is not None else None
    if plan is None:
        plan = simulated(s)
    return plan
