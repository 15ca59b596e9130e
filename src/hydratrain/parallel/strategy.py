"""The distribution strategy, built once from the config; every strategy decision lives here.

``build_strategy(cfg)`` gives a :class:`Single`, :class:`DDP`, :class:`FSDP` or :class:`HSDP`. Nothing else reads
``strategy.name`` or looks at wrapper or tensor types: the loop asks the strategy (needs a process group? build on
meta? gradient sync on or off for this micro-batch? global grad norm and clipping? the autocast to use? the plain
module under the wrapper? how many bytes of parameters does this rank hold, or would it hold for a model of N bytes
on W ranks?).

Model set-up order (as torchtitan's parallelize functions): build (on meta or on the device) -> find the blocks
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

from hydratrain import components
from hydratrain.config.schema import FSDPStrategy
from hydratrain.config.settings import LoraSettings, ModelSettings, option_value
from hydratrain.config.values import shard_on_one_rank_setting
from hydratrain.dist.env import dist_info
from hydratrain.errors import ConfigError, HydratrainError
from hydratrain.parallel import init as param_init
from hydratrain.parallel import lora
from hydratrain.parallel.ac_compile import (
    CompileChoice,
    apply_activation_checkpointing,
    apply_compile,
    choose_compile,
)
from hydratrain.parallel.blocks import Blocks, find_blocks
from hydratrain.parallel.precision import Precision, float32_modules
from hydratrain.parallel.wrap_policy import mixed_dtypes, shard_units

log = logging.getLogger(__name__)

#: what to do when ranks run different modules in one step, under FSDP
_SAME_MODULES_FIX = ("use strategy=ddp strategy.find_unused_parameters=true, or make every module run every step "
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
               f"reduce-scatters no longer pair up across ranks: {_SAME_MODULES_FIX}") if sharded else \
            "another rank failed, hangs, or issued a different collective (see its log)"
        super().__init__(f"a collective of {where} waited past distributed.collective_timeout_s: {why}")


class Strategy:
    """Base: one process's full model. Subclasses override what differs."""

    name = "single"
    needs_process_group = False  # ddp/fsdp need one even on a single rank
    shards_parameters = False
    compiled: Optional[str] = None  # what parallelize() compiled ("the whole model (GPT)", "12 blocks (12 Block)")

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
        to, and naming ``model.init_device`` when, after a meta build, the init left a buffer unset."""
        blocks = self.blocks(raw)
        # which repeated submodules are the FSDP, checkpointing and compile units, and what chose them
        notes = [f"blocks: {blocks.describe()} (from {blocks.source})"] if blocks.modules else []
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


class FSDP(Strategy):
    """FSDP2 ``fully_shard`` over a 1-D device mesh: each unit of the wrap policy, then the root.

    Options: ``strategy.reshard_after_forward``, ``strategy.cpu_offload`` (``CPUOffloadPolicy``; pinned memory only
    with CUDA), and the precision's ``MixedPrecisionPolicy`` (parameters cast by FSDP, so no autocast)."""

    name = "fsdp"
    needs_process_group = True
    shards_parameters = True
    _replicated: list = []  # the 0-d parameters each rank holds whole (_wrap)
    _device: Optional[torch.device] = None  # where the model computes (_wrap): the device of the checks' collectives

    def _mesh(self, device: torch.device):
        """The 1-D mesh of all ranks (every parameter sharded across all of them)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device.type, (dist.get_world_size(),))

    def _wrap(self, raw, precision, device, seed, blocks, built_on_meta):
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        scfg, policy = self.cfg.strategy, str(self.cfg.wrap_policy.name)
        self._device = device
        mesh = self._mesh(device)
        kwargs = dict(mesh=mesh, reshard_after_forward=scfg.reshard_after_forward,
                      mp_policy=precision.mixed_precision_policy())
        if scfg.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
        if policy == "transformer_block" and not blocks.modules:
            raise ConfigError("wrap_policy", policy, "found no blocks in the model (no _no_split_modules, no "
                              "nn.ModuleList or nn.Sequential of one class): name them with "
                              "wrap_policy.block_classes, or use wrap_policy=size_based")
        units = shard_units(raw, self.cfg.wrap_policy, blocks)
        if not units and policy == "size_based":
            largest = max((sum(p.numel() for p in m.parameters()) for m in raw.modules() if m is not raw), default=0)
            log.warning("wrap_policy.min_num_params=%d wraps nothing (the largest submodule holds %d parameters): "
                        "FSDP shards the model as one unit, as wrap_policy=none does, and gathers all of it at once; "
                        "lower min_num_params, or use wrap_policy=transformer_block",
                        self.cfg.wrap_policy.min_num_params, largest)
        if not units and policy == "auto" and not blocks.modules:
            log.warning("wrap_policy=auto found no blocks in the model (no _no_split_modules, no nn.ModuleList or "
                        "nn.Sequential of one class): FSDP shards it as one unit and gathers all of it at once; name "
                        "them with wrap_policy.block_classes, or use wrap_policy=size_based")
        # fully_shard cannot shard a 0-d parameter (CLIP's logit_scale, a learnable temperature): each rank keeps it
        # whole, and grad_sync averages its gradient over the ranks as the reduce-scatter does the others'
        scalars = [name for name, p in raw.named_parameters() if p.dim() == 0]
        if scalars:
            kwargs["ignored_params"] = {raw.get_parameter(name) for name in scalars}
        mixed = mixed_dtypes(raw, units, {id(raw.get_parameter(name)) for name in scalars})
        if mixed:
            raise ConfigError("strategy", self.name, f"FSDP shards each unit's parameters as one buffer of one dtype, "
                              f"but {mixed}: use strategy=ddp, or give them a module of their own and add its class "
                              "to wrap_policy.block_classes")
        ties = param_init.tied_parameters(raw)
        norms = float32_modules(raw) if precision.compute_dtype != torch.float32 else []
        kinds = ", ".join(sorted({type(m).__name__ for m in norms}))  # (before fully_shard renames the classes)
        for norm in norms:  # (Precision.float32_policy)
            fully_shard(norm, **{**kwargs, "mp_policy": precision.float32_policy()})
        for unit in units:
            fully_shard(unit, **kwargs)
        # The root holds what no unit took; it is never resharded after forward since backward needs it at once.
        fully_shard(raw, **{**kwargs, "reshard_after_forward": False if units else scfg.reshard_after_forward})
        if any(p.is_meta for p in raw.parameters()) or any(b.is_meta for b in raw.buffers()):
            raw.to_empty(device="cpu" if scfg.cpu_offload else device)
        param_init.retie(ties)
        param_init.move_buffers(raw, device)
        self._replicated = [raw.get_parameter(name) for name in scalars]
        for p in self._replicated:  # not offloaded: it lives where the compute does
            p.data = p.data.to(device)
        init_note = param_init.initialise(raw, seed, device, built_on_meta)
        rank0_buffers_before_training_forwards(raw)
        what = f"{len(units)}"
        if policy in ("auto", "transformer_block") and units:  # the units made (not a block with a tied weight)
            what = Blocks(units, blocks.classes, blocks.source).describe()
            if len(units) < len(blocks.modules):
                what += (f" (and {len(blocks.modules) - len(units)} more blocks that share a tied weight with another "
                         "module, in the root)")
        what += f" + {len(norms)} in float32 ({kinds})" if norms else ""
        if scalars:
            shown = ", ".join(scalars[:3]) + (f" and {len(scalars) - 3} more" if len(scalars) > 3 else "")
            init_note = "; ".join(filter(None, [f"{len(scalars)} 0-d parameters replicated ({shown})", init_note]))
        return raw, (f"{self.name}: sharded {len(units) + len(norms) + 1} modules ({what} by wrap_policy={policy} + "
                     "root)"
                     f"{self._mesh_note(mesh)}, reshard_after_forward={scfg.reshard_after_forward}, cpu_offload="
                     f"{scfg.cpu_offload}" + (f"; {init_note}" if init_note else ""))

    def _mesh_note(self, mesh) -> str:
        return ""

    def autocast(self, precision, device):
        """None: the ``MixedPrecisionPolicy`` casts the weights (``precision.fsdp_autocast``: autocast as well)."""
        return precision.autocast(device) if precision.fsdp_autocast else contextlib.nullcontext()

    def check_first_forward(self, model):
        """FSDP gathers each unit's parameters before the unit's forward and reduce-scatters the gradients of the
        parameters that got one after its backward, on all ranks together: ranks that run different modules in a
        step (top-1 MoE routing with an expert that got no rows on some rank) issue different collectives, which
        hang until ``distributed.collective_timeout_s`` or abort the process (gloo: "collective mismatch").
        Around the first forward: before each unit's gather, one all-reduce of the unit's index (so the first unit
        that one rank runs and another does not is found by every rank at the same collective, before the
        mismatched gather); after the forward, one all-reduce of which parameter-owning modules ran (a unit that
        holds several modules, as ``wrap_policy=none``'s root, reduce-scatters only the gradients it got).
        Either raises :class:`ConfigError` on every rank alike, naming the modules. A module skipped on every
        rank alike (LayerDrop drawn from a generator seeded alike) passes. First forward only, so later steps cost
        nothing; a mismatch in a later step ends as :class:`CollectiveTimeout`. Not with ``trainer.compile`` (the
        hooks would run in the compiled region) nor on one rank."""
        if not dist.is_initialized() or dist.get_world_size() == 1 or self.compiled:
            return contextlib.nullcontext()
        return self._same_modules(model)

    @contextlib.contextmanager
    def _same_modules(self, model):
        from torch.distributed.fsdp import FSDPModule

        device = self._device if self._device is not None else torch.device("cpu")
        units = [n for n, m in model.named_modules() if isinstance(m, FSDPModule) and m is not model]
        owners = [n for n, m in model.named_modules() if any(p.requires_grad for p in m.parameters(recurse=False))]
        ran = [False] * len(owners)

        def unit(i: int) -> str:
            return units[i] if i < len(units) else "none (its forward was over)"

        def agree(i: int) -> None:  # every rank at the same unit (len(units): at the end of the forward)
            at = torch.tensor([i, -i], dtype=torch.int64, device=device)
            dist.all_reduce(at, op=dist.ReduceOp.MAX)
            first, last = -int(at[1]), int(at[0])
            if first != last:
                raise ConfigError("strategy", self.name, f"the ranks ran different modules in step 1: where some "
                                  f"ran FSDP unit {unit(first)}, others ran {unit(last)}; FSDP gathers each unit's "
                                  f"parameters on all ranks together, so they would hang or abort: "
                                  f"{_SAME_MODULES_FIX}")

        handles = []
        modules = dict(model.named_modules())
        for i, name in enumerate(units):  # prepended: before FSDP's own pre-forward hook, which gathers
            handles.append(modules[name].register_forward_pre_hook(lambda *_, i=i: agree(i), prepend=True))
        for k, name in enumerate(owners):
            handles.append(modules[name].register_forward_pre_hook(lambda *_, k=k: ran.__setitem__(k, True)))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
        agree(len(units))
        flags = torch.tensor(ran + [not r for r in ran], dtype=torch.int64, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # [ran on some rank..., skipped on some rank...]
        split = [owners[k] for k in range(len(owners)) if flags[k] and flags[len(owners) + k]]
        if split:
            shown = ", ".join(split[:4]) + (f" and {len(split) - 4} more" if len(split) > 4 else "")
            raise ConfigError("strategy", self.name, f"{shown} ran on some ranks and not on others in step 1 (their "
                              "parameters got a gradient on some ranks only); FSDP reduce-scatters a unit's "
                              "gradients on all ranks together, so the backward would hang or abort: "
                              f"{_SAME_MODULES_FIX}")

    def grad_sync(self, model, enabled):
        model.set_requires_gradient_sync(enabled)
        return self._average_replicated() if enabled and self._replicated else contextlib.nullcontext()

    @contextlib.contextmanager
    def _average_replicated(self):
        """After the backward it wraps: the gradients of the parameters every rank holds whole (0-d, which
        fully_shard leaves out) averaged over all ranks, in one all-reduce (sum / world_size: gloo has no AVG)."""
        yield
        grads = [p.grad for p in self._replicated if p.grad is not None]
        if not grads or dist.get_world_size() == 1:
            return
        flat = torch.stack([g.float() for g in grads])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        for g, value in zip(grads, flat):
            g.copy_(value)

    def _global_norm(self, norm):
        # the DTensor of per-shard partial norms, reduced over the mesh (plain only when no parameter is sharded)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def local_param_bytes(self, model):
        return sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
                   for p in model.parameters())

    def shard_degree(self, world_size, local_world_size):
        return world_size


class HSDP(FSDP):
    """Hybrid sharding: FSDP2 ``fully_shard`` over a 2-D ``(replicate, shard)`` device mesh of
    ``(world_size / shard_size, shard_size)`` ranks. Each parameter is sharded within a shard group of
    ``strategy.shard_size`` consecutive ranks (default: the ranks of one node, ``LOCAL_WORLD_SIZE``) and replicated
    across the groups: gradients are reduce-scattered inside a group, then all-reduced between the replicas
    (FSDP2's HSDP, placements ``(Replicate(), Shard(0))``). Everything else (wrap policy, meta build, per-parameter
    seeded init, ties, buffers, mixed precision, CPU offload) is :class:`FSDP`'s, so it starts from the same weights.
    """

    name = "hsdp"

    @staticmethod
    def mesh_shape(shard_size: Optional[int], world_size: int, local_world_size: int) -> tuple[int, int]:
        """``(replicas, shard_size)`` for ``strategy.shard_size`` (null: ``local_world_size``) on ``world_size``
        ranks. Raises :class:`~hydratrain.errors.ConfigError` naming ``strategy.shard_size`` when it does not divide
        the world size."""
        size = local_world_size if shard_size is None else int(shard_size)
        if size < 1 or world_size % size:
            divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
            where = "" if shard_size is not None else f" (null: LOCAL_WORLD_SIZE={local_world_size})"
            raise ConfigError("strategy.shard_size", shard_size, f"must divide the world size {world_size}{where}; "
                              f"allowed: {', '.join(map(str, divisors))}")
        return world_size // size, size

    def _mesh(self, device):
        from torch.distributed.device_mesh import init_device_mesh


        shape = self.mesh_shape(self.cfg.strategy.shard_size, dist.get_world_size(), dist_info().local_world_size)
        return init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))

    def _mesh_note(self, mesh) -> str:
        replicas, shard = mesh.shape
        return f" on a {replicas} x {shard} mesh ({replicas} replica(s) of {shard}-way shards)"

    def shard_degree(self, world_size, local_world_size):
        return self.mesh_shape(self.cfg.strategy.shard_size, world_size, local_world_size)[1]


STRATEGIES = {"single": Single, "ddp": DDP, "fsdp": FSDP, "hsdp": HSDP}


def single_on_one_rank(name: str, setting, world_size: int, device_type: str, cpu_offload: bool) -> Optional[str]:
    """Why ``strategy=name`` (``fsdp``/``hsdp``) on ``world_size`` rank(s) of a ``device_type`` device trains as
    ``strategy=single``, or None when it keeps its own strategy. ``setting``: ``strategy.shard_on_one_rank``.

    At world size 1 FSDP shards nothing: every rank holds all parameters, gradients and optimizer state either way,
    and what FSDP2 still does per unit (copying the parameters into unsharded ones in the compute dtype before each
    forward and again before each backward, the gradient reduction, DTensor dispatch in the optimizer and the norm)
    is pure cost; on one H200 gpt_small (8 x 1024 tokens, bf16) trained at 137,934 tokens/s under FSDP against
    211,034-254,310 under ``single`` (``bench/results/h200-2026-11-30``, torch 2.11). ``auto`` trains as ``single``
    on CUDA only: on a CPU FSDP at world size 1 is kept (the CPU tests exercise it on purpose, and no speed is at
    stake there); with ``cpu_offload`` FSDP is kept, since offloading the shards is what saves device memory.

    Pure: reads no device. Raises :class:`ConfigError` naming ``strategy.shard_on_one_rank`` when it is not
    auto/true/false, or is false with ``strategy.cpu_offload=true`` at world size 1."""
    value = shard_on_one_rank_setting(setting)
    if name not in ("fsdp", "hsdp") or world_size != 1 or value == "true":
        return None
    if cpu_offload:
        if value == "false":
            raise ConfigError("strategy.shard_on_one_rank", False, "strategy.cpu_offload=true needs FSDP's shards; "
                              "allowed with cpu_offload: auto or true")
        return None
    if value == "false":
        return f"strategy={name} on 1 rank trains as strategy=single (strategy.shard_on_one_rank=false)"
    if device_type != "cuda":
        return None
    return (f"strategy={name} on 1 GPU trains as strategy=single: one rank shards nothing, and FSDP's per-unit "
            "copies and hooks only cost time (strategy.shard_on_one_rank=true keeps FSDP)")


def build_strategy(cfg, world_size: Optional[int] = None, device_type: Optional[str] = None) -> Strategy:
    """The :class:`Strategy` for ``cfg.strategy.name`` (validated by ``hydratrain.config``). Given the launch's
    ``world_size`` and ``device_type``, ``fsdp``/``hsdp`` on one rank may become :class:`Single`
    (:func:`single_on_one_rank`, logged once); without them the configured strategy is built as it is."""
    name = str(cfg.strategy.name)
    if world_size is not None and device_type is not None:
        why = single_on_one_rank(name, option_value(cfg.strategy, "shard_on_one_rank", FSDPStrategy), world_size,
                                 device_type, bool(option_value(cfg.strategy, "cpu_offload", FSDPStrategy)))
        if why:
            log.info(why)
            return Single(cfg)
    return STRATEGIES[name](cfg)


def build_model(cfg, strategy: Strategy, precision: Precision, device: torch.device, vocab_size: Optional[int]):
    """The model of ``cfg.model`` (:func:`hydratrain.components.build_model`; a ``vocab_size`` keyword that is null
    gets ``vocab_size``), built where ``strategy`` says, parallelized and initialised.

    Returns (model to train, the plain module under any wrapper, parameter count, summary line). Raises
    :class:`ConfigError`: a meta build of a model that nothing could initialise (:func:`~hydratrain.parallel.init.
    uninitialisable`), or what the build raised.
    """
    kind = param_init.protocol_of_class(components.model_class(cfg))
    build_device = strategy.build_device(device, kind)
    raw = components.build_model(cfg, build_device, vocab_size, checked=True)  # on meta: the one check() built
    on_meta = build_device.type == "meta"
    if on_meta:
        lacking = param_init.uninitialisable(raw)
        if lacking:
            shown = ", ".join(lacking[:4]) + (f" and {len(lacking) - 4} more" if len(lacking) > 4 else "")
            raise ConfigError("model.init_device", strategy.init_device(), f"built on meta, the model must be "
                              f"initialised after sharding, but {shown} own parameters or buffers without a "
                              "reset_parameters() (and the model has no init_weights()): give them one, or build it "
                              "with storage: ++model.init_device=cpu (or cuda)")
    adapters = LoraSettings.of(cfg)
    if adapters is not None:  # (+peft=lora: the base frozen, adapters added, before any wrapper)
        raw = lora.apply(raw, adapters)
    n_params = sum(p.numel() for p in raw.parameters())
    model, summary = strategy.parallelize(raw, precision, device, cfg.trainer.seed, built_on_meta=on_meta)
    if adapters is not None:
        summary += (f"; LoRA r={adapters.r} alpha={adapters.alpha:g}: {lora.trainable_count(raw):,} trainable "
                    f"parameters of {n_params:,}, the base frozen")
    return model, raw, n_params, summary
