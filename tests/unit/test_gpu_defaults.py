"""The decisions that make the defaults fast on a GPU and leave the CPU as it was, each a pure function tested with a
fake device: what ``trainer.compile`` compiles (whole model or per block, per strategy and activation
checkpointing), ``strategy=fsdp`` on one GPU training as ``single``, and ``data.batch_size=auto``'s search over a
predictor of peak memory; then the pieces that apply them, in this process."""
from __future__ import annotations

import logging
import math
import time

import pytest
import torch

from hydratrain.auto_batch import CPU_LIMIT, LIMIT, largest_fitting
from hydratrain.errors import ConfigError
from hydratrain.parallel.ac_compile import CompileChoice, CompileClock, apply_compile, choose_compile

STRATEGIES = ("single", "ddp", "fsdp", "hsdp")

# (strategy, activation checkpointing) -> what trainer.compile=auto compiles on CUDA (and =true on any device)
ON_CUDA = {("single", False): "model", ("single", True): "model",
           ("ddp", False): "model", ("ddp", True): "blocks",
           ("fsdp", False): "blocks", ("fsdp", True): "blocks",
           ("hsdp", False): "blocks", ("hsdp", True): "blocks"}


# ------------------------------------------------------------------------------------------ trainer.compile
@pytest.mark.parametrize("strategy,ac", list(ON_CUDA))
def test_compile_auto_compiles_on_cuda_only_and_true_everywhere(strategy, ac):
    assert choose_compile("auto", "cuda", strategy, ac, has_blocks=True).what == ON_CUDA[strategy, ac]
    off = choose_compile("auto", "cpu", strategy, ac, has_blocks=True)
    assert off == CompileChoice("none", off.why) and not off.enabled and "not on cpu" in off.why
    for device in ("cpu", "cuda"):
        for true in (True, "true", "TRUE"):
            assert choose_compile(true, device, strategy, ac, has_blocks=True).what == ON_CUDA[strategy, ac]
        for false in (False, "false"):
            assert choose_compile(false, device, strategy, ac, has_blocks=True).what == "none"
        assert choose_compile("model", device, strategy, ac, has_blocks=True).what == "model"
        assert choose_compile("blocks", device, strategy, ac, has_blocks=True).what == "blocks"


def test_compile_choice_says_why():
    assert "the whole model" in choose_compile("auto", "cuda", "single", False, True).why
    assert "DDP's buckets" in choose_compile("auto", "cuda", "ddp", False, True).why
    assert "checkpoints" in choose_compile("auto", "cuda", "ddp", True, True).why
    assert "FSDP2" in choose_compile(True, "cpu", "fsdp", False, True).why


def test_compile_without_blocks():
    """The whole model needs no blocks; per block it does: auto then compiles nothing (a user's model without
    blocks must still start), an explicit request is a one-line error naming the key."""
    assert choose_compile("auto", "cuda", "single", False, has_blocks=False).what == "model"
    assert choose_compile("model", "cuda", "fsdp", False, has_blocks=False).what == "model"
    skipped = choose_compile("auto", "cuda", "fsdp", False, has_blocks=False)
    assert skipped.what == "none" and "wrap_policy.block_classes" in skipped.why
    for value, strategy in (("true", "fsdp"), ("blocks", "single"), (True, "hsdp")):
        with pytest.raises(ConfigError) as err:
            choose_compile(value, "cuda", strategy, False, has_blocks=False)
        assert err.value.key == "trainer.compile" and "wrap_policy.block_classes" in str(err.value)


@pytest.mark.parametrize("value", ["yes", "on", 1, "whole"])
def test_compile_refuses_other_values_in_one_line(value, compose):
    from hydratrain.config.validate import validate

    with pytest.raises(ConfigError) as err:
        choose_compile(value, "cuda", "single", False, True)
    assert (err.value.key, err.value.why) == ("trainer.compile", "allowed: auto, true, false, model, blocks")
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="^trainer.compile="):
        validate(compose([f"trainer.compile={value}"]))


def test_compile_defaults_to_auto_and_takes_every_value(compose):
    from hydratrain.config.validate import validate

    assert compose([]).trainer.compile == "auto"
    for value in ("auto", "true", "false", "model", "blocks"):
        validate(compose([f"trainer.compile={value}"]))


