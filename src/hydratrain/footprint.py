"""The bytes one rank holds during a training step, moment by moment: :func:`predict` a :class:`Setup`.

What a rank holds (``predict``), at each moment of a steady-state step (step >= 2, so AdamW's moments exist; with
``trainer.grad_accum_steps`` > 1 a later micro-batch, whose gradients add to the earlier ones'):

* parameters: fp32 master weights (plus the rotary tables); FSDP: this rank's shard of each parameter, dim 0
  padded to a multiple of the world size as ``fully_shard`` does;
* gradients: fp32, from each parameter's backward to ``zero_grad(set_to_none=True)`` after the optimizer step
  (through the whole step under accumulation); FSDP: the reduce-scattered shards, but under accumulation the
  unsharded gradients of every unit in the reduce dtype (FSDP2 keeps them unsharded until the micro-batch that syncs);
* optimizer: AdamW's exp_avg and exp_avg_sq, fp32 (sharded under FSDP), and the step's temporaries: one
  parameter-sized buffer per parameter group with the foreach implementation (CUDA), two of the largest parameter
  with the per-tensor one (CPU) (``torch.optim.adam._multi_tensor_adam`` / ``_single_tensor_adam``);
* DDP: the gradient buckets, a second fp32 copy of every gradient (``gradient_as_bucket_view=False``);
* FSDP buffers: the units' parameters all-gathered in the compute dtype (the root's for the whole step; a block's
  during its forward, and in backward the block's plus the next one prefetched; all of them with
  ``reshard_after_forward=false``), the all-gather's flat output while it is copied out, the unsharded gradients in
  the compute dtype and the reduce-scatter input in the reduce dtype (one kept until the next unit's reduce-scatter)
  (``torch.distributed.fsdp._fully_shard._fsdp_collectives``);
* activations: what each decoder block keeps for backward and the working set of the block in flight, measured by
  running one block (:mod:`hydratrain.memsim`) for the real batch, length, dtypes and activation-checkpointing
  setting, times the number of blocks; under autocast (single/ddp with bf16/fp16) this includes autocast's
  low-precision copies of the weights;
* logits/loss: the head as the trainer runs it: logits (B x T x vocab) in the compute dtype, their fp32 copy, the
  log-softmax the loss keeps and their gradients -- for large vocabularies often the largest item;
* batches: this micro-batch's and the prefetched next one's token ids (int64);
* baseline (CPU): what the process already holds when the plan is made (its resident set: the interpreter, torch's
  libraries, the data); on CUDA the tensors already allocated.

The peak is the largest moment: the last block's forward, the head's forward and backward, each block's backward,
the embedding's backward, the optimizer step, an FSDP unit's all-gather or reduce-scatter. Not modelled: eval
(forward only, smaller), checkpoint saves, the end-of-run full state dict, CUDA's context and the caching
allocator's reserve (``torch.cuda.max_memory_allocated`` is what CUDA predictions compare with), compile.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

GiB = 2 ** 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
PRECISION_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class Setup:
    """What one rank's peak depends on. ``model``: the ``GPTConfig`` fields as sorted (key, value) pairs, vocabulary
    resolved; ``precision``: the resolved preset (fp32 | bf16 | fp16); ``device``: cpu | cuda; ``baseline``: bytes the
    process holds before the model (CPU: resident set; CUDA: allocated)."""

    model: tuple
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
    optim: str = "adamw"  # adamw | adamw8bit
    optim_block_size: int = 256  # adamw8bit: values per quantisation block
    optim_impl: str = "auto"  # optim.impl: auto | fused | foreach | for_loop (auto is fused on cpu and cuda)

    @property
    def shards(self) -> bool:
        """Whether parameters are sharded (fsdp, hsdp)."""
        return self.strategy in ("fsdp", "hsdp")

    @property
    def shard_world(self) -> int:
        """Ranks one parameter is split across: the world size (fsdp), a shard group (hsdp), 1 otherwise."""
        return (self.shard_degree or self.world_size) if self.shards else 1

    @property
    def cfg(self):
        from hydratrain.models.gpt import GPTConfig

        return GPTConfig(**dict(self.model))

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
    peak), with ``notes`` ({name: what the bytes are}) and ``facts`` (per-stage figures, lines of text)."""

    setup: Setup
    peak: int
    moment: str
    parts: dict
    notes: dict = field(default_factory=dict)
    facts: list = field(default_factory=list)
    n_params: int = 0

    def summary(self) -> str:
        """``peak 5.31 GiB at <moment> (parameters 0.32 + ... GiB)``."""
        parts = " + ".join(f"{k} {v / GiB:.2f}" for k, v in self.parts.items() if v >= GiB / 200)
        return f"peak {self.peak / GiB:.2f} GiB at {self.moment} ({parts} GiB)"

    def table(self) -> list[str]:
        s = self.setup
        m = s.cfg
        head = (f"memory plan per rank: model {m.n_layer} x {m.d_model} ({self.n_params / 1e6:.1f}M parameters, "
                f"vocab {m.vocab_size}), strategy={s.strategy} on {s.world_size} rank(s)"
                + (f" (shard groups of {s.shard_world}, wrap_policy={s.wrap_policy}, reshard_after_forward="
                   f"{str(s.reshard_after_forward).lower()}, cpu_offload={str(s.cpu_offload).lower()})"
                   if s.shards else "") + f", optim={s.optim}"
                + f", precision={s.precision}, micro-batch {s.batch_size} x {s.seq_len} tokens, "
                f"grad_accum_steps={s.grad_accum_steps}, "
                f"activation_checkpointing={str(s.activation_checkpointing).lower()}, device {s.device}")
        lines = [head]
        for name, value in self.parts.items():
            lines.append(f"  {name:<18} {value / GiB:9.3f} GiB  {self.notes.get(name, '')}".rstrip())
        lines.append(f"  {'peak':<18} {self.peak / GiB:9.3f} GiB  at {self.moment}")
        lines += [f"  {line}" for line in self.facts]
        return lines


