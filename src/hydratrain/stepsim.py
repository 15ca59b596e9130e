"""The generic memory plan: any ``nn.Module``, its training step simulated whole (:func:`predict`).

For a model class without a memory model of its own (see :mod:`hydratrain.footprint`), the plan takes

* parameters, gradients and optimizer state exactly from a build of the model on the meta device
  (:func:`hydratrain.components.build_model`): every parameter's shape and dtype, gradients and AdamW's two moments
  for the trainable ones, buffers whole on every rank; under FSDP this rank's shard of each parameter, dim 0 padded
  as ``fully_shard`` pads it, and FSDP's units as the run makes them (:func:`hydratrain.parallel.wrap_policy.
  shard_units` on the meta model, after activation checkpointing wraps its blocks; BatchNorm and parametrized
  layers their own fp32 units under bf16/fp16: :func:`hydratrain.parallel.precision.float32_modules`);
* activations from one training step of the real model on storage-less tensors (:func:`trace`,
  :mod:`hydratrain.memsim`): the example micro-batch of the run's shapes (the data's first samples, or a token batch
  of ``data.seq_len``), forward in the strategy's autocast region (FSDP: parameters in the compute dtype, the
  inputs cast as FSDP's root casts them), the run's loss outside it (:mod:`hydratrain.train.batch`), backward, with
  the run's real activation-checkpointing wrappers. Each parameter's gradient is dropped as it is made and counted
  as the strategy holds it (fp32 replica; FSDP: its reduce-scattered shard; under accumulation the gradients held
  from earlier micro-batches), so one trace serves every world size;
* FSDP's buffers as an upper bound: the root's parameters gathered for the whole step and its unsharded gradients,
  the largest unit gathered twice (in flight and prefetched) with its unsharded gradients and its reduce-scatter
  input.

The peak is the larger of the simulated step's (with the state above) and the optimizer step's. What cannot be
predicted is said, never guessed: a model that does not build on meta raises :class:`PlanUnavailable`; a forward,
loss or backward the planner cannot simulate on storage-less tensors (data-dependent shapes, ``.item()``, custom
kernels) leaves the activations out of the peak and names them in :attr:`~hydratrain.footprint.Plan.unpredicted`, as
a limit of the planner, and so does a kernel's buffer no shape tells (:data:`hydratrain.memsim.UNSIZED`).
Costs: one meta build and one forward + backward of shadow ops per (micro-batch, precision, checkpointing), cached;
the first run of some ops' meta kernels imports ``torch._dynamo`` (1-3 s), which the run's first optimizer step
imports anyway.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Mapping

import torch
from omegaconf import OmegaConf
from torch import nn

from hydratrain import components
from hydratrain.config.settings import LoraSettings
from hydratrain.footprint import (
    CPU_FACT,
    DTYPE_BYTES,
    PRECISION_DTYPE,
    ModelSpec,
    Plan,
    PlanUnavailable,
    Setup,
    mode_of,
    moment_bytes,
    optim_note,
    padded,
    shard_unit_names,
    step_temporaries,
)
from hydratrain.memsim import Mode, ShadowFactories, Tracker, fuse_norms, shadow, shadow_module
from hydratrain.parallel import lora
from hydratrain.parallel.ac_compile import apply_activation_checkpointing
from hydratrain.parallel.blocks import find_blocks
from hydratrain.parallel.precision import float32_modules
from hydratrain.train.batch import forward, loss_of

MiB = 2 ** 20


# ---------------------------------------------------------------------------------------------- the batch
def describe(batch: Any) -> tuple:
    """``batch``'s structure with each tensor as ``("tensor", shape, dtype)``: tuples, lists and dicts kept, other
    values as they are (hashable ones) or their repr. What a :class:`ModelSpec` holds of the example batch."""
    if isinstance(batch, torch.Tensor):
        return ("tensor", tuple(batch.shape), str(batch.dtype).removeprefix("torch."))
    if isinstance(batch, Mapping):
        return ("dict", tuple((str(k), describe(v)) for k, v in batch.items()))
    if isinstance(batch, (list, tuple)):
        return ("list" if isinstance(batch, list) else "tuple", tuple(describe(v) for v in batch))
    return ("value", batch if isinstance(batch, (int, float, str, bool, type(None))) else repr(batch))


def token_batch(batch_size: int, seq_len: int) -> tuple:
    """:func:`describe` of a token micro-batch ``(inputs, targets)``, each ``(batch_size, seq_len)`` int64."""
    ids = ("tensor", (batch_size, seq_len), "int64")
    return ("tuple", (ids, ids))


def _rows(desc: tuple) -> int:
    """Samples in a described batch: the first dim of its first tensor with one (0: none)."""
    kind, body = desc[0], desc[1]
    if kind == "tensor":
        return body[0] if body else 0
    for child in (body if kind in ("list", "tuple") else (v for _, v in body) if kind == "dict" else ()):
        n = _rows(child)
        if n:
            return n
    return 0


def _resized(desc: tuple, rows: int, batch_size: int) -> tuple:
    """``desc`` with ``batch_size`` samples: every tensor whose first dim is ``rows`` gets ``batch_size`` there."""
    kind = desc[0]
    if kind == "tensor":
        shape = desc[1]
        return ("tensor", (batch_size, *shape[1:]) if shape and shape[0] == rows else shape, desc[2])
    if kind in ("list", "tuple"):
        return (kind, tuple(_resized(c, rows, batch_size) for c in desc[1]))
    if kind == "dict":
        return (kind, tuple((k, _resized(c, rows, batch_size)) for k, c in desc[1]))
    return desc


def batch_of(spec: ModelSpec, batch_size: int) -> tuple:
    """The example batch of ``spec`` described with ``batch_size`` samples."""
    return _resized(spec.batch, _rows(spec.batch), batch_size) if spec.batch else ()


def _leaves(desc: tuple):
    kind = desc[0]
    if kind == "tensor":
        yield desc
    elif kind in ("list", "tuple"):
        for c in desc[1]:
            yield from _leaves(c)
    elif kind == "dict":
        for _, c in desc[1]:
            yield from _leaves(c)


def batch_bytes(desc: tuple) -> int:
    """Bytes of the tensors of a described batch."""
    return sum(_numel(shape) * getattr(torch, dtype).itemsize for _, shape, dtype in _leaves(desc)) if desc else 0


def batch_text(desc: tuple) -> str:
    """``(64, 2) float32, (64,) int64``, or ``input_ids (8, 128) int64, ...`` for a dict batch."""
    if not desc:
        return "?"
    if desc[0] == "dict":
        return ", ".join(f"{k} {batch_text(c)}" for k, c in desc[1] if c[0] != "value")
    return ", ".join(f"{shape} {dtype}" for _, shape, dtype in _leaves(desc))


def _materialise(desc: tuple, device: torch.device, tracker: Tracker) -> Any:
    """A batch of :class:`~hydratrain.memsim.Shadow` tensors as ``desc`` describes (ignored by ``tracker``: the
    planner counts the batches itself)."""
    kind, body = desc[0], desc[1]
    if kind == "tensor":
        t = shadow(body, getattr(torch, desc[2]), device)
        tracker.ignore(t)
        return t
    if kind in ("list", "tuple"):
        items = [_materialise(c, device, tracker) for c in body]
        return items if kind == "list" else tuple(items)
    if kind == "dict":
        return {k: _materialise(c, device, tracker) for k, c in body}
    return body


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---------------------------------------------------------------------------------------------- the model
def _config(spec: ModelSpec):
    return OmegaConf.create({"model": json.loads(spec.node), "loss": json.loads(spec.loss)})


def meta_model(spec: ModelSpec) -> nn.Module:
    """The model of ``spec`` built on the meta device. Raises :class:`PlanUnavailable` naming what the build
    raised."""
    try:
        model = components.build_model(_config(spec), "meta")
        adapters = LoraSettings.of({"peft": json.loads(spec.peft)}) if spec.peft else None
        # LoRA: the base frozen, so the plan holds no gradient or optimizer state for it
        return lora.apply(model, adapters) if adapters is not None else model
    except Exception as err:  # noqa: BLE001 (a ConfigError of the constructor, or anything a build on meta raises)
        raise PlanUnavailable(f"model._target_={spec.target} does not build on the meta device, so its parameters "
                              f"are unknown: {_one_line(err)}") from None


def _one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"


def _blocks(model: nn.Module, spec: ModelSpec):
    return find_blocks(model, list(spec.block_classes) or None)


@dataclass(frozen=True)
class Structure:
    """The model's state as one rank sees it: ``params`` ((name, shape, bytes per value, trainable) of every
    parameter, tied ones once, in order), ``buffer_bytes``, FSDP's ``units`` (parameter names per unit, as the run
    shards them), ``fp32_units`` (those kept in float32: BatchNorm under bf16/fp16) and the ``root``'s names."""

    params: tuple
    buffer_bytes: int
    units: tuple
    fp32_units: tuple
    root: tuple


