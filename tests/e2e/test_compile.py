"""torch.compile per block, before FSDP2 wraps the blocks (torchtitan's order): one graph for all blocks."""
import json

import pytest

from helpers import ROOT, run


@pytest.mark.slow  # ~10-30 s of compiling
def test_compiled_blocks_share_one_graph_under_fsdp_without_recompiles():
    r = run([], nproc=2, script=str(ROOT / "tests" / "scripts" / "compile_check.py"), fast=False, timeout=600).ok()
    got = json.loads(r.output.strip().splitlines()[-1])
    assert "compiled 12 blocks" in got["summary"] and "fsdp: sharded 13 modules" in got["summary"]
    assert (got["unique_graphs"], got["recompiles"], got["graph_breaks"]) == (1, 0, 0), got
