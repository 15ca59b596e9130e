"""hydratrain's GPT under the memory planner: its own moment-by-moment model (:func:`predict`), which
:meth:`hydratrain.models.gpt.GPT.memory_plan` hands the planner (:mod:`hydratrain.footprint` explains the hook).

What a rank holds (``predict``), at each moment of a steady-state step (step >= 2, so AdamW's moments exist; with
``trainer.grad_accum_steps`` > 1 a later micro-batch, whose gradients add to the earlier ones'):

* parameters: fp32 master weights (plus the rotary tables); FSDP: this rank's shard of each parameter, dim 0
  padded to a multiple of the world size as ``fully_shard`` does;
* gradients: fp32, from each parameter's backward to ``zero_grad(set_to_none=True)`` after the optimizer step
  (through the whole step under accumulation); FSDP: the reduce-scattered shards, but under accumulation the
  unsharded gradients of every unit in the reduce dtype (FSDP2 keeps them unsharded until the micro-batch that syncs);
* optimizer: AdamW's exp_avg and exp_avg_sq, fp32 (sharded under FSDP), and the step's temporaries
  (:func:`hydratrain.footprint.step_temporaries`);
* DDP: the gradient buckets, a second fp32 copy of every gradient (``gradient_as_bucket_view=False``);
* FSDP buffers: the units' parameters all-gathered in the compute dtype (the root's for the whole step; a block's
  during its forward, and in backward the block's plus the next one prefetched; all of them with
  ``reshard_after_forward=false``), the all-gather's flat output while it is copied out, the unsharded gradients in
  the compute dtype and the reduce-scatter input in the reduce dtype (one kept until the next unit's reduce-scatter)
  (``torch.distributed.fsdp._fully_shard._fsdp_collectives``);
* activations: what each decoder block keeps for backward and the working set of the block in flight, measured by
  running one block on storage-less tensors (:mod:`hydratrain.memsim`, :func:`block_profile`) for the real batch,
  length, dtypes and activation-checkpointing setting, times the number of blocks; under autocast (single/ddp with
  bf16/fp16) this includes autocast's low-precision copies of the weights;
* logits/loss: the head as the trainer runs it (:func:`head_profile`): logits (B x T x vocab) in the compute dtype,
  their fp32 copy, the log-softmax the loss keeps and their gradients -- for large vocabularies often the largest;
* batches: this micro-batch's and the prefetched next one's token ids (int64);
* baseline (CPU): what the process already holds when the plan is made (its resident set: the interpreter, torch's
  libraries, the data); on CUDA the tensors already allocated.

The peak is the largest moment: the last block's forward, the head's forward and backward, each block's backward,
the embedding's backward, the optimizer step, an FSDP unit's all-gather or reduce-scatter. Running one block and the
head (not the whole model) costs the same at any depth: a plan of llama_8b takes well under a second, and imports
no ``torch._dynamo`` (see :mod:`hydratrain.memsim`).
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from hydratrain.footprint import (
    CPU_FACT,
    DTYPE_BYTES,
    PRECISION_DTYPE,
    ModelSpec,
    Plan,
    Setup,
    mode_of,
    moment_bytes,
    optim_note,
    padded,
    raf_ok,
    shard_unit_names,
    step_temporaries,
)
from hydratrain.memsim import META, Mode, Tracker, fuse_norms, inner, shadow, shadow_module
from hydratrain.models.gpt_layers import Block, GPTConfig

TARGET = "hydratrain.models.GPT"


def config_of(spec: ModelSpec) -> GPTConfig:
    """The :class:`GPTConfig` a ``GPT(**keywords)`` of ``spec`` builds (null keywords take the defaults, as
    :class:`hydratrain.models.gpt.GPT` does)."""
    kwargs = spec.keywords()
    return GPTConfig(**{k: v for k, v in kwargs.items() if v is not None or k in ("n_kv_head", "d_ff")})


def model_spec(cfg: GPTConfig) -> ModelSpec:
    """The planner's :class:`ModelSpec` of ``GPT(cfg)``."""
    return ModelSpec(TARGET, json.dumps({"_target_": TARGET, **dataclasses.asdict(cfg)}, sort_keys=True))


