"""optim=adamw8bit without processes: the state is about 1/4 of AdamW's, a checkpoint's float32 copy of the
8-bit moments quantises back to the same codes, and a missing torchao is a one-line config error."""
from __future__ import annotations

import warnings

import pytest
import torch
from omegaconf import OmegaConf

from helpers import ROOT, requires
from hydratrain.errors import ConfigError

pytestmark = requires("lowbit")


def _stepped(name: str) -> torch.optim.Optimizer:
    """gpt_tiny's parameters (0.9M) and one step of ``optim=name`` on random gradients."""
    from hydratrain.models.gpt import GPT, GPTConfig
    from hydratrain.optim import build_optimizer

    torch.manual_seed(0)
    model = GPT(GPTConfig())
    cfg = OmegaConf.create({"name": name, "lr": 1e-3, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8,
                            "block_size": 256})
    optimizer = build_optimizer(model, cfg)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    return optimizer


@pytest.mark.slow  # torchao compiles its 8-bit step with inductor: about 25 s on 2 CPU cores
def test_8bit_state_is_about_a_quarter_of_adamw():
    from hydratrain.optim import state_bytes

    adamw = _stepped("adamw")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        low = _stepped("adamw8bit")
    # dynamo's note on torchao's state class reached the console at the first step
    assert not [w for w in seen if "_stable_hash_for_caching" in str(w.message)], [str(w.message) for w in seen]
    full, low = state_bytes(adamw), state_bytes(low)
    n = sum(p.numel() for group in adamw.param_groups for p in group["params"])
    assert full >= 8 * n  # two fp32 moments per parameter (+ step counts)
    assert 0.24 < low / full < 0.30, (low, full)  # 1 byte per value + one fp32 scale per 256 + small fp32 tensors


def test_checkpointed_moments_quantise_back_to_the_same_codes():
    from torchao.optim.subclass_8bit import OptimState8bit

    from hydratrain.checkpoint.stateful import _dequantised, _quantised

    torch.manual_seed(1)
    for signed in (True, False):
        for magnitude in (1e-8, 1e-3, 1.0):
            x = torch.randn(32, 256) * magnitude
            x[5] = 0  # an all-zero block
            x = x if signed else x.square()
            q = OptimState8bit.zeros(x.shape, signed, 256, device="cpu")
            q.copy_(x)
            assert _quantised(q)
            again = OptimState8bit.zeros(x.shape, signed, 256, device="cpu")
            again.copy_(_dequantised(q))
            assert torch.equal(q.codes, again.codes) and torch.equal(q.scale, again.scale), (signed, magnitude)


def test_lowbit_without_torchao_is_a_config_error(compose, monkeypatch):
    import hydratrain.config.validate
    from hydratrain.config.validate import check_environment

    cfg = compose(["optim=adamw8bit", "device=cpu"])
    assert cfg.optim.block_size == 256
    check_environment(cfg, 1, ROOT)
    monkeypatch.setattr(hydratrain.config.validate, "lowbit_available", lambda: False)  # (imported from optim)
    with pytest.raises(ConfigError) as err:
        check_environment(cfg, 1, ROOT)
    assert str(err.value) == ("optim.name='adamw8bit': needs torchao, which is not installed (pip install -e "
                              "'.[lowbit]'); allowed here: adamw")


def test_env_report_lists_the_optimizers():
    from hydratrain.env import report

    line = next(x for x in report() if x.startswith("optimizers:"))
    assert "adamw8bit (torchao" in line


def _trained(job, steps: int) -> list[float]:
    batches = iter(job.trainer.train_batches)
    return [float(job.trainer.train_step(batches)[0]) for _ in range(steps)]


def _moments(job) -> dict[str, tuple[float, torch.Tensor]]:
    """{parameter name: (step count, exp_avg as float32)} of ``job``'s optimizer (8-bit moments dequantised)."""
    from hydratrain.checkpoint.stateful import _dequantised, _quantised

    names = {id(p): n for n, p in job.raw.named_parameters()}
    return {names[id(p)]: (float(s["step"]), _dequantised(s["exp_avg"]) if _quantised(s["exp_avg"])
                           else s["exp_avg"].clone()) for p, s in job.trainer.optimizer.state.items()}


@pytest.mark.slow  # 9 s; tests/e2e/test_adamw8bit_runs.py covers adamw8bit -> adamw on 2 ranks as well
def test_a_checkpoint_resumes_under_the_other_optimizer_both_ways(make_job, tmp_path):
    """torchao's AdamW8bit keeps lr and initial_lr in its param_groups as 0-d tensors, so its checkpoints store them
    as tensors where torch's AdamW stores floats; DCP refused to read a stored tensor into a float ("Invalid checkpoint
    metadata for optim.param_groups.0.lr, expected BytesStorageMetadata"). Each way, the other optimizer's
    checkpoint loads with its moments and step counts, keeps this run's kinds, and trains on."""
    from hydratrain.checkpoint.stateful import _quantised

    ckpt = ("checkpoint.every_n_steps=100", "checkpoint.keep_last=0")
    low = make_job(tmp_path / "low", "optim=adamw8bit", *ckpt)
    assert isinstance(low.trainer.optimizer.param_groups[0]["lr"], torch.Tensor)
    _trained(low, 3)
    saved_low = _moments(low)
    assert any(_quantised(s["exp_avg"]) for s in low.trainer.optimizer.state.values())
    path = low.checkpoints.save(3)

    full = make_job(tmp_path / "full", "optim=adamw", *ckpt)
    full.checkpoints.load(path)
    opt = full.trainer.optimizer
    assert full.trainer.progress.step == 3
    for group in opt.param_groups:
        assert type(group["lr"]) is float and type(group["initial_lr"]) is float
        assert group["lr"] == pytest.approx(full.trainer.scheduler.get_last_lr()[0])
    loaded = _moments(full)
    assert loaded.keys() == saved_low.keys()
    for name, (step, m) in loaded.items():
        assert step == 3 and torch.equal(m, saved_low[name][1]) and m.abs().sum() > 0, name
    losses = _trained(full, 2)
    assert all(torch.isfinite(torch.tensor(losses))), losses
    saved_full = _moments(full)
    assert {s for s, _ in saved_full.values()} == {5.0}
    path = full.checkpoints.save(5)

    back = make_job(tmp_path / "back", "optim=adamw8bit", *ckpt)
    back.checkpoints.load(path)
    opt = back.trainer.optimizer
    assert back.trainer.progress.step == 5
    for group in opt.param_groups:
        assert isinstance(group["lr"], torch.Tensor) and isinstance(group["initial_lr"], torch.Tensor)
    assert any(_quantised(s["exp_avg"]) for s in opt.state.values())
    loaded = _moments(back)
    assert loaded.keys() == saved_full.keys()
    for name, (step, m) in loaded.items():  # equal within 8-bit precision
        saved_m = saved_full[name][1]
        assert step == 5 and (m - saved_m).abs().max() <= saved_m.abs().max() / 64 and m.abs().sum() > 0, name
    losses = _trained(back, 1)
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert {s for s, _ in _moments(back).values()} == {6.0}
