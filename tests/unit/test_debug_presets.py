"""The debug presets and what a run of another model is told about: ``+debug=fast`` shortens the run and the data of
any model (one's own, an experiment's CNN) and leaves the model as it is; ``+debug=fast_gpt`` is that run of the
built-in GPT with small sizes; ``--cfg job`` marks a key the run will not use (``trainer.sample_tokens`` for data
that is not token data). All in this process (``compose``, ``cli``)."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from helpers import requires, results
from hydratrain.config.validate import validate

# what +debug=fast sets, whatever the model (conf/debug/fast.yaml)
FAST_TRAINER = {"max_steps": 10, "eval_every_n_steps": 5, "eval_samples": 16, "log_every_n_steps": 1,
                "sample_tokens": 0, "save_weights": False, "progress_bar": False}
UNUSED_SAMPLE = ("# not used by this run: trainer.sample_tokens (a sample of generated tokens: token data with "
                 "loss=next_token only)")


@pytest.mark.parametrize("experiment", [
    pytest.param("spirals", id="own_model"),  # examples/own_model: mypkg.nets.ResMLP on its spirals
    pytest.param("digits_cnn", id="digits_cnn", marks=requires("examples")),
])
def test_fast_shortens_the_run_and_data_of_any_model_and_keeps_the_model(compose, own, experiment):
    """``+debug=fast`` after an experiment of another model composes and validates, and differs from the
    experiment only in the run's length and the batch size: it sets no model key (the GPT's ``model.d_model`` is no
    keyword of ``mypkg.nets.ResMLP``)."""
    search = [f"hydra.searchpath=[file://{own / 'my_conf'}]"]  # the example's option files (--config-dir)
    plain = compose([*search, f"+experiment={experiment}"])
    cfg = compose([*search, f"+experiment={experiment}", "+debug=fast"])
    validate(cfg)
    assert cfg.model == plain.model and cfg.loss == plain.loss and cfg.metrics == plain.metrics
    assert cfg.data.batch_size == 4 and cfg.data.batch_size != plain.data.batch_size
    assert {k: v for k, v in cfg.data.items() if k != "batch_size"} == \
        {k: v for k, v in plain.data.items() if k != "batch_size"}
    assert {k: cfg.trainer[k] for k in FAST_TRAINER} == FAST_TRAINER


def test_fast_runs_ones_own_model_for_its_10_steps(cli, own):
    r = cli(["--config-dir", "my_conf", "+experiment=spirals", "+debug=fast", "strategy=single", "device=cpu",
             "precision=fp32", "logger.peak_flops=1e11"], own / "run", fast=False)
    assert r.returncode == 0, r.output[-3000:]
    res = results(own / "run")
    assert res["steps"] == 10 and res["hparams"]["data.batch_size"] == 4
    assert (res["hparams"]["model.width"], res["hparams"]["model.depth"]) == (64, 4)  # the experiment's sizes
    assert "eval at step 5:" in r.output and "eval at step 10:" in r.output
    assert not (own / "run" / "model.safetensors").exists()  # trainer.save_weights=false


def test_fast_gpt_is_fast_on_a_small_gpt_and_synthetic_data(compose):
    default, fast, gpt = compose([]), compose(["+debug=fast"]), compose(["+debug=fast_gpt"])
    assert fast.model == default.model and fast.data.name == default.data.name == "python_stdlib"
    assert gpt.trainer == fast.trainer and gpt.data.batch_size == fast.data.batch_size == 4
    assert (gpt.model.d_model, gpt.model.n_layer, gpt.model.n_head, gpt.data.seq_len) == (64, 2, 2, 64)
    assert gpt.data.name == "synthetic"


@pytest.mark.parametrize("args,marked", [
    pytest.param(["+experiment=digits_cnn"], True, id="cnn", marks=requires("examples")),
    pytest.param(["+experiment=digits_cnn", "trainer.sample_tokens=0"], False, id="cnn_no_sample",
                 marks=requires("examples")),
    pytest.param(["data=synthetic", "loss=cross_entropy"], True, id="tokens_without_next_token_loss"),
    pytest.param([], False, id="gpt"),
])
def test_cfg_job_marks_sample_tokens_not_used_without_a_language_model(cli, args, marked):
    """``--cfg job`` prints the config as composed (``trainer.sample_tokens: 120`` stays), then, once its checks
    pass, a YAML comment for the key that the run ignores: only a language model on token data samples."""
    r = cli(["--cfg", "job", "strategy=single", "device=cpu", *args], fast=False)
    assert r.returncode == 0, r.output[-3000:]
    printed = OmegaConf.create(r.out)  # the comment keeps it YAML
    assert printed.trainer.sample_tokens == (0 if "trainer.sample_tokens=0" in args else 120)
    assert (UNUSED_SAMPLE in r.out.splitlines()) == marked, r.out[-500:]
