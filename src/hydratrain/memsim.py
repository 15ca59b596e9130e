"""Bytes a model's forward and backward keep and peak at, measured on tensors that have no storage.

The memory planner (:mod:`hydratrain.footprint`) needs the bytes autograd saves for backward and the transient peaks
of forward and backward, for the real batch, sequence length, dtypes and activation-checkpointing setting. Modelling
every op by hand goes stale as torch changes its kernels, so the planner runs the real modules (hydratrain's GPT: one
decoder block and the head, :mod:`hydratrain.models.gpt_memory`; any other model: the whole model and its loss,
:mod:`hydratrain.stepsim`) with the real ``torch.autocast`` on :class:`Shadow` tensors: a tensor subclass that
reports a CPU or CUDA device (so autocast and the attention kernel choice behave as on that device) and computes
every op on the ``meta`` device, which gives shapes, dtypes, views and in-place aliasing but allocates nothing. A
:class:`Tracker` counts the bytes of the distinct meta storages alive at each moment (a weakref callback per storage
sees it die), which is what a caching allocator would have handed out: views and in-place results share their
base's storage and are counted once.

Why not ``torch._subclasses.FakeTensorMode``: its first use imports ``torch._dynamo`` (sympy included), about 2-3 s,
while this runs at the start of every training run. The approach -- run on meta, count storages -- is the one
``torch.distributed._tools.mem_tracker.MemTracker`` takes under fake tensors; autograd's saved tensors are the
storages alive between forward and backward (``torch.autograd.graph.saved_tensors_hooks`` docs).

Costs: one GPT block forward + backward is ~100 shadow ops, 10-50 ms, whatever the depth.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

META = torch.device("meta")
_TRACKERS: list["Tracker"] = []  # the active tracker (a stack of at most one in practice)


class Tracker:
    """Live bytes of the meta storages that :class:`Shadow` ops create, and their peak.

    Storages registered with :meth:`ignore` (parameters, rotary tables: counted elsewhere by the planner) are never
    counted, even when a view of them is returned by an op."""

    def __init__(self):
        self.now = 0
        self.peak = 0
        self._live: dict[int, weakref.ref] = {}
        self._ignored: dict[int, torch.UntypedStorage] = {}  # strong refs, so their ids are not reused
        self.unsized: set[str] = set()  # what ran but allocates bytes no shape tells (:data:`UNSIZED`)

    def track(self, t: torch.Tensor) -> None:
        st = inner(t).untyped_storage()
        key = st._cdata
        if key in self._live or key in self._ignored:
            return
        n = st.nbytes()

        def freed(_ref, key=key, n=n):
            if self._live.pop(key, None) is not None:
                self.now -= n

        self._live[key] = weakref.ref(st, freed)
        self.now += n
        self.peak = max(self.peak, self.now)

    def ignore(self, t: torch.Tensor) -> None:
        st = inner(t).untyped_storage()
        self._ignored[st._cdata] = st

    def reset_peak(self) -> None:
        self.peak = self.now

    def __enter__(self) -> "Tracker":
        _TRACKERS.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _TRACKERS.remove(self)


def inner(t: torch.Tensor) -> torch.Tensor:
    return t.elem if isinstance(t, Shadow) else t


class Shadow(torch.Tensor):
    """A tensor that claims ``device`` (cpu or cuda) but holds a storage-less ``meta`` tensor, ``elem``."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor, device: torch.device, requires_grad: bool = False):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(),
                                                storage_offset=elem.storage_offset(), dtype=elem.dtype,
                                                device=device, requires_grad=requires_grad)
        r.elem = elem
        return r

    def __repr__(self) -> str:  # type: ignore[override]  # no tensor_contents: a shadow has no values to print
        return f"Shadow({tuple(self.shape)}, {self.dtype}, {self.device})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._fused_sdp_choice.default:
            return _sdp_choice(*args, **kwargs)
        device, inputs = None, {}

        def unwrap(t):
            nonlocal device
            if isinstance(t, Shadow):
                device = t.device
                inputs[id(t.elem)] = t
                return t.elem
            if isinstance(t, torch.device):
                return META
            return t

        out = _meta_call(func, tree_map(unwrap, args), tree_map(unwrap, kwargs))
        if torch.Tag.inplace_view in func.tags:  # transpose_, unsqueeze_, as_strided_ (an RNN's batch_first)
            _restride(func, args, kwargs)
        device = device or kwargs.get("device") or torch.device("cpu")
        tracker = _TRACKERS[-1] if _TRACKERS else None
        if tracker is not None and func in UNSIZED:
            tracker.unsized.add(UNSIZED[func])

        def wrap(t):
            if not isinstance(t, torch.Tensor) or t.device != META:
                return t
            if id(t) in inputs:  # in-place or out= result: the input itself
                return inputs[id(t)]
            if tracker is not None:
                tracker.track(t)
            return Shadow(t, device)

        return tree_map(wrap, out)


