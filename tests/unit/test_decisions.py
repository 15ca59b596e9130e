"""In-process checks of the objects that own a decision: the config is never written, Precision resolves into a new
object, every key either takes effect or is an error, Strategy builds the same model on meta and eagerly, the fixed
eval set, the Stateful components' resume rules, the save guard, and the CUDA-path helpers that run on a CPU."""
from __future__ import annotations

import math
import time
from unittest.mock import patch

import pytest
import torch
from omegaconf import OmegaConf
from omegaconf.errors import ReadonlyConfigError

from hydratrain.config.validate import validate
from hydratrain.errors import CheckpointError, ConfigError, DivergenceError


def _job(compose, tmp_path, *overrides):
    from hydratrain.dist.env import DistInfo
    from hydratrain.parallel.build import build_strategy
    from hydratrain.run import build

    cfg = compose(["+debug=fast_gpt", "strategy=single", "precision=fp32", "device=cpu", "logger.tensorboard=false",
                   "logger.peak_flops=1e12", *overrides])
    return build(cfg, build_strategy(cfg), DistInfo(device=torch.device("cpu")), tmp_path, tmp_path)


# ------------------------------------------------------------------------------------- the config stays composed
def test_main_never_writes_the_config_and_resolves_auto_into_a_new_object(compose, tmp_path):
    from hydratrain.parallel.precision import Precision
    from hydratrain.run import main

    cfg = compose(["+debug=fast_gpt", "strategy=single", "device=cpu", "trainer.max_steps=2", "logger.peak_flops=1e12"])
    before = OmegaConf.to_yaml(cfg)
    assert cfg.precision.name == "auto"
    writes = []

    def write_inside(*args, **kwargs):  # read-only inside main(): any write is a bug, found at once
        with pytest.raises(ReadonlyConfigError):
            cfg.precision.name = "bf16"
        writes.append("refused")
        validate(cfg)  # validating a read-only config works: validate only reads

    with patch("hydratrain.run.write_outputs", write_inside):
        result = main(cfg, run_dir=tmp_path / "a")
    assert writes == ["refused"] and OmegaConf.to_yaml(cfg) == before and result.steps == 2
    p = Precision.resolve(cfg.precision, torch.device("cpu"))
    assert p.requested == "auto" and p.name in ("fp32", "bf16") and cfg.precision.name == "auto"
    cfg.trainer.max_steps = 3  # the caller's object again: change one value, run again (not read-only for good)
    assert main(cfg, run_dir=tmp_path / "b").steps == 3


@pytest.mark.parametrize("overrides", [
    ["strategy=ddp", "strategy.cpu_offload=true"],                    # fsdp's key on ddp
    ["strategy=single", "strategy.backend=gloo"],                     # single has no process group
    ["precision=bf16", "precision.init_scale=2"],                     # only fp16 has a scaler
    ["wrap_policy=auto", "wrap_policy.min_num_params=5"],             # only size_based has a threshold
    ["scheduler=constant", "scheduler.min_lr_ratio=0.5"],             # constant has no decay
    ["launcher=local", "launcher.nproc_per_node=2"],                  # local starts nothing
    ["data=synthetic", "data.paths=[a.txt]"],                         # synthetic reads no files
    ["strategy.name=fsdq"],                                           # not an option
])
def test_a_key_the_option_does_not_use_is_a_compose_error(compose, overrides):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        compose(overrides)


@pytest.mark.parametrize("overrides,key", [
    (["strategy=ddp", "+strategy.cpu_offload=true"], "strategy.cpu_offload"),  # what Hydra's own error suggests
    (["+trainer.max_step=10"], "trainer.max_step"),
    (["launcher=torchrun", "+launcher.max_restart=1"], "launcher.max_restart"),
    (["+learning_rate=1e-3"], "learning_rate"),
])
def test_a_key_appended_with_plus_is_a_config_error_not_ignored(cli, overrides, key):
    """Exit 2 with ``hydratrain: config error: KEY=...``, from a run and from a launcher's job check alike (one run
    under launcher=torchrun is a sweep of one job that ends as a run), with no traceback."""
    r = cli(overrides)
    assert r.returncode == 2, r.output[-2000:]
    line = next((ln for ln in r.err.splitlines() if f"{key}=" in ln and "not a key of" in ln), None)
    assert line is not None and "allowed:" in line and line.startswith(f"hydratrain: config error: {key}="), r.err
    assert "Traceback" not in r.err, r.err[-2000:]


