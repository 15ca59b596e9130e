"""Run under torchrun: build ``model=llama_1b`` with strategy=fsdp on the meta device, shard, materialise.

Prints one line per rank: ``rank R: local_param_bytes=B total_param_bytes=T max_rss_bytes=M``.
"""
import os
import resource

from hydra import compose, initialize_config_dir

from hydratrain.config import register_configs
from hydratrain.distributed import destroy_distributed, init_distributed, register_resolvers
from hydratrain.parallelize import local_param_bytes
from hydratrain.run import build_model

register_configs()
register_resolvers()
conf = os.path.join(os.path.dirname(__file__), "..", "..", "conf")
with initialize_config_dir(config_dir=os.path.abspath(conf), version_base="1.3"):
    cfg = compose("train", overrides=["model=llama_1b", "strategy=fsdp", "precision=fp32", "data=synthetic"])
info = init_distributed("cpu", "gloo", need_group=True)
model, raw, n_params, summary = build_model(cfg, info)
assert not any(p.is_meta for p in model.parameters())
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(f"rank {info.rank}: local_param_bytes={local_param_bytes(model)} total_param_bytes={n_params * 4} "
      f"max_rss_bytes={rss} summary={summary}", flush=True)
destroy_distributed()
