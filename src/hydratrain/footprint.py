"""The bytes one rank holds during a training step, moment by moment: :func:`predict` a :class:`Setup`.

A :class:`Setup` is what one rank's peak depends on (the model, strategy, world size, precision, micro-batch,
activation checkpointing, optimizer, device, what the process already holds); a :class:`Plan` is the prediction:
the peak, the moment of the step it falls on, and its parts in bytes. Any model is planned, by one of two routes:

* **The model's own memory model.** A model class may define the classmethod ``memory_plan(setup) -> Plan | None``
  (hydratrain's GPT does: :mod:`hydratrain.models.gpt_memory`, an analytic moment-by-moment model of its blocks and
  head, within 9 % of the measured peak in docs/memory-planner.md); the planner asks the class named by
  ``model._target_`` for it, as MFU asks a model for ``flops_per_token``. None falls back to the generic plan.
* **The generic plan** (:mod:`hydratrain.stepsim`), for any ``nn.Module``: parameter, gradient and optimizer bytes
  exactly from a build on the meta device, sharded as the strategy shards them; activations from running the real
  model forward, the run's loss and backward on storage-less tensors (:mod:`hydratrain.memsim`) for an example
  micro-batch of the run's shapes.

What a rank holds, in both: parameters (fp32 master weights; FSDP: this rank's shard of each, dim 0 padded to a
multiple of the shard group as ``fully_shard`` pads it), gradients (until ``zero_grad(set_to_none=True)``; through the
whole step under accumulation), the optimizer's state and its step's temporaries, DDP's gradient buckets, FSDP's
all-gather and reduce-scatter buffers, the activations and the loss, this and the prefetched next micro-batch, and
the process's baseline (CPU: its resident set when the plan is made; CUDA: the tensors already allocated). Bytes
everywhere; GiB = 2**30 bytes. Not counted (:meth:`Plan.not_covered`): evaluation, checkpoint saves, compile,
DataLoader worker processes, CUDA's context and caching allocator, and on CPU the heap glibc's malloc keeps.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from hydratrain.memsim import Mode
from hydratrain.optim import FUSED_DEVICES
from hydratrain.parallel.wrap_policy import shard_units

GiB = 2 ** 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# fp8 is planned as bf16: its float8 copies of a layer's input and weight live only around that layer's gemms
PRECISION_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16"}
# what a CPU plan leaves out (docs/memory-planner.md: measured with glibc as it comes and with the threshold set)
CPU_FACT = ("CPU: this counts tensors; glibc's malloc keeps freed memory in its heap, and the resident set measured "
            "40-120% above it (docs/memory-planner.md); MALLOC_MMAP_THRESHOLD_=131072 in the environment makes it "
            "track the tensors, at the cost of page faults")


class PlanUnavailable(RuntimeError):
    """The planner cannot predict this setup (the run goes on without a plan)."""


@dataclass(frozen=True)
class ModelSpec:
    """What the planner knows of the model, hashable (so plans can be cached): ``target`` (``model._target_``),
    ``node`` (the model node's constructor keywords and Hydra keys as JSON, vocabulary resolved), ``loss`` (the loss
    node as JSON), ``batch`` (an example micro-batch's structure and shapes, :func:`hydratrain.stepsim.describe`;
    empty for a model with its own memory model), ``block_classes`` (``wrap_policy.block_classes``), ``peft``."""

    target: str
    node: str = "{}"
    loss: str = "{}"
    batch: tuple = ()
    block_classes: tuple = ()
    peft: str = ""  # ``+peft=lora``'s settings as JSON (the adapters the model gets, the base frozen); "" without

    def keywords(self) -> dict:
        """The model's constructor keywords (the node without Hydra's ``_..._`` keys)."""
        return {k: v for k, v in json.loads(self.node).items() if not k.startswith("_")}


@dataclass(frozen=True)
class Setup:
    """What one rank's peak depends on. ``model``: a :class:`ModelSpec`; ``precision``: the resolved preset (fp32 |
    bf16 | fp16); ``seq_len``: tokens per sample of token data (0 for a dataset's samples, whose shapes are in the
    spec); ``device``: cpu | cuda; ``baseline``: bytes the process holds before the model (CPU: resident set; CUDA:
    allocated); ``loader_workers``: ``data.num_workers`` (processes the plan does not count)."""

    model: ModelSpec
    strategy: str = "single"
    world_size: int = 1
    precision: str = "fp32"
    reduce_dtype: str = "float32"
    wrap_policy: str = "auto"
    min_num_params: int = 100_000
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    batch_size: int = 8
    seq_len: int = 256
    grad_accum_steps: int = 1
    device: str = "cpu"
    baseline: int = 0
    shard_degree: Optional[int] = None  # hsdp: ranks of a shard group (fsdp shards over all world_size ranks)
    optim: str = "adamw"  # adamw | adamw8bit | own (an optim._target_: planned as AdamW)
    optim_block_size: int = 256  # adamw8bit: values per quantisation block
    optim_impl: str = "auto"  # optim.impl: auto | fused | foreach | for_loop (auto is fused on cpu and cuda)
    loader_workers: int = 0

    @property
    def shards(self) -> bool:
        """Whether parameters are sharded (fsdp, hsdp)."""
        return self.strategy in ("fsdp", "hsdp")

    @property
    def shard_world(self) -> int:
        """Ranks one parameter is split across: the world size (fsdp), a shard group (hsdp), 1 otherwise."""
        return (self.shard_degree or self.world_size) if self.shards else 1

    def replace(self, **changes) -> "Setup":
        return dataclasses.replace(self, **changes)

    def overrides(self, other: "Setup") -> list[str]:
        """The command-line overrides (and launch change) that turn this setup into ``other``."""
        out = []
        if other.strategy != self.strategy:
            out.append(f"strategy={other.strategy}")
        if other.world_size != self.world_size:
            out.append(f"{other.world_size} ranks")
        for key, name in (("precision", "precision"), ("activation_checkpointing", "activation_checkpointing"),
                          ("cpu_offload", "strategy.cpu_offload"), ("batch_size", "data.batch_size"),
                          ("grad_accum_steps", "trainer.grad_accum_steps")):
            if getattr(other, key) != getattr(self, key):
                value = getattr(other, key)
                out.append(f"{name}={str(value).lower() if isinstance(value, bool) else value}")
        return out


@dataclass
class Plan:
    """A prediction: ``peak`` bytes at the moment ``moment``, made of ``parts`` ({name: bytes}, summing to the
    peak), with ``notes`` ({name: what the bytes are}), ``facts`` (per-stage figures, lines of text), the model's
    and the micro-batch's description for the table (``model_desc``, ``batch_desc``) and ``unpredicted``: the
    parts the planner could not predict for this model (not in the peak), one phrase each."""

    setup: Setup
    peak: int
    moment: str
    parts: dict
    notes: dict = field(default_factory=dict)
    facts: list = field(default_factory=list)
    n_params: int = 0
    model_desc: str = "model"
    batch_desc: str = ""
    unpredicted: list = field(default_factory=list)

    def with_margin(self, margin: float) -> int:
        """The peak with ``margin`` (:func:`hydratrain.plan.error_margin`) on the predicted part only, bytes: the
        baseline is measured (this process's resident set, or CUDA's allocated bytes), so no prediction error is in
        it, and a x2 margin on a large baseline alone could exceed a budget that every smaller batch fits."""
        baseline = min(self.parts.get("baseline", 0), self.peak)
        return int(baseline + (self.peak - baseline) * margin)

    def summary(self) -> str:
        """``peak 5.31 GiB at <moment> (parameters 0.32 + ... GiB)``, and what it leaves out when it could not
        predict a part."""
        parts = " + ".join(f"{k} {v / GiB:.2f}" for k, v in self.parts.items() if v >= GiB / 200)
        missing = f"; not predicted: {'; '.join(self.unpredicted)}" if self.unpredicted else ""
        return f"peak {self.peak / GiB:.2f} GiB at {self.moment} ({parts} GiB){missing}"

    def table(self) -> list[str]:
        s = self.setup
        head = (f"memory plan per rank: {self.model_desc}, strategy={s.strategy} on {s.world_size} rank(s)"
                + (f" (shard groups of {s.shard_world}, wrap_policy={s.wrap_policy}, reshard_after_forward="
                   f"{str(s.reshard_after_forward).lower()}, cpu_offload={str(s.cpu_offload).lower()})"
                   if s.shards else "") + f", optim={s.optim}"
                + f", precision={s.precision}, {self.batch_desc}, "
                f"grad_accum_steps={s.grad_accum_steps}, "
                f"activation_checkpointing={str(s.activation_checkpointing).lower()}, device {s.device}")
        lines = [head]
        for name, value in self.parts.items():
            lines.append(f"  {name:<18} {value / GiB:9.3f} GiB  {self.notes.get(name, '')}".rstrip())
        lines.append(f"  {'peak':<18} {self.peak / GiB:9.3f} GiB  at {self.moment}")
        lines += [f"  not predicted: {what}" for what in self.unpredicted]
        lines += [f"  {line}" for line in self.facts]
        return lines

    def not_covered(self) -> list[str]:
        """What this plan does not count, one phrase each: the parts it could not predict, then what no plan
        counts on this device (see the module docstring)."""
        s = self.setup
        out = list(self.unpredicted)
        if s.device == "cpu":
            out.append("glibc malloc's heap: freed tensors stay in it, and resident peaks measured 33-80% above the "
                       "plan with glibc as it comes (within 9% with MALLOC_MMAP_THRESHOLD_=131072 in the environment)")
        else:
            out.append("CUDA's context, NCCL's buffers and the caching allocator's reserve (the plan is "
                       "torch.cuda.max_memory_allocated's count)")
        if s.loader_workers:
            out.append(f"the {s.loader_workers} DataLoader worker process(es) (data.num_workers), each with memory "
                       "of its own, and the batches they prefetch")
        out.append("evaluation, checkpoint saves and torch.compile")
        return out


# ------------------------------------------------------------------------------------- shared arithmetic
def padded(shape, world: int) -> tuple[int, int]:
    """(numel all-gathered, numel of one rank's shard) of a parameter of ``shape`` under ``fully_shard`` on ``world``
    ranks: dim 0 is split into ``world`` chunks of ``ceil(dim0 / world)`` rows, the last ones padded."""
    if not shape:
        return world, 1  # a 0-d parameter: FSDP2 shards it as one row
    rows = -(-shape[0] // world)
    rest = math.prod(shape[1:])
    return rows * world * rest, rows * rest


def moment_bytes(numel: int, s: Setup) -> int:
    """Bytes of AdamW's two moments for a (local) fp32 tensor of ``numel`` values: fp32 each (``optim=adamw``);
    under ``optim=adamw8bit`` (torchao's ``AdamW8bit``) one byte per value plus one fp32 scale per block, for tensors
    of at least 4096 values that are a multiple of the block size, fp32 for the rest (``hydratrain.optim``)."""
    block = s.optim_block_size
    if s.optim == "adamw8bit" and numel >= 4096 and numel % block == 0:
        return 2 * (numel + 4 * (numel // block))
    return 8 * numel


def optim_note(s: Setup) -> str:
    if s.optim == "adamw8bit":
        return f"AdamW8bit exp_avg + exp_avg_sq, 8-bit codes + an fp32 scale per {s.optim_block_size} values"
    if s.optim == "own":
        return "an optimizer of your own, planned as AdamW's two fp32 states"
    return "AdamW exp_avg + exp_avg_sq, fp32"


def step_temporaries(s: Setup, params_fp32: int, two_largest_fp32: int) -> tuple[int, str]:
    """(bytes AdamW's step allocates beyond its state, what they are). CPU: two of the largest parameter (calibrated
    on CPU for the per-tensor and fused kernels). CUDA: the implementation ``optim.impl`` names, ``auto`` being fused
    where :data:`hydratrain.optim.FUSED_DEVICES` has the device (torchao's 8-bit AdamW counted as foreach): fused,
    none (one in-place kernel: on an H200, llama_1b's optimizer-step peak was parameters + gradients + moments);
    foreach, one fp32 copy of the parameters (``torch.optim.adam._multi_tensor_adam``); for_loop, two of the largest
    parameter."""
    per_tensor = (two_largest_fp32, "AdamW's temporaries (per tensor: two of the largest parameter)")
    if s.device != "cuda":
        return per_tensor
    impl = "foreach" if s.optim == "adamw8bit" else s.optim_impl
    if impl == "fused" or (impl == "auto" and s.device in FUSED_DEVICES):
        return 0, ""
    if impl in ("foreach", "auto"):
        return params_fp32, "AdamW's temporaries (foreach: one fp32 copy of the parameters)"
    return per_tensor


def raf_ok(s: Setup) -> bool:
    """Whether FSDP frees each block unit's gathered parameters after its forward (so none are held at the head)."""
    return not s.shards or s.reshard_after_forward


def mode_of(s: Setup):
    """The :class:`hydratrain.memsim.Mode` the forward runs in: FSDP casts parameters (no autocast), single/ddp
    keep fp32 weights under autocast."""

    compute = getattr(torch, PRECISION_DTYPE[s.precision])
    device = "cuda" if s.device == "cuda" and torch.cuda.is_available() else "cpu"
    if s.shards:  # FSDP casts parameters: no autocast; from a CPU-only host, CUDA's fused rms_norm is modelled
        return Mode(compute, None, device, fused_norms=s.device == "cuda" and device == "cpu")
    return Mode(torch.float32, None if compute == torch.float32 else compute, device)


def shard_unit_names(model, wrap_policy: str, min_num_params: int, blocks=None) -> list[list[str]]:
    """The parameter names of each unit :func:`hydratrain.parallel.wrap_policy.shard_units` gives its own
    ``fully_shard`` on ``model`` (a meta or stand-in module, possibly with activation-checkpointing wrappers; its
    ``blocks``, :class:`hydratrain.parallel.blocks.Blocks`, are needed for ``auto`` and ``transformer_block``), in
    its order, each parameter in the first unit that holds it; names without the wrappers' prefix."""
    from types import SimpleNamespace


    policy = SimpleNamespace(name=wrap_policy, min_num_params=min_num_params)
    name_of = {id(p): n.replace("._checkpoint_wrapped_module", "") for n, p in model.named_parameters()}
    seen: set[int]
    units, seen = [], set()
    for unit in shard_units(model, policy, blocks):
        own = [name_of[id(p)] for p in unit.parameters() if id(p) not in seen]
        seen.update(id(p) for p in unit.parameters())
        units.append(own)
    return units