def _restride(func, args, kwargs) -> None:
    """After an in-place view op changed the sizes or strides of the meta tensor inside a :class:`Shadow` (its
    ``self``), the same change on the Shadow itself, by torch's meta kernel of ``func`` (the way
    ``torch.utils._python_dispatch.return_and_correct_aliasing`` keeps a wrapper subclass's metadata)."""
    from torch.utils._mode_utils import no_dispatch

    with no_dispatch():
        meta_in_tls = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            func(*args, **kwargs)
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta_in_tls)


def _empty(shape, dtype, like: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A meta tensor of ``shape`` and ``dtype``: contiguous, or with the dimension order of ``like`` (a tensor of
    the same shape), as TensorIterator lays out the result of a pointwise op on a permuted input."""
    shape = tuple(shape)
    order = list(range(len(shape)))[::-1]  # innermost first
    if like is not None and tuple(like.shape) == shape and not like.is_contiguous():
        order = sorted(range(len(shape)), key=lambda d: (like.stride(d), -d))
    strides, step = [0] * len(shape), 1
    for d in order:
        strides[d] = step
        step *= max(shape[d], 1)
    return torch.empty_strided(shape, strides, dtype=dtype, device=META)


def _pointwise(func, args, kwargs):
    """A functional pointwise op on floating tensors: the broadcast shape, the promoted dtype, the layout of the first
    input of full shape (``memory_format=torch.contiguous_format``, as ``reshape`` clones a tensor it cannot view:
    contiguous). None (use torch's meta kernel) for anything else, another ``memory_format`` included."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if not tensors or not all(t.is_floating_point() for t in tensors):
        return None
    memory_format = kwargs.get("memory_format")
    if memory_format not in (None, torch.preserve_format, torch.contiguous_format):
        return None
    shape = torch.Size([])
    for t in tensors:
        shape = torch.broadcast_shapes(shape, t.shape)
    # all operands are floating, so python scalars never change the dtype and 0-dim tensors only count alone
    ranked = [t for t in tensors if t.dim() > 0] or tensors
    dtype = ranked[0].dtype
    for t in ranked[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    like = next((t for t in tensors if tuple(t.shape) == tuple(shape)), None)
    return _empty(shape, dtype, None if memory_format is torch.contiguous_format else like)


def _reduce(x, dim, keepdim=False, *, dtype=None):
    """``mean.dim`` / ``sum.dim_IntList``."""
    dims = {d % x.dim() for d in ([dim] if isinstance(dim, int) else (dim or range(x.dim())))}
    shape = [1 if d in dims else n for d, n in enumerate(x.shape) if keepdim or d not in dims]
    return _empty(shape, dtype or x.dtype)


def _cat(tensors, dim=0):
    tensors = [t for t in tensors if not (t.dim() == 1 and t.numel() == 0)]
    dim = dim % tensors[0].dim()
    shape = list(tensors[0].shape)
    shape[dim] = sum(t.shape[dim] for t in tensors)
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return _empty(shape, dtype)


def _log_softmax(x, dim, half_to_float):
    return _empty(x.shape, torch.float32 if half_to_float else x.dtype)


def _log_softmax_backward(grad_out, out, dim, input_dtype):
    return _empty(grad_out.shape, input_dtype)


def _nll_loss_backward(grad_out, x, target, weight, reduction, ignore_index, total_weight):
    return _empty(x.shape, x.dtype)


def _nll_loss_forward(x, target, weight, reduction, ignore_index):
    """(loss, total_weight): loss per sample for reduction none (0), else a scalar."""
    shape = target.shape if reduction == 0 else ()
    return _empty(shape, x.dtype), _empty((), x.dtype)


def _rms_norm(x, normalized_shape, weight, eps):
    """``aten::_fused_rms_norm`` (CUDA): (output like ``x``, rstd in fp32 (fp64 for fp64) with the normalized dims
    kept as 1), as torch's decomposition ``torch._decomp.decompositions._fused_rms_norm`` returns them."""
    n = len(normalized_shape)
    stat_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    return _empty(x.shape, x.dtype), _empty((*x.shape[:x.dim() - n], *[1] * n), stat_dtype)


def _rms_norm_backward(grad_out, x, normalized_shape, rstd, weight, output_mask):
    """``aten::_fused_rms_norm_backward``: (grad input like ``x``, grad weight shaped like ``weight`` in ``x``'s
    dtype), each None where ``output_mask`` says so."""
    grad_x = _empty(x.shape, x.dtype) if output_mask[0] else None
    grad_w = _empty(weight.shape, x.dtype) if output_mask[1] and weight is not None else None
    return grad_x, grad_w


# torch registers Python meta kernels (torch._meta_registrations, torch._refs) over most of aten's C++ ones; many
# are wrapped in torch._compile._disable_dynamo, whose first call imports torch._dynamo and sympy (2-3 s). The ops a
# decoder block and its loss use get their output shape, dtype and layout here instead. tests/unit/test_plan.py
# checks that these agree with torch's meta kernels and that planning imports neither torch._dynamo nor sympy.
_RULES = {
    torch.ops.aten.mean.dim: _reduce,
    torch.ops.aten.sum.dim_IntList: _reduce,
    torch.ops.aten.cat.default: _cat,
    torch.ops.aten._log_softmax.default: _log_softmax,
    torch.ops.aten._log_softmax_backward_data.default: _log_softmax_backward,
    torch.ops.aten.nll_loss_forward.default: _nll_loss_forward,
    torch.ops.aten.nll_loss_backward.default: _nll_loss_backward,
    torch.ops.aten._fused_rms_norm.default: _rms_norm,
    torch.ops.aten._fused_rms_norm_backward.default: _rms_norm_backward,
}
USE_RULES = True  # False runs every op through torch's own meta kernels (tests compare the two)
#: ops whose real kernel allocates a buffer that torch's meta kernel gives as empty, its size known to the library
#: alone (oneDNN's LSTM workspace, kept for backward: 204 KiB for 12 x 4 x 64 on a CPU, where the meta kernel says 0)
UNSIZED = {torch.ops.aten.mkldnn_rnn_layer.default: "the oneDNN workspace of nn.LSTM layers on a CPU"}


def _meta_call(func, args, kwargs):
    """``func`` on meta tensors: a rule above when there is one, else torch's meta kernel."""
    if USE_RULES:
        rule = _RULES.get(func)
        if rule is not None:
            return rule(*args, **kwargs)
        if torch.Tag.pointwise in func.tags and not func._schema.is_mutable:
            out = _pointwise(func, args, kwargs)
            if out is not None:
                return out
    return func(*args, **kwargs)


def shadow(shape, dtype: torch.dtype, device: torch.device, requires_grad: bool = False) -> Shadow:
    """A :class:`Shadow` of ``shape`` and ``dtype`` on ``device`` (allocates nothing)."""
    return Shadow(torch.empty(shape, dtype=dtype, device=META), device, requires_grad)


class ShadowFactories(TorchDispatchMode):
    """Inside it, a tensor made from no tensor (``torch.arange``, ``ones``, ``full``, ``randn``, ... with or without
    a ``device``) is a :class:`Shadow` on the device it asks for, counted by the active :class:`Tracker`: a model's
    forward that makes its positions or masks on its input's device (``torch.arange(T, device=x.device)``) allocates
    nothing and is counted as the real one would be. Ops on tensors go to :class:`Shadow` (or run as they are)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        makes = not any(isinstance(t, torch.Tensor) for t in tree_leaves((args, kwargs))) and \
            any(a.name == "device" for a in func._schema.arguments)
        if not makes:
            return func(*args, **kwargs)
        device = torch.device(kwargs.get("device") or "cpu")
        on_meta = {**kwargs, "device": META}
        if on_meta.get("pin_memory"):
            on_meta["pin_memory"] = False  # (meta memory cannot be pinned)
        out = func(*args, **on_meta)
        tracker = _TRACKERS[-1] if _TRACKERS else None

        def wrap(t):
            if not isinstance(t, torch.Tensor):
                return t
            if tracker is not None:
                tracker.track(t)
            return Shadow(t, device)
        return tree_map(wrap, out)


def _sdp_choice(q, k, v, *args, **kwargs) -> int:
    """``aten::_fused_sdp_choice`` as the real device would answer it: asked with tiny real tensors of the same
    dtype and head layout (the choice depends on dtype, head size, mask and dropout, not on batch or length)."""
    def small(t):
        return torch.zeros(1, t.shape[1], min(t.shape[2], 8), t.shape[3], dtype=t.dtype, device=t.device)

    args = tuple(torch.zeros(1, dtype=a.dtype, device=a.device) if isinstance(a, torch.Tensor) else a for a in args)
    return torch.ops.aten._fused_sdp_choice.default(small(q), small(k), small(v), *args, **kwargs)


def shadow_module(module: nn.Module, dtype: Optional[torch.dtype], device: torch.device, tracker: Tracker,
                  buffers: bool = False) -> nn.Module:
    """Replace every parameter of ``module`` (built on meta) by a leaf :class:`Shadow` that requires grad, of
    ``dtype`` (None: the parameter's own; a parameter that is not floating point keeps its dtype), ignored by
    ``tracker`` (parameter bytes are the planner's own arithmetic); ties are kept. With ``buffers``, every buffer
    too, in its own dtype (a module in training mode updates its statistics in place)."""
    done: dict[int, Shadow] = {}
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) not in done:
                cast = dtype if dtype is not None and p.is_floating_point() else p.dtype
                done[id(p)] = shadow(p.shape, cast, device, requires_grad=p.requires_grad)
                tracker.ignore(done[id(p)])
            mod._parameters[name] = done[id(p)]  # type: ignore[assignment]  # a Shadow stands in for the Parameter
        for name, b in list(mod._buffers.items()) if buffers else ():
            if b is not None and not isinstance(b, Shadow):
                if id(b) not in done:
                    done[id(b)] = shadow(b.shape, b.dtype, device)
                    tracker.ignore(done[id(b)])
                mod._buffers[name] = done[id(b)]
    return module


class _FusedRMSNorm(torch.autograd.Function):
    """What CUDA's ``aten::_fused_rms_norm`` keeps for backward: the input and one fp32 rstd per row, nothing else.

    Planning a CUDA run on a host whose torch has no CUDA, the shadows must claim ``cpu`` (autograd aborts on a
    ``cuda`` device there), and on ``cpu`` ``rms_norm`` decomposes into ``pow``, ``mean``, ``rsqrt`` and ``mul``,
    whose results autograd keeps: about two more (B, T, C) tensors per norm than the GPU holds (measured on an H200:
    gpt_small, fsdp bf16, 8 x 1024, planned 4.72 GiB from a CPU host against 3.75 GiB measured)."""

    @staticmethod
    def forward(ctx, x, weight):
        rstd = x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)
        ctx.save_for_backward(x, rstd, weight)
        return x.new_empty(x.shape)

    @staticmethod
    def backward(ctx, grad_out):
        x, rstd, weight = ctx.saved_tensors
        return grad_out.new_empty(x.shape), weight.new_empty(weight.shape)


def fuse_norms(module: nn.Module, mode: "Mode") -> None:
    """With ``mode.fused_norms``, run every ``nn.RMSNorm`` of ``module`` as :class:`_FusedRMSNorm`."""
    if not mode.fused_norms:
        return
    for mod in module.modules():
        if isinstance(mod, nn.RMSNorm) and mod.weight is not None:
            # (the instance's forward shadows the class's; the lambda binds this mod)
            mod.forward = lambda x, mod=mod: _FusedRMSNorm.apply(x, mod.weight)  # type: ignore[method-assign,misc]


@dataclass(frozen=True)
class Mode:
    """How the forward sees numbers. ``param_dtype``: dtype of the parameters the kernels read (fp32 master weights
    under single/ddp; FSDP's all-gathered compute dtype under fsdp). ``autocast``: the autocast dtype, or None.
    ``device``: the device type the simulation claims (cpu, or cuda when this process has CUDA)."""

    param_dtype: torch.dtype
    autocast: Optional[torch.dtype]
    device: str = "cpu"
    fused_norms: bool = False  # model CUDA's fused rms_norm while claiming cpu (see :class:`_FusedRMSNorm`)

    def torch_device(self) -> torch.device:
        """The device the shadows claim, with an index: autograd's engine routes a backward by device index, and a
        bare ``cuda`` (index -1) failed its internal assert on an H200 (torch 2.11), so every GPU run lost its plan."""
        return torch.device(self.device) if self.device == "cpu" else torch.device(self.device, 0)

    def autocast_ctx(self):
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device, dtype=self.autocast)
