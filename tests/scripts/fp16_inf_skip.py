"""Run under torchrun (2 ranks): an inf gradient on ONE rank makes EVERY rank skip the fp16 step.

Prints ``rank R: scale A -> B, params_changed=X`` for a clean step and for the poisoned step; exits non-zero on a
disagreement.
"""
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from hydratrain.distributed import destroy_distributed, init_distributed
from hydratrain.models.gpt import GPT, GPTConfig
from hydratrain.parallelize import apply_fsdp
from hydratrain.precision import grad_scaler

info = init_distributed("cpu", "gloo", need_group=True)
torch.manual_seed(0)
model = GPT(GPTConfig(d_model=32, n_layer=2, n_head=2, max_seq_len=16))
cfg = OmegaConf.create({"strategy": {"reshard_after_forward": True, "cpu_offload": False},
                        "precision": {"compute_dtype": "float16", "reduce_dtype": "float32", "grad_scaler": True,
                                      "init_scale": 1024.0},
                        "wrap_policy": {"name": "transformer_block"}})
apply_fsdp(model, cfg, info.device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
scaler = grad_scaler(cfg.precision, info.device)
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
    print(f"rank {info.rank}: poison={poison} scale {scale:.0f} -> {scaler.get_scale():.0f}, params_changed={changed}",
          flush=True)
    ok &= changed != poison and (scaler.get_scale() < scale) == poison
flag = torch.tensor([int(ok)])
dist.all_reduce(flag, op=dist.ReduceOp.MIN)
destroy_distributed()
raise SystemExit(0 if flag.item() else 1)