@pytest.mark.parametrize("overrides,key", [
    (["strategy=ddp", "wrap_policy=size_based"], "wrap_policy"),
    (["strategy=single", "precision.reduce_dtype=bfloat16"], "precision.reduce_dtype"),
    (["strategy=fsdp", "strategy.name=ddp"], "strategy.name"),
    (["device=cpu", "model.init_device=cuda"], "model.init_device"),
    (["checkpoint.preempt_exit_code=4"], "checkpoint.preempt_exit_code"),
])
def test_a_value_that_cannot_take_effect_is_a_config_error(compose, overrides, key):
    with pytest.raises(ConfigError) as err:
        validate(compose(overrides))
    assert err.value.key == key and "\n" not in str(err.value)


# -------------------------------------------------------------------------------- meta build = eager build
@pytest.mark.parametrize("tied", [True, False])
def test_meta_and_eager_builds_are_the_same_model(compose, tied):
    from hydratrain.parallel.build import build_model, build_strategy
    from hydratrain.parallel.precision import Precision

    built = {}
    for init_device in ("meta", "cpu"):
        cfg = compose(["strategy=single", "precision=fp32", f"model.init_device={init_device}",
                       f"model.tie_embeddings={str(tied).lower()}"])
        precision = Precision.resolve(cfg.precision, torch.device("cpu"))
        model, raw, n_params, _ = build_model(cfg, build_strategy(cfg), precision, torch.device("cpu"), 256)
        assert (raw.lm_head.weight is raw.tok_emb.weight) == tied
        assert sum(p.numel() for p in model.parameters()) == n_params.total
        built[init_device] = raw
    meta, eager = built["meta"].state_dict(), built["cpu"].state_dict()
    assert all(torch.equal(meta[k], eager[k]) for k in eager)
    for name, p in built["meta"].named_parameters():
        if p.ndim == 2:
            want = 0.02 / math.sqrt(2 * 4) if name.endswith(("wo.weight", "w2.weight")) else 0.02
            assert abs(p.std().item() / want - 1) < 0.05, name