@lru_cache(maxsize=16)
def structure(spec: ModelSpec, checkpointed: bool, wrap_policy: str, min_num_params: int,
              fp32_norms: bool) -> Structure:
    """The :class:`Structure` of ``spec``'s model under this activation checkpointing and wrap policy (``none``
    for strategies that do not shard). Raises :class:`PlanUnavailable` (the model does not build on meta)."""
    model = meta_model(spec)
    params = tuple((n, tuple(p.shape), p.element_size(), p.requires_grad) for n, p in model.named_parameters())
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    name_of = {id(p): n for n, p in model.named_parameters()}
    norms = [[name_of[id(p)] for p in m.parameters()] for m in float32_modules(model)] if fp32_norms else []
    blocks = _blocks(model, spec)
    if checkpointed and blocks.modules:
        apply_activation_checkpointing(model, blocks)
    units = shard_unit_names(model, wrap_policy, min_num_params, blocks) if wrap_policy != "none" else []
    in_norms = {n for u in norms for n in u}
    units = [[n for n in u if n not in in_norms] for u in units]
    taken = in_norms | {n for u in units for n in u}
    return Structure(params, buffer_bytes, tuple(tuple(u) for u in units if u), tuple(tuple(u) for u in norms),
                     tuple(n for n, *_ in params if n not in taken))


