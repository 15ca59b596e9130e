"""The distribution strategy, built once from the config; every strategy decision lives here.

``build_strategy(cfg)`` gives a :class:`Single`, :class:`DDP`, :class:`FSDP` or :class:`HSDP`. Nothing else reads
``strategy.name`` or looks at wrapper or tensor types: the loop asks the strategy (needs a process group? build on
meta? gradient sync on or off for this micro-batch? global grad norm and clipping? the autocast to use? the plain
module under the wrapper? how many bytes of parameters does this rank hold, or would it hold for a model of N bytes
on W ranks?).

Model set-up order (as torchtitan's parallelize functions): build (on meta or on the device) -> activation
checkpointing -> compile -> wrap (DDP, or FSDP2 ``fully_shard`` per wrap policy then the root) -> materialise (meta
only) -> initialise every parameter from its own seeded generator (:mod:`hydratrain.parallel.init`).
"""
from __future__ import annotations

import contextlib
import logging
from typing import ContextManager, Optional

import torch
from torch import nn

from hydratrain.parallel import init as param_init
from hydratrain.parallel.ac_compile import apply_activation_checkpointing, compile_blocks
from hydratrain.parallel.precision import Precision
from hydratrain.parallel.wrap_policy import shard_units

log = logging.getLogger(__name__)


class Strategy:
    """Base: one process's full model. Subclasses override what differs."""

    name = "single"
    needs_process_group = False  # ddp/fsdp need one even on a single rank
    shards_parameters = False

    def __init__(self, cfg):
        self.cfg = cfg  # the whole run config, read only
        self.backend: Optional[str] = cfg.strategy.get("backend")
        self.cpu_offload: bool = bool(cfg.strategy.get("cpu_offload", False))

    # ---------------------------------------------------------------------------------------------- building
    def build_on_meta(self) -> bool:
        """``model.init_device``: meta -> yes; auto -> only for strategies that shard parameters."""
        init_device = str(self.cfg.model.init_device)
        return init_device == "meta" or (init_device == "auto" and self.shards_parameters)

    def build_device(self, device: torch.device) -> torch.device:
        """Where the model's constructor allocates: meta, the run's device, or ``model.init_device``'s kind."""
        init_device = str(self.cfg.model.init_device)
        if self.build_on_meta():
            return torch.device("meta")
        if init_device in ("auto", device.type):
            return device
        return torch.device(init_device)

    def parallelize(self, raw: nn.Module, precision: Precision, device: torch.device,
                    seed: int) -> tuple[nn.Module, str]:
        """AC, compile and this strategy's wrapping applied to ``raw`` (a ``GPT`` built on :meth:`build_device`),
        then materialised (when on meta) and initialised from per-parameter generators seeded by ``seed``.
        Returns (the model to train, a one-line summary)."""
        notes = []
        if self.cfg.activation_checkpointing:
            notes.append(f"activation checkpointing on {apply_activation_checkpointing(raw)} blocks")
        if self.cfg.trainer.compile:
            notes.append(f"compiled {compile_blocks(raw)} blocks")
        model, note = self._wrap(raw, precision, device, seed)
        return model, "; ".join(notes + [note])

    def _wrap(self, raw: nn.Module, precision: Precision, device: torch.device, seed: int):
        self._materialise_plain(raw, device, seed)
        return raw, self.name

    @staticmethod
    def _materialise_plain(raw: nn.Module, device: torch.device, seed: int) -> None:
        if any(p.is_meta for p in raw.parameters()):
            param_init.to_empty_keeping_ties(raw, device)
        raw.to(device)
        raw.init_weights(param_init.generators(seed, device))

    # ------------------------------------------------------------------------------------------- the loop
    def autocast(self, precision: Precision, device: torch.device) -> ContextManager:
        """The context each forward runs in: autocast to the compute dtype (FSDP casts parameters instead)."""
        return precision.autocast(device)

    def grad_sync(self, model: nn.Module, enabled: bool) -> ContextManager:
        """Context for one micro-batch's backward: gradient sync only on the last micro-batch of a step."""
        return contextlib.nullcontext()

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, device: torch.device) -> torch.Tensor:
        """Global L2 norm of all gradients (over all ranks and shards), before clipping; clips to ``max_norm`` when
        it is > 0. Returns the norm as a 0-d float tensor on ``device``."""
        params = [p for p in model.parameters() if p.grad is not None]
        grads = [p.grad for p in params]
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

    def _wrap(self, raw, precision, device, seed):
        from torch.nn.parallel import DistributedDataParallel

        self._materialise_plain(raw, device, seed)
        # No buffer sync before each forward: DDP would otherwise send rank 0's buffers to every rank every step (1.6
        # ms per step for gpt_tiny on gloo, 31 broadcasts in a 30-step profile); the model's only buffers are the
        # rotary tables, computed identically on every rank and never changed by training. torch 2.13 renamed the
        # switch (forward_sync_buffers; broadcast_buffers warns there).
        import inspect

        renamed = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
        no_sync = "forward_sync_buffers" if renamed else "broadcast_buffers"
        model = DistributedDataParallel(raw, device_ids=[device.index] if device.type == "cuda" else None,
                                        bucket_cap_mb=self.cfg.strategy.bucket_cap_mb,
                                        find_unused_parameters=self.cfg.strategy.find_unused_parameters,
                                        **{no_sync: False})
        note = "ddp"
        if precision.reduce_dtype != torch.float32:
            model.register_comm_hook(None, _all_reduce_in(precision.reduce_dtype))
            note += f", gradients all-reduced in {str(precision.reduce_dtype).removeprefix('torch.')}"
        return model, note

    def grad_sync(self, model, enabled):
        return contextlib.nullcontext() if enabled else model.no_sync()

    def unwrap(self, model):
        return model.module