def items(cfg: GPTConfig) -> tuple:
    """``cfg``'s fields as sorted (key, value) pairs: the hashable key of the profiles below."""
    return tuple(sorted(dataclasses.asdict(cfg).items()))


# ------------------------------------------------------------------------------------------------ parameters
def param_shapes(m: GPTConfig) -> list[tuple[str, tuple]]:
    """(name, shape) of every parameter of ``hydratrain.models.GPT(m)``, tied weights once, in its order."""
    d, hd = m.d_model, m.head_dim
    shapes: list[tuple[str, tuple]] = [("tok_emb.weight", (m.vocab_size, d))]
    for i in range(m.n_layer):
        p = f"blocks.{i}."
        shapes += [(p + "attn_norm.weight", (d,)), (p + "attn.wq.weight", (m.n_head * hd, d)),
                   (p + "attn.wk.weight", (m.kv_heads * hd, d)), (p + "attn.wv.weight", (m.kv_heads * hd, d)),
                   (p + "attn.wo.weight", (d, m.n_head * hd)), (p + "mlp_norm.weight", (d,)),
                   (p + "mlp.w1.weight", (m.ff_dim, d)), (p + "mlp.w3.weight", (m.ff_dim, d)),
                   (p + "mlp.w2.weight", (d, m.ff_dim))]
    shapes.append(("norm.weight", (d,)))
    if not m.tie_embeddings:
        shapes.append(("lm_head.weight", (m.vocab_size, d)))
    return shapes


def fsdp_units(s: Setup) -> tuple[list[list[str]], list[str]]:
    """(the parameter names of each unit that ``wrap_policy`` gives its own ``fully_shard``, in forward order; the
    root's) for setup ``s`` (see :mod:`hydratrain.parallel.wrap_policy`)."""
    m = config_of(s.model)
    names = [n for n, _ in param_shapes(m)]
    policy = s.wrap_policy
    if policy in ("auto", "transformer_block"):
        units = [[n for n in names if n.startswith(f"blocks.{i}.")] for i in range(m.n_layer)]
    elif policy == "size_based":
        units = _size_based_units(m, s.min_num_params, s.activation_checkpointing)
    else:
        units = []
    taken = {n for u in units for n in u}
    return units, [n for n in names if n not in taken]


def _size_based_units(m: GPTConfig, min_num_params: int, checkpointed: bool = False) -> list[list[str]]:
    """The size rule of :func:`hydratrain.parallel.wrap_policy.shard_units` on a storage-less stand-in of the GPT
    (the real constructor's initialisers would run Python meta kernels); ``checkpointed``: each block inside an
    activation-checkpointing wrapper, into which ``shard_units`` merges any unit below it."""
    class Leaf(nn.Module):
        def __init__(self, shape):
            super().__init__()
            self.weight = nn.Parameter(torch.empty(shape, device="meta"))

    class Wrapper(nn.Module):  # what shard_units recognises a checkpoint wrapper by (checkpoint_wrapper's attribute)
        def __init__(self, block):
            super().__init__()
            self._checkpoint_wrapped_module = block

    root = nn.Module()
    root.tok_emb = Leaf((m.vocab_size, m.d_model))
    with torch.device("meta"):
        blocks = [Block(m) for _ in range(m.n_layer)]
    root.blocks = nn.ModuleList(Wrapper(b) if checkpointed else b for b in blocks)
    root.norm = Leaf((m.d_model,))
    root.lm_head = Leaf((m.vocab_size, m.d_model))
    if m.tie_embeddings:
        root.lm_head.weight = root.tok_emb.weight
    return shard_unit_names(root, "size_based", min_num_params)


