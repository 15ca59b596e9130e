"""Run under torchrun: build ``model=llama_1b`` with strategy=fsdp on the meta device, shard, materialise.

Prints one line per rank: ``rank R: local_param_bytes=B total_param_bytes=T max_rss_bytes=M``.
"""
import os
import resource

from hydra import compose, initialize_config_dir

from hydratrain.config import register_configs
from hydratrain.dist.process_group import process_group
from hydratrain.dist.run_dir import register_resolvers
from hydratrain.parallel.build import build_model, build_strategy
from hydratrain.parallel.precision import Precision

register_configs()
register_resolvers()
conf = os.path.join(os.path.dirname(__file__), "..", "..", "conf")
with initialize_config_dir(config_dir=os.path.abspath(conf), version_base="1.3"):
    cfg = compose("train", overrides=["model=llama_1b", "strategy=fsdp", "precision=fp32", "data=synthetic"])
strategy = build_strategy(cfg)
with process_group("cpu", "gloo", needs_group=True) as info:
    model, raw, n_params, summary = build_model(cfg, strategy, Precision.resolve(cfg.precision, info.device),
                                                info.device, cfg.model.vocab_size)
    assert not any(p.is_meta for p in model.parameters())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"rank {info.rank}: local_param_bytes={strategy.local_param_bytes(model)} "
          f"total_param_bytes={n_params.total * 4} max_rss_bytes={rss} summary={summary}", flush=True)
