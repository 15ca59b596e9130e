"""One timed training run through ``transformers.Trainer``: the Trainer's side of bench/gpu_table.py's ``hf_trainer``
row set, whose other side is hydratrain ``model=hf_causal_lm`` on the same model (bench/train_worker.py). One
process, one device, extra [hf]; prints one JSON line with the fields train_worker.py prints:

    python bench/hf_trainer_worker.py --config '{"model_type": "llama", "hidden_size": 2048, "vocab_size": 32000}' \
        --batch 4 --seq 2048 --precision bf16 --device cuda --steps 30 --warm 10

The model: ``AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")`` in float32 with its KV cache off,
``config`` made from ``--config`` (the keys of hydratrain's ``model.config``, ``vocab_size`` included) by
``hydratrain.models.hf.hf_config``, as hydratrain makes it; built on the device. The data: hydratrain's
``data=synthetic`` train split over the model's vocabulary, its windows of ``--seq`` tokens in the order hydratrain's
first epoch on one rank takes them (:class:`Samples`), so step k of either side gets the same inputs; labels =
inputs (the model shifts them). The Trainer: ``TrainingArguments(bf16=..., per_device_train_batch_size=--batch,
max_steps=--steps, train_sampling_strategy="sequential")`` with hydratrain's default optimizer settings
(conf/optim/adamw.yaml: lr, weight decay, betas, eps), clipping (conf/trainer/default.yaml) and warm-up + cosine
schedule (conf/scheduler/warmup_cosine.yaml); no logging, eval or saving, nothing reported; the Trainer's own
defaults otherwise (fused AdamW, no torch.compile). ``--precision auto``: bf16 where the device computes it natively
(``hydratrain.parallel.precision.native_bf16``), else fp32, as ``precision=auto``.

Measured as train_worker.py measures: a ``TrainerCallback`` synchronises the device at the end of every optimizer
step and takes the time; tokens/s is ``--batch x --seq x (steps - warm)`` over the timed steps' seconds
(``train_worker.timing``); peak memory is CUDA ``max_memory_allocated`` since before the model was built (the CPU:
the peak resident set) up to the last timed step; FLOPs per token are counted on a meta copy of the model
(``hydratrain.flops.counted_flops_per_sample``, as hydratrain counts a model without a formula) for MFU.
``train_loss`` is the Trainer's: the mean over all steps.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import torch
import transformers
from omegaconf import OmegaConf
from torch.utils.data import Dataset, DistributedSampler
from train_worker import ROOT, cores, peak_memory, sync, timing

from hydratrain.data.registry import corpus
from hydratrain.data.streams import TokenDataset
from hydratrain.flops import counted_flops_per_sample
from hydratrain.metrics import peak_flops
from hydratrain.models.hf import hf_config
from hydratrain.parallel.precision import native_bf16


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="the transformers config as JSON (model_type, vocab_size, ...)")
    p.add_argument("--batch", type=int, required=True, help="samples per step")
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warm", type=int, default=10, help="steps before the timed ones")
    args = p.parse_args(argv)
    if args.warm < 1 or args.steps <= args.warm:
        p.error("--warm must be >= 1 and < --steps")
    return args


class Samples(Dataset):
    """hydratrain's training samples of ``tokens`` in the order its first epoch takes them on one rank (as
    ``hydratrain.data.streams.ShardedBatches`` orders them: the windows of a ``TokenDataset``, permuted by
    ``DistributedSampler(shuffle=True, seed)`` over one replica), the first ``n`` of them, each ``{"input_ids": x,
    "labels": x}``: with a sequential sampler, the Trainer's step k gets the inputs hydratrain's step k gets (the
    model shifts the labels)."""

    def __init__(self, tokens, seq: int, seed: int, n: int):
        self.windows = TokenDataset(tokens, seq)
        # (a sampler reads only len(): TokenDataset is no torch Dataset, as in ShardedBatches)
        order = DistributedSampler(self.windows, num_replicas=1, rank=0, shuffle=True, seed=seed,
                                   drop_last=True)
        self.order = list(order)[:n]

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int) -> dict:
        x, _ = self.windows.batch([self.order[i]])
        return {"input_ids": x[0], "labels": x[0]}


class StepClock(transformers.TrainerCallback):
    """The time at the end of every optimizer step, after a device synchronisation, and the peak memory up to the
    last one (before the Trainer's own end of training)."""

    def __init__(self, device: torch.device):
        self.device, self.times, self.start, self.peak = device, [], 0.0, 0

    def on_train_begin(self, args, state, control, **kwargs):
        sync(self.device)
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        sync(self.device)
        self.times.append(time.perf_counter())
        self.peak = peak_memory(self.device)


def main(argv=None) -> int:
    args = parse(argv)
    t0 = time.perf_counter()
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        torch.set_num_threads(cores())  # hydratrain's rule for one rank: every core
    precision = args.precision if args.precision != "auto" else ("bf16" if native_bf16(device) else "fp32")
    optim, sched, trainer_cfg, data = (OmegaConf.load(ROOT / "conf" / f) for f in (
        "optim/adamw.yaml", "scheduler/warmup_cosine.yaml", "trainer/default.yaml", "data/synthetic.yaml"))
    config = hf_config(json.loads(args.config), None)
    config.use_cache = False  # as hydratrain builds it for training
    transformers.set_seed(int(trainer_cfg.seed))
    with device:
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    tokens = corpus("synthetic").splits(data, config.vocab_size, ROOT, False)["train"]  # (as hydratrain's run)
    clock = StepClock(device)
    with tempfile.TemporaryDirectory(prefix="bench-hf-trainer-") as tmp:
        training = transformers.TrainingArguments(
            output_dir=tmp, bf16=precision == "bf16", use_cpu=not cuda, per_device_train_batch_size=args.batch,
            max_steps=args.steps, learning_rate=float(optim.lr), weight_decay=float(optim.weight_decay),
            adam_beta1=float(optim.beta1), adam_beta2=float(optim.beta2), adam_epsilon=float(optim.eps),
            max_grad_norm=float(trainer_cfg.grad_clip), lr_scheduler_type="cosine_with_min_lr",
            lr_scheduler_kwargs={"min_lr_rate": float(sched.min_lr_ratio)}, warmup_steps=int(sched.warmup_steps),
            logging_strategy="no", eval_strategy="no", save_strategy="no", report_to=[], disable_tqdm=True,
            train_sampling_strategy="sequential", dataloader_drop_last=True, seed=int(trainer_cfg.seed))
        trainer = transformers.Trainer(model=model, args=training, callbacks=[clock],
                                       train_dataset=Samples(tokens, args.seq, int(trainer_cfg.seed),
                                                             args.batch * args.steps))
        result = trainer.train()

    def meta_copy():
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")

    example = torch.zeros(args.batch, args.seq, dtype=torch.long)
    flops = counted_flops_per_sample(meta_copy, {"input_ids": example, "labels": example}, None) / args.seq
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    row = {"precision": precision, "first_step_s": clock.times[0] - clock.start, "flops_per_token": flops,
           "peak_flops_total": peak_flops(device, dtype), "peak_memory_bytes": clock.peak,
           "n_params": sum(p.numel() for p in model.parameters()), "train_loss": result.training_loss,
           "batch": args.batch, "trained_as": "single", "compiled": "none",
           "transformers": transformers.__version__}
    row.update(timing(args, clock.times, 1, args.batch, row["first_step_s"]))
    row.update(impl="hf_trainer", strategy="single", requested_precision=args.precision, model=config.model_type,
               seq=args.seq, steps=args.steps, threads=torch.get_num_threads(),
               adamw=getattr(training.optim, "value", training.optim), compile="none", wall_s=time.perf_counter() - t0)
    print(json.dumps(row, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
