"""One timed training run through torchtitan's Llama-3 trainer: the other side of bench/gpu_table.py's ``torchtitan``
row set, whose hydratrain side trains the same shape at the same batch and sequence length. torchrun launches it,
also for one process (torchtitan reads its rank from torchrun's environment); rank 0 prints one JSON line with the
fields train_worker.py prints:

    TORCHTITAN_SITE=DIR torchrun --standalone --nproc_per_node 8 bench/torchtitan_worker.py --model llama_1b \
        --batch 8 --seq 2048 --steps 30 --warm 10

torchtitan 0.3.0 and the pure-Python packages it imports come from ``$TORCHTITAN_SITE`` (``bash
bench/torchtitan_deps.sh install DIR``) or the environment. triton (CUDA builds of torch ship it) and Hugging Face
datasets are stood in for where absent, while torchtitan is imported (:func:`stand_ins`).

The model: torchtitan's ``Llama3Model`` built as its own flavors build it (``_build_llama3_layers``: fused QKV,
grouped-query attention, SwiGLU, RMSNorm, rotary embeddings, its depth-scaled init) with the dimensions of
hydratrain's ``conf/model/<model>.yaml``: d_model, layers, heads, key/value heads, SwiGLU width, vocabulary (the
preset's, else ``--vocab``, else 256 as hydratrain's synthetic data), tied embeddings, rope theta. Both sides report
``n_params``, which must be equal. Attention (``--attention``): ``sdpa``, causal ``scaled_dot_product_attention``,
the kernel hydratrain uses (swapped into each layer as torchtitan's own tests do: one document per window needs no
mask), or ``flex``, torchtitan's default for Llama-3 (GPU only: FlexAttention has no backward on the CPU).

The training: torchtitan's ``Trainer`` with its Llama-3 recipe's settings (``llama3_8b``: the chunked cross-entropy,
AdamW with betas 0.9/0.95 and weight decay 0.1 at hydratrain's default lr, warm-up then linear decay, clipping at
1.0), FSDP2 over every rank with bf16 parameters and fp32 reductions, ``--compile on`` (its ``model`` and ``loss``
components: each block compiled, and the loss), ``--ac full`` (each block recomputed in backward; ``selective`` is
its per-op policy, ``none`` off) and ``--cuda-graphs on`` (its default: each step's forward and backward captured
as one CUDA graph); checkpoints, validation, profiling and TensorBoard off. Its dataloader is replaced by
hydratrain's synthetic token stream (``synthetic_stream`` over the model's vocabulary, random windows per rank, as
train_worker.py's hand loop), its tokenizer by a stand-in that is never called: nothing is read from disk or a hub.

Measured as train_worker.py measures: ``Trainer.train_step`` is wrapped to synchronise the device after every step
and take the time; tokens/s is ``ranks x --batch x --seq x (steps - warm)`` over the timed steps' seconds
(``train_worker.timing``); peak memory is CUDA ``max_memory_allocated`` over the run, the largest of the ranks (the
CPU: the peak resident set); FLOPs per token are hydratrain's formula for the same shape (``GPT.flops_per_token``),
so MFU is computed the same way on both sides. ``train_loss`` is the last step's loss.

On a machine without CUDA (``--device cpu``, the dry run) torchtitan is pointed at the CPU before it is imported
(it picks its device type at import), with gloo; its CUDA-only pieces are replaced (:func:`stand_ins_for_cpu`).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import sys
import time
import types
from dataclasses import dataclass

import torch
from train_worker import dist_env, max_over_ranks, model_shape, peak_memory, sync, timing

from hydratrain.data.corpora import synthetic_stream
from hydratrain.dist.process_group import cpu_threads
from hydratrain.metrics import peak_flops
from hydratrain.models.gpt import GPT, GPTConfig

SITE = os.environ.get("TORCHTITAN_SITE")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama_1b", help="hydratrain's preset whose shape torchtitan builds")
    p.add_argument("--vocab", type=int, default=None, help="the vocabulary where the preset sets none")
    p.add_argument("--batch", type=int, required=True, help="samples per rank and step")
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warm", type=int, default=10, help="steps before the timed ones")
    p.add_argument("--compile", choices=["on", "off"], default="on")
    p.add_argument("--ac", choices=["full", "selective", "none"], default="full")
    p.add_argument("--attention", choices=["sdpa", "flex"], default="sdpa",
                   help="sdpa: causal scaled_dot_product_attention (hydratrain's kernel); flex: torchtitan's default")
    p.add_argument("--cuda-graphs", choices=["on", "off"], default="on",
                   help="on: torchtitan's default, forward and backward captured as one CUDA graph (CUDA only)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--lr", type=float, default=2e-3, help="hydratrain's default (conf/optim/adamw.yaml)")
    args = p.parse_args(argv)
    if args.warm < 1 or args.steps <= args.warm:
        p.error("--warm must be >= 1 and < --steps")
    return args


def hydratrain_shape(args) -> tuple[GPTConfig, GPT]:
    """hydratrain's config of ``--model`` (every width resolved) and the model built on meta (FLOPs, parameters)."""
    shape = model_shape(args.model)
    shape.setdefault("vocab_size", args.vocab or 256)
    cfg = GPTConfig(**{**shape, "max_seq_len": max(shape.get("max_seq_len", 0), args.seq)})
    with torch.device("meta"):
        return cfg, GPT(cfg)


