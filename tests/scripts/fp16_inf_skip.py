"""Run under torchrun (2 ranks): an inf gradient on ONE rank makes EVERY rank skip the fp16 step.

Prints ``rank R: scale A -> B, params_changed=X`` for a clean step and for the poisoned step; exits non-zero on a
disagreement.
"""
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from hydratrain.dist.process_group import process_group
from hydratrain.models.gpt import GPT, GPTConfig
from hydratrain.parallel.fsdp import FSDP
from hydratrain.parallel.precision import Precision

with process_group("cpu", "gloo", needs_group=True) as info:
    cfg = OmegaConf.create({"strategy": {"name": "fsdp", "reshard_after_forward": True, "cpu_offload": False},
                            "wrap_policy": {"name": "transformer_block"}, "activation_checkpointing": False,
                            "trainer": {"compile": False}, "model": {"init_device": "auto"}})
    precision = Precision(name="fp16", requested="fp16", compute_dtype=torch.float16, reduce_dtype=torch.float32,
                          use_scaler=True, init_scale=1024.0)
    model, _ = FSDP(cfg).parallelize(GPT(GPTConfig(d_model=32, n_layer=2, n_head=2, max_seq_len=16)), precision,
                                     info.device, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = precision.grad_scaler(info.device)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(info.rank))
    ok = True
    for poison in (False, True):
        before = [p.detach().to_local().clone() for p in model.parameters()]
        loss = torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), x.flatten())
        scaler.scale(loss).backward()
        if poison and info.rank == 1:
            next(iter(model.parameters())).grad.to_local().view(-1)[0] = float("inf")
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        changed = any(not torch.equal(b, p.detach().to_local()) for b, p in zip(before, model.parameters()))
        print(f"rank {info.rank}: poison={poison} scale {scale:.0f} -> {scaler.get_scale():.0f}, "
              f"params_changed={changed}", flush=True)
        ok &= changed != poison and (scaler.get_scale() < scale) == poison
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
raise SystemExit(0 if flag.item() else 1)
