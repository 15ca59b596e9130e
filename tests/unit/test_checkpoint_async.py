"""Asynchronous checkpoint saves in this process (``checkpoint.async_save``): the state is staged when ``save``
returns and written in the background; the save counts (resume, keep_last, the callbacks) only once the write is
complete; a failed background write is the synchronous save's one-line error. The kill of every rank during the
background write, on 2 ranks: tests/e2e/test_checkpoint.py::test_a_kill_during_a_background_write_resumes_from_the_
previous_checkpoint_exactly."""
from __future__ import annotations

import errno
import math
import re
import threading

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

from helpers import ckpt_of, cut_command, diff_checkpoints
from hydratrain.checkpoint.io import read_all
from hydratrain.checkpoint.manager import latest_checkpoint, list_checkpoints
from hydratrain.errors import CheckpointError, DivergenceError

ASYNC = "checkpoint.async_save=true"


@pytest.fixture
def held_write(monkeypatch):
    """Holds every background write before its shards until ``.set()`` is called (so a test sees the save in
    flight without racing it); returns the event."""
    release = threading.Event()
    write_data = FileSystemWriter.write_data

    def held(self, *args, **kwargs):
        if threading.current_thread() is not threading.main_thread():  # (a synchronous save is not held)
            assert release.wait(30), "the test never released the background write"
        return write_data(self, *args, **kwargs)

    monkeypatch.setattr(FileSystemWriter, "write_data", held)
    return release


def test_a_save_in_flight_counts_only_once_complete_and_holds_the_state_it_was_staged_with(make_job, tmp_path,
                                                                                           held_write):
    """While the write is held: the step is not a checkpoint (latest and keep_last pruning ignore it) and training
    changes the weights; once waited for, it is complete, the older one is pruned, and it holds the staged weights:
    the same checkpoint as a synchronous save of that state."""
    job = make_job(tmp_path / "async", ASYNC, "checkpoint.keep_last=1")
    ckpts = job.checkpoints
    root = tmp_path / "async" / "checkpoints"
    held_write.set()
    assert ckpts.save(1) is None and ckpts.in_flight
    assert ckpts.wait() == (1, root / "step_00000001") and not ckpts.in_flight
    held_write.clear()

    job.trainer.progress.step = 2
    assert ckpts.save(2) is None and ckpts.last_saved_step == 2
    assert latest_checkpoint(root).name == "step_00000001" and (root / ".tmp-step_00000002").is_dir()
    staged = {k: v.clone() for k, v in job.trainer.model.state_dict().items()}
    with torch.no_grad():
        for p in job.trainer.model.parameters():
            p.add_(1.0)  # the loop goes on meanwhile
    held_write.set()
    assert ckpts.wait() == (2, root / "step_00000002")
    assert ckpts.wait() is None  # nothing in flight
    assert [p.name for _, p in list_checkpoints(root)] == ["step_00000002"]  # keep_last=1, pruned at completion
    saved = read_all(root / "step_00000002")
    assert all(torch.equal(saved[f"model.{k}"], v) for k, v in staged.items())

    sync = make_job(tmp_path / "sync")
    sync.trainer.model.load_state_dict(staged)
    sync.trainer.optimizer.load_state_dict(job.trainer.optimizer.state_dict())
    sync.trainer.progress.step = 2
    sync.checkpoints.save(2)
    # (first_loss: NaN before a first logged loss, unequal to itself)
    assert diff_checkpoints(root / "step_00000002", ckpt_of(tmp_path / "sync", 2), skip=["progress.first_loss"]) == []


