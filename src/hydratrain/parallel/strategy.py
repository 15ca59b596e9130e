"""The distribution strategy, built once from the config; every strategy decision lives in a :class:`Strategy`.

:func:`hydratrain.parallel.build.build_strategy` gives a :class:`Single`, :class:`DDP` (here), or an
:class:`~hydratrain.parallel.fsdp.FSDP` or :class:`~hydratrain.parallel.fsdp.HSDP` (:mod:`hydratrain.parallel.fsdp`).
Nothing else reads
``strategy.name`` or looks at wrapper or tensor types: the loop asks the strategy (needs a process group? build on
meta? gradient sync on or off for this micro-batch? global grad norm and clipping? the autocast to use? the plain
module under the wrapper? how many bytes of parameters does this rank hold, or would it hold for a model of N bytes
on W ranks?).

Model set-up order (as torchtitan's parallelize functions): build (on meta or on the device) -> float8 conversion
(``precision=fp8``: :mod:`hydratrain.parallel.float8`) -> find the blocks
(:mod:`hydratrain.parallel.blocks`) -> activation checkpointing -> compile -> wrap (DDP, or FSDP2 ``fully_shard`` per
wrap policy then the root) -> materialise (meta only) -> initialise by the model's init protocol
(:mod:`hydratrain.parallel.init`). Nothing here knows which model it sets up.
"""
from __future__ import annotations

import contextlib
import logging
import re
from typing import ContextManager, Optional

import torch
import torch.distributed as dist
from torch import nn

from hydratrain.config.schema import FSDPStrategy
from hydratrain.config.settings import ModelSettings, option_value
from hydratrain.errors import ConfigError, HydratrainError
from hydratrain.parallel import init as param_init
from hydratrain.parallel.ac_compile import (
    CompileChoice,
    apply_activation_checkpointing,
    apply_compile,
    choose_compile,
)
from hydratrain.parallel.blocks import Blocks, find_blocks
from hydratrain.parallel.float8 import Conversion, convert
from hydratrain.parallel.precision import Precision

log = logging.getLogger(__name__)

#: what to do when ranks run different modules in one step, under FSDP
SAME_MODULES_FIX = ("use strategy=ddp strategy.find_unused_parameters=true, or make every module run every step "
                    "(an expert on zero rows)")


def persistent_buffers(model: nn.Module) -> list:
    """``(module, name)`` of each persistent buffer of ``model`` (what its ``state_dict`` holds besides parameters:
    BatchNorm's running statistics; not non-persistent ones, such as rotary tables)."""
    return [(m, name) for m in model.modules() for name, b in m._buffers.items()
            if b is not None and name not in m._non_persistent_buffers_set]


def rank0_buffers(buffers: list) -> None:
    """Make each ``(module, name)`` buffer of :func:`persistent_buffers` rank 0's on every rank (every rank calls):
    one broadcast per dtype and device of the buffers flattened together, as DDP coalesces its own."""
    from collections import defaultdict

    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    groups = defaultdict(list)
    for m, name in buffers:
        b = m._buffers.get(name)  # read now: a buffer may have been replaced since the list was made
        if b is not None:
            groups[(b.dtype, b.device)].append(b)
    for tensors in groups.values():
        flat = _flatten_dense_tensors([t.detach() for t in tensors])
        dist.broadcast(flat, src=0)
        for t, value in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
            t.detach().copy_(value)


def rank0_buffers_before_training_forwards(model: nn.Module) -> None:
    """On several ranks, make ``model``'s persistent buffers rank 0's before each of its training forwards (train
    mode, grad enabled), as DDP does for a model that has some: every rank's copy then evolves alike (each forward
    updates it with the rank's own batch), so a save or an eval, which make them rank 0's
    (:meth:`Strategy.sync_buffers`), changes nothing in the training. A model without persistent buffers gets no
    hook and pays nothing."""
    held = persistent_buffers(model)
    if held and dist.is_initialized() and dist.get_world_size() > 1:
        model.register_forward_pre_hook(lambda module, args: rank0_buffers(held) if module.training
                                        and torch.is_grad_enabled() else None)