def _tiny(n_layer: int = 2):
    from hydratrain.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(d_model=32, n_layer=n_layer, n_head=2, max_seq_len=16))


def test_parallelize_compiles_the_whole_model_without_renaming_parameters(compose):
    """trainer.compile=true under single: Module.compile on the root (no '_orig_mod.' in any key); auto on the CPU
    compiles nothing and says nothing."""
    from hydratrain.parallel.build import build_strategy
    from hydratrain.parallel.precision import Precision

    cpu = torch.device("cpu")
    for value, compiled in (("true", "the whole model (GPT)"), ("auto", None), ("blocks", "2 blocks (2 Block)")):
        cfg = compose(["strategy=single", "precision=fp32", f"trainer.compile={value}"])
        strategy = build_strategy(cfg)
        raw = _tiny()
        keys = list(raw.state_dict())
        model, summary = strategy.parallelize(raw, Precision.resolve(cfg.precision, cpu), cpu, seed=0)
        assert strategy.compiled == compiled and list(model.state_dict()) == keys
        assert (raw._compiled_call_impl is not None) == (value == "true")
        assert ("compiled" in summary) == (compiled is not None), summary


def test_whole_model_compile_with_activation_checkpointing_trains_as_eager():
    """The checkpointed blocks inside one whole-model graph (a higher-order op) give eager's loss and gradients.
    aot_eager: dynamo and AOTAutograd's partitioner as with inductor, without generating kernels (seconds)."""
    from hydratrain.parallel.ac_compile import apply_activation_checkpointing
    from hydratrain.parallel.blocks import find_blocks

    x = torch.randint(0, 256, (2, 16))
    results = []
    for compiled in (False, True):
        raw = _tiny()
        blocks = find_blocks(raw)
        apply_activation_checkpointing(raw, blocks)
        if compiled:
            choice = choose_compile("true", "cpu", "single", True, True)
            assert apply_compile(raw, blocks, choice, backend="aot_eager") == "the whole model (GPT)"
        loss = raw(x).float().logsumexp(-1).mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in raw.named_parameters()}))
    (eager_loss, eager_grads), (loss, grads) = results
    torch.testing.assert_close(loss, eager_loss)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(grads[name], grad, msg=name)


def test_compile_clock_logs_what_was_compiled_and_the_compile_time(caplog):
    cpu = torch.device("cpu")
    clock = CompileClock("the whole model (GPT)", cpu)
    with caplog.at_level(logging.INFO, logger="hydratrain.compile"):
        clock.step_done(0, time.perf_counter() - 3.0)
        clock.step_done(1, time.perf_counter() - 0.4)
        clock.step_done(2, time.perf_counter() - 9.0)  # later steps are not timed
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("torch.compile: compiled the whole model (GPT); first step 3.00 s, second 0.40")
    assert "about 2.6 s of compilation" in line and math.isclose(clock.compile_s, 2.6, abs_tol=0.03)
    caplog.clear()
    once = CompileClock("2 blocks (2 Block)", cpu)
    with caplog.at_level(logging.INFO, logger="hydratrain.compile"):
        once.step_done(0, time.perf_counter() - 1.0, last=True)
    assert "compilation included (no second step" in caplog.records[0].getMessage()


# --------------------------------------------------------------------------------- fsdp on one GPU = single
@pytest.mark.parametrize("name", ["fsdp", "hsdp"])
def test_fsdp_on_one_gpu_trains_as_single(name):
    from hydratrain.parallel.build import single_on_one_rank

    why = single_on_one_rank(name, "auto", 1, "cuda", cpu_offload=False)
    assert why.startswith(f"strategy={name} on 1 GPU trains as strategy=single")
    assert "strategy.shard_on_one_rank=true keeps FSDP" in why
    assert single_on_one_rank(name, "auto", 1, "cpu", cpu_offload=False) is None  # CPU: as it was
    assert single_on_one_rank(name, "auto", 2, "cuda", cpu_offload=False) is None  # two ranks shard
    assert single_on_one_rank(name, "auto", 1, "cuda", cpu_offload=True) is None  # offload needs the shards
    for true in (True, "true"):
        assert single_on_one_rank(name, true, 1, "cuda", cpu_offload=False) is None
    assert "shard_on_one_rank=false" in single_on_one_rank(name, False, 1, "cpu", cpu_offload=False)
    assert single_on_one_rank(name, False, 4, "cuda", cpu_offload=False) is None
    with pytest.raises(ConfigError, match="^strategy.shard_on_one_rank=False: strategy.cpu_offload=true needs"):
        single_on_one_rank(name, False, 1, "cuda", cpu_offload=True)
    with pytest.raises(ConfigError, match="^strategy.shard_on_one_rank='maybe': allowed: auto, true, false$"):
        single_on_one_rank(name, "maybe", 1, "cuda", cpu_offload=False)