def test_a_failed_background_write_is_the_synchronous_saves_error_and_nothing_counts(make_job, tmp_path,
                                                                                      monkeypatch):
    """No space while the background write runs: ``wait`` (the next save, the end) raises the one-line
    CheckpointError naming the intact checkpoint; the partial dir is gone and the step is not taken as saved."""
    run_dir = tmp_path / "r"
    job = make_job(run_dir, ASYNC)
    job.checkpoints.save(2)
    job.checkpoints.wait()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", full)
    assert job.checkpoints.save(4) is None  # the failure is in the background
    with pytest.raises(CheckpointError) as err:
        job.checkpoints.save(6)  # waits for step 4's write first
    assert re.fullmatch(re.escape(f"saving step 4 under {run_dir / 'checkpoints'} failed (OSError: [Errno 28] No space "
                                  "left on device; ") + r"\d+\.\d MB free there\)" + re.escape(
        f"; training stopped. The latest complete checkpoint, {ckpt_of(run_dir, 2)}, is intact: make room (or lower "
        "checkpoint.keep_last) and resume from it with"), cut_command(str(err.value))[0]), str(err.value)
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_00000002"]
    assert job.checkpoints.last_saved_step == 2 and not job.checkpoints.in_flight


def test_a_non_finite_state_is_refused_by_the_background_write_and_evicts_nothing(make_job, tmp_path):
    """The non-finite check of an async save reads the staged copy in the background write (the loop does not wait
    for it): waiting raises the synchronous save's DivergenceError; no shard was written, keep_last=1 kept step 2."""
    run_dir = tmp_path / "r"
    job = make_job(run_dir, ASYNC, "checkpoint.keep_last=1")
    job.checkpoints.save(2)
    job.checkpoints.wait()
    with torch.no_grad():
        next(job.trainer.model.parameters()).view(-1)[0] = math.nan
    assert job.checkpoints.save(4) is None
    with pytest.raises(DivergenceError, match=r"not saving step 4: the state holds non-finite values \(model\."):
        job.checkpoints.wait()
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_00000002"]
    assert job.checkpoints.last_saved_step == 2


@pytest.mark.parametrize("end", ["save_last", "preempted"])
def test_fit_with_async_saves_reports_each_save_when_complete_and_ends_with_none_in_flight(make_job, tmp_path,
                                                                                           caplog, end):
    """trainer.fit with saves every 2 steps, ending after step 3 by ``save_last`` or by a preemption signal (SIGTERM)
    received in step 3: every save is complete when fit returns, ``on_checkpoint_saved`` came once per step, in
    order, after its dir existed, and the preemption's stop line names step 3's checkpoint."""
    import signal

    job = make_job(tmp_path, ASYNC, f"trainer.max_steps={3 if end == 'save_last' else 5}",
                   "checkpoint.every_n_steps=2", "checkpoint.save_last=true", "checkpoint.keep_last=0",
                   "trainer.eval_every_n_steps=0")
    saved: list[int] = []

    def call(hook, *args):
        if hook == "on_train_step_end" and args[0] == 3 and end == "preempted":
            job.trainer.preemption.received = signal.SIGTERM
        if hook == "on_checkpoint_saved":
            assert (args[1] / ".metadata").exists()
            saved.append(args[0])

    job.trainer.callbacks.call = call
    result = job.trainer.fit()
    assert result.preempted == (end == "preempted") and result.steps == 3
    assert saved == [2, 3] and not job.checkpoints.in_flight
    assert [s for s, _ in list_checkpoints(tmp_path / "checkpoints")] == [2, 3]
    if end == "preempted":
        assert f"stopping at step 3 after a preemption signal; checkpoint {ckpt_of(tmp_path, 3)};" in caplog.text


def test_the_non_finite_check_before_a_save_tells_values_from_an_overflowing_sum():
    """The check reads a tensor's sum first (one pass; the mask of isfinite cost most of a save): NaN and infs are
    found, while finite values whose sum overflows (float32, or fp16 accumulated in float32) are not taken for one."""
    from hydratrain.checkpoint.io import all_finite as _all_finite

    big = torch.full((4,), 3e38)
    assert _all_finite(big) and _all_finite(torch.full((4,), 60000.0, dtype=torch.float16))
    for bad in (math.nan, math.inf, -math.inf):
        assert not _all_finite(torch.cat([big, torch.tensor([bad])]))
    assert not _all_finite(torch.tensor([math.inf, -math.inf]))  # (their sum is NaN)
