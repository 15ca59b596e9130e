"""The non-finite guard (``hydratrain.train.nonfinite``) drops a non-finite update on the device and is read only
where the loop synchronises anyway: no ``.item()``/``bool()`` of a tensor between log steps (no per-step host
synchronisation), yet ``stop`` leaves the weights exactly where the last finite step left them and ``skip``
counts every dropped update."""
from __future__ import annotations

import logging
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hydratrain.errors import DivergenceError
from hydratrain.train.nonfinite import stop_advice

RUN = ["trainer.max_steps=8", "trainer.log_every_n_steps=4", "trainer.eval_every_n_steps=0", "scheduler=constant",
       "scheduler.warmup_steps=0"]
LOG_STEPS = {1, 4, 8}  # steps that log (the final eval and save come after step 8)


class HostReads(TorchDispatchMode):
    """Records ``trainer.progress.step`` at every read of a tensor's value on the host (``.item()``, ``bool()``,
    ``float()``, ``.tolist()`` all end in ``aten._local_scalar_dense``)."""

    def __init__(self, trainer):
        super().__init__()
        self.trainer, self.at = trainer, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.at.add(self.trainer.progress.step)
        return func(*args, **(kwargs or {}))


def _poison(trainer, steps: set[int]) -> None:
    """Make the loss (so the gradient norm) NaN at optimizer ``steps``, without reading anything on the host."""
    loss_of = trainer.loss_of

    def poisoned(batch):
        loss = loss_of(batch)
        return loss * float("nan") if trainer.progress.step + 1 in steps else loss

    trainer.loss_of = poisoned


def _params(job) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in job.model.state_dict().items()}


def test_the_loop_reads_nothing_on_the_host_between_log_steps(make_job, tmp_path):
    job = make_job(tmp_path, *RUN)
    with HostReads(job.trainer) as reads:
        job.trainer.fit()
    assert reads.at and reads.at <= LOG_STEPS, sorted(reads.at)
    assert job.trainer._guard_on_device  # optim.impl=auto is fused on CPU: it takes found_inf


@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.slow), "fsdp"])
def test_ddp_and_fsdp_read_nothing_on_the_host_between_log_steps(compose, tmp_path, monkeypatch, strategy):
    """The same on a one-rank process group: DDP's bucketed all-reduce, FSDP2's DTensor gradients, the global norm
    over shards and fused AdamW dropping a poisoned step's update on DTensor shards, all without a host read."""
    import torch.distributed as dist

    from hydratrain.dist.process_group import process_group
    from hydratrain.parallel.build import build_strategy
    from hydratrain.run import build

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    cfg = compose(["+debug=fast_gpt", f"strategy={strategy}", "precision=fp32", "device=cpu",
                   "logger.tensorboard=false", "logger.peak_flops=1e12", *RUN, "trainer.on_nonfinite=skip"])
    strategy_ = build_strategy(cfg)
    with process_group("cpu", strategy_.backend, True) as info:
        assert dist.is_initialized()
        job = build(cfg, strategy_, info, tmp_path, tmp_path)
        _poison(job.trainer, {3})
        with HostReads(job.trainer) as reads:
            result = job.trainer.fit()
    assert reads.at <= LOG_STEPS, sorted(reads.at)
    assert job.trainer._guard_on_device and result.skipped_steps == 1 and result.steps == 8


def test_stop_drops_the_update_on_the_device_and_raises_at_the_next_log_step(make_job, tmp_path):
    one_step = make_job(tmp_path / "one", *RUN[1:], "trainer.max_steps=1")
    one_step.trainer.fit()
    job = make_job(tmp_path / "nan", *RUN)
    _poison(job.trainer, {2})
    with HostReads(job.trainer) as reads, pytest.raises(DivergenceError) as err:
        job.trainer.fit()
    assert reads.at <= LOG_STEPS, sorted(reads.at)
    assert err.value.step == 2 and job.trainer.progress.step == 4
    assert job.trainer.progress.skipped_steps == 3  # steps 2, 3 and 4: every dropped update counts
    assert "non-finite gradient norm (nan) at step 2" in str(err.value)
    assert "and every update after it up to step 4, was not applied (trainer.on_nonfinite=stop" in str(err.value)
    # the advice names the clipping as it is set: on by default, so lowered, not "set"
    clip = job.cfg.trainer.grad_clip
    assert (f"or lower trainer.grad_clip (now {clip:g})" if clip else "or set trainer.grad_clip") in str(err.value)
    assert stop_advice(0.0).endswith("or set trainer.grad_clip (1.0 is common)")
    # steps 2-4 changed nothing: the weights and moments are step 1's, bit for bit
    assert all(torch.equal(v, _params(one_step)[k]) for k, v in _params(job).items())
    state = job.trainer.optimizer.state_dict()["state"][0]
    assert float(state["step"]) == 1
    assert torch.equal(state["exp_avg"], one_step.trainer.optimizer.state_dict()["state"][0]["exp_avg"])