@pytest.mark.parametrize("name", ["single", "ddp"])
def test_other_strategies_stay_on_one_gpu(name):
    from hydratrain.parallel.build import single_on_one_rank

    assert single_on_one_rank(name, "auto", 1, "cuda", cpu_offload=False) is None


def test_build_strategy_on_one_rank(compose, caplog):
    from hydratrain.config.validate import validate
    from hydratrain.parallel.build import build_strategy
    from hydratrain.parallel.fsdp import FSDP, HSDP
    from hydratrain.parallel.strategy import Single

    cfg = compose(["strategy=fsdp"])
    assert cfg.strategy.shard_on_one_rank == "auto"
    with caplog.at_level(logging.INFO, logger="hydratrain.parallel.build"):
        assert type(build_strategy(cfg, 1, "cuda")) is Single
    assert "trains as strategy=single" in caplog.text
    assert type(build_strategy(cfg, 1, "cpu")) is FSDP
    assert type(build_strategy(cfg, 2, "cuda")) is FSDP
    assert type(build_strategy(cfg)) is FSDP  # without the launch: as configured (tests, the planner's CLI)
    assert type(build_strategy(compose(["strategy=fsdp", "strategy.shard_on_one_rank=true"]), 1, "cuda")) is FSDP
    assert type(build_strategy(compose(["strategy=hsdp"]), 1, "cuda")) is Single
    assert type(build_strategy(compose(["strategy=hsdp"]), 1, "cpu")) is HSDP
    with pytest.raises(ConfigError, match="^strategy.shard_on_one_rank='often': allowed: auto, true, false$"):
        validate(compose(["strategy=fsdp", "strategy.shard_on_one_rank=often"]))


def test_fsdp_trained_as_single_compiles_the_whole_model(compose):
    """On one GPU the default strategy=fsdp trains as single, so trainer.compile=auto compiles the whole model
    (the device here is faked: parallelize reads only its type before wrapping)."""
    from hydratrain.parallel.build import build_strategy

    strategy = build_strategy(compose(["strategy=fsdp"]), 1, "cuda")
    assert strategy.compile_choice(torch.device("cuda"), has_blocks=True).what == "model"
    fsdp = build_strategy(compose(["strategy=fsdp"]), 2, "cuda")
    assert fsdp.compile_choice(torch.device("cuda"), has_blocks=True).what == "blocks"
    assert fsdp.compile_choice(torch.device("cpu"), has_blocks=True).what == "none"


# ------------------------------------------------------------------------------------ data.batch_size=auto
def _linear(base: int, per_sample: int, calls: list):
    def predict(b: int) -> int:
        calls.append(b)
        return base + per_sample * b
    return predict


@pytest.mark.parametrize("budget", [1_000 + 7 * b for b in (1, 2, 3, 37, 64, 100, 511, 1000)] + [1_000 + 7 * 64 - 1])
def test_largest_fitting_is_the_exact_largest_batch(budget):
    calls: list = []
    got = largest_fitting(_linear(1_000, 7, calls), budget)
    assert got == (budget - 1_000) // 7
    assert 1_000 + 7 * got <= budget < 1_000 + 7 * (got + 1)
    assert len(calls) <= 2 * math.log2(got + 1) + 3  # doubling, then bisection
    assert [b for b in calls if b & (b - 1) == 0][:3] == [1, 2, 4][:len([b for b in calls if b & (b - 1) == 0][:3])]


