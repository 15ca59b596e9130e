"""One timed training run, through hydratrain or through a hand-written loop on the same model; rank 0 prints one JSON
line. Started by bench/overhead.py, bench/memory.py and bench/fastpaths.py (plain python for one rank, torchrun for
more); usable alone:

    python bench/train_worker.py --impl hand --strategy single --precision fp32
    torchrun --standalone --nproc_per_node 2 bench/train_worker.py --impl hydratrain --strategy fsdp --precision bf16

Both implementations train ``hydratrain.models.gpt.GPT`` (shapes from ``conf/model/<model>.yaml``; hydratrain any
``--model`` preset with ``--override``s, as bench/gpu_table.py's hf_causal_lm rows) on the same
synthetic token stream (``hydratrain.data.corpora.synthetic_stream``), ``--batch`` x ``--seq`` tokens per rank and
step, with
AdamW (decay on matrices only, lr 2e-3, betas 0.9/0.95; ``--adamw``: the implementation, by default torch's choice
for the hand-written loop and ``optim.impl=auto`` for hydratrain), global
grad-norm clipping at 1.0 and a warm-up + cosine ``LambdaLR``; the CPU thread count per rank is the same
(``cores / ranks per node``, hydratrain's rule, unless ``--threads``). Time is taken at the end of every optimizer
step (after a device synchronisation); tokens/s is ``tokens of all ranks x (steps - warm) / (t[steps] - t[warm])``.
The default ``--warm 11`` keeps the first log step (step 10) out of the timed steps: hydratrain creates its
TensorBoard writer there (importing TensorBoard, opening the event file), a one-time cost that made 20 timed gpt_tiny
steps about 3 % slower on one CPU process, and that a run of hundreds of steps does not see.

hand: the loop a user writes: ``DistributedDataParallel`` or FSDP2 ``fully_shard`` of each block then the root
(``MixedPrecisionPolicy`` for bf16), ``torch.autocast`` for bf16 otherwise, ``loss.item()`` every 10 steps;
``--compile blocks`` compiles each block and ``model`` the whole model, before any wrapper (torchtitan's order).
hydratrain: ``hydratrain.run.build`` + ``Trainer.fit`` with the product's defaults and these overrides (eval only
after the last step, log every 10 steps, TensorBoard on, no checkpoints); its logged tokens/s and MFU are reported too.
``--compile default`` keeps hydratrain's ``trainer.compile`` default (auto); ``none`` sets it to false (the same work
as the eager hand loop), ``blocks``/``model`` to that granularity. ``--batch auto``: ``data.batch_size=auto``.

Every run reports ``peak_memory_bytes`` (CUDA: ``max_memory_allocated`` over the training steps; CPU: the peak
resident set) and ``first_step_s``; ``compile_s`` estimates the compilation as the first step's seconds minus a timed
step's. ``--profile K`` trains K more steps after the timed ones under ``torch.profiler`` and reports the top device
kernels and the share of those steps' wall time the device was busy (``--profile-out FILE`` gets the whole table).

    python bench/train_worker.py --impl plan --model llama_1b --seq 2048 --strategy fsdp --device cuda

prints the batch ``data.batch_size=auto`` picks for that launch (``hydratrain.auto_batch``; ``--nproc`` ranks).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impl", choices=["hand", "hydratrain", "plan"], required=True)
    p.add_argument("--strategy", choices=["single", "ddp", "fsdp"], default="single")
    p.add_argument("--precision", default="fp32", help="fp32 | bf16 | fp16 | auto (hydratrain: its default)")
    p.add_argument("--model", default="gpt_tiny")
    p.add_argument("--batch", default="16", help="samples per rank and step, or auto (hydratrain and plan)")
    p.add_argument("--max-batch", type=int, default=None, help="plan: the most auto may pick")
    p.add_argument("--nproc", type=int, default=None, help="plan: ranks to plan for (default: WORLD_SIZE or 1)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=31)
    p.add_argument("--warm", type=int, default=11, help="steps before the timed ones")
    p.add_argument("--log-every", type=int, default=10, help="hydratrain: trainer.log_every_n_steps (keep its "
                   "first log step, where TensorBoard's writer is made, before --warm)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads per rank (default: cores / local ranks)")
    p.add_argument("--adamw", choices=["default", "for_loop", "foreach", "fused"], default="default",
                   help="AdamW implementation (hand: default = torch's choice; hydratrain: default = optim.impl=auto)")
    p.add_argument("--compile", choices=["default", "none", "blocks", "model"], default="default",
                   help="torch.compile of each block or of the whole model (hand: default = none; hydratrain: "
                        "default = its trainer.compile default, none = false)")
    p.add_argument("--profile", type=int, default=0, help="profile this many extra steps after the timed ones")
    p.add_argument("--profile-out", default=None, help="write the profile's kernel table here")
    p.add_argument("--device", default="auto")
    p.add_argument("--memory", action="store_true", help="also report per-rank parameter/grad/optimizer bytes")
    p.add_argument("--override", action="append", default=[], help="extra hydratrain override (repeatable)")
    return p.parse_args(argv)


def dist_env() -> tuple[int, int, int, int]:
    """(rank, local rank, world size, ranks on this node) from torchrun's variables (1 rank without them)."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
            int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def model_shape(name: str) -> dict:
    """The ``GPTConfig`` keywords of ``conf/model/<name>.yaml`` (vocab_size only where the preset sets it; the
    hand loop's default is the byte data's 256, as hydratrain's)."""
    from omegaconf import OmegaConf

    node = OmegaConf.load(ROOT / "conf" / "model" / f"{name}.yaml")
    keys = ("vocab_size", "max_seq_len", "d_model", "n_layer", "n_head", "n_kv_head", "d_ff", "tie_embeddings",
            "ff_multiple_of", "rope_theta", "norm_eps")
    return {k: node[k] for k in keys if k in node and node[k] is not None}


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def grad_bytes(model) -> int:
    total = 0
    for p in model.parameters():
        g = p.grad
        if g is not None:
            g = g.to_local() if hasattr(g, "to_local") else g
            total += g.numel() * g.element_size()
    return total


