"""The reference points of bench/startup.py; rank 0 prints one JSON line with ``time.time()`` when it was done.

    python bench/startup_baseline.py pg                      # import torch + a 1-rank gloo process group
    torchrun --standalone --nproc_per_node 2 bench/startup_baseline.py pg
    python bench/startup_baseline.py loop                    # ... + GPT (+debug=fast_gpt shapes), AdamW, one step

``pg``: ``import torch`` and ``init_process_group`` (gloo on CPU, nccl on CUDA; a HashStore for one rank, torchrun's
store otherwise), then a barrier. ``loop``: also the smallest hand-written training loop to its first optimizer step
(the same model as ``+debug=fast_gpt``: 2 layers, d_model 64, batch 4 x 64), which adds what any torch.optim loop pays:
``torch.optim`` imports ``torch._dynamo`` (sympy, inductor's helpers) on first use.
"""
from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    what = sys.argv[1] if len(sys.argv) > 1 else "pg"
    t0 = time.time()
    import torch
    import torch.distributed as dist

    t_import = time.time()
    world = int(os.environ.get("WORLD_SIZE", 1))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    backend = "nccl" if cuda else "gloo"
    if world > 1:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    dist.barrier()
    t_pg = time.time()
    row = {"what": what, "import_torch_s": t_import - t0, "process_group_s": t_pg - t_import}
    if what == "loop":
        import torch.nn.functional as F

        from hydratrain.models.gpt import GPT, GPTConfig

        device = torch.device("cuda") if cuda else torch.device("cpu")
        model = GPT(GPTConfig(vocab_size=256, max_seq_len=64, d_model=64, n_layer=2, n_head=2)).to(device)
        if world > 1:
            model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randint(0, 256, (4, 65), device=device)
        loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        row["loop_s"] = time.time() - t_pg
    row["done_at"] = time.time()
    dist.barrier()
    if int(os.environ.get("RANK", 0)) == 0:
        print(json.dumps(row), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