def test_skip_drops_each_nonfinite_update_counts_it_and_warns_at_the_log_step(make_job, tmp_path, caplog):
    job = make_job(tmp_path, *RUN, "trainer.on_nonfinite=skip")
    _poison(job.trainer, {2, 3, 6})
    with caplog.at_level(logging.WARNING, "hydratrain.trainer"), HostReads(job.trainer) as reads:
        result = job.trainer.fit()
    assert reads.at <= LOG_STEPS, sorted(reads.at)
    assert result.steps == 8 and result.skipped_steps == 3 and job.trainer.progress.consecutive_skipped == 0
    assert float(job.trainer.optimizer.state_dict()["state"][0]["step"]) == 5  # 8 steps, 3 dropped
    warnings = [r.getMessage() for r in caplog.records if "update skipped on every rank" in r.getMessage()]
    assert len(warnings) == 2 and "at step 2 (loss nan) and at 1 more step(s) up to step 3" in warnings[0]
    assert "at step 6 (loss nan):" in warnings[1]
    assert all(torch.isfinite(v).all() for v in _params(job).values())


def test_skipped_steps_stay_out_of_the_logged_loss_and_of_the_checkpoint(make_job, tmp_path, caplog):
    """A dropped step's loss (NaN) is left out of the logging window, so the window's train/loss is the mean of the
    steps that trained, and a checkpoint saved between log steps holds no NaN (the save refuses any)."""
    from hydratrain.checkpoint.io import read_all

    job = make_job(tmp_path, *RUN, "trainer.on_nonfinite=skip", "checkpoint.every_n_steps=6")
    _poison(job.trainer, {3, 4, 5})
    with caplog.at_level(logging.INFO, "hydratrain.trainer"):
        result = job.trainer.fit()
    assert result.steps == 8 and result.skipped_steps == 3
    lines = {int(m.split()[1].split("/")[0]): float(m.split()[3]) for m in
             (r.getMessage() for r in caplog.records) if m.startswith("step ")}
    assert sorted(lines) == [1, 4, 8] and all(math.isfinite(v) for v in lines.values()), lines
    saved = read_all(tmp_path / "checkpoints" / "step_00000006")
    assert all(torch.isfinite(v).all() for v in saved.values() if isinstance(v, torch.Tensor) and v.is_floating_point())


def test_a_window_of_dropped_steps_logs_no_loss(make_job, tmp_path, caplog):
    """A log window whose every update was dropped has no loss to report: the line says so and train/loss is left
    out, rather than a NaN that reads like the divergence the skips avoided."""
    job = make_job(tmp_path, *RUN, "trainer.on_nonfinite=skip")
    _poison(job.trainer, {2, 3, 4})
    with caplog.at_level(logging.INFO, "hydratrain.trainer"):
        job.trainer.fit()
    assert any(r.getMessage().startswith("step 4/8 loss n/a (every update skipped)") for r in caplog.records)


def test_skip_stops_after_too_many_in_a_row_naming_the_step_the_limit_was_reached(make_job, tmp_path):
    job = make_job(tmp_path, *RUN, "trainer.on_nonfinite=skip", "trainer.max_consecutive_nonfinite=2")
    _poison(job.trainer, {2, 3, 5, 6, 7})
    with pytest.raises(DivergenceError, match="2 steps in a row up to step 3 had non-finite gradients"):
        job.trainer.fit()
    assert job.trainer.progress.step == 4 and job.trainer.progress.skipped_steps == 2