def rss_bytes() -> int:
    """This process's resident set size now (``VmRSS``), bytes; 0 without /proc."""
    try:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))
    except (OSError, StopIteration, ValueError):
        return 0


def max_over_ranks(values: dict, device) -> dict:
    """``values`` (ints) with each replaced by its maximum over the ranks of the default process group."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return values
    t = torch.tensor([float(v) for v in values.values()], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {k: int(v) for k, v in zip(values, t.tolist())}


def param_bytes(model) -> int:
    total = 0
    for p in model.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        total += t.numel() * t.element_size()
    return total


# ------------------------------------------------------------------------------------------------ hand-written
def run_hand(args) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from hydratrain.data.corpora import synthetic_stream
    from hydratrain.models.gpt import GPT, GPTConfig

    rank, local_rank, world, local_world = dist_env()
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", local_rank % max(1, torch.cuda.device_count())) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(args.threads or max(1, cores() // local_world))
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo")
    elif args.strategy != "single":
        dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    precision = args.precision
    if precision == "auto":
        from hydratrain.parallel.precision import native_bf16

        precision = "bf16" if native_bf16(device) else "fp32"
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    torch.manual_seed(1234)
    cfg = GPTConfig(**{"vocab_size": 256, **model_shape(args.model)})
    model = GPT(cfg).to(device)
    raw = model
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    if args.compile == "blocks":
        for block in model.blocks:
            block.compile()
    elif args.compile == "model":
        model.compile()
    if args.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    elif args.strategy == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=None if dtype == torch.float32 else dtype, reduce_dtype=torch.float32)
        for block in raw.blocks:
            fully_shard(block, mp_policy=mp)
        fully_shard(raw, mp_policy=mp)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    impl = {"default": {}, "for_loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
    opt = torch.optim.AdamW(groups, lr=2e-3, betas=(0.9, 0.95), eps=1e-8, **impl[args.adamw])
    warmup, total = 20, args.steps

    def lr_lambda(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (s - warmup) / max(1, total - warmup))))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    tokens = torch.from_numpy(synthetic_stream(2_000_000, 256).astype("int64"))
    gen = torch.Generator().manual_seed(1234 + rank)
    offsets = torch.arange(args.seq + 1)
    autocast = (torch.autocast(device.type, dtype=dtype) if dtype != torch.float32 and args.strategy != "fsdp"
                else torch.autocast(device.type, enabled=False))
    times, peak_grads, losses = [], 0, []
    profiler = Profiler(args, device)
    model.train()
    sync(device)
    loop_start = time.perf_counter()
    for step in range(1, args.steps + args.profile + 1):
        if step == args.steps + 1:
            train_peak = peak_memory(device)
            profiler.start()
        starts = torch.randint(0, len(tokens) - args.seq - 1, (args.batch,), generator=gen)
        window = tokens[starts[:, None] + offsets]
        x, y = window[:, :-1].to(device, non_blocking=True), window[:, 1:].to(device, non_blocking=True)
        with autocast:
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        if args.memory:
            peak_grads = max(peak_grads, grad_bytes(model))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 10 == 0:
            losses.append(loss.item())
        sync(device)
        times.append(time.perf_counter())
        profiler.step()
    if not args.profile:
        train_peak = peak_memory(device)
    from hydratrain.metrics import peak_flops

    row = {"precision": precision, "losses": losses, "first_step_s": times[0] - loop_start,
           "flops_per_token": raw.flops_per_token(args.seq), "peak_flops_total": world * peak_flops(device, dtype),
           "peak_memory_bytes": max_over_ranks({"peak": train_peak}, device)["peak"], "batch": args.batch,
           "trained_as": args.strategy, "compiled": args.compile if args.compile != "default" else "none",
           **profiler.finish()}
    if args.memory:
        from hydratrain.metrics import peak_memory_bytes
        from hydratrain.optim import state_bytes

        row.update(param_bytes=param_bytes(model), grad_bytes=peak_grads, optim_bytes=state_bytes(opt),
                   peak_memory_bytes=peak_memory_bytes(device))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return {**row, **timing(args, times, world, int(row["batch"]), row["first_step_s"])}


# -------------------------------------------------------------------------------------------------- hydratrain
def run_hydratrain(args) -> dict:
    from hydra import compose, initialize_config_dir

    from hydratrain.config import register_configs
    from hydratrain.dist.run_dir import register_resolvers

    register_configs()
    register_resolvers()
    overrides = [f"model={args.model}", "data=synthetic", f"data.batch_size={args.batch}", f"data.seq_len={args.seq}",
                 f"strategy={args.strategy}", f"trainer.max_steps={args.steps + args.profile}",
                 "trainer.eval_every_n_steps=0",
                 "trainer.eval_samples=16", f"trainer.log_every_n_steps={args.log_every}", "trainer.progress_bar=false",
                 "trainer.sample_tokens=0", "trainer.save_weights=false", "checkpoint.every_n_steps=0",
                 "checkpoint.auto_resume=false", f"device={args.device}"]
    if args.precision != "auto":
        overrides.append(f"precision={args.precision}")
    if args.compile != "default":
        overrides.append(f"trainer.compile={'false' if args.compile == 'none' else args.compile}")
    if args.adamw != "default":
        overrides.append(f"optim.impl={args.adamw}")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=overrides + list(args.override))
    import torch
    from omegaconf import OmegaConf

    from hydratrain.dist.process_group import device_type, process_group
    from hydratrain.optim import state_bytes
    from hydratrain.parallel.build import build_strategy
    from hydratrain.run import build

    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    OmegaConf.set_readonly(cfg, True)
    _, _, world, _ = dist_env()
    strategy = build_strategy(cfg, world, device_type(str(cfg.device)))  # as hydratrain.run.main builds it
    with tempfile.TemporaryDirectory(prefix="bench-run-") as tmp, \
            process_group(str(cfg.device), strategy.backend, strategy.needs_process_group) as info:
        if args.threads and info.device.type == "cpu":
            torch.set_num_threads(args.threads)
        if info.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(info.device)
        if args.memory and info.device.type == "cpu":
            # libraries the build and the first step load, loaded before the baseline is read
            import torch._dynamo  # noqa: F401  (torch.optim's first use)
            import torch.distributed.fsdp  # noqa: F401
            import torch.utils.tensorboard  # noqa: F401
        start_bytes = torch.cuda.memory_allocated(info.device) if info.device.type == "cuda" else rss_bytes()
        job = build(cfg, strategy, info, Path(tmp), Path(tmp))
        times, peak_grads = [], [0]
        logger, device = job.step_logger, info.device
        original = logger.step_done
        profiler = Profiler(args, device)
        train_peak = [0]

        def step_done(step, loss, *rest):
            original(step, loss, *rest)
            sync(device)
            times.append(time.perf_counter())
            if step <= args.steps:  # the timed steps' peak (the final eval after fit loads torchmetrics)
                train_peak[0] = peak_memory(device)
            if step == args.steps:
                profiler.start()
            elif step > args.steps:
                profiler.step()

        logger.step_done = step_done
        if args.memory:
            opt, step_fn = job.trainer.optimizer, job.trainer.optimizer.step

            def step_with_bytes(*a, **k):
                peak_grads[0] = max(peak_grads[0], grad_bytes(job.model))
                return step_fn(*a, **k)

            opt.step = step_with_bytes
        sync(device)
        fit_start = time.perf_counter()
        result = job.trainer.fit()
        row = {"precision": job.precision.name, "logged_tokens_per_sec": windows_rate(logger.rates, args),
               "logged_mfu_last": logger.rates[-1][1] if logger.rates else None,
               "flops_per_token": logger.flops_per_token, "peak_flops_total": logger.peak,
               "n_params": sum(p.numel() for p in job.raw.parameters()),  # (tied ones once; any model: hf_causal_lm)
               "train_loss": result.train_loss, "startup_s": result.startup_s,
               "first_step_s": times[0] - fit_start, "batch": job.cfg.data.batch_size,
               "trained_as": job.strategy.name, "compiled": job.strategy.compiled or "none",
               "peak_memory_bytes": max_over_ranks({"peak": train_peak[0]}, device)["peak"], **profiler.finish(),
               # each step's wall seconds from the previous step's end (steps 2..N; a checkpoint saved after step K
               # lands in step K+1's: the trainer saves after logging the step)
               "step_seconds": [b - a for a, b in zip(times, times[1:])]}
        if args.memory:
            # max over ranks (shards differ by FSDP's padding); peak memory: CUDA max_memory_allocated, CPU VmHWM,
            # and what it grew by from just before the build (the interpreter and torch's libraries excluded)
            peak = train_peak[0]
            row.update(max_over_ranks({"param_bytes": param_bytes(job.model), "grad_bytes": peak_grads[0],
                                       "optim_bytes": state_bytes(job.trainer.optimizer),
                                       "peak_above_start_bytes": peak - start_bytes}, device))
        job.step_logger.tb.close()
    return {**row, **timing(args, times, world, int(row["batch"]), row["first_step_s"])}


def peak_memory(device) -> int:
    """Peak memory so far, bytes: CUDA ``max_memory_allocated`` (since the last reset), CPU the peak RSS."""
    from hydratrain.metrics import peak_memory_bytes

    return int(peak_memory_bytes(device))


class Profiler:
    """``torch.profiler`` over the ``--profile`` steps after the timed ones (a no-op without it): :meth:`finish`
    gives the top device kernels by self time and the share of the profiled steps' wall time that the device
    (CUDA; the CPU ops' self time on a CPU) was busy; ``--profile-out`` gets the whole table."""

    def __init__(self, args, device):
        self.args, self.device, self.prof, self.t0, self.seconds = args, device, None, 0.0, 0.0

    def start(self) -> None:
        if not self.args.profile:
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self.prof = profile(activities=activities)
        self.prof.__enter__()
        self.t0 = time.perf_counter()

    def step(self) -> None:
        if self.prof is not None:
            self.seconds = time.perf_counter() - self.t0

    def finish(self) -> dict:
        if self.prof is None:
            return {}
        self.prof.__exit__(None, None, None)
        cuda = self.device.type == "cuda"
        key = "self_device_time_total" if cuda else "self_cpu_time_total"
        events = [e for e in self.prof.key_averages() if getattr(e, key, 0) > 0]
        if cuda:  # device kernels only: what ran on the GPU
            events = [e for e in events if getattr(e, "device_type", None) is not None
                      and str(e.device_type).endswith("CUDA")] or events
        events.sort(key=lambda e: getattr(e, key), reverse=True)
        busy_us = sum(getattr(e, key) for e in events)
        if self.args.profile_out:
            Path(self.args.profile_out).write_text(self.prof.key_averages().table(
                sort_by=key.replace("self_device", "self_cuda"), row_limit=30))
        return {"profile_steps": self.args.profile, "profile_seconds": self.seconds,
                "profile_busy": busy_us / 1e6 / self.seconds if self.seconds else None,
                "profile_top": [[e.key[:80], round(getattr(e, key) / 1e3 / self.args.profile, 3)] for e in events[:8]]}


def run_plan(args) -> dict:
    """The micro-batch ``data.batch_size=auto`` picks for a launch of ``--model``/``--seq``/``--strategy`` on
    ``--nproc`` ranks of ``--device`` (``hydratrain.auto_batch.resolve``, with the strategy a run would train as)."""
    from hydra import compose, initialize_config_dir

    from hydratrain import auto_batch
    from hydratrain.config import register_configs
    from hydratrain.dist.env import DistInfo
    from hydratrain.dist.process_group import choose_device, device_type
    from hydratrain.dist.run_dir import register_resolvers
    from hydratrain.parallel.build import build_strategy
    from hydratrain.parallel.precision import Precision

    register_configs()
    register_resolvers()
    overrides = [f"model={args.model}", "data=synthetic", "data.batch_size=auto", f"data.seq_len={args.seq}",
                 f"strategy={args.strategy}", f"device={args.device}"]
    if args.precision != "auto":
        overrides.append(f"precision={args.precision}")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=overrides + list(args.override))
    world = args.nproc or dist_env()[2]
    strategy = build_strategy(cfg, world, device_type(str(cfg.device)))
    device = choose_device(str(cfg.device), 0)
    info = DistInfo(rank=0, local_rank=0, world_size=world, local_world_size=world, device=device)
    precision = Precision.resolve(cfg.precision, device)
    vocab = cfg.model.get("vocab_size") or 256  # synthetic data: the preset's vocabulary, else bytes
    limit = args.max_batch or auto_batch.LIMIT
    resolved = auto_batch.resolve(cfg, strategy, info, precision, vocab, limit=limit)
    return {"impl": "plan", "model": args.model, "seq": args.seq, "strategy": args.strategy,
            "trained_as": strategy.name, "nproc": world, "batch": int(resolved.data.batch_size),
            "precision": precision.name}