def test_largest_fitting_edges():
    calls: list = []
    assert largest_fitting(_linear(1_000, 7, calls), 1_006) is None and calls == [1]  # not even one sample
    assert largest_fitting(lambda b: 0, 1) == LIMIT  # capped
    assert largest_fitting(lambda b: b, 10**9, limit=100) == 100
    assert largest_fitting(lambda b: b, 70, limit=100) == 70
    assert largest_fitting(lambda b: b, 5, limit=1) == 1
    steps = largest_fitting(lambda b: 0 if b <= 48 else 10**12, 1)  # a step in memory: kernels switch at 49
    assert steps == 48
    with pytest.raises(ValueError):
        largest_fitting(lambda b: b, 5, limit=0)


@pytest.mark.parametrize("value", ["0", "-3", "abc", "true", "1.5"])
def test_batch_size_takes_a_positive_int_or_auto(compose, value):
    from hydratrain.config.validate import validate

    validate(compose(["data.batch_size=auto"]))
    validate(compose(["data.batch_size=12"]))
    with pytest.raises(ConfigError) as err:
        validate(compose([f"data.batch_size={value}"]))
    assert err.value.key == "data.batch_size" and "or auto" in str(err.value)


def test_batch_size_auto_trains_with_the_planners_largest_fit(compose, tmp_path, caplog, monkeypatch):
    """A run with data.batch_size=auto: the job's config holds the number the planner gives (the largest whose
    predicted peak, with the planner's margin on all but the measured baseline, fits plan.memory_gb), the data and
    the step size follow it, and the composed config and the checkpoint's record keep auto (so a relaunch is the
    same trial)."""
    from omegaconf import OmegaConf

    from hydratrain import plan
    from hydratrain.dist.env import DistInfo
    from hydratrain.parallel.build import build_strategy
    from hydratrain.run import build

    monkeypatch.setattr(plan, "baseline_bytes", lambda device: 300 * 2**20)  # this process's RSS, held still
    cfg = compose(["+debug=fast_gpt", "strategy=single", "precision=fp32", "device=cpu", "logger.tensorboard=false",
                   "logger.peak_flops=1e12", "data.batch_size=auto", "plan.memory_gb=1.5"])
    OmegaConf.set_readonly(cfg, True)
    with caplog.at_level(logging.INFO, logger="hydratrain.auto_batch"):
        job = build(cfg, build_strategy(cfg), DistInfo(device=torch.device("cpu")), tmp_path, tmp_path)
    b = job.cfg.data.batch_size
    assert cfg.data.batch_size == "auto" and isinstance(b, int) and 1 < b < LIMIT
    assert job.trainer.train_batches.batch_size == b
    assert job.step_logger.tokens_per_step == b * cfg.data.seq_len
    assert job.checkpoints.config["data"]["batch_size"] == "auto"
    assert f"data.batch_size=auto: {b} samples per micro-batch per rank" in caplog.text
    setup = plan.setup_for(job.cfg, job.strategy, world_size=1, precision="fp32", vocab_size=256, device="cpu",
                           baseline=300 * 2**20)
    margin, budget = plan.error_margin("cpu"), int(1.5 * plan.GiB)
    assert plan.predict(setup).with_margin(margin) <= budget
    # on a CPU auto stops at CPU_LIMIT (time binds before memory there); the largest fit is larger here
    assert b == CPU_LIMIT and "the most auto picks (32)" in caplog.text
    assert budget >= plan.predict(setup.replace(batch_size=b + 1)).with_margin(margin)


def test_batch_size_auto_needs_a_model_the_planner_knows(compose, tmp_path):
    from hydratrain.dist.env import DistInfo
    from hydratrain.parallel.build import build_strategy
    from hydratrain.run import build

    cfg = compose(["+experiment=digits_cnn", "strategy=single", "device=cpu", "logger.tensorboard=false",
                   "logger.peak_flops=1e12", "data.batch_size=auto"])
    with pytest.raises(ConfigError, match="^data.batch_size='auto': needs the memory planner's whole step, but it "
                                          "does not predict activations"):
        build(cfg, build_strategy(cfg), DistInfo(device=torch.device("cpu")), tmp_path, tmp_path)