def point_at_cpu() -> None:
    """torchtitan picks ``cuda`` at import where no accelerator is found; the dry run wants the CPU."""
    import torch._utils

    torch._utils._get_available_device_type = lambda: "cpu"


# what torchtitan imports but a dense Llama trained on synthetic tokens never calls: triton (GPU kernels defined at
# import: its expert-parallel dispatch, fused SwiGLU and MLA overrides; CPU builds of torch lack it) and Hugging Face
# datasets (its dataset loaders); the GPU machine need not carry them
STAND_INS = {"triton": ("triton", "triton.language"), "datasets": ("datasets", "datasets.distributed")}
# torch's own modules that torchtitan imports and that look for triton: imported before a stand-in exists
TORCH_FIRST = ("torch._dynamo", "torch._functorch.partitioners", "torch._inductor.codecache",
               "torch._inductor.compile_fx", "torch.nn.attention.flex_attention", "torch.distributed.tensor")


class Anything:
    """Any attribute, call or decorator: a kernel defined or a loader named, never run."""

    def __getattr__(self, name):
        if name.startswith("__"):  # (no __file__, __wrapped__, ...: inspect and pickle look for them)
            raise AttributeError(name)
        return self

    def __call__(self, *a, **k):
        return self


@contextlib.contextmanager
def stand_ins():
    """While torchtitan is imported, a stand-in for each of :data:`STAND_INS` that is not installed; gone again
    afterwards, so that torch itself still finds no triton. Yields the names stood in for."""
    missing = [top for top in STAND_INS if importlib.util.find_spec(top) is None]
    if "triton" in missing:
        for name in TORCH_FIRST:
            importlib.import_module(name)
    names = [name for top in missing for name in STAND_INS[top]]
    for name in names:
        module = types.ModuleType(name)
        module.__getattr__ = Anything().__getattr__  # type: ignore[method-assign]
        sys.modules[name] = module
    try:
        yield missing
    finally:
        for name in names:
            sys.modules.pop(name, None)


def main(argv=None) -> int:
    args = parse(argv)
    t0 = time.perf_counter()
    if SITE:
        sys.path.insert(0, SITE)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    rank, local_rank, world, local_world = dist_env()
    if cuda:
        torch.cuda.set_device(local_rank)
        torch.cuda.reset_peak_memory_stats()
    else:
        if args.attention == "flex":
            raise SystemExit("bench/torchtitan_worker.py: --attention flex needs CUDA (FlexAttention has no backward "
                             "on the CPU); --attention sdpa runs anywhere")
        point_at_cpu()
        torch.set_num_threads(cpu_threads(local_world))  # hydratrain's rule for a CPU rank
    cfg, meta = hydratrain_shape(args)
    row = run(args, cfg, meta, cuda, world)
    if rank == 0:
        row.update(impl="torchtitan", strategy="fsdp", model=args.model, seq=args.seq, steps=args.steps,
                   threads=torch.get_num_threads(), wall_s=time.perf_counter() - t0)
        print(json.dumps(row, default=str), flush=True)
    return 0