# -------------------------------------------------------------------------------------------------- predict
def predict(s: Setup) -> Plan:
    """The :class:`Plan` of setup ``s`` (a GPT): every moment of a step, in bytes; the peak is the largest."""
    m = config_of(s.model)
    cfg_items = items(m)
    shapes = dict(param_shapes(m))
    n_params = sum(math.prod(v) for v in shapes.values())
    c = DTYPE_BYTES[PRECISION_DTYPE[s.precision]]
    r = DTYPE_BYTES[s.reduce_dtype]
    mode = mode_of(s)
    p_bytes = 4 if mode.autocast is not None or not s.shards else c  # bytes of a parameter the kernels read
    blk = block_profile(cfg_items, s.batch_size, s.seq_len, mode, s.activation_checkpointing)
    head = head_profile(cfg_items, s.batch_size, s.seq_len, mode)
    L = m.n_layer
    buffers = 2 * m.max_seq_len * m.head_dim * 4  # the rotary tables, fp32
    batches = 4 * s.batch_size * s.seq_len * 8  # x and y of this micro-batch and of the prefetched one, int64
    emb = m.vocab_size * m.d_model * p_bytes  # the embedding's gradient, computed in its backward
    accum = s.grad_accum_steps > 1
    on_device = not (s.cpu_offload and s.device == "cuda")  # FSDP offload moves shards to host memory
    parts_static: dict
    notes, parts_static = {}, {}

    if s.shards:
        W = s.shard_world
        units, root = fsdp_units(s)
        full = {n: padded(shapes[n], W) for n in shapes}
        shard = sum(v[1] for v in full.values())
        unit_full = [sum(full[n][0] for n in u) for u in units] or [0]
        unit_shard = [sum(full[n][1] for n in u) for u in units] or [0]
        root_full = sum(full[n][0] for n in root)
        biggest, biggest_shard = max(unit_full), max(unit_shard)
        block0 = [n for n in shapes if n.startswith("blocks.0.")]
        blocks_wrapped = not any(n in root for n in block0)
        params = shard * 4 * on_device + buffers
        optim = sum(moment_bytes(v[1], s) for v in full.values()) * on_device
        grads_all = 4 * shard * on_device
        where = "" if on_device else " (in host RAM: cpu_offload)"
        notes["parameters"] = f"fp32 master weights, this rank's 1/{W} shard{where} (+ rotary tables)"
        notes["gradients"] = (f"{r * 8}-bit, every unit's unsharded gradient (kept unsharded between micro-batches)"
                              if accum else f"fp32, 1/{W} shard after each reduce-scatter{where}")
        notes["optimizer"] = f"{optim_note(s)}, 1/{W} shard{where}"
        grads_persist = sum(v[0] for v in full.values()) * r if accum else 0
        raf = s.reshard_after_forward
        root_params = root_full * c  # kept gathered for the whole step (units exist) or the whole model (none)
        fwd_units = (biggest if raf else sum(unit_full)) * c

        def bwd_units(i: int) -> int:
            """Block i's backward: its unit's parameters gathered, the next one's prefetched (i > 0), and the
            reduce-scatter input of the one before kept until this unit's reduce-scatter (i < L - 1)."""
            if not units:
                return 0
            gathered = (1 + (i > 0)) * biggest if raf else sum(unit_full)
            replicas = s.strategy == "hsdp" and s.world_size > W  # the all-reduce between shard groups keeps one
            return gathered * c + (i < L - 1) * biggest * r + replicas * biggest_shard * r
        gather_extra = biggest * c + (biggest_shard * c if c != 4 or not on_device else 0)
        # a block's gradients once its backward is done: reduce-scattered fp32 shards (its own unit), or unsharded
        # in the compute dtype until the root's reduce-scatter at the end
        block_shard = sum(full[n][1] for n in block0)
        done_per_block = block_shard * 4 * on_device if blocks_wrapped else blk.param_grads
        root_grads = (head.param_grads + (0 if m.tie_embeddings else emb)
                      + (0 if blocks_wrapped else L * blk.param_grads))
        root_reduce = root_grads + root_full * r + (root_full // W) * (r + (4 if r != 4 else 0))
        fsdp_note = (f"{c * 8}-bit parameters of the root and {'the block(s) in flight' if raf else 'every unit'} "
                     f"all-gathered, {c * 8}-bit unsharded gradients, {r * 8}-bit reduce-scatter input")
        step_tmp, step_note = step_temporaries(s, 4 * shard, 2 * 4 * max(v[1] for v in full.values()))
        step_tmp *= on_device
        parts_static.update(parameters=params, optimizer=optim)
    else:
        params = 4 * n_params + buffers
        optim = sum(moment_bytes(math.prod(v), s) for v in shapes.values())
        grads_all = 4 * n_params
        grads_persist = grads_all if accum else 0
        root_params = fwd_units = gather_extra = root_reduce = 0

        def bwd_units(i: int) -> int:
            return 0
        done_per_block = blk.param_grads
        notes["parameters"] = "fp32 master weights, a full replica" + (" (+ rotary tables)" if buffers else "")
        notes["gradients"] = "fp32"
        notes["optimizer"] = optim_note(s)
        step_tmp, step_note = step_temporaries(s, 4 * n_params, 2 * 4 * max(math.prod(v) for v in shapes.values()))
        parts_static.update(parameters=params, optimizer=optim)
        if s.strategy == "ddp":
            parts_static["ddp buckets"] = 4 * n_params
            notes["ddp buckets"] = "fp32 copy of every gradient (DistributedDataParallel's buckets)"

    def moment(name: str, *, grads=0, fsdp=0, act=0, head_bytes=0, step=0) -> tuple[str, dict]:
        parts = dict(parts_static)
        parts["gradients"] = grads
        if s.shards:
            parts["fsdp buffers"] = fsdp
        parts["activations"] = act
        parts["logits/loss"] = head_bytes
        parts["optimizer step"] = step
        parts["batches"] = batches
        parts["baseline"] = s.baseline
        return name, parts

    kept_fwd = blk.kept_in_autocast
    head_grads_done = head.param_grads  # the head's parameter gradients, made first in backward
    moments = [
        moment(f"forward of block {L}/{L}", grads=grads_persist, fsdp=root_params + fwd_units,
               act=(L - 1) * kept_fwd + blk.fwd_peak),
        moment(f"all-gather of block {L}/{L}'s unit", grads=grads_persist,
               fsdp=root_params + fwd_units + gather_extra, act=(L - 1) * kept_fwd + blk.kept)
        if s.shards else None,
        moment("forward of the head and loss", grads=grads_persist, fsdp=root_params + (0 if raf_ok(s) else fwd_units),
               act=L * kept_fwd, head_bytes=head.fwd_peak),
        moment("backward of the head and loss", grads=grads_persist, fsdp=root_params + (0 if raf_ok(s) else fwd_units),
               act=L * blk.kept, head_bytes=head.bwd_peak),
    ]
    for i in (L - 1, 0):  # the extremes of a linear sequence
        grads = grads_persist or (head_grads_done + (L - 1 - i) * done_per_block)
        moments.append(moment(f"backward of block {i + 1}/{L}", grads=grads, fsdp=root_params + bwd_units(i),
                              act=i * blk.kept + blk.bwd_peak))
    grads_end = grads_persist or (head_grads_done + L * done_per_block)
    emb_extra = emb if m.tie_embeddings else 0  # tied: the embedding's gradient is added to the head's, then freed
    moments.append(moment("backward of the embedding", grads=grads_end + (0 if m.tie_embeddings or grads_persist
                                                                         else emb),
                          fsdp=root_params, act=s.batch_size * s.seq_len * m.d_model * p_bytes + emb_extra))
    if s.shards:
        moments.append(moment("reduce-scatter of the root", grads=L * done_per_block if blocks_wrapped else 0,
                              fsdp=root_reduce))
    moments.append(moment("optimizer step", grads=grads_all, step=step_tmp))
    name, parts = max((mo for mo in moments if mo is not None), key=lambda mo: sum(mo[1].values()))
    parts = {k: v for k, v in parts.items() if v}
    notes.update({
        "activations": (f"{L} blocks x {blk.kept / 2**20:.0f} MiB kept for backward "
                        f"({'with' if s.activation_checkpointing else 'without'} activation checkpointing) and the "
                        "working set of the block in flight"),
        "logits/loss": (f"B x T x vocab = {s.batch_size} x {s.seq_len} x {m.vocab_size}: logits, fp32 copy, "
                        "log-softmax, their gradients"),
        "optimizer step": step_note,
        "fsdp buffers": fsdp_note if s.shards else "",
        "batches": "token ids of this and the next micro-batch, int64",
        "baseline": "this process before the model: resident set (interpreter, torch, data)" if s.device == "cpu"
        else "tensors allocated before the model",
    })
    other = block_profile(cfg_items, s.batch_size, s.seq_len, mode, not s.activation_checkpointing)
    on, off = (blk, other) if s.activation_checkpointing else (other, blk)
    facts = [f"per block: {on.kept / 2**20:.1f} MiB kept with activation checkpointing, {off.kept / 2**20:.1f} MiB "
             f"without; one block's forward peak {blk.fwd_peak / 2**20:.1f} MiB, backward peak "
             f"{blk.bwd_peak / 2**20:.1f} MiB",
             f"head and loss: forward peak {head.fwd_peak / 2**20:.1f} MiB, kept {head.kept / 2**20:.1f} MiB, "
             f"backward peak {head.bwd_peak / 2**20:.1f} MiB (fp32 logits alone: "
             f"{s.batch_size * s.seq_len * m.vocab_size * 4 / 2**20:.1f} MiB)"]
    if s.device == "cpu":
        facts.append(CPU_FACT)
    return Plan(s, sum(parts.values()), name, parts, notes, facts, n_params,
                model_desc=f"model {m.n_layer} x {m.d_model} ({n_params / 1e6:.1f}M parameters, vocab {m.vocab_size})",
                batch_desc=f"micro-batch {s.batch_size} x {s.seq_len} tokens")


# ----------------------------------------------------------------------------------- block and head profiles
@dataclass(frozen=True)
class StageProfile:
    """Bytes of one stage (a decoder block, or the head with its loss), all absolute (0 = nothing of this stage):

    fwd_peak: the most alive during its forward, its input included.
    kept_in_autocast: kept after forward while the autocast region is still open (what backward needs, plus
        autocast's cached low-precision weight copies), its output excluded.
    kept: the same after the autocast region closed (autocast's cache is freed then): what backward needs.
    bwd_peak: the most alive during its backward: what it kept, the incoming gradient, the parameter gradients it
        makes, the gradient of its input, temporaries (and recomputation under activation checkpointing).
    param_grads: bytes of the parameter gradients it leaves (dtype of the parameters it reads).
    """

    fwd_peak: int
    kept_in_autocast: int
    kept: int
    bwd_peak: int
    param_grads: int
@lru_cache(maxsize=64)
def block_profile(cfg_items: tuple, batch: int, seq: int, mode: Mode, checkpointed: bool) -> StageProfile:
    """:class:`StageProfile` of one decoder block (``cfg_items``: the GPTConfig fields as sorted (key, value)
    pairs) on a ``(batch, seq, d_model)`` input; ``checkpointed``: wrapped in non-reentrant activation
    checkpointing, as :mod:`hydratrain.parallel.ac_compile` does."""
    plain = _run_block(cfg_items, batch, seq, mode, grad=True)
    if not checkpointed:
        return plain
    return _checkpointed(plain, _run_block(cfg_items, batch, seq, mode, grad=False))


def _checkpointed(plain: StageProfile, no_grad: StageProfile) -> StageProfile:
    """A checkpointed block, from the block run with and without autograd. Non-reentrant checkpointing
    (``torch.utils.checkpoint``, ``use_reentrant=False``) runs the forward with every saved tensor dropped and keeps
    the inputs; in backward it reruns the forward, this time saving, then runs the block's backward. So: the forward
    peaks and what stays alive (the input, plus autocast's weight cache until the region closes) are those of the
    forward without autograd; the backward peak is the larger of the recomputation (the saving forward's peak plus
    the incoming gradient, the size of the input) and the plain backward. The real wrapper is not run here because
    its first call imports torch._dynamo; tests/unit/test_plan.py checks this against it."""
    grad_in = no_grad.kept  # the incoming gradient is the size of the output, i.e. of the input
    return StageProfile(fwd_peak=no_grad.fwd_peak, kept_in_autocast=no_grad.kept_in_autocast, kept=no_grad.kept,
                        bwd_peak=max(plain.fwd_peak + grad_in, plain.bwd_peak), param_grads=plain.param_grads)


def _run_block(cfg_items: tuple, batch: int, seq: int, mode: Mode, grad: bool) -> StageProfile:
    """One block's forward (and with ``grad``, backward). Without ``grad`` the forward runs under ``no_grad`` and
    the input is kept (as checkpointing keeps it): ``kept`` is then the input, ``bwd_peak`` and ``param_grads`` 0."""
    cfg = GPTConfig(**dict(cfg_items))
    device = mode.torch_device()
    tracker = Tracker()
    with torch.device(META):
        block = Block(cfg)
    shadow_module(block, mode.param_dtype, device, tracker)
    fuse_norms(block, mode)
    # the rotary tables are buffers (counted by the planner); FSDP casts them to the compute dtype per block
    rope_dtype = mode.param_dtype if mode.autocast is None else torch.float32
    cos, sin = (shadow((seq, cfg.head_dim), rope_dtype, device) for _ in range(2))
    tracker.ignore(cos)
    tracker.ignore(sin)
    with tracker, torch.set_grad_enabled(grad):
        x = shadow((batch, seq, cfg.d_model), mode.param_dtype, device, requires_grad=True)
        tracker.track(x)
        tracker.reset_peak()
        with mode.autocast_ctx():
            y = block(x, cos, sin)
            fwd_peak = tracker.peak
            if grad:
                del x  # the chain keeps it only if the block saved it
            y_bytes = inner(y).untyped_storage().nbytes()
            kept_in_autocast = tracker.now - y_bytes
        kept = tracker.now - y_bytes
        if not grad:
            return StageProfile(fwd_peak, kept_in_autocast, kept, 0, 0)
        grad_y = shadow(y.shape, y.dtype, device)
        tracker.track(grad_y)
        tracker.reset_peak()
        y.backward(grad_y)
        bwd_peak = tracker.peak - y_bytes  # y itself is held here only; in the chain the next block freed it
        grads = sum(inner(p.grad).untyped_storage().nbytes() for p in block.parameters() if p.grad is not None)
    return StageProfile(fwd_peak, kept_in_autocast, kept, bwd_peak, grads)


@lru_cache(maxsize=64)
def head_profile(cfg_items: tuple, batch: int, seq: int, mode: Mode) -> StageProfile:
    """:class:`StageProfile` of the head as the trainer runs it (``hydratrain.train.trainer.Trainer.loss_of``): final
    norm and ``lm_head`` inside the autocast region, then ``cross_entropy(logits.float(), targets)`` outside it;
    the logits are dropped when the loss is returned. Its input is the last block's output."""
    cfg = GPTConfig(**dict(cfg_items))
    device = mode.torch_device()
    tracker = Tracker()
    with torch.device(META):
        head = nn.Module()
        head.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        head.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
    shadow_module(head, mode.param_dtype, device, tracker)
    fuse_norms(head, mode)
    targets = shadow((batch, seq), torch.int64, device)
    tracker.ignore(targets)
    with tracker:
        h = shadow((batch, seq, cfg.d_model), mode.param_dtype, device, requires_grad=True)
        tracker.track(h)
        tracker.reset_peak()
        with mode.autocast_ctx():
            logits = head.lm_head(head.norm(h))
            del h
            kept_in_autocast = tracker.now - inner(logits).untyped_storage().nbytes()
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        del logits
        fwd_peak = tracker.peak
        kept = tracker.now - inner(loss).untyped_storage().nbytes()
        tracker.reset_peak()
        loss.backward()
        bwd_peak = tracker.peak
        grads = sum(inner(p.grad).untyped_storage().nbytes() for p in head.parameters() if p.grad is not None)
    return StageProfile(fwd_peak, kept_in_autocast, kept, bwd_peak, grads)