# ---------------------------------------------------------------------------------------------- the step
@dataclass(frozen=True)
class Trace:
    """One simulated training step's activation bytes (:func:`trace`), gradients excluded. ``points``: ((phase,
    gradient bytes done, most bytes alive), ...): for each phase (forward, loss, backward) and amount of finished
    parameter gradients (bytes of their full fp32 -- their own dtype's -- copies), the most alive then; ``fwd_peak``,
    ``kept`` (alive once the outputs are dropped, the loss computed: what backward needs) and ``bwd_peak`` for the
    table; ``error``: why the step did not run on storage-less tensors ("" when it did); ``unsized``: buffers the
    step's kernels allocate that no shape tells (:data:`hydratrain.memsim.UNSIZED`), left out of the bytes."""

    points: tuple = ()
    fwd_peak: int = 0
    kept: int = 0
    bwd_peak: int = 0
    error: str = ""
    unsized: tuple = ()

    def peak(self, grad_factor: float) -> tuple[int, str, int]:
        """(most bytes alive, its phase, gradient bytes done then), the gradients counted ``grad_factor`` times
        their full size."""
        if not self.points:
            return 0, "forward", 0
        phase, done, alive = max(self.points, key=lambda p: p[2] + grad_factor * p[1])
        return alive, phase, done


class _StepTracker(Tracker):
    """A :class:`Tracker` that records the most bytes alive per (phase, gradient bytes done)."""

    def __init__(self):
        super().__init__()
        self.phase, self.done, self.points = "forward", 0, {}

    def track(self, t: torch.Tensor) -> None:
        super().track(t)
        key = (self.phase, self.done)
        self.points[key] = max(self.points.get(key, 0), self.now)


