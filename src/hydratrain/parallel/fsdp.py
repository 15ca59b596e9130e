"""FSDP2 strategies: :class:`FSDP` (``fully_shard`` over a 1-D mesh of all ranks) and :class:`HSDP` (over a 2-D
``(replicate, shard)`` mesh). The :class:`~hydratrain.parallel.strategy.Strategy` interface they implement, and the
model set-up order, are in :mod:`hydratrain.parallel.strategy`.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Optional

import torch
import torch.distributed as dist

from hydratrain.dist.env import dist_info
from hydratrain.errors import ConfigError
from hydratrain.parallel import init as param_init
from hydratrain.parallel.blocks import Blocks
from hydratrain.parallel.precision import float32_modules
from hydratrain.parallel.strategy import SAME_MODULES_FIX, Strategy, rank0_buffers_before_training_forwards
from hydratrain.parallel.wrap_policy import mixed_dtypes, shard_units

log = logging.getLogger(__name__)


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
                                  f"{SAME_MODULES_FIX}")

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
                              f"{SAME_MODULES_FIX}")

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