def test_activation_checkpointing_does_not_change_the_initial_weights(compose):
    """activation_checkpointing=true must train the same model (AC only trades memory for compute)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from hydratrain.parallel.build import build_model, build_strategy
    from hydratrain.parallel.precision import Precision

    built = {}
    for ac in ("false", "true"):
        cfg = compose(["strategy=single", "precision=fp32", f"activation_checkpointing={ac}"])
        model, _, _, _ = build_model(cfg, build_strategy(cfg), Precision.resolve(cfg.precision, torch.device("cpu")),
                                     torch.device("cpu"), 256)
        built[ac] = get_model_state_dict(model)  # names without wrapper prefixes
    assert sorted(built["true"]) == sorted(built["false"])
    assert [k for k in built["false"] if not torch.equal(built["false"][k], built["true"][k])] == []


@pytest.mark.parametrize("policy", ["transformer_block", "size_based"])
def test_fsdp_shards_a_checkpointed_block_at_its_wrapper(policy):
    """FSDP's pre-forward hook (all-gather, cast to the MixedPrecisionPolicy dtype) must run outside the checkpointed
    region: sharded inside it, torch 2.11 recomputed in fp32 what the forward had saved in bf16 (CheckpointError on
    every strategy=fsdp precision=bf16 activation_checkpointing=true run; found by bench/gpu.sh on torch 2.11)."""
    from omegaconf import OmegaConf

    from hydratrain.models.gpt import GPT, Block, GPTConfig
    from hydratrain.parallel.ac_compile import apply_activation_checkpointing
    from hydratrain.parallel.wrap_policy import shard_units

    model = GPT(GPTConfig(d_model=32, n_layer=2, n_head=2, max_seq_len=16, vocab_size=64))
    assert apply_activation_checkpointing(model) == 2
    units = shard_units(model, OmegaConf.create({"name": policy, "min_num_params": 1000}))
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    assert [getattr(u, "_checkpoint_wrapped_module", None) for u in units] == blocks


# ----------------------------------------------------------------------------------------------- eval set
@pytest.mark.parametrize("n_samples", [0, 10, 33])
def test_eval_set_counts_each_sample_once_at_any_world_size_and_batch(n_samples):
    import numpy as np

    from hydratrain.data.streams import EvalBatches, TokenDataset

    ds = TokenDataset(np.arange(40 * 8 + 1), 8)  # sample i starts with token 8 * i
    want = None
    for world, batch in [(1, 8), (2, 3), (3, 2), (4, 5)]:
        seen, counts = [], set()
        for rank in range(world):
            batches = list(EvalBatches(ds, n_samples, batch, rank, world))
            counts.add(len(batches))
            seen += [int(x[i, 0]) // 8 for (x, _), valid in batches for i in range(len(valid)) if valid[i]]
            assert all(len(valid) == len(x) and (valid.all() or len(valid) == 1) for (x, _), valid in batches)
        assert len(counts) == 1  # every rank runs the same number of forwards
        assert len(seen) == len(set(seen)) == (n_samples or 40)
        want = want or sorted(seen)
        assert sorted(seen) == want


def test_eval_loss_is_the_same_when_the_last_batch_is_padded():
    """24 eval samples in batches of 8 (no padding) and of 5 (the last batch holds 4 samples and 1 pad): the same
    eval loss. (A mean of per-sample losses that counted pads as zero-loss samples gave 24/25 of it here.)"""
    import contextlib

    import numpy as np

    from hydratrain.data.streams import EvalBatches, TokenDataset
    from hydratrain.losses import NextTokenLoss
    from hydratrain.models.gpt import GPT, GPTConfig
    from hydratrain.train.evaluate import Evaluator

    torch.manual_seed(0)
    model = GPT(GPTConfig(d_model=32, n_layer=1, n_head=2, max_seq_len=16))
    ds = TokenDataset(np.random.default_rng(0).integers(0, 256, 40 * 16 + 1), 16)
    losses = [Evaluator(EvalBatches(ds, 24, batch, 0, 1), torch.device("cpu"), NextTokenLoss()).evaluate(
        model, contextlib.nullcontext())["loss"] for batch in (8, 5)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)


# ------------------------------------------------------------------------------- resume rules, save guard
def test_resume_keeps_moments_and_steps_but_takes_the_configured_lr(compose, tmp_path):
    job = _job(compose, tmp_path / "a", "optim.lr=1e-3", "scheduler=constant", "scheduler.warmup_steps=4")
    batches = iter(job.trainer.train_batches)
    for _ in range(2):
        job.trainer.train_step(batches)
    saved = job.checkpoints.save(2)
    moments = {k: v.clone() for k, v in job.trainer.optimizer.state_dict()["state"][0].items()}

    job2 = _job(compose, tmp_path / "b", "optim.lr=5e-3", "scheduler=constant", "scheduler.warmup_steps=4",
                "optim.weight_decay=0.05")
    job2.checkpoints.load(saved)
    groups = job2.trainer.optimizer.param_groups
    assert groups[0]["lr"] == pytest.approx(5e-3 * 3 / 4)  # step 3's lr of the new schedule
    assert groups[0]["weight_decay"] == 0.05 and job2.trainer.progress.step == 2
    state = job2.trainer.optimizer.state_dict()["state"][0]
    assert all(torch.equal(state[k], v) for k, v in moments.items())


@pytest.mark.parametrize("saved,resumed", [("foreach", "fused"), ("fused", "for_loop")])
def test_resume_runs_the_configured_optimizer_implementation(compose, tmp_path, saved, resumed):
    """optim.impl is this run's choice, not the checkpoint writer's: torch's load_state_dict would bring back the
    saved foreach/fused flags (and a fused run would then step with another kernel than it was configured with, one
    that cannot drop a non-finite update on the device). The moments and step counts still come from the checkpoint,
    and the next update is the one an uninterrupted run makes (up to the kernels' rounding)."""
    job = _job(compose, tmp_path / "a", f"optim.impl={saved}")
    batches = iter(job.trainer.train_batches)
    for _ in range(2):
        job.trainer.train_step(batches)
    saved_dir = job.checkpoints.save(2)
    job.trainer.train_step(batches)
    uninterrupted = {k: v.clone() for k, v in job.model.state_dict().items()}

    job2 = _job(compose, tmp_path / "b", f"optim.impl={resumed}")
    job2.checkpoints.load(saved_dir)
    flags = {"for_loop": (False, False), "foreach": (True, False), "fused": (None, True)}[resumed]
    assert all((bool(g["foreach"]), bool(g["fused"])) == tuple(map(bool, flags))
               for g in job2.trainer.optimizer.param_groups)
    assert all(float(s["step"]) == 2 for s in job2.trainer.optimizer.state.values())
    batches2 = iter(job2.trainer.train_batches)
    job2.trainer.train_step(batches2)
    assert job2.trainer._guard_on_device == (resumed == "fused")
    for k, v in job2.model.state_dict().items():
        torch.testing.assert_close(v, uninterrupted[k], rtol=1e-5, atol=1e-6)


def test_a_state_with_a_nan_is_never_saved_and_evicts_nothing(compose, tmp_path):
    from hydratrain.checkpoint.manager import list_checkpoints

    job = _job(compose, tmp_path, "checkpoint.keep_last=1")
    job.checkpoints.save(1)
    with torch.no_grad():
        next(job.model.parameters()).view(-1)[0] = float("nan")
    with pytest.raises(DivergenceError, match="not saving step 2: the state holds non-finite values") as err:
        job.checkpoints.save(2)
    assert err.value.last_checkpoint.endswith("step_00000001")
    assert [p.name for _, p in list_checkpoints(tmp_path / "checkpoints")] == ["step_00000001"]
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_checkpoint_errors_are_one_line():
    from hydratrain.errors import root_cause

    class CheckpointException(BaseException):
        failures = {0: (ValueError("size mismatch for tok_emb"), ["<FrameSummary file x.py, line 3>"])}

    cause = root_cause(CheckpointException())
    assert isinstance(cause, ValueError) and str(cause) == "size mismatch for tok_emb"


def test_loading_another_model_size_names_the_keys(compose, tmp_path):
    job = _job(compose, tmp_path / "a", "model.d_model=64")
    saved = job.checkpoints.save(1)
    other = _job(compose, tmp_path / "b", "model.d_model=32")
    with pytest.raises(CheckpointError) as err:
        other.checkpoints.load(saved)
    message = str(err.value)
    assert "\n" not in message and "model.tok_emb.weight has shape (256, 64) in the checkpoint" in message
    assert "model.d_model: 64 -> 32" in message


# -------------------------------------------------------------------------------------- what is logged
def test_paused_time_stays_out_of_tokens_per_second(tmp_path):
    from hydratrain.train.step_logger import StepLogger

    logger = StepLogger(tmp_path, torch.device("cpu"), tokens_per_step=1000, flops_per_token=1.0,
                        peak_flops_total=1e9, log_every=1, max_steps=10, is_main=True, tensorboard=False,
                        progress_bar=False)
    logger.start(0)
    time.sleep(0.05)
    logger.step_done(1, torch.tensor(1.0))
    with logger.paused():
        time.sleep(0.5)  # eval or a checkpoint save
    logger.log(1, torch.tensor(0.5), 1e-3, timed=True)
    tps, _, _ = logger.rates[-1]
    assert 1000 / 0.5 < tps < 1000 / 0.045  # ~20k tokens/s: the 0.5 s pause is not counted


# ------------------------------------------------------------------------------ CUDA paths checked on a CPU
def test_backend_gets_gloo_for_cpu_tensors_when_fsdp_offloads_on_cuda():
    from hydratrain.dist.process_group import backend_for

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert backend_for(cuda, None, cpu_offload=False) == "nccl"
    assert backend_for(cuda, None, cpu_offload=True) == "cuda:nccl,cpu:gloo"
    assert backend_for(cuda, "nccl", cpu_offload=True) == "cuda:nccl,cpu:gloo"
    assert backend_for(cpu, None, cpu_offload=True) == "gloo"
    assert backend_for(cuda, "gloo", cpu_offload=False) == "gloo"


def test_device_index_also_works_when_each_task_sees_one_gpu():
    from hydratrain.dist.process_group import device_index

    assert [device_index(r, 8) for r in (0, 3, 7)] == [0, 3, 7]
    assert [device_index(r, 1) for r in (0, 3, 7)] == [0, 0, 0]  # --gpus-per-task=1
    assert device_index(5, 4) == 1
    with pytest.raises(RuntimeError):
        device_index(0, 0)


def test_auto_precision_asks_for_native_bf16_only(monkeypatch):
    from hydratrain.parallel import precision

    asked = {}
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda **kw: asked.update(kw) or False)
    assert precision.native_bf16(torch.device("cuda", 0)) is False
    assert asked == {"including_emulation": False}  # V100/T4 only emulate bf16