def _all_reduce_in(dtype: torch.dtype):
    """A DDP communication hook (``register_comm_hook``'s ``(process_group, bucket) -> Future`` contract) that
    averages each gradient bucket in ``dtype``: cast, divide by the world size, all-reduce, cast back into the
    bucket. The shape of torch's ``fp16_compress_hook``, for any dtype and backend (torch's bf16 hook refuses gloo,
    whose all-reduce handles bfloat16 fine)."""
    import torch.distributed as dist

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

    def _mesh(self, device: torch.device):
        """The 1-D mesh of all ranks (every parameter sharded across all of them)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device.type, (dist.get_world_size(),))

    def _wrap(self, raw, precision, device, seed):
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        scfg = self.cfg.strategy
        mesh = self._mesh(device)
        kwargs = dict(mesh=mesh, reshard_after_forward=scfg.reshard_after_forward,
                      mp_policy=precision.mixed_precision_policy())
        if scfg.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
        units = shard_units(raw, self.cfg.wrap_policy)
        if not units and str(self.cfg.wrap_policy.name) == "size_based":
            largest = max((sum(p.numel() for p in m.parameters()) for m in raw.modules() if m is not raw), default=0)
            log.warning("wrap_policy.min_num_params=%d wraps nothing (the largest submodule holds %d parameters): "
                        "FSDP shards the model as one unit, as wrap_policy=none does, and gathers all of it at once; "
                        "lower min_num_params, or use wrap_policy=transformer_block",
                        self.cfg.wrap_policy.min_num_params, largest)
        ties = param_init.tied_parameters(raw)
        for unit in units:
            fully_shard(unit, **kwargs)
        # The root holds what no unit took; it is never resharded after forward since backward needs it at once.
        fully_shard(raw, **{**kwargs, "reshard_after_forward": False if units else scfg.reshard_after_forward})
        if any(p.is_meta for p in raw.parameters()):
            raw.to_empty(device="cpu" if scfg.cpu_offload else device)
        param_init.retie(ties)
        param_init.move_buffers(raw, device)
        self._init_shards(raw, seed)
        return raw, (f"{self.name}: sharded {len(units) + 1} modules ({len(units)} by wrap_policy="
                     f"{self.cfg.wrap_policy.name} + root){self._mesh_note(mesh)}, reshard_after_forward="
                     f"{scfg.reshard_after_forward}, cpu_offload={scfg.cpu_offload}")

    def _mesh_note(self, mesh) -> str:
        return ""

    @staticmethod
    @torch.no_grad()
    def _init_shards(raw: nn.Module, seed: int) -> None:
        """Initialise each DTensor parameter's local shard with the slice of the full tensor its generator gives
        (every rank draws the full parameter, one parameter at a time, and keeps its slice: no communication)."""
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        for name, p in raw.named_parameters():
            local = p.to_local()
            full = torch.empty(p.shape, dtype=local.dtype, device=local.device)
            gen = torch.Generator(device=local.device).manual_seed(param_init.param_seed(seed, name))
            raw.init_param_(name, full, gen)
            shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            local.copy_(full[tuple(slice(o, o + n) for o, n in zip(offset, shape))])
        raw.init_buffers()

    def autocast(self, precision, device):
        return contextlib.nullcontext()

    def grad_sync(self, model, enabled):
        model.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()

    def _global_norm(self, norm):
        return norm.full_tensor()  # the DTensor of per-shard partial norms, reduced over the mesh

    def local_param_bytes(self, model):
        return sum(p.to_local().numel() * p.element_size() for p in model.parameters())

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
        from hydratrain.errors import ConfigError

        size = local_world_size if shard_size is None else int(shard_size)
        if size < 1 or world_size % size:
            divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
            where = "" if shard_size is not None else f" (null: LOCAL_WORLD_SIZE={local_world_size})"
            raise ConfigError("strategy.shard_size", shard_size, f"must divide the world size {world_size}{where}; "
                              f"allowed: {', '.join(map(str, divisors))}")
        return world_size // size, size

    def _mesh(self, device):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from hydratrain.dist.env import dist_info

        shape = self.mesh_shape(self.cfg.strategy.shard_size, dist.get_world_size(), dist_info().local_world_size)
        return init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))

    def _mesh_note(self, mesh) -> str:
        replicas, shard = mesh.shape
        return f" on a {replicas} x {shard} mesh ({replicas} replica(s) of {shard}-way shards)"

    def shard_degree(self, world_size, local_world_size):
        return self.mesh_shape(self.cfg.strategy.shard_size, world_size, local_world_size)[1]


STRATEGIES = {"single": Single, "ddp": DDP, "fsdp": FSDP, "hsdp": HSDP}


def build_strategy(cfg) -> Strategy:
    """The :class:`Strategy` for ``cfg.strategy.name`` (validated by ``hydratrain.config``)."""
    return STRATEGIES[str(cfg.strategy.name)](cfg)


def build_model(cfg, strategy: Strategy, precision: Precision, device: torch.device, vocab_size: int):
    """The GPT of ``cfg.model`` with ``vocab_size`` tokens (resolved from the data when ``model.vocab_size`` is
    null), built where ``strategy`` says, parallelized and initialised.

    Returns (model to train, the plain GPT under any wrapper, parameter count, summary line).
    """
    from hydratrain.models.gpt import GPT, GPTConfig

    gcfg = GPTConfig(**{**{k: cfg.model[k] for k in GPTConfig.__dataclass_fields__}, "vocab_size": vocab_size})
    with torch.device(strategy.build_device(device)):
        raw = GPT(gcfg)
    n_params = raw.num_params()
    model, summary = strategy.parallelize(raw, precision, device, cfg.trainer.seed)
    return model, raw, n_params, summary
