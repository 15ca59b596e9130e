"""trainer.profile.steps: the config check (one line naming the key before any process) and the window the
profiler callback records, driven through its hooks in this process (the 2-rank run: e2e/test_profiler_runs.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.profiler import record_function

from hydratrain.config.validate import validate
from hydratrain.errors import ConfigError
from hydratrain.train.callbacks import RunView
from hydratrain.train.profiler import StepProfiler


@pytest.mark.parametrize("steps", ["[3]", "[1,2,3]", "[0,2]", "[5,4]", "[9,11]"])
def test_a_window_that_is_not_first_le_last_within_max_steps_is_refused(compose, steps):
    with pytest.raises(ConfigError) as err:
        validate(compose(["trainer.max_steps=10", f"trainer.profile.steps={steps}"]))
    assert str(err.value).startswith(f"trainer.profile.steps={json.loads(steps)}: must be [first, last] optimizer "
                                     "steps with 1 <= first <= last <= trainer.max_steps=10")
    assert "\n" not in str(err.value)


def test_a_window_within_the_run_and_no_window_pass(compose):
    validate(compose(["trainer.max_steps=10", "trainer.profile.steps=[10,10]"]))
    validate(compose(["trainer.max_steps=10", "trainer.profile.steps=[1,10]"]))
    validate(compose(["trainer.max_steps=10"]))


def test_a_callback_named_profiler_beside_the_window_is_refused(compose):
    cfg = compose(["trainer.max_steps=10", "trainer.profile.steps=[2,3]",
                   "+callbacks.profiler._target_=hydratrain.train.callbacks.Callback"])
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert str(err.value).startswith("callbacks.profiler._target_='hydratrain.train.callbacks.Callback': "
                                     "callbacks.profiler is the name of trainer.profile's own callback")


def _view(run_dir: Path) -> RunView:
    return RunView(rank=3, world_size=4, run_dir=run_dir, model=torch.nn.Linear(1, 1),
                   raw_model=torch.nn.Linear(1, 1), _max_steps=lambda: 8, _step=lambda: 0, _stop=lambda why: None,
                   _checkpoint=lambda: None)


def _fit(profiler: StepProfiler, view: RunView, steps: range) -> None:
    """What the trainer does around the callback: a step's start hook, a labelled phase, the fit's end."""
    for step in steps:
        profiler.on_train_step_start(view, step)
        with record_function("hydratrain/forward"):
            torch.ones(4).sum()
    profiler.on_fit_end(view, None)


def _names(trace: Path) -> list[str]:
    return [e["name"] for e in json.loads(trace.read_text())["traceEvents"]
            if e.get("cat") == "user_annotation" and e["name"].startswith("hydratrain/")]


@pytest.mark.parametrize("first,last,start,end,traced", [
    (3, 5, 1, 8, [3, 4, 5]),  # inside the run: stopped at the start of step 6
    (6, 8, 1, 8, [6, 7, 8]),  # up to the run's last step: stopped at the fit's end
    (3, 5, 4, 8, [4, 5]),  # a resume inside the window: from its first step
    (3, 5, 1, 4, [3, 4]),  # a run stopped early inside the window
])
def test_the_trace_holds_a_range_per_step_of_the_window_and_nothing_outside(tmp_path, first, last, start, end,
                                                                            traced):
    profiler, view = StepProfiler(first, last, torch.device("cpu")), _view(tmp_path)
    _fit(profiler, view, range(start, end + 1))
    names = _names(tmp_path / "profile" / "rank3.pt.trace.json")
    assert sorted(n for n in names if n.startswith("hydratrain/step_")) == [f"hydratrain/step_{s}" for s in traced]
    assert names.count("hydratrain/forward") == len(traced)


def test_a_resume_after_the_window_writes_no_trace(tmp_path):
    profiler, view = StepProfiler(3, 5, torch.device("cpu")), _view(tmp_path)
    _fit(profiler, view, range(6, 9))
    assert not (tmp_path / "profile").exists()
