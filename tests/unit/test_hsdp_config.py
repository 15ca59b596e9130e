"""strategy=hsdp's decisions without processes: the mesh shape, the bytes a rank holds, the one-line errors."""
from __future__ import annotations

import pytest

from hydratrain.config.validate import validate
from hydratrain.errors import ConfigError
from hydratrain.parallel.build import build_strategy
from hydratrain.parallel.fsdp import HSDP


def test_mesh_shape_defaults_to_the_ranks_per_node_and_must_divide_the_world():
    assert HSDP.mesh_shape(None, 16, 8) == (2, 8)
    assert HSDP.mesh_shape(2, 4, 4) == (2, 2)
    assert HSDP.mesh_shape(None, 1, 1) == (1, 1)
    with pytest.raises(ConfigError) as err:
        HSDP.mesh_shape(3, 4, 4)
    assert str(err.value) == "strategy.shard_size=3: must divide the world size 4; allowed: 1, 2, 4"
    with pytest.raises(ConfigError, match=r"null: LOCAL_WORLD_SIZE=3"):
        HSDP.mesh_shape(None, 4, 3)


@pytest.mark.parametrize("strategy,extra,per_rank", [("single", [], 1000), ("ddp", [], 1000), ("fsdp", [], 125),
                                                     ("hsdp", ["strategy.shard_size=2"], 500), ("hsdp", [], 250)])
def test_param_bytes_per_rank_for_a_planner(compose, strategy, extra, per_rank):
    """1000 bytes of parameters on 8 ranks, 4 per node: what one rank holds under each strategy."""
    s = build_strategy(compose([f"strategy={strategy}", *extra]))
    assert s.param_bytes_per_rank(1000, 8, 4) == per_rank


def test_hsdp_composes_with_wrap_policies_and_checks_shard_size(compose):
    cfg = compose(["strategy=hsdp", "wrap_policy=size_based"])
    assert cfg.strategy.shard_size is None and cfg.strategy.reshard_after_forward
    validate(cfg)
    with pytest.raises(ConfigError, match=r"^strategy.shard_size=0: must be >= 1"):
        validate(compose(["strategy=hsdp", "strategy.shard_size=0"]))
    with pytest.raises(ConfigError, match=r"^strategy.shard_size=3: must divide the 4 ranks launcher=torchrun starts; "
                                          r"allowed: 1, 2, 4$"):
        validate(compose(["strategy=hsdp", "strategy.shard_size=3", "launcher=torchrun",
                          "launcher.nproc_per_node=4"]))
    with pytest.raises(Exception, match="shard_size"):  # a key of hsdp's node only
        compose(["strategy=fsdp", "strategy.shard_size=2"])


def test_env_report_lists_hsdp():
    from hydratrain.env import report

    line = next(x for x in report() if x.startswith("strategies:"))
    assert "hsdp" in line.split(": ")[1].split(", ")