def is_collective_timeout(err: BaseException) -> bool:
    """Whether ``err`` is a collective that waited past the process group's timeout
    (``distributed.collective_timeout_s``): gloo's "Timed out waiting ...", NCCL's watchdog timeout."""
    message = str(err)
    return isinstance(err, RuntimeError) and ("Timed out waiting" in message or "collective operation timeout"
                                              in message or "timed out" in message.lower() and "gloo" in message)


class CollectiveTimeout(HydratrainError):
    """A collective of a training step waited past ``distributed.collective_timeout_s``: the other ranks failed, hang,
    or issued other collectives (under FSDP: ranks that ran different modules in that step). One line, not the
    backend's traceback and not a blame of the forward, which only happened to be waiting."""

    def __init__(self, step: Optional[int], strategy: str):
        where = f"step {step}" if step is not None else "a training step"
        sharded = strategy in ("fsdp", "hsdp")
        why = (f"either another rank failed or hangs (see its log), or the ranks ran different modules in {where} "
               f"(a forward that picks modules per batch, as top-1 MoE routing), so FSDP's per-module gathers and "
               f"reduce-scatters no longer pair up across ranks: {SAME_MODULES_FIX}") if sharded else \
            "another rank failed, hangs, or issued a different collective (see its log)"
        super().__init__(f"a collective of {where} waited past distributed.collective_timeout_s: {why}")