# ------------------------------------------------------------------------------------------------ parameters
def param_shapes(m) -> list[tuple[str, tuple]]:
    """(name, shape) of every parameter of ``hydratrain.models.GPT(m)``, tied weights once, in its order."""
    d, hd = m.d_model, m.head_dim
    shapes = [("tok_emb.weight", (m.vocab_size, d))]
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


def _numel(shape) -> int:
    return math.prod(shape)


def _padded(shape, world: int) -> tuple[int, int]:
    """(numel all-gathered, numel of one rank's shard) of a parameter under ``fully_shard`` on ``world`` ranks: dim 0
    is split into ``world`` chunks of ``ceil(dim0 / world)`` rows, the last ones padded."""
    rows = -(-shape[0] // world)
    rest = _numel(shape[1:])
    return rows * world * rest, rows * rest


def fsdp_units(s: Setup) -> tuple[list[list[str]], list[str]]:
    """(the parameter names of each unit that ``wrap_policy`` gives its own ``fully_shard``, in forward order; the
    root's) for setup ``s`` (see :mod:`hydratrain.parallel.wrap_policy`)."""
    m = s.cfg
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


def _size_based_units(m, min_num_params: int, checkpointed: bool = False) -> list[list[str]]:
    """The size rule of :func:`hydratrain.parallel.wrap_policy.shard_units` on a storage-less stand-in of the GPT
    (the real constructor's initialisers would run Python meta kernels); ``checkpointed``: each block inside an
    activation-checkpointing wrapper, into which ``shard_units`` merges any unit below it."""
    import torch
    from torch import nn

    from hydratrain.models.gpt import Block
    from hydratrain.parallel.wrap_policy import shard_units

    class Leaf(nn.Module):
        def __init__(self, shape):
            super().__init__()
            self.weight = nn.Parameter(torch.empty(shape, device="meta"))

    root = nn.Module()
    root.tok_emb = Leaf((m.vocab_size, m.d_model))
    class Wrapper(nn.Module):  # what shard_units recognises a checkpoint wrapper by (checkpoint_wrapper's attribute)
        def __init__(self, block):
            super().__init__()
            self._checkpoint_wrapped_module = block

    with torch.device("meta"):
        blocks = [Block(m) for _ in range(m.n_layer)]
    root.blocks = nn.ModuleList(Wrapper(b) if checkpointed else b for b in blocks)
    root.norm = Leaf((m.d_model,))
    root.lm_head = Leaf((m.vocab_size, m.d_model))
    if m.tie_embeddings:
        root.lm_head.weight = root.tok_emb.weight
    policy = type("Policy", (), {"name": "size_based", "min_num_params": min_num_params})()
    name_of = {id(p): n.replace("._checkpoint_wrapped_module", "") for n, p in root.named_parameters()}
    units, seen = [], set()
    for unit in shard_units(root, policy):
        own = [name_of[id(p)] for p in unit.parameters() if id(p) not in seen]
        seen.update(id(p) for p in unit.parameters())
        units.append(own)
    return units


# -------------------------------------------------------------------------------------------------- predict
def _mode(s: Setup):
    """The :class:`hydratrain.memsim.Mode` the forward runs in: FSDP casts parameters (no autocast), single/ddp
    keep fp32 weights under autocast."""
    import torch

    from hydratrain.memsim import Mode

    compute = getattr(torch, PRECISION_DTYPE[s.precision])
    device = "cuda" if s.device == "cuda" and torch.cuda.is_available() else "cpu"
    if s.shards:  # FSDP casts parameters: no autocast; from a CPU-only host, CUDA's fused rms_norm is modelled
        return Mode(compute, None, device, fused_norms=s.device == "cuda" and device == "cpu")
    return Mode(torch.float32, None if compute == torch.float32 else compute, device)


def predict(s: Setup) -> Plan:
    """The :class:`Plan` of setup ``s``: every moment of a step, in bytes; the peak is the largest."""
    from hydratrain.memsim import block_profile, head_profile

    m = s.cfg
    shapes = dict(param_shapes(m))
    n_params = sum(_numel(v) for v in shapes.values())
    c = DTYPE_BYTES[PRECISION_DTYPE[s.precision]]
    r = DTYPE_BYTES[s.reduce_dtype]
    mode = _mode(s)
    p_bytes = 4 if mode.autocast is not None or not s.shards else c  # bytes of a parameter the kernels read
    blk = block_profile(s.model, s.batch_size, s.seq_len, mode, s.activation_checkpointing)
    head = head_profile(s.model, s.batch_size, s.seq_len, mode)
    L = m.n_layer
    buffers = 2 * m.max_seq_len * m.head_dim * 4  # the rotary tables, fp32
    batches = 4 * s.batch_size * s.seq_len * 8  # x and y of this micro-batch and of the prefetched one, int64
    emb = m.vocab_size * m.d_model * p_bytes  # the embedding's gradient, computed in its backward
    accum = s.grad_accum_steps > 1
    on_device = not (s.cpu_offload and s.device == "cuda")  # FSDP offload moves shards to host memory
    notes, parts_static = {}, {}

    if s.shards:
        W = s.shard_world
        units, root = fsdp_units(s)
        full = {n: _padded(shapes[n], W) for n in shapes}
        shard = sum(v[1] for v in full.values())
        unit_full = [sum(full[n][0] for n in u) for u in units] or [0]
        unit_shard = [sum(full[n][1] for n in u) for u in units] or [0]
        root_full = sum(full[n][0] for n in root)
        biggest, biggest_shard = max(unit_full), max(unit_shard)
        block0 = [n for n in shapes if n.startswith("blocks.0.")]
        blocks_wrapped = not any(n in root for n in block0)
        params = shard * 4 * on_device + buffers
        optim = sum(_moment_bytes(v[1], s) for v in full.values()) * on_device
        grads_all = 4 * shard * on_device
        where = "" if on_device else " (in host RAM: cpu_offload)"
        notes["parameters"] = f"fp32 master weights, this rank's 1/{W} shard{where} (+ rotary tables)"
        notes["gradients"] = (f"{r * 8}-bit, every unit's unsharded gradient (kept unsharded between micro-batches)"
                              if accum else f"fp32, 1/{W} shard after each reduce-scatter{where}")
        notes["optimizer"] = f"{_optim_note(s)}, 1/{W} shard{where}"
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
        step_tmp, step_note = _step_temporaries(s, 4 * shard, 2 * 4 * max(v[1] for v in full.values()))
        step_tmp *= on_device
        parts_static.update(parameters=params, optimizer=optim)
    else:
        params = 4 * n_params + buffers
        optim = sum(_moment_bytes(_numel(v), s) for v in shapes.values())
        grads_all = 4 * n_params
        grads_persist = grads_all if accum else 0
        root_params = fwd_units = gather_extra = root_reduce = 0

        def bwd_units(i: int) -> int:
            return 0
        done_per_block = blk.param_grads
        notes["parameters"] = "fp32 master weights, a full replica" + (" (+ rotary tables)" if buffers else "")
        notes["gradients"] = "fp32"
        notes["optimizer"] = _optim_note(s)
        step_tmp, step_note = _step_temporaries(s, 4 * n_params, 2 * 4 * max(_numel(v) for v in shapes.values()))
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
    other = block_profile(s.model, s.batch_size, s.seq_len, mode, not s.activation_checkpointing)
    on, off = (blk, other) if s.activation_checkpointing else (other, blk)
    facts = [f"per block: {on.kept / 2**20:.1f} MiB kept with activation checkpointing, {off.kept / 2**20:.1f} MiB "
             f"without; one block's forward peak {blk.fwd_peak / 2**20:.1f} MiB, backward peak "
             f"{blk.bwd_peak / 2**20:.1f} MiB",
             f"head and loss: forward peak {head.fwd_peak / 2**20:.1f} MiB, kept {head.kept / 2**20:.1f} MiB, "
             f"backward peak {head.bwd_peak / 2**20:.1f} MiB (fp32 logits alone: "
             f"{s.batch_size * s.seq_len * m.vocab_size * 4 / 2**20:.1f} MiB)"]
    if s.device == "cpu":
        facts.append("CPU: this counts tensors; glibc's malloc keeps freed memory in its heap, and the resident set "
                      "measured 40-120% above it (README, Memory planner); MALLOC_MMAP_THRESHOLD_=131072 in the "
                      "environment makes it track the tensors, at the cost of page faults")
    return Plan(s, sum(parts.values()), name, parts, notes, facts, n_params)


def _step_temporaries(s: Setup, params_fp32: int, two_largest_fp32: int) -> tuple[int, str]:
    """(bytes AdamW's step allocates beyond its state, what they are). CPU: two of the largest parameter (calibrated
    on CPU for the per-tensor and fused kernels). CUDA: the implementation ``optim.impl`` names, ``auto`` being fused
    where :data:`hydratrain.optim.FUSED_DEVICES` has the device (torchao's 8-bit AdamW counted as foreach): fused,
    none (one in-place kernel: on an H200, llama_1b's optimizer-step peak was parameters + gradients + moments);
    foreach, one fp32 copy of the parameters (``torch.optim.adam._multi_tensor_adam``); for_loop, two of the largest
    parameter."""
    from hydratrain.optim import FUSED_DEVICES

    per_tensor = (two_largest_fp32, "AdamW's temporaries (per tensor: two of the largest parameter)")
    if s.device != "cuda":
        return per_tensor
    impl = "foreach" if s.optim == "adamw8bit" else s.optim_impl
    if impl == "fused" or (impl == "auto" and s.device in FUSED_DEVICES):
        return 0, ""
    if impl in ("foreach", "auto"):
        return params_fp32, "AdamW's temporaries (foreach: one fp32 copy of the parameters)"
    return per_tensor


def _moment_bytes(numel: int, s: Setup) -> int:
    """Bytes of AdamW's two moments for a (local) tensor of ``numel`` values: fp32 each (``optim=adamw``); under
    ``optim=adamw8bit`` (torchao's ``AdamW8bit``) one byte per value plus one fp32 scale per block, for tensors of at
    least 4096 values that are a multiple of the block size, fp32 for the rest (``hydratrain.optim``)."""
    block = s.optim_block_size
    if s.optim == "adamw8bit" and numel >= 4096 and numel % block == 0:
        return 2 * (numel + 4 * (numel // block))
    return 8 * numel


def _optim_note(s: Setup) -> str:
    if s.optim == "adamw8bit":
        return f"AdamW8bit exp_avg + exp_avg_sq, 8-bit codes + an fp32 scale per {s.optim_block_size} values"
    return "AdamW exp_avg + exp_avg_sq, fp32"


def raf_ok(s: Setup) -> bool:
    """Whether FSDP frees each block unit's gathered parameters after its forward (so none are held at the head)."""
    return not s.shards or s.reshard_after_forward