@pytest.mark.parametrize("impl", ["foreach", "for_loop"])
def test_an_optimizer_without_found_inf_is_guarded_on_the_host_every_step(make_job, tmp_path, impl):
    """torch's foreach and for-loop AdamW cannot drop an update on the device: the guard is read every step, and
    stop raises at the non-finite step itself, before its update."""
    job = make_job(tmp_path, *RUN, f"optim.impl={impl}")
    _poison(job.trainer, {3})
    with pytest.raises(DivergenceError, match="at step 3 .*: its update was not applied"):
        job.trainer.fit()
    assert not job.trainer._guard_on_device
    assert job.trainer.progress.step == 2
    assert float(job.trainer.optimizer.state_dict()["state"][0]["step"]) == 2


def test_only_a_fused_optimizer_on_the_guards_device_drops_updates_there():
    from hydratrain.train.nonfinite import drops_updates_on_device

    params = [torch.nn.Parameter(torch.zeros(2, 2))]
    fused, foreach = torch.optim.AdamW(params, fused=True), torch.optim.AdamW(params, foreach=True)
    assert drops_updates_on_device(fused, torch.device("cpu"))
    assert not drops_updates_on_device(foreach, torch.device("cpu"))
    # strategy.cpu_offload on CUDA: the update runs on the CPU while the flag is on the GPU
    assert not drops_updates_on_device(fused, torch.device("cuda", 0))
    fused.param_groups[0]["fused"] = None  # what an older checkpoint's groups said before the configured flags won
    assert not drops_updates_on_device(fused, torch.device("cpu"))


def test_an_error_a_peer_cannot_cause_is_this_ranks_own_whoever_recorded_first():
    """Each rank's stop message names its own loss (or its own failed allocation): whichever rank recorded a failure
    first, a divergence or an out-of-memory error keeps its exit status; a generic error only with the same text."""
    from hydratrain.dist.process_group import _caused_by_peer
    from hydratrain.errors import OutOfMemoryError

    err = DivergenceError("non-finite gradient norm (nan) at step 2 (loss 1.446e+05): ...", 2)
    mine = f"rank 0: DivergenceError: {err}"
    assert not _caused_by_peer(f"rank 1: DivergenceError: {str(err).replace('1.446e+05', '1.449e+05')}", mine, err)
    assert not _caused_by_peer("rank 1: RuntimeError: injected fault", mine, err)
    oom = OutOfMemoryError("you tried to allocate 16777216 bytes")
    assert not _caused_by_peer("rank 1: OutOfMemoryError: you tried to allocate 8388608 bytes",
                               f"rank 0: OutOfMemoryError: {oom}", oom)
    other = RuntimeError("CUDA error")
    assert _caused_by_peer("rank 1: RuntimeError: CUDA error: device 1", "rank 0: RuntimeError: CUDA error", other)
    assert not _caused_by_peer("rank 1: RuntimeError: CUDA error", "rank 0: RuntimeError: CUDA error", other)