class Strategy:
    """Base: one process's full model. Subclasses override what differs."""

    name = "single"
    needs_process_group = False  # ddp/fsdp need one even on a single rank
    shards_parameters = False
    compiled: Optional[str] = None  # what parallelize() compiled ("the whole model (GPT)", "12 blocks (12 Block)")
    float8: Optional[Conversion] = None  # what parallelize() converted to float8 (precision=fp8)

    def __init__(self, cfg):
        self.cfg = cfg  # the whole run config, read only
        self.backend: Optional[str] = cfg.strategy.get("backend")
        self.cpu_offload: bool = bool(option_value(cfg.strategy, "cpu_offload", FSDPStrategy))

    # ---------------------------------------------------------------------------------------------- building
    def init_device(self) -> str:
        """``model.init_device`` (default auto)."""
        return str(ModelSettings.of(self.cfg.get("model")).init_device)

    def build_on_meta(self, init_protocol: str = param_init.PER_PARAMETER) -> bool:
        """``model.init_device``: meta -> yes; auto -> for strategies that shard parameters, when the model has an
        init protocol that covers the whole model (``init_param_`` or ``init_weights``; a model initialised only by
        its modules' constructors is built eagerly, so no init of its constructor is lost)."""
        init_device = self.init_device()
        return init_device == "meta" or (init_device == "auto" and self.shards_parameters
                                         and init_protocol != param_init.PER_MODULE)

    def build_device(self, device: torch.device, init_protocol: str = param_init.PER_PARAMETER) -> torch.device:
        """Where the model's constructor allocates: meta, the run's device, or ``model.init_device``'s kind."""
        init_device = self.init_device()
        if self.build_on_meta(init_protocol):
            return torch.device("meta")
        if init_device in ("auto", device.type):
            return device
        return torch.device(init_device)

    def blocks(self, raw: nn.Module) -> Blocks:
        """The model's blocks (:func:`~hydratrain.parallel.blocks.find_blocks`, ``wrap_policy.block_classes``)."""
        return find_blocks(raw, self.cfg.wrap_policy.get("block_classes"))

    def parallelize(self, raw: nn.Module, precision: Precision, device: torch.device, seed: int,
                    built_on_meta: bool = False) -> tuple[nn.Module, str]:
        """AC, compile and this strategy's wrapping applied to ``raw`` (built on :meth:`build_device`), then
        materialised (``built_on_meta``) and initialised (:func:`hydratrain.parallel.init.initialise`, seeded by
        ``seed``). Returns (the model to train, a one-line summary); :attr:`compiled` then says what was compiled
        (None: nothing). Raises :class:`ConfigError` when activation checkpointing or compile has no block to apply
        to, and naming ``model.init_device`` when, after a meta build, the init left a buffer unset.
        ``precision=fp8``: the Linear layers are converted first (:attr:`float8` then says which)."""
        notes = []
        if precision.float8 is not None:  # before AC, compile and wrapping (torchtitan's order)
            self.float8 = convert(raw, precision.float8, precision.float8.all_gather(self.shards_parameters, device))
            notes.append(self.float8.describe())
        blocks = self.blocks(raw)
        # which repeated submodules are the FSDP, checkpointing and compile units, and what chose them
        notes += [f"blocks: {blocks.describe()} (from {blocks.source})"] if blocks.modules else []
        if self.cfg.activation_checkpointing and not blocks.modules:
            raise ConfigError("activation_checkpointing", True, "found no blocks in the model to apply it to (no "
                              "_no_split_modules, no nn.ModuleList or nn.Sequential of one class): name them with "
                              "wrap_policy.block_classes")
        choice = self.compile_choice(device, bool(blocks.modules))
        if self.cfg.activation_checkpointing:
            apply_activation_checkpointing(raw, blocks)
            notes.append(f"activation checkpointing on {blocks.describe()}")
        self.compiled = apply_compile(raw, blocks, choice)
        if self.compiled:
            notes.append(f"compiled {self.compiled} ({choice.why})")
        try:
            model, note = self._wrap(raw, precision, device, seed, blocks, built_on_meta)
        except param_init.UninitialisedBuffers as err:
            raise ConfigError("model.init_device", self.init_device(), str(err)) from None
        return model, "; ".join(notes + [note])

    def compile_choice(self, device: torch.device, has_blocks: bool) -> CompileChoice:
        """What ``trainer.compile`` compiles for this strategy on ``device``
        (:func:`~hydratrain.parallel.ac_compile.choose_compile`)."""
        return choose_compile(self.cfg.trainer.compile, device.type, self.name,
                              bool(self.cfg.activation_checkpointing), has_blocks)

    def _wrap(self, raw: nn.Module, precision: Precision, device: torch.device, seed: int, blocks: Blocks,
              built_on_meta: bool):
        return raw, "; ".join(filter(None, [self.name, self._materialise_plain(raw, device, seed, built_on_meta)]))

    @staticmethod
    def _materialise_plain(raw: nn.Module, device: torch.device, seed: int, built_on_meta: bool) -> Optional[str]:
        if any(p.is_meta for p in raw.parameters()) or any(b.is_meta for b in raw.buffers()):
            param_init.to_empty_keeping_ties(raw, device)
        raw.to(device)
        return param_init.initialise(raw, seed, device, built_on_meta)

    # ------------------------------------------------------------------------------------------- the loop
    def autocast(self, precision: Precision, device: torch.device) -> ContextManager:
        """The context each forward runs in: autocast to the compute dtype (FSDP casts parameters instead)."""
        return precision.autocast(device)

    def check_first_gradients(self, model: nn.Module) -> None:
        """Checks of the gradients the first backward made (DDP: every trained parameter got one)."""

    def check_first_forward(self, model: nn.Module) -> ContextManager:
        """Context for the first training forward, for the checks that must run around it (FSDP: every rank runs
        the same modules); nothing by default."""
        return contextlib.nullcontext()

    def grad_sync(self, model: nn.Module, enabled: bool) -> ContextManager:
        """Context for one micro-batch's backward: gradient sync only on the last micro-batch of a step."""
        return contextlib.nullcontext()

    def explain(self, model: nn.Module, err: BaseException, step: Optional[int] = None):
        """The error to report for ``err``, raised by a training step's forward or backward, when the strategy knows
        what is behind it (DDP: parameters unused in some step; any strategy: a collective that timed out, as
        :class:`CollectiveTimeout`); None otherwise."""
        if is_collective_timeout(err):
            return CollectiveTimeout(step, self.name)
        return None

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, device: torch.device) -> torch.Tensor:
        """Global L2 norm of all gradients (over all ranks and shards), before clipping; clips to ``max_norm`` when
        it is > 0. Returns the norm as a 0-d float tensor on ``device``."""
        params = [p for p in model.parameters() if p.grad is not None]
        grads = [p.grad for p in params if p.grad is not None]  # (all of them: params have a grad)
        # foreach on every device that has the kernels: torch picks it by itself only for plain tensors, so FSDP's
        # DTensor gradients would otherwise take one Python-dispatched op per tensor for the norm and the scaling
        foreach = True if grads and grads[0].device.type in ("cpu", "cuda") else None
        norm = self._global_norm(torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=foreach))
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=foreach)
        return norm.to(device, non_blocking=True)

    def _global_norm(self, norm: torch.Tensor) -> torch.Tensor:
        return norm

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module under any wrapper (DDP's ``.module``; FSDP2 and AC keep the module itself)."""
        return model

    def sync_buffers(self, model: nn.Module) -> None:
        """Make the model's persistent buffers (BatchNorm's running statistics) rank 0's on every rank, before an
        eval or a save reads them (every rank calls). DDP and FSDP send rank 0's before each training forward
        (:func:`rank0_buffers_before_training_forwards`), which then updates each rank's copy with its own batch.
        Without this the eval would mix
        per-rank statistics, and a checkpoint could hold any rank's (DCP writes each replicated tensor from one
        rank of its choosing), so a resume would not continue the run exactly."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        rank0_buffers(persistent_buffers(model))

    def local_param_bytes(self, model: nn.Module) -> int:
        """Bytes of parameter storage this rank holds (its shards under FSDP)."""
        return sum(p.numel() * p.element_size() for p in model.parameters())

    def shard_degree(self, world_size: int, local_world_size: int) -> int:
        """Ranks that one parameter is split across (1: every rank holds it whole). For planning without a model."""
        return 1

    def param_bytes_per_rank(self, total_bytes: int, world_size: int, local_world_size: int) -> int:
        """Bytes of parameters (or of anything sharded like them: gradients, optimizer state) one rank holds when
        the whole model has ``total_bytes``, on ``world_size`` ranks with ``local_world_size`` per node. An upper
        bound: FSDP pads each parameter's dim 0 to a multiple of the shard degree."""
        return -(-total_bytes // self.shard_degree(world_size, local_world_size))


class Single(Strategy):
    """One process, no process group."""


class DDP(Strategy):
    """``DistributedDataParallel``: a full replica per rank; gradients all-reduced in buckets during backward, in
    ``precision.reduce_dtype`` (a bf16/fp16 compression hook when it is not float32)."""

    name = "ddp"
    needs_process_group = True

    def _wrap(self, raw, precision, device, seed, blocks, built_on_meta):
        from torch.nn.parallel import DistributedDataParallel

        init_note = self._materialise_plain(raw, device, seed, built_on_meta)
        # Buffer sync before each forward only for buffers that training changes: DDP would otherwise send rank 0's
        # buffers to every rank every step (1.6 ms per step for gpt_tiny on gloo, 31 broadcasts in a 30-step
        # profile), and buffers computed identically on every rank and never changed by training (rotary tables:
        # non-persistent) need none. Persistent buffers (BatchNorm's running statistics) do: without the sync each
        # rank would keep its own statistics and the checkpoint would hold rank 0's only. torch 2.13 renamed the
        # switch (forward_sync_buffers; broadcast_buffers warns there).
        import inspect

        renamed = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
        no_sync = "forward_sync_buffers" if renamed else "broadcast_buffers"
        persistent = any(not isinstance(v, nn.Parameter) for v in raw.state_dict(keep_vars=True).values())
        model = DistributedDataParallel(raw, device_ids=[device.index] if device.type == "cuda" else None,
                                        bucket_cap_mb=self.cfg.strategy.bucket_cap_mb,
                                        find_unused_parameters=self.cfg.strategy.find_unused_parameters,
                                        **{no_sync: persistent})
        note = "ddp"
        if precision.reduce_dtype != torch.float32:
            model.register_comm_hook(None, _all_reduce_in(precision.reduce_dtype))
            note += f", gradients all-reduced in {str(precision.reduce_dtype).removeprefix('torch.')}"
        return model, "; ".join(filter(None, [note, init_note]))

    def grad_sync(self, model, enabled):
        return contextlib.nullcontext() if enabled else model.no_sync()

    def check_first_gradients(self, model: nn.Module) -> None:
        """After the first backward: a parameter that got no gradient stalls DDP's next step (its reducer waits for
        it) unless ``strategy.find_unused_parameters=true``. Raises :class:`ConfigError` naming the parameters."""
        if self.cfg.strategy.find_unused_parameters:
            return
        unused = [n for n, p in model.module.named_parameters()  # type: ignore[union-attr]  # (DDP's module)
                  if p.requires_grad and p.grad is None]
        if unused:
            shown = ", ".join(unused[:4]) + (f" and {len(unused) - 4} more" if len(unused) > 4 else "")
            raise ConfigError("strategy.find_unused_parameters", False, f"{shown} got no gradient in the first step "
                              "(the forward did not use them), which stalls DistributedDataParallel's next step: set "
                              "strategy.find_unused_parameters=true, or freeze them (requires_grad=False)")

    def explain(self, model: nn.Module, err: BaseException, step: Optional[int] = None):
        # DDP's reducer, at the forward after a backward that left some parameter without a gradient (a branch the
        # forward takes only sometimes: LayerDrop, an auxiliary head every N steps); it lists their indices among
        # the parameters that require grad
        message = str(err)
        if self.cfg.strategy.find_unused_parameters or "Expected to have finished reduction" not in message:
            return super().explain(model, err, step)
        # (DDP's module): why the ignore below
        trained = [n for n, p in model.module.named_parameters() if p.requires_grad]  # type: ignore[union-attr]
        found = re.search(r"did not receive grad for rank \d+: ([\d ,]+)", message)
        indices = [int(i) for i in re.findall(r"\d+", found.group(1))] if found else []
        unused = [trained[i] for i in indices if i < len(trained)]
        shown = (", ".join(unused[:4]) + (f" and {len(unused) - 4} more" if len(unused) > 4 else "")
                 if unused else "some parameters")
        return ConfigError("strategy.find_unused_parameters", False, f"{shown} got no gradient in the previous step "
                           "(the forward used them only in some steps), which stops DistributedDataParallel: set "
                           "strategy.find_unused_parameters=true")

    def unwrap(self, model):
        return model.module


def _all_reduce_in(dtype: torch.dtype):
    """A DDP communication hook (``register_comm_hook``'s ``(process_group, bucket) -> Future`` contract) that
    averages each gradient bucket in ``dtype``: cast, divide by the world size, all-reduce, cast back into the
    bucket. The shape of torch's ``fp16_compress_hook``, for any dtype and backend (torch's bf16 hook refuses gloo,
    whose all-reduce handles bfloat16 fine)."""
    def hook(process_group, bucket):
        group = process_group if process_group is not None else dist.group.WORLD
        buffer = bucket.buffer()
        compressed = buffer.to(dtype).div_(dist.get_world_size(group))
        future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

        def decompress(fut):
            buffer.copy_(fut.value()[0])
            return buffer

        return future.then(decompress)

    return hook