def test_tf32_only_for_fp32_on_cuda(compose):
    from hydratrain.parallel.precision import Precision

    cfg = compose(["precision=fp32"]).precision
    assert Precision.resolve(cfg, torch.device("cpu")).tf32 is False
    assert Precision.resolve(compose(["precision=fp32", "precision.tf32=false"]).precision, torch.device("cpu")).tf32 \
        is False


def test_buffers_follow_the_compute_device_and_ties_survive_to_empty():
    from hydratrain.models.gpt import GPT, GPTConfig
    from hydratrain.parallel.init import move_buffers, to_empty_keeping_ties

    with torch.device("meta"):
        model = GPT(GPTConfig(d_model=32, n_layer=1, n_head=2, max_seq_len=16))
    to_empty_keeping_ties(model, torch.device("cpu"))
    assert model.lm_head.weight is model.tok_emb.weight
    assert len(list(model.parameters())) == len({id(p) for p in model.parameters()})
    move_buffers(model, torch.device("meta"))  # a stand-in for the CUDA device: parameters stay where they are
    assert model.rope_cos.is_meta and not model.tok_emb.weight.is_meta


def test_grouped_query_attention_gives_the_same_result_with_kv_heads_expanded(monkeypatch):
    from hydratrain.models import gpt, gpt_layers

    torch.manual_seed(0)
    model = gpt.GPT(gpt.GPTConfig(d_model=64, n_layer=1, n_head=4, n_kv_head=2, max_seq_len=16))
    x = torch.randint(0, 256, (2, 16))
    assert not gpt.expand_kv_heads(torch.zeros(1))  # CPU: SDPA takes enable_gqa
    ref = model(x)
    monkeypatch.setattr(gpt_layers, "expand_kv_heads", lambda q: True)  # the CUDA fp32 path
    torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------- the hparams table
