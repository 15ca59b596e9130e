"""Run under torchrun (or alone for ``single``): ``trainer.compile=true`` on a 12-block GPT (more blocks than dynamo's
recompile limit of 8), three forward/backward passes, under the strategy named by the first argument (default fsdp):
fsdp compiles each block before FSDP2 wraps it, single the whole model, ddp the whole model before DDP wraps it.
Prints on rank 0 one JSON line with the strategy's summary and dynamo's counters: one graph must serve every block
(or the whole model), with no recompiles and no graph breaks (else deep models silently fall back to eager)."""
import json
import sys

import torch
from omegaconf import OmegaConf
from torch._dynamo.utils import counters

from hydratrain.dist.process_group import process_group
from hydratrain.models.gpt import GPT, GPTConfig
from hydratrain.parallel.build import STRATEGIES
from hydratrain.parallel.precision import Precision

name = sys.argv[1] if len(sys.argv) > 1 else "fsdp"
strategy_cfg = {"name": name, "reshard_after_forward": True, "cpu_offload": False, "bucket_cap_mb": 25,
                "find_unused_parameters": False}
with process_group("cpu", "gloo", needs_group=name != "single") as info:
    cfg = OmegaConf.create({"strategy": strategy_cfg, "wrap_policy": {"name": "transformer_block"},
                            "activation_checkpointing": False, "trainer": {"compile": True},
                            "model": {"init_device": "auto"}})
    precision = Precision(name="fp32", requested="fp32", compute_dtype=torch.float32, reduce_dtype=torch.float32)
    strategy = STRATEGIES[name](cfg)
    model, summary = strategy.parallelize(GPT(GPTConfig(d_model=64, n_layer=12, n_head=2, max_seq_len=32)),
                                          precision, info.device, seed=0)
    x = torch.randint(0, 256, (2, 32))
    for _ in range(3):
        model(x).float().mean().backward()
    if info.is_main:
        print(json.dumps({"summary": summary, "compiled": strategy.compiled,
                          "unique_graphs": counters["stats"]["unique_graphs"],
                          "recompiles": sum(counters["recompiles"].values()),
                          "graph_breaks": sum(counters["graph_break"].values())}), flush=True)
