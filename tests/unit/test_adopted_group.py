"""A default process group that exists before the job (Ray Train makes one in each worker) is used, checked and left
alone: no second group, no destroy, and a backend that cannot serve the run is a one-line error."""
from __future__ import annotations

import pytest
import torch.distributed as dist

from hydratrain.dist.env import DistInfo
from hydratrain.dist.process_group import adopt_group, process_group
from hydratrain.errors import ConfigError


@pytest.fixture
def launcher_group(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    if dist.is_initialized():
        dist.destroy_process_group()


def test_an_existing_group_is_used_and_left_to_its_maker(launcher_group):
    with process_group("cpu", None, needs_group=True) as info:
        assert dist.group.WORLD is launcher_group and info.world_size == 1
    assert dist.is_initialized() and dist.group.WORLD is launcher_group


def test_a_backend_that_cannot_serve_the_run_is_a_config_error(launcher_group):
    assert adopt_group(DistInfo(), "gloo") == "gloo"
    with pytest.raises(ConfigError) as err:
        adopt_group(DistInfo(), "cuda:nccl,cpu:gloo")
    assert str(err.value) == ("launcher.backend='gloo': the launcher's process group cannot serve this run, which "
                              "needs cuda:nccl,cpu:gloo (strategy.backend / strategy.cpu_offload); allowed: "
                              "cuda:nccl,cpu:gloo")
    with pytest.raises(RuntimeError, match="rank 0 of 1, but the environment says rank 0 of 2"):
        adopt_group(DistInfo(world_size=2), "gloo")