def windows_rate(rates, args) -> float | None:
    """The logged tokens/s over the timed steps: the windows after step ``warm`` up to ``--steps`` (one per
    ``--log-every`` steps), combined as total tokens over total time (each window has the same number of steps)."""
    n, end = (args.steps - args.warm) // args.log_every, args.steps // args.log_every
    picked = [r[0] for r in rates[max(0, end - n):end]] if n > 0 else []
    if not picked:
        return None
    return len(picked) / sum(1.0 / r for r in picked)


def timing(args, times: list, world: int, batch: int, first_step_s: float) -> dict:
    """tokens/s over the timed steps (``--warm`` + 1 .. ``--steps``) of ``batch`` x ``--seq`` tokens per rank, and
    the compilation estimate: the first step's seconds minus a timed step's mean."""
    timed = args.steps - args.warm
    seconds = times[args.steps - 1] - times[args.warm - 1]
    return {"tokens_per_sec": world * batch * args.seq * timed / seconds, "timed_steps": timed,
            "timed_seconds": seconds, "world_size": world,
            "compile_s": max(0.0, first_step_s - seconds / timed)}


def main(argv=None) -> int:
    args = parse(argv)
    if args.impl != "plan" and (args.warm < 1 or args.steps <= args.warm):
        raise SystemExit("--warm must be >= 1 and < --steps")
    t0 = time.perf_counter()
    if args.batch != "auto":
        args.batch = int(args.batch)
    elif args.impl == "hand":
        raise SystemExit("--batch auto: hydratrain and plan only (give the hand loop the number plan prints)")
    row = {"hand": run_hand, "hydratrain": run_hydratrain, "plan": run_plan}[args.impl](args)
    rank = int(os.environ.get("RANK", 0))
    if rank == 0:
        import torch

        row.update(impl=args.impl, strategy=args.strategy, requested_precision=args.precision, model=args.model,
                   seq=args.seq, steps=args.steps, threads=torch.get_num_threads(), adamw=args.adamw,
                   compile=args.compile, wall_s=time.perf_counter() - t0)
        row.setdefault("batch", args.batch)
        print(json.dumps(row, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