@lru_cache(maxsize=32)
def trace(spec: ModelSpec, batch_size: int, mode: Mode, checkpointed: bool, shards: bool) -> Trace:
    """The :class:`Trace` of one training step of ``spec``'s model on a micro-batch of ``batch_size`` samples, in
    ``mode`` (``shards``: FSDP's casts: parameters in ``mode.param_dtype``, BatchNorm in float32, the root's
    floating inputs cast), with activation checkpointing on the model's blocks when ``checkpointed``. Never raises
    for the model's sake: a step that does not run gives a Trace with ``error`` set."""
    if not spec.batch:
        return Trace(error="no example batch of the run's data")
    device, tracker = mode.torch_device(), _StepTracker()
    try:
        model = meta_model(spec)
        model.train()
        sizes = [p.numel() * p.element_size() for p in model.parameters()]  # the master weights' dtypes
        low = shards and mode.param_dtype != torch.float32
        norms = float32_modules(model) if low else []
        blocks = _blocks(model, spec)
        if checkpointed and blocks.modules:
            apply_activation_checkpointing(model, blocks)
        shadow_module(model, mode.param_dtype if shards else None, device, tracker, buffers=True)
        for norm in norms:  # float32 parameters, inputs cast to float32, outputs back to the compute dtype
            shadow_module(norm, torch.float32, device, tracker)
            norm.forward = (lambda x, f=norm.forward, dtype=mode.param_dtype: f(x.float()).to(dtype))
        fuse_norms(model, mode)
        if shards:
            model.register_forward_pre_hook(_cast_inputs(mode.param_dtype), with_kwargs=True)
        seen: set = set()

        def made(p: torch.Tensor, size: int) -> None:  # the gradient is counted as the strategy holds it
            p.grad = None
            if id(p) not in seen:
                seen.add(id(p))
                tracker.done += size
        for p, size in zip(model.parameters(), sizes):  # (shadowing keeps the parameters' order)
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda p, size=size: made(p, size))
        batch = _materialise(batch_of(spec, batch_size), device, tracker)
        loss_fn = components.build_loss(_config(spec))
        if isinstance(loss_fn, nn.Module):  # its buffers (class weights) on the step's device, storage-less too
            shadow_module(loss_fn, None, device, tracker, buffers=True)
        with tracker, ShadowFactories():
            outputs = forward(model, batch, mode.autocast_ctx())
            tracker.phase = "loss"
            loss = loss_of(outputs, batch, loss_fn)
            del outputs
            fwd_peak, kept = tracker.peak, tracker.now
            tracker.phase, tracker.peak = "backward", tracker.now
            loss.backward()
            bwd_peak = tracker.peak
    except Exception as err:  # noqa: BLE001 (the plan says what it could not predict; the run goes on)
        if tracker.phase == "loss":  # the model ran; the loss refused its outputs, which a real step may do too
            return Trace(error=f"the loss did not take the model's storage-less outputs ({type(err).__name__}; if the "
                         "real outputs fail too, the first step says why)")
        return Trace(error="the planner could not simulate the step on storage-less tensors, a limit of the "
                     f"planner (the run is not affected): {_one_line(err)}")
    points = tuple((phase, done, alive) for (phase, done), alive in tracker.points.items())
    return Trace(points, fwd_peak, kept, bwd_peak, unsized=tuple(sorted(tracker.unsized)))


def _cast_inputs(dtype: torch.dtype):
    """A forward pre-hook casting floating tensors of the inputs to ``dtype``, as FSDP2's root does
    (``MixedPrecisionPolicy.cast_forward_inputs``)."""
    from torch.utils._pytree import tree_map

    def cast(t):
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    def hook(module, args, kwargs):
        return tree_map(cast, args), tree_map(cast, kwargs)
    return hook


