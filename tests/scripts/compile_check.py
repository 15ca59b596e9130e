"""Run under torchrun: ``trainer.compile=true`` on a 12-block GPT under FSDP2 (more blocks than dynamo's recompile
limit of 8), three forward/backward passes. Prints on rank 0 one JSON line with dynamo's counters: one graph must
serve every block, with no recompiles and no graph breaks (else deep models silently fall back to eager)."""
import json

import torch
from omegaconf import OmegaConf
from torch._dynamo.utils import counters

from hydratrain.dist.process_group import process_group
from hydratrain.models.gpt import GPT, GPTConfig
from hydratrain.parallel.precision import Precision
from hydratrain.parallel.strategy import FSDP

with process_group("cpu", "gloo", needs_group=True) as info:
    cfg = OmegaConf.create({"strategy": {"name": "fsdp", "reshard_after_forward": True, "cpu_offload": False},
                            "wrap_policy": {"name": "transformer_block"}, "activation_checkpointing": False,
                            "trainer": {"compile": True}, "model": {"init_device": "auto"}})
    precision = Precision(name="fp32", requested="fp32", compute_dtype=torch.float32, reduce_dtype=torch.float32)
    model, summary = FSDP(cfg).parallelize(GPT(GPTConfig(d_model=64, n_layer=12, n_head=2, max_seq_len=32)),
                                           precision, info.device, seed=0)
    x = torch.randint(0, 256, (2, 32))
    for _ in range(3):
        model(x).float().mean().backward()
    if info.is_main:
        print(json.dumps({"summary": summary, "unique_graphs": counters["stats"]["unique_graphs"],
                          "recompiles": sum(counters["recompiles"].values()),
                          "graph_breaks": sum(counters["graph_break"].values())}), flush=True)
