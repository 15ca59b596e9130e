"""trainer.profile.steps on 2 gloo ranks under FSDP: each rank writes a Chrome trace that parses as JSON and holds a
range per profiled step, exactly those steps, with the trainer's labelled phases inside them (the checkpoint save of
a step in the window included)."""
from __future__ import annotations

import json

from helpers import log_of, run

PHASES = ["hydratrain/data_wait", "hydratrain/forward", "hydratrain/backward", "hydratrain/grad_sync",
          "hydratrain/optimizer_step"]


def _within(event: dict, steps: dict) -> str:
    """The name of the step range whose time span holds ``event``'s, or '' (Chrome trace: ts and dur in us)."""
    return next((name for name, s in steps.items()
                 if s["ts"] <= event["ts"] and event["ts"] + event["dur"] <= s["ts"] + s["dur"]), "")


def test_a_profiled_two_rank_run_traces_exactly_its_window_on_every_rank(tmp_path):
    # steps 2-3 of 4, a checkpoint at step 3: steps 1 and 4 run outside the window
    run(["strategy=fsdp", "trainer.max_steps=4", "trainer.eval_every_n_steps=0", "trainer.eval_samples=8",
         "checkpoint.every_n_steps=3", "plan.enabled=false", "trainer.profile.steps=[2,3]"], tmp_path,
        nproc=2).ok()
    for rank in (0, 1):
        trace = tmp_path / "profile" / f"rank{rank}.pt.trace.json"
        ranges = [e for e in json.loads(trace.read_text())["traceEvents"]
                  if e.get("cat") == "user_annotation" and e["name"].startswith("hydratrain/")]
        steps = {e["name"]: e for e in ranges if e["name"].startswith("hydratrain/step_")}
        assert sorted(steps) == ["hydratrain/step_2", "hydratrain/step_3"]
        assert len([e for e in ranges if e["name"].startswith("hydratrain/step_")]) == 2
        inner = [e for e in ranges if not e["name"].startswith("hydratrain/step_")]
        assert sorted(e["name"] for e in inner) == sorted([*PHASES, *PHASES, "hydratrain/checkpoint_save"])

        assert sorted(_within(e, steps) for e in inner if e["name"] == "hydratrain/forward") == sorted(steps)
        save = next(e for e in inner if e["name"] == "hydratrain/checkpoint_save")
        assert _within(save, steps) == "hydratrain/step_3"
        assert f"profile: steps 2-3 traced to {trace}" in log_of(tmp_path, rank)
