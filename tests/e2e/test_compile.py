"""trainer.compile=true on the CPU: per block before FSDP2 wraps the blocks (torchtitan's order), the whole model
under single and ddp; each as one graph without recompiles or graph breaks."""
import json

import pytest

from helpers import ROOT, run


@pytest.mark.slow  # ~10-30 s of compiling
def test_compiled_blocks_share_one_graph_under_fsdp_without_recompiles():
    r = run(["fsdp"], nproc=2, script=str(ROOT / "tests" / "scripts" / "compile_check.py"), fast=False,
            timeout=600).ok()
    got = json.loads(r.output.strip().splitlines()[-1])
    assert "compiled 12 blocks" in got["summary"] and "fsdp: sharded 13 modules" in got["summary"]
    assert (got["unique_graphs"], got["recompiles"], got["graph_breaks"]) == (1, 0, 0), got


@pytest.mark.slow  # ~20-60 s of compiling
@pytest.mark.parametrize("strategy,nproc", [("single", 1), ("ddp", 2)])
def test_the_whole_model_is_one_graph_under_single_and_ddp(strategy, nproc):
    """DDP's graph is split at its buckets by dynamo's DDPOptimizer, which is not a graph break."""
    r = run([strategy], nproc=nproc, script=str(ROOT / "tests" / "scripts" / "compile_check.py"), fast=False,
            timeout=900).ok()
    got = json.loads(r.output.strip().splitlines()[-1])
    assert got["compiled"] == "the whole model (GPT)", got
    assert (got["unique_graphs"], got["recompiles"], got["graph_breaks"]) == (1, 0, 0), got