def test_a_swept_key_is_one_typed_column_in_the_hparams_table(compose, tmp_path):
    """Two jobs of a sweep over trainer.max_steps=null,100 and activation_checkpointing=true,false: TensorBoard gets
    a number or no cell (never the string "null" beside numbers) and bools as bools (not 1.0/0.0), and no run writes
    an experiment summary that would type every column from its own values alone; results.json keeps null."""
    from hydra.core.hydra_config import HydraConfig
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer
    from tensorboard.plugins.hparams import metadata as hp

    from hydratrain.metrics import TensorBoardLogger
    from hydratrain.train.outputs import hparams_of

    rows = {}
    for job, (steps, ac) in {"0": ("null", "true"), "1": ("100", "false")}.items():
        cfg = compose(["trainer.max_epochs=1", f"trainer.max_steps={steps}", f"activation_checkpointing={ac}"],
                      return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        try:
            rows[job] = hparams_of(cfg, 1, "fp32")
        finally:
            HydraConfig.instance().cfg = None
        tb = TensorBoardLogger(tmp_path / job / "tensorboard", enabled=True)
        tb.hparams(rows[job], {"eval_loss": 1.5}, step=3)
        tb.close()
    assert rows["0"]["trainer.max_steps"] is None and rows["1"]["trainer.max_steps"] == 100
    mux = EventMultiplexer()
    mux.AddRunsFromDirectory(str(tmp_path))
    mux.Reload()
    content = mux.PluginRunToTagToContent("hparams")
    assert sorted(run.split("/hparams/")[0] for run in content) == ["0/tensorboard", "1/tensorboard"], content
    assert not any(hp.EXPERIMENT_TAG in tags for tags in content.values())
    start = {run.split("/")[0]: hp.parse_session_start_info_plugin_data(tags[hp.SESSION_START_INFO_TAG]).hparams
             for run, tags in content.items()}
    assert "trainer.max_steps" not in start["0"] and start["1"]["trainer.max_steps"].number_value == 100
    assert start["0"]["activation_checkpointing"].WhichOneof("kind") == "bool_value"
    assert [start[j]["activation_checkpointing"].bool_value for j in "01"] == [True, False]
    assert start["0"]["optim.lr"].WhichOneof("kind") == "number_value"
    assert start["0"]["strategy.name"].WhichOneof("kind") == "string_value"


# ---------------------------------------------------------------------------------------------- the run length
@pytest.mark.parametrize("overrides, expected", [
    (["trainer.max_epochs=1", "trainer.grad_accum_steps=2", "scheduler.warmup_steps=2"],
     ["trainer.max_steps=10 ends the run before trainer.max_epochs=1 would (at 3710 optimizer steps): it stops "
      "after 0.0027 epochs"]),
    (["scheduler.warmup_steps=10"],
     ["scheduler.warmup_steps=10 is not shorter than the 10 optimizer steps this run takes (trainer.max_steps / "
      "max_epochs): the lr reaches optim.lr only at the last step, and warmup_cosine never decays"]),
    (["scheduler=constant", "scheduler.warmup_steps=40"],
     ["scheduler.warmup_steps=40 is not shorter than the 10 optimizer steps this run takes (trainer.max_steps / "
      "max_epochs): the lr never reaches optim.lr (it ends at 25% of it)"]),
    (["scheduler.warmup_steps=9"], []),
    # the last micro-batch of the epoch is not dropped without a word
    (["data=synthetic", "data.synthetic_tokens=3000", "trainer.max_steps=null", "trainer.max_epochs=1",
      "trainer.grad_accum_steps=2", "scheduler.warmup_steps=1"],
     ["trainer.max_epochs=1 leaves the run's last 1 micro-batch(es) per rank (4 samples each rank) untrained: its 11 "
      "micro-batches per rank fill 5 optimizer steps of trainer.grad_accum_steps=2; a grad_accum_steps that divides "
      "11 trains them all"]),
    (["data=synthetic", "data.synthetic_tokens=3000", "trainer.max_steps=null", "trainer.max_epochs=2",
      "trainer.grad_accum_steps=2", "scheduler.warmup_steps=1"], []),  # 22 micro-batches: steps straddle epochs
])
def test_a_run_length_the_keys_do_not_suggest_is_one_warning_line(make_job, tmp_path, caplog, overrides, expected):
    """max_steps cutting max_epochs short, and a warm-up as long as the run or longer, each say so once at start,
    naming both keys' numbers; a run whose keys agree says nothing."""
    import logging

    with caplog.at_level(logging.WARNING, "hydratrain.optim"):
        make_job(tmp_path, *overrides)
    lines = [r.getMessage() for r in caplog.records if r.name == "hydratrain.optim"]
    assert len(lines) == len(expected) and all(line.startswith(e) for line, e in zip(lines, expected)), lines


@pytest.mark.parametrize("save_last", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_run_whose_last_steps_are_in_no_checkpoint_says_so(make_job, tmp_path, caplog, save_last):
    """checkpoints every 4 of 10 steps, checkpoint.save_last=false: steps 9-10 are in no checkpoint, so extending
    the run trains them again; the end of the run says which checkpoint a relaunch resumes from (a new user missed
    it); with save_last=true there is nothing to say."""
    import logging

    job = make_job(tmp_path, "checkpoint.every_n_steps=4", f"checkpoint.save_last={str(save_last).lower()}")
    with caplog.at_level(logging.INFO, "hydratrain.trainer"):
        job.trainer.fit()
    said = [r.getMessage() for r in caplog.records if "are in no checkpoint" in r.getMessage()]
    assert [s.partition(": python ")[0] for s in said] == ([] if save_last else [
        f"steps after {tmp_path / 'checkpoints' / 'step_00000008'} are in no checkpoint (checkpoint.save_last=false): "
        "a relaunch with a larger trainer.max_steps resumes from it and trains them again"]), said
    assert all(s.endswith(f" hydra.run.dir={tmp_path} trainer.max_steps=<more>") for s in said), said


def bags(batch):
    """PyTorch's text-classification collate: (tokens, label) samples -> one flat ``input`` and ``offsets``."""
    lengths = torch.tensor([0] + [len(t) for t, _ in batch[:-1]])
    return {"input": torch.cat([t for t, _ in batch]), "offsets": lengths.cumsum(0),
            "labels": torch.tensor([c for _, c in batch])}


def test_a_flat_batch_layout_gets_the_same_eval_at_any_batch_size():
    """``nn.EmbeddingBag``'s layout (one flat ``input`` of every sample's tokens, ``offsets`` where each starts): no
    row of ``input`` is a sample, so a padding sample in the last batch could not be dropped again and its tokens
    joined the last real bag (eval/loss moved with the batch size). The last batch holds only real samples."""
    import contextlib

    from omegaconf import OmegaConf
    from torch import nn

    from hydratrain.data.loader import loader_fetch
    from hydratrain.data.streams import EvalBatches
    from hydratrain.train.evaluate import Evaluator

    g = torch.Generator().manual_seed(0)
    samples = [(torch.randint(0, 20, (int(n),), generator=g), int(c))
               for n, c in zip(torch.randint(1, 6, (10,), generator=g), torch.randint(0, 3, (10,), generator=g))]

    class Bag(nn.Module):
        def __init__(self):
            super().__init__()
            self.bag, self.head = nn.EmbeddingBag(20, 8), nn.Linear(8, 3)

        def forward(self, input, offsets, labels=None):
            return self.head(self.bag(input, offsets))

    model = Bag()
    with torch.no_grad():
        hand = nn.functional.cross_entropy(model(**bags(samples)), bags(samples)["labels"]).item()
    node = OmegaConf.create({"_target_": "x", "collate_fn": {"_target_": f"{__name__}.bags"}})
    for batch in (3, 4, 16):
        evals = EvalBatches(samples, 10, batch, 0, 1, fetch=loader_fetch(samples, node, torch.device("cpu")))
        out = Evaluator(evals, torch.device("cpu"), nn.CrossEntropyLoss()).evaluate(model, contextlib.nullcontext())
        assert out["loss"] == pytest.approx(hand, rel=1e-6), batch


def test_parameter_counts_read_as_model_sizes_with_the_trainable_part_when_some_are_frozen():
    """The start-up line said '0.00M parameters' for a 17,000-parameter model and nothing of a frozen block."""
    from torch import nn

    from hydratrain.parallel.build import ParamCount, count_text

    assert [count_text(n) for n in (950, 17_213, 124_439_808, 1_199_999_999, 1_234_567_890, 999_999)] == [
        "950", "17.2K", "124M", "1.2B", "1.23B", "1M"]
    model = nn.Sequential(nn.Linear(100, 100), nn.Linear(100, 10))
    assert str(ParamCount.of(model)) == "11.1K parameters"
    model[0].requires_grad_(False)
    assert str(ParamCount.of(model)) == "11.1K parameters (1.01K trainable)"