def test_a_collective_that_lost_its_peer_is_a_symptom_not_this_ranks_failure():
    from hydratrain.dist.process_group import lost_a_peer

    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:59012: Connection reset by peer.")
    assert lost_a_peer(gloo) and lost_a_peer(torch.distributed.DistNetworkError("store: connection refused"))
    try:  # wrapped, as a checkpoint save re-raises it
        raise RuntimeError("checkpoint save failed") from gloo
    except RuntimeError as wrapped:
        assert lost_a_peer(wrapped)
    assert not lost_a_peer(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not lost_a_peer(ValueError("connection reset by peer"))  # only the collective's RuntimeError


def test_a_divergence_after_a_resume_names_the_checkpoint_it_resumed_from(make_job, tmp_path):
    """A run started from another run's checkpoint (checkpoint.resume_from) has none of its own yet: the checkpoint
    it resumed from is the last good one."""
    first = make_job(tmp_path / "a", *RUN)
    batches = iter(first.trainer.train_batches)
    for _ in range(2):
        first.trainer.train_step(batches)
    saved = first.checkpoints.save(2)
    job = make_job(tmp_path / "b", *RUN)
    job.checkpoints.load(saved)
    _poison(job.trainer, {3})
    with pytest.raises(DivergenceError) as err:
        job.trainer.fit()
    assert err.value.step == 3 and err.value.last_checkpoint == str(saved)
    assert str(err.value).endswith(f"last good checkpoint: {saved}")


@pytest.mark.parametrize("other_loss, says", [
    (float("nan"), "non-finite gradient norm (nan) at step 5 (loss nan: not finite on 1 of 2 ranks, whose batches or "
                   "forward passes failed): its update was not applied (trainer.on_nonfinite=stop; check that step's "
                   "data on those ranks)"),
    (5.0, "non-finite gradient norm (nan) at step 5 (loss 5.126): its update was not applied (trainer.on_nonfinite="
          "stop; lower optim.lr"),
])
def test_the_divergence_line_gives_the_steps_loss_over_ranks(monkeypatch, other_loss, says):
    """Each rank recorded its own loss: with rank 1's loss NaN (a bad batch), rank 0 said "loss 5.252" and pointed
    at the lr. The line now gives the step's loss as train/loss does (the mean over ranks) and says when
    only some ranks' loss was not finite. Rank 1's side of the all-reduce is played here."""
    from hydratrain.train import nonfinite
    from hydratrain.train.nonfinite import NonFiniteGuard
    from hydratrain.train.progress import TrainProgress

    guard = NonFiniteGuard("stop", 20, torch.device("cpu"), scaler_skips=False)
    guard.update(5, torch.tensor(float("nan")), torch.tensor(5.252))
    monkeypatch.setattr(nonfinite, "rank_and_world", lambda: (0, 2))  # (nonfinite imports it from dist.collectives)

    def with_rank_1(values, op=None):
        values += torch.tensor([other_loss, 0.0 if math.isfinite(other_loss) else 1.0], dtype=values.dtype)

    monkeypatch.setattr(torch.distributed, "all_reduce", with_rank_1)
    err = guard.read(TrainProgress(), 5, lambda: None)
    assert str(err).startswith(says), str(err)


def test_a_step_with_no_target_is_skipped_without_halting_or_breaking_a_run_of_skips(caplog):
    """A step whose targets are all ignored on every rank has nothing to learn from: its update is dropped and
    counted as skipped, with one warning at the read; under ``stop`` it halts nothing, and under ``skip`` it neither
    adds to nor resets a run of non-finite steps (``max_consecutive_nonfinite``)."""
    from hydratrain.train.nonfinite import NonFiniteGuard
    from hydratrain.train.progress import TrainProgress

    yes, no = torch.tensor(True), torch.tensor(False)
    stop = NonFiniteGuard("stop", 20, torch.device("cpu"), scaler_skips=False)
    flags = [stop.update(1, torch.tensor(1.0), torch.tensor(2.0), no),
             stop.update(2, torch.tensor(float("nan")), torch.tensor(float("nan")), yes),  # NaN from no targets
             stop.update(3, torch.tensor(1.0), torch.tensor(2.0), no)]
    assert [float(f) for f in flags] == [0.0, 1.0, 0.0]
    progress = TrainProgress()
    with caplog.at_level("WARNING", logger="hydratrain.trainer"):
        assert stop.read(progress, 3, lambda: None) is None
    assert progress.skipped_steps == 1 and "step 2 had no target on any rank" in caplog.text

    skip = NonFiniteGuard("skip", 2, torch.device("cpu"), scaler_skips=False)
    for step, norm, empty in [(1, float("inf"), no), (2, 0.0, yes), (3, float("inf"), no), (4, 0.0, yes)]:
        assert float(skip.update(step, torch.tensor(norm), torch.tensor(1.0), empty)) == 1.0
    progress = TrainProgress()
    caplog.clear()
    with caplog.at_level("WARNING", logger="hydratrain.trainer"):
        err = skip.read(progress, 5, lambda: None)  # steps 1 and 3: two non-finite steps in a row, step 2 between
    assert progress.skipped_steps == 4 and "2 steps in a row up to step 3" in str(err)
    assert "step 2 and 1 more step(s) up to step 4 had no target" in caplog.text
    assert "at step 1 (loss 1) and at 1 more step(s) up to step 3: update skipped" in caplog.text