def run(args, cfg: GPTConfig, meta: GPT, cuda: bool, world: int) -> dict:
    with stand_ins() as stood_in:
        import torchtitan
        from torch.utils.data import IterableDataset
        from torchtitan.components.dataloader import ParallelAwareDataloader
        from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
        from torchtitan.components.metrics import MetricsProcessor
        from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
        from torchtitan.components.tokenizer import BaseTokenizer
        from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
        from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
        from torchtitan.models import llama3
        from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
        from torchtitan.models.common.attention import ScaledDotProductAttention
        from torchtitan.models.common.config_utils import decoder_vocab_size
        from torchtitan.trainer import Trainer

    rank = dist_env()[0]
    vocab, dim = cfg.vocab_size, cfg.d_model

    class Windows(IterableDataset):
        """Random windows of ``seq + 1`` tokens of hydratrain's synthetic stream, this rank's own draw."""

        def __init__(self, seq: int, dp_rank: int):
            self.tokens = torch.from_numpy(synthetic_stream(2_000_000, vocab).astype("int64"))
            self.seq, self.gen = seq, torch.Generator().manual_seed(1234 + dp_rank)
            self.offsets = torch.arange(seq + 1)

        def __iter__(self):
            while True:
                start = int(torch.randint(0, len(self.tokens) - self.seq - 1, (1,), generator=self.gen))
                window = self.tokens[start + self.offsets]
                # one document per window: positions 0..seq-1 (the block-causal mask is then causal)
                yield {"input": window[:-1], "positions": self.offsets[:-1]}, window[1:]

    class SyntheticLoader(ParallelAwareDataloader):
        @dataclass(kw_only=True, slots=True)
        class Config(ParallelAwareDataloader.Config):
            pass

        def __init__(self, config, *, dp_world_size, dp_rank, tokenizer, seq_len, local_batch_size, **_):
            super().__init__(Windows(seq_len, dp_rank), dp_rank=dp_rank, dp_world_size=dp_world_size,
                             batch_size=local_batch_size)

    class NoTokenizer(BaseTokenizer):
        """The tokenizer the trainer builds; synthetic tokens need none."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            pass

        def __init__(self, config, **_):
            super().__init__()

        def encode(self, *a, **k):
            raise NotImplementedError("synthetic tokens: nothing to encode")

        def decode(self, *a, **k):
            raise NotImplementedError("synthetic tokens: nothing to decode")

        def get_vocab_size(self) -> int:
            return vocab

    spec = llama3.model_registry("1B")  # the 1B flavor's structure and init; the dimensions are set below
    spec.model = llama3.Llama3Model.Config(
        dim=dim, vocab_size=vocab, enable_weight_tying=cfg.tie_embeddings,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init=llama3._EMBEDDING_SKIP_INIT if cfg.tie_embeddings
                                        else llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, eps=cfg.norm_eps, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=llama3._output_linear_init(dim)),
        layers=llama3._build_llama3_layers(
            fuse_qkv=True, n_layers=cfg.n_layer, dim=dim, n_heads=cfg.n_head, n_kv_heads=cfg.kv_heads,
            hidden_dim=cfg.ff_dim, attn_backend="flex",
            rope=ComplexRoPE.Config(dim=dim // cfg.n_head, max_seq_len=args.seq, theta=cfg.rope_theta,
                                    scaling="none")))
    if args.attention == "sdpa":  # built as flex (its registry's check), then each layer's kernel swapped
        for layer in spec.model.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    ac = {"full": FullAC.Config(), "selective": SelectiveAC.Config(), "none": None}[args.ac]
    config = Trainer.Config(
        model_spec=spec,
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec))),
        tokenizer=NoTokenizer.Config(), dataloader=SyntheticLoader.Config(),
        optimizer=default_adamw(lr=args.lr),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=min(20, args.steps // 2), decay_ratio=0.8,
                                                  decay_type="linear", min_lr_factor=0.1),
        training=TrainingConfig(local_batch_size=args.batch, seq_len=args.seq, steps=args.steps,
                                mixed_precision_param="bfloat16" if cuda else "float32",
                                disable_cuda_graphs=not cuda or args.cuda_graphs == "off"),
        # FSDP2 as torchtitan has long applied it (its default since 0.3.0, "spmd_types", wants every parameter a
        # DTensor on the whole mesh before fully_shard, and fails so on torch 2.13 even for its own debug model)
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        metrics=MetricsProcessor.Config(log_freq=args.steps),
        activation_checkpoint=ac,
        compile=CompileConfig(enable=args.compile == "on"),
        dump_folder=os.environ.get("TMPDIR", "/tmp") + f"/bench-torchtitan-{os.getpid()}",
    )
    if not cuda:
        stand_ins_for_cpu()
    trainer = config.build()
    device = trainer.device
    times, losses = [], []
    step_fn = trainer.train_step

    def timed_step(*a, **k):
        out = step_fn(*a, **k)
        sync(device)
        times.append(time.perf_counter())
        return out

    trainer.train_step = timed_step
    log_metrics = trainer.metrics_processor.log  # called at step 1 and every log_freq steps: the last one's loss

    def log(step, global_avg_loss, *a, **k):
        losses.append(float(global_avg_loss))
        return log_metrics(step, global_avg_loss, *a, **k)

    trainer.metrics_processor.log = log
    n_params = sum(p.numel() for p in {id(p): p for p in trainer.model_parts[0].parameters()}.values())
    sync(device)
    start = time.perf_counter()
    try:
        trainer.train()
        peak = max_over_ranks({"peak": peak_memory(device)}, device)["peak"]
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    dtype = torch.bfloat16 if cuda else torch.float32
    row = {"precision": "bf16" if cuda else "fp32", "first_step_s": times[0] - start,
           "flops_per_token": meta.flops_per_token(args.seq), "peak_flops_total": world * peak_flops(device, dtype),
           "peak_memory_bytes": peak, "n_params": n_params, "train_loss": losses[-1] if losses else None,
           "batch": args.batch, "trained_as": "fsdp", "compiled": "blocks" if args.compile == "on" else "none",
           "ac": args.ac, "attention": args.attention,
           "cuda_graphs": cuda and args.cuda_graphs == "on", "torchtitan": getattr(torchtitan, "__version__", "?"),
           "stand_ins": stood_in}
    row.update(timing(args, times, world, args.batch, row["first_step_s"]))
    if rank == 0 and not math.isfinite(row["train_loss"] or float("nan")):
        raise SystemExit(f"torchtitan's loss is not finite: {losses}")
    return row


def stand_ins_for_cpu() -> None:
    """torchtitan's CUDA-only start-up pieces, for the CPU dry run: the device memory monitor (``torch.cpu`` has no
    memory statistics), the peak-FLOPS lookup (``lspci``), and FSDP's gradient sum without division, which
    torchtitan asks for with a divide factor of 1 (NCCL's PREMUL_SUM, which gloo lacks): a plain SUM is the same;
    and the shorter collective timeout set after the first step (a barrier given a CUDA device index)."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components import metrics
    from torchtitan.distributed import fsdp
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.tools import utils

    def sum_gradients(model) -> None:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)

    class CPUMemory:
        device_name, device_capacity_gib = "cpu", 0.0

        def get_peak_stats(self):
            return metrics.DeviceMemStats(-1, -1, -1, -1, 0, 0)

        def reset_peak_stats(self):
            pass

    metrics.build_device_memory_monitor = CPUMemory
    utils.get_peak_flops = lambda name: 1e12
    fsdp.disable_fsdp_gradient_division = sum_gradients
    dist_utils.set_pg_timeouts = lambda **_: None


if __name__ == "__main__":
    sys.exit(main())