# ------------------------------------------------------------------------------------------------ predict
def predict(s: Setup) -> Plan:
    """The generic :class:`Plan` of setup ``s`` (see the module docstring). Raises :class:`PlanUnavailable` when
    the model does not build on the meta device."""
    spec = s.model
    c = DTYPE_BYTES[PRECISION_DTYPE[s.precision]]
    r = DTYPE_BYTES[s.reduce_dtype]
    mode = mode_of(s)
    low = s.shards and c != 4
    st = structure(spec, s.activation_checkpointing, s.wrap_policy if s.shards else "none", s.min_num_params, low)
    step = trace(spec, s.batch_size, mode, s.activation_checkpointing, s.shards)
    accum = s.grad_accum_steps > 1
    on_device = not (s.cpu_offload and s.device == "cuda")  # FSDP offload moves shards to host memory
    trainable = [(n, shape, size) for n, shape, size, grad in st.params if grad]
    full = sum(_numel(shape) * size for _, shape, size in trainable)
    n_params = sum(_numel(shape) for _, shape, *_ in st.params)
    parts, notes = {}, {}
    W = s.shard_world
    local = {n: padded(shape, W)[1] if s.shards else _numel(shape) for n, shape, *_ in st.params}
    held = sum(local[n] * size for n, _, size, _ in st.params)  # this rank's parameter bytes
    grads_all = sum(local[n] * size for n, _, size in trainable) * on_device
    where = "" if on_device else " (in host RAM: cpu_offload)"
    share = f"this rank's 1/{W} shard{where}" if s.shards else "a full replica"
    parts["parameters"] = held * on_device + st.buffer_bytes
    notes["parameters"] = f"the model's own dtypes, {share}" + (" (+ buffers, whole)" if st.buffer_bytes else "")
    parts["optimizer"] = sum(moment_bytes(local[n], s) * size // 4 for n, _, size in trainable) * on_device
    notes["optimizer"] = f"{optim_note(s)}, {share}" if s.shards else optim_note(s)
    if s.strategy == "ddp":
        parts["ddp buckets"] = full
        notes["ddp buckets"] = "a copy of every gradient (DistributedDataParallel's buckets)"
    fsdp = {}  # gathered parameters and gradient buffers, during forward and backward only
    if s.shards:
        size_of = {n: size for n, _, size, _ in st.params}
        shape_of = {n: shape for n, shape, *_ in st.params}

        def gathered(names, dtype_bytes=c) -> int:
            return sum(padded(shape_of[n], W)[0] * min(size_of[n], dtype_bytes) for n in names)
        units = [gathered(u) for u in st.units] + [gathered(u, 4) for u in st.fp32_units]
        biggest = max(units, default=0)
        in_flight = 2 * biggest if s.reshard_after_forward else sum(units)
        root = gathered(st.root)
        fsdp["fsdp buffers"] = 2 * root + in_flight + biggest + biggest * r // c
        units_held = ("the largest unit gathered twice (in flight, prefetched)" if s.reshard_after_forward
                      else "every unit gathered")
        notes["fsdp buffers"] = (f"at most: the root's {c * 8}-bit parameters gathered and their unsharded gradients, "
                                 f"{units_held} with its unsharded gradients and {r * 8}-bit reduce-scatter input")
        grads_persist = sum(padded(shape_of[n], W)[0] for n, _, _ in trainable) * r if accum else 0
        factor = 0.0 if accum else grads_all / max(full, 1)
        notes["gradients"] = (f"{r * 8}-bit, every unit's unsharded gradient (kept unsharded between micro-batches)"
                              if accum else f"the parameters' dtype, 1/{W} shard after each reduce-scatter{where}")
    else:
        grads_persist = grads_all if accum else 0
        factor = 0.0 if accum else 1.0
        notes["gradients"] = "the parameters' dtype, from each parameter's backward" + (
            " (kept through the micro-batches)" if accum else "")
    act, phase, done = step.peak(factor)
    batches = 2 * batch_bytes(batch_of(spec, s.batch_size))
    during = dict(parts, **fsdp, gradients=grads_persist + int(factor * done), activations=act, batches=batches,
                  baseline=s.baseline)
    tmp, tmp_note = step_temporaries(s, grads_all, 2 * max((local[n] * size for n, _, size in trainable), default=0))
    stepping = dict(parts, gradients=grads_all, **{"optimizer step": tmp * on_device}, batches=batches,
                    baseline=s.baseline)
    named = {"forward": "forward of the model", "loss": "the loss", "backward": "backward of the loss and the model"}
    moments = [(named[phase], during), ("optimizer step", stepping)]
    moment, parts = max(moments, key=lambda m: sum(m[1].values()))
    parts = {k: v for k, v in parts.items() if v}
    ac = "with" if s.activation_checkpointing else "without"
    notes.update({
        "activations": (f"one training step of the model and its loss run on storage-less tensors ({ac} activation "
                        "checkpointing): what backward needs, the outputs, the working set"),
        "optimizer step": tmp_note,
        "batches": f"this and the prefetched next micro-batch: {batch_text(batch_of(spec, s.batch_size))}",
        "baseline": "this process before the model: resident set (interpreter, torch, data)" if s.device == "cpu"
        else "tensors allocated before the model",
    })
    facts = []
    unpredicted = []
    if step.error:
        unpredicted.append(f"activations and the loss ({step.error})")
    else:
        facts.append(f"the step: forward peak {step.fwd_peak / MiB:.1f} MiB, kept for backward {step.kept / MiB:.1f} "
                     f"MiB, backward peak {step.bwd_peak / MiB:.1f} MiB (gradients apart)")
    unpredicted += [f"{what} (its size is the library's own, not known from shapes: a limit of the planner)"
                    for what in step.unsized]
    if s.device == "cpu":
        facts.append(CPU_FACT)
    return Plan(s, sum(parts.values()), moment, parts, notes, facts, n_params,
                model_desc=f"model {spec.target} ({_count(n_params)} parameters)",
                batch_desc=f"micro-batch {s.batch_size} x {_sample_text(spec)}", unpredicted=unpredicted)


def _count(n: int) -> str:
    """``34,976``, ``12.3M``, ``7.2B``."""
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"


def _sample_text(spec: ModelSpec) -> str:
    """One sample's shapes: ``(2,) float32 -> () int64``, from the example batch with one sample."""
    one = batch_of(spec, 1)
    if not one:
        return "samples of unknown shape"
    leaves = [(shape[1:] if shape and shape[0] == 1 else shape, dtype) for _, shape, dtype in _leaves(one)]
    return "samples of " + ", ".join(f"{tuple(shape)} {dtype}" for shape, dtype in leaves)
