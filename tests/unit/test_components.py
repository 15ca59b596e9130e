"""The researcher's own components through the config, in this process: a model, datasets, loss and metric defined
outside the package (examples/own_model, copied into a temp launch dir) train, export, sweep and initialise after a
meta build; each bad component is one config-error line naming its key. (The 2-rank runs: tests/e2e/test_own_model.)
"""
from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from helpers import requires, results, tb_all

# a run of seconds on the example: fp32 on the CPU, 12 steps, eval at 6 and 12, no progress bar
QUICK = ["--config-dir", "my_conf", "+experiment=spirals", "device=cpu", "precision=fp32", "logger.peak_flops=1e11",
         "trainer.max_steps=12", "trainer.eval_every_n_steps=6", "trainer.log_every_n_steps=6",
         "trainer.progress_bar=false", "data.n=600"]


def test_a_model_data_loss_and_metric_of_ones_own_train_export_and_report(cli, own):
    r = cli([*QUICK, "strategy=single"], own / "run", fast=False)
    assert r.returncode == 0, r.output[-3000:]
    res = results(own / "run")
    assert res["eval_metrics"]["accuracy"] > 0.5 and res["train_loss"] < res["first_loss"]
    assert res["objective"] == res["eval_metrics"]["accuracy"]  # trainer.objective=eval/accuracy (the experiment)
    assert res["hparams"]["model"] == "res_mlp" and res["hparams"]["model.width"] == 64
    assert res["hparams"]["loss"] == "cross_entropy" and res["samples_per_sec"] > 0 and res["tokens_per_sec"] is None
    assert "data.seq_len" not in res["hparams"] and res["hparams"]["data.batch_size"] > 0  # (a dataset has no seq_len)
    scalars = tb_all(own / "run")
    assert {"eval/accuracy", "eval/loss", "perf/samples_per_sec", "perf/mfu", "train/loss"} <= set(scalars)
    assert "eval/perplexity" not in scalars and "sampling" not in r.output  # not a language model
    assert "model res_mlp: 133K parameters," in r.output
    from mypkg.nets import ResMLP
    from safetensors.torch import load_file

    model = ResMLP(width=64, depth=4, num_classes=3)
    model.load_state_dict(load_file(own / "run" / "model.safetensors"), strict=True)  # the class's own names
    from safetensors import safe_open

    with safe_open(str(own / "run" / "model.safetensors"), "pt") as f:
        record = json.loads(f.metadata()["model_config"])  # what rebuilds it: hydra.utils.instantiate(record)
    assert record == {"_target_": "mypkg.nets.ResMLP", "width": 64, "depth": 4, "num_classes": 3}


def test_a_sweep_over_two_models_reports_each_row_with_the_metric(cli, own):
    r = cli(["-m", *QUICK, "strategy=single", "model.width=32,48", f"hydra.sweep.dir={own / 'sweep'}"], fast=False)
    assert r.returncode == 0, r.output[-3000:]
    report = (own / "sweep" / "sweep_report.csv").read_text().splitlines()
    assert report[0].split(",")[:6] == ["job", "overrides", "status", "steps", "train_loss", "eval_loss"]
    assert {"eval/accuracy", "samples_per_sec"} <= set(report[0].split(",")) and len(report) == 3
    assert "tokens_per_sec" not in report[0].split(",")  # (no column that every row leaves empty)
    assert all("COMPLETED" in row for row in report[1:])


def test_a_meta_build_initialises_through_reset_parameters(cli, own):
    r = cli([*QUICK, "strategy=single", "+model.init_device=meta", "trainer.max_steps=2"], own / "meta", fast=False)
    assert r.returncode == 0, r.output[-3000:]
    assert "initialised by the reset_parameters() of 14 modules" in r.output
    from safetensors.torch import load_file

    weights = load_file(own / "meta" / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert 0.05 < weights["blocks.0.fc1.weight"].std() < 0.2  # Linear's kaiming-uniform init, not garbage or zeros
    assert torch.allclose(weights["blocks.0.norm.weight"], torch.ones(64), atol=0.01)  # LayerNorm's reset, 2 steps on


def test_a_module_that_nothing_can_initialise_after_a_meta_build_is_named(cli, own):
    (own / "mypkg" / "odd.py").write_text(
        "import torch\nfrom torch import nn\n\n"
        "class Scale(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.gain = nn.Parameter(torch.ones(3))\n\n    def forward(self, x):\n        return x * self.gain\n\n"
        "class Odd(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.fc = nn.Linear(2, 3)\n        self.scale = Scale()\n\n"
        "    def forward(self, x):\n        return self.scale(self.fc(x))\n")
    r = cli([*QUICK, "strategy=single", "model._target_=mypkg.odd.Odd", "~model.width", "~model.depth",
             "~model.num_classes", "+model.init_device=meta"], own / "odd", fast=False)
    assert r.returncode == 2, r.output[-3000:]
    assert r.err.strip().splitlines() == [
        "hydratrain: config error: model.init_device='meta': built on meta, the model must be initialised after "
        "sharding, but scale (Scale) own parameters or buffers without a reset_parameters() (and the model has no "
        "init_weights()): give them one, or build it with storage: ++model.init_device=cpu (or cuda)"]
    r = cli([*QUICK, "strategy=single", "model._target_=mypkg.odd.Odd", "~model.width", "~model.depth",
             "~model.num_classes", "trainer.max_steps=2"], own / "odd_eager", fast=False)
    assert r.returncode == 0, r.output[-3000:]  # built eagerly (the default for it), its constructor's values train


ROPE = """
import torch
from torch import nn

from mypkg.nets import ResMLP


class RopeMLP(ResMLP):
    def __init__(self, recompute: bool = False):
        super().__init__()
        self.recompute = recompute
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self):
        return 1.0 / 10000 ** (torch.arange(0, 8, 2, device=self.head.weight.device) / 8)

    def init_weights(self):
        for m in self.modules():
            if m is not self and callable(getattr(m, "reset_parameters", None)):
                m.reset_parameters()
        if self.recompute:
            self.inv_freq.copy_(self._inv_freq())

    def forward(self, x):
        return super().forward(x) * self.inv_freq[0]
"""


def test_a_buffer_the_init_leaves_unset_after_a_meta_build_is_named(cli, own):
    """A meta build loses what the constructor computed into buffers (a rotary table): an init_weights() that does
    not compute them again is refused in one line, and one that does trains."""
    (own / "mypkg" / "rope.py").write_text(ROPE)
    common = [*QUICK, "strategy=single", "model._target_=mypkg.rope.RopeMLP", "~model.width", "~model.depth",
              "~model.num_classes", "+model.init_device=meta", "trainer.max_steps=2"]
    r = cli(common, own / "lost", fast=False)
    assert r.returncode == 2, r.output[-3000:]
    assert r.err.strip().splitlines() == [
        "hydratrain: config error: model.init_device='meta': built on meta, the model's buffers are only as its init "
        "makes them, and init_weights() left inv_freq unset (a constructor's values are lost on meta): compute them "
        "there too, or build it with storage: ++model.init_device=cpu (or cuda)"]
    r = cli([*common, "+model.recompute=true"], own / "kept", fast=False)
    assert r.returncode == 0, r.output[-3000:]
    assert results(own / "kept")["train_loss"] < 5


@pytest.mark.parametrize("args,line", [
    (["model._target_=mypkg.nope.Net"], "model._target_='mypkg.nope.Net': cannot be imported (ModuleNotFoundError: "
                                        "No module named 'mypkg.nope'); is its package in the launch dir or on "
                                        "PYTHONPATH?"),
    (["+model.widht=3"], "model.widht=3: not a keyword of mypkg.nets.ResMLP; allowed: in_features, width, depth, "
                         "num_classes"),
    (["model.width=wide"], "model.width='wide': must be int (as mypkg.nets.ResMLP annotates it)"),
    (["~metrics.accuracy.num_classes"], "metrics.accuracy._target_='torchmetrics.classification.MulticlassAccuracy'"
                                        ": building it raised ValueError: Argument `num_classes` can only be `None` "
                                        "for `average='micro'`"),
    (["+model.in_features=3"], "model._target_='mypkg.nets.ResMLP': its forward refused the first batch (inputs "
                               "(64, 2) float32): RuntimeError: mat1 and mat2 shapes cannot be multiplied"),
    (["loss=mse"], "loss._target_='torch.nn.MSELoss': refused the model's outputs (64, 3) float32 against targets "
                   "(64,) int64: UserWarning: Using a target size (torch.Size([64])) that is different to the input "
                   "size (torch.Size([64, 3]))"),  # (torch warns, then broadcasts: (64, 1) outputs would train)
    (["data._target_=mypkg.data.nothing"], "data._target_='mypkg.data.nothing': cannot be imported"),
    (["metrics.accuracy.num_classes=2"], "metrics.accuracy._target_='torchmetrics.classification.accuracy."
                                         "MulticlassAccuracy': refused the model's outputs (64, 3) float32 against "
                                         "targets (64,) int64"),
    (["+metrics.accuracy.average=null"], "metrics.accuracy._target_='torchmetrics.classification.accuracy."
                                        "MulticlassAccuracy': its compute() returns a tensor of shape (3,), and each "
                                        "metric is logged as one number"),
    (["trainer.objective=eval/perplexity"], "trainer.objective='eval/perplexity': names no metric the evaluation logs; "
                                            "allowed: eval/loss, eval/accuracy "
                                            "(perplexity is logged with a loss that reports it: loss=next_token)"),
    (["+data.shuffle=true"], "data.shuffle=True: not a keyword of mypkg.data.spirals; allowed: n, classes, noise, "
                             "seed"),
    (["loss._target_=torch.atleast_1d"], "loss._target_='torch.atleast_1d': returned ((64, 3) float32, (64,) int64), "
                                         "not a 0-d tensor: return the mean alone (log other terms as metrics)"),
    (["+loss.reduction=sum"], "loss.reduction='sum': allowed: mean (batchmean for KLDivLoss)"),
    (["loss._target_=torch.nn.AdaptiveLogSoftmaxWithLoss", "+loss.in_features=3", "+loss.n_classes=3",
      "+loss.cutoffs=[1]"], "loss._target_='torch.nn.AdaptiveLogSoftmaxWithLoss': has trainable parameters "
                            "(head.weight, tail.0.0.weight, tail.0.1.weight) that nothing would train"),
])
def test_each_bad_component_is_one_line_naming_its_key(cli, own, args, line):
    r = cli([*QUICK, "strategy=single", *args], own / "bad", fast=False)
    assert r.returncode == 2, r.output[-3000:]
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"hydratrain: config error: {line}"), r.err[-2000:]
    assert "step 2/" not in r.output and "eval at step" not in r.output  # refused at the first step at the latest
    assert "Error getting object" not in r.output  # (Hydra's own 3-line log of a failed import)


def test_a_components_own_error_is_kept_over_the_error_it_chains(own, monkeypatch):
    """A target that turns a missing module into its own advice (``raise ImportError("... pip install ...") from
    err``), when called or when its module is imported, is quoted with that advice, not with the bare "No module
    named" it chains; a target that is not there is still named with the missing module."""
    from hydratrain.components import instantiate_node, locate
    from hydratrain.errors import ConfigError

    advice = ("    try:\n        import not_installed_xyz  # noqa: F401\n    except ImportError as err:\n"
              "        raise ImportError(\"needs xyz: pip install -e '.[xyz]'\") from err\n")
    (own / "mypkg" / "needs.py").write_text("def needs_extra():\n" + advice)
    (own / "mypkg" / "needs_at_import.py").write_text("if True:\n" + advice + "\n\ndef net():\n    pass\n")
    monkeypatch.syspath_prepend(str(own))
    with pytest.raises(ConfigError) as err:
        instantiate_node({"_target_": "mypkg.needs.needs_extra"}, "data._target_", "mypkg.needs.needs_extra", "raised")
    assert str(err.value) == ("data._target_='mypkg.needs.needs_extra': raised ImportError: needs xyz: "
                              "pip install -e '.[xyz]'")
    with pytest.raises(ConfigError) as err:
        locate("mypkg.needs_at_import.net", "model")
    assert str(err.value).startswith("model._target_='mypkg.needs_at_import.net': cannot be imported (ImportError: "
                                     "needs xyz: pip install -e '.[xyz]'); ")
    for target, missing in [("mypkg.absent.net", "ModuleNotFoundError: No module named 'mypkg.absent'"),
                            ("mypkg.needs.absent", "AttributeError: module 'mypkg.needs' has no attribute 'absent'")]:
        with pytest.raises(ConfigError, match=rf"^model._target_='{target}': cannot be imported \({missing}\); "):
            locate(target, "model")

def test_a_parameter_that_the_forward_creates_is_refused_at_the_first_step(cli, own):
    """A layer built on the forward's first call (old TensorFlow-port style) came after the optimizer took the
    parameters: it trained never, under ddp was never synced, and under fsdp broke the clipping with a traceback."""
    (own / "mypkg" / "lazy.py").write_text(
        "import torch\nfrom torch import nn\n\n\nclass LazyByHand(nn.Module):\n"
        "    def __init__(self, width: int = 8):\n        super().__init__()\n"
        "        self.width, self.fc, self.head = width, None, nn.Linear(width, 3)\n\n"
        "    def forward(self, x):\n        if self.fc is None:\n"
        "            self.fc = nn.Linear(x.shape[-1], self.width)\n        return self.head(torch.relu(self.fc(x)))\n")
    r = cli([*QUICK, "strategy=single", "model._target_=mypkg.lazy.LazyByHand", "~model.depth", "~model.num_classes",
             "model.width=8"], own / "lazy", fast=False)
    assert r.returncode == 2 and r.err.strip().splitlines() == [
        "hydratrain: config error: model._target_='mypkg.lazy.LazyByHand': its forward created parameters (fc.weight, "
        "fc.bias) on its first call, after the optimizer and the strategy took the model's parameters, so they would "
        "never train: create them in __init__ (give the input size as a keyword)"], r.output[-2000:]


def test_a_forward_that_makes_float32_tensors_is_told_to_autocast_under_fsdp_and_trains_with_it(cli, own):
    """``x.float() / 255`` of uint8 pixels in the forward: FSDP's MixedPrecisionPolicy casts the weights to bf16 and
    runs no autocast, so the default strategy=fsdp with precision=auto (bf16 where native) refused a model that
    ddp + bf16 trains. The line names precision.fsdp_autocast, and with it the model trains."""
    (own / "mypkg" / "floaty.py").write_text(
        "from mypkg.nets import ResMLP\n\n\nclass Floaty(ResMLP):\n    def forward(self, x):\n"
        "        return super().forward(x.double().float())\n")
    common = [*QUICK, "strategy=fsdp", "precision=bf16", "model._target_=mypkg.floaty.Floaty", "trainer.max_steps=2"]
    r = cli(common, own / "refused", fast=False)
    assert r.returncode == 2, r.output[-2000:]
    (line,) = r.err.strip().splitlines()
    assert line.startswith("hydratrain: config error: model._target_='mypkg.floaty.Floaty': its forward refused the "
                           "first batch (inputs (64, 2) float32): RuntimeError: ") and line.endswith(
        "; under strategy=fsdp precision=bf16 FSDP casts the weights to bfloat16 and no autocast runs, so a float32 "
        "tensor the forward makes itself (x.float()) meets bfloat16 weights: set precision.fsdp_autocast=true "
        "(autocast, as strategy=ddp runs it), or make it in the weights' dtype"), line
    assert cli([*common, "precision.fsdp_autocast=true"], own / "autocast", fast=False).returncode == 0
    r = cli([*common, "strategy=ddp", "precision.fsdp_autocast=true"], own / "ddp", fast=False)
    assert r.returncode == 2 and r.err.strip() == (
        "hydratrain: config error: precision.fsdp_autocast=True: unused with strategy=ddp, whose forward runs under "
        "autocast already; allowed with strategy=fsdp or hsdp"), r.output[-2000:]


def test_a_class_weight_of_zero_trains_as_its_targets_ignored_whatever_the_split(cli, own):
    """CrossEntropyLoss(weight=[0, 1, 2]) (a class left out, as a segmentation background): a micro-batch whose
    targets all weigh 0 gets torch's NaN gradient (0 / 0), and the run stopped as "diverged ... lower optim.lr" when
    such a micro-batch met one with real targets in a step. Such targets now count as ignored: the same loss, and
    batch 1 x 2 micro-batches trains the weights batch 2 does. The weight may be written as a YAML list."""
    from safetensors.torch import load_file

    from hydratrain.train.batch import zero_weight_ignored

    ce = torch.nn.CrossEntropyLoss(weight=torch.tensor([0.0, 1.0, 2.0]))
    logits, targets = torch.randn(4, 3), torch.tensor([0, 2, -100, 1])
    kept = zero_weight_ignored(ce, targets)
    assert kept.tolist() == [-100, 2, -100, 1] and ce(logits, kept) == ce(logits, targets)
    lone = logits[:1].clone().requires_grad_()
    (ce(lone, zero_weight_ignored(ce, targets[:1])) / math.inf).backward()
    assert lone.grad.abs().sum() == 0  # (torch's own for weight 0: NaN)
    common = [*QUICK, "strategy=single", "loss=cross_entropy", "trainer.max_steps=8", "trainer.eval_every_n_steps=0",
              "scheduler=constant", "data.n=64"]
    # the weight as a YAML list (a keyword torch annotates as a Tensor: made one) and as a torch.tensor node
    for name, split in (("accum", ["data.batch_size=1", "trainer.grad_accum_steps=2", "+loss.weight=[0.0,1.0,2.0]"]),
                        ("batch", ["data.batch_size=2", "+loss.weight={_target_:torch.tensor,data:[0.0,1.0,2.0]}"])):
        r = cli([*common, *split], own / name, fast=False)
        assert r.returncode == 0, r.output[-3000:]
    a, b = (load_file(own / name / "model.safetensors") for name in ("accum", "batch"))
    for key, value in a.items():
        torch.testing.assert_close(b[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_a_loss_of_shape_one_trains_and_a_model_with_nothing_to_train_is_one_line(cli, own):
    """A (1,) loss (a keepdim mean) passed the step-1 check and ended in a traceback at the loss sum; a model with
    every parameter frozen ended in the optimizer's "empty parameter list" traceback."""
    (own / "mypkg" / "odd.py").write_text(
        "import torch\nfrom mypkg.nets import ResMLP\n\n\nclass Frozen(ResMLP):\n"
        "    def __init__(self, **kwargs):\n        super().__init__(**kwargs)\n        self.requires_grad_(False)\n"
        "\n\ndef keepdim(outputs, targets):\n"
        "    return torch.nn.functional.cross_entropy(outputs, targets).reshape(1)\n")
    common = [*QUICK, "strategy=single", "trainer.max_steps=2"]
    r = cli([*common, "loss._target_=mypkg.odd.keepdim"], own / "keepdim", fast=False)
    assert r.returncode == 0 and results(own / "keepdim")["eval_loss"] > 0, r.output[-3000:]
    r = cli([*common, "model._target_=mypkg.odd.Frozen"], own / "frozen", fast=False)
    assert r.returncode == 2 and r.err.strip() == (
        "hydratrain: config error: model._target_='mypkg.odd.Frozen': every parameter of the model is frozen "
        "(requires_grad=False), so there is nothing to train: leave the ones to train trainable"), r.output[-3000:]


def test_an_auxiliary_loss_beside_the_logits_is_named_not_dropped_without_a_word(cli, own):
    """{"logits", "aux_loss"} (an MoE's balance term): the loss node gets the logits only, so aux_loss trained
    nothing, silently; a loss written for the dict was refused with an IndexError that did not say it got the logits."""
    (own / "mypkg" / "aux.py").write_text(
        "from mypkg.nets import ResMLP\n\n\nclass Aux(ResMLP):\n    def forward(self, x):\n"
        "        logits = super().forward(x)\n        return {'logits': logits, 'aux_loss': logits.pow(2).mean()}\n"
        "\n\ndef ce_plus_aux(outputs, targets):\n    import torch\n"
        "    return torch.nn.functional.cross_entropy(outputs['logits'], targets) + outputs['aux_loss']\n")
    common = [*QUICK, "strategy=single", "trainer.max_steps=2", "model._target_=mypkg.aux.Aux"]
    r = cli(common, own / "warned", fast=False)
    assert r.returncode == 0 and r.output.count("returns aux_loss beside its logits") == 1, r.output[-3000:]
    r = cli([*common, "loss._target_=mypkg.aux.ce_plus_aux"], own / "refused", fast=False)
    assert r.returncode == 2 and r.err.strip().endswith(
        "; it gets the output's 'logits' only, not aux_loss: to use them, compute the loss in the forward and return "
        "it as 'loss'"), r.output[-3000:]


def test_an_optimizer_of_ones_own_trains_and_resumes_exactly_and_its_keywords_are_checked(cli, own):
    """optim=sgd (examples/own_model: torch.optim.SGD with momentum, nesterov and weight decay on matrices, by
    _target_): the optimizer was a closed choice of adamw / adamw8bit. It trains under the run's schedule, its
    momentum is checkpointed (a resume from step 6 ends bit for bit where the uninterrupted run does), and a keyword
    it does not take is one line before the run."""
    from safetensors.torch import load_file

    common = [*QUICK, "strategy=single", "optim=sgd", "trainer.eval_every_n_steps=0", "checkpoint.every_n_steps=6",
              "scheduler=constant", "scheduler.warmup_steps=0"]  # (the 6-step run's schedule: the 12-step one's)
    assert cli(common, own / "whole", fast=False).returncode == 0
    assert cli([*common, "trainer.max_steps=6"], own / "half", fast=False).returncode == 0
    r = cli([*common, f"checkpoint.resume_from={own / 'half' / 'checkpoints' / 'step_00000006'}"], own / "resumed",
            fast=False)
    assert r.returncode == 0 and "torch.optim.SGD, weight decay 0.0001 on matrices" in r.output, r.output[-3000:]
    whole, resumed = (load_file(own / name / "model.safetensors") for name in ("whole", "resumed"))
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    assert results(own / "whole")["train_loss"] < results(own / "whole")["first_loss"]
    r = cli([*common, "+optim.momentun=0.5"], own / "typo", fast=False)
    assert r.returncode == 2 and r.err.strip().startswith(
        "hydratrain: config error: optim.momentun=0.5: not a keyword of torch.optim.SGD; allowed: lr, momentum, "), \
        r.output[-3000:]


def test_a_tuple_output_that_the_loss_refuses_is_one_line_with_the_fix(cli, own):
    (own / "mypkg" / "pair.py").write_text(
        "from mypkg.nets import ResMLP\n\n\nclass Pair(ResMLP):\n    def forward(self, x):\n"
        "        logits = super().forward(x)\n        return logits, logits.softmax(-1)\n")
    r = cli([*QUICK, "strategy=single", "model._target_=mypkg.pair.Pair"], own / "pair", fast=False)
    assert r.returncode == 2, r.output[-2000:]
    (line,) = r.err.strip().splitlines()
    assert line.startswith("hydratrain: config error: loss._target_='torch.nn.CrossEntropyLoss': refused the model's "
                           "outputs ((64, 3) float32, (64, 3) float32) against targets (64,) int64: TypeError: ")
    assert line.endswith("; the model returns a tuple: return a dict with its 'logits' (the loss and the metrics get "
                         "them) or give a loss that takes the tuple"), line


def test_a_model_option_that_names_no_class_is_refused(cli, own):
    """A model file holding only ``name: mlp`` used to train the built-in GPT under that name."""
    (own / "my_conf" / "model" / "mlp.yaml").write_text("name: mlp\n")
    r = cli(["--config-dir", "my_conf", "model=mlp", "strategy=single", "device=cpu"], own / "mlp", fast=False)
    assert r.returncode == 2 and r.err.strip().splitlines() == [
        "hydratrain: config error: model._target_=<absent>: the model node names no class or function to build (its "
        "keys: name); give one, e.g. _target_: mypkg.nets.MLP"], r.output[-2000:]
    assert not (own / "mlp" / "results.json").exists()


@requires("examples")
def test_the_digits_example_reaches_95_percent_accuracy(cli, tmp_path):
    """+experiment=digits_cnn: a CNN with BatchNorm on scikit-learn's digits (extra [examples])."""
    r = cli(["+experiment=digits_cnn", "strategy=single", "device=cpu", "precision=fp32", "trainer.max_steps=120",
             "trainer.eval_every_n_steps=0", "trainer.progress_bar=false", "logger.peak_flops=1e11"], tmp_path,
            fast=False)
    assert r.returncode == 0, r.output[-3000:]
    res = results(tmp_path)
    assert res["eval_metrics"]["accuracy"] >= 0.95 and res["objective"] == res["eval_metrics"]["accuracy"], res


def test_a_function_loss_and_collate_fn_are_called_with_their_keywords_bound(cli, own):
    (own / "mypkg" / "extra.py").write_text(
        "import torch\nimport torch.nn.functional as F\nfrom torch.utils.data import default_collate\n\n"
        "CALLS = []\n\n"
        "def smooth_ce(outputs, targets, smoothing=0.0):\n"
        "    CALLS.append(smoothing)\n    return F.cross_entropy(outputs, targets, label_smoothing=smoothing)\n\n"
        "def collate(samples, scale=1.0):\n    x, y = default_collate(samples)\n    return x * scale, y\n")
    r = cli([*QUICK, "strategy=single", "trainer.max_steps=2", "loss._target_=mypkg.extra.smooth_ce",
             "+loss.smoothing=0.1", "+data.collate_fn._target_=mypkg.extra.collate", "+data.collate_fn.scale=2.0"],
            own / "fn", fast=False)
    assert r.returncode == 0, r.output[-3000:]
    import mypkg.extra

    assert mypkg.extra.CALLS and set(mypkg.extra.CALLS) == {0.1}
    from hydratrain.components import build_callable
    from hydratrain.errors import ConfigError

    # a misspelt keyword is told the keywords it can set: not the outputs and targets the run passes
    for node, key, supplied, allowed in [({"smoothin": 0.1}, "loss", 2, "smoothing"),
                                         ({"scal": 2.0}, "data.collate_fn", 1, "scale")]:
        target = "mypkg.extra.smooth_ce" if key == "loss" else "mypkg.extra.collate"
        with pytest.raises(ConfigError, match=rf"not a keyword of {target}; allowed: {allowed}$"):
            build_callable({"_target_": target, **node}, key, supplied=supplied)


def test_blocks_are_never_containers_and_lists_of_lists_give_the_blocks_inside():
    """Stages held as a ModuleList of ModuleLists gave the class ModuleList as the block: FSDP refused to shard a
    container without forward (a traceback) and activation checkpointing wrapped nothing."""
    from torch import nn

    from hydratrain.errors import ConfigError
    from hydratrain.parallel.blocks import find_blocks

    class Blk(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

    model = nn.Module()
    model.stages = nn.ModuleList(nn.ModuleList(Blk() for _ in range(2)) for _ in range(3))
    blocks = find_blocks(model)
    assert blocks.describe() == "6 Blk" and all(type(b) is Blk for b in blocks.modules)
    with pytest.raises(ConfigError, match="'ModuleList' is a container without a forward of its own"):
        find_blocks(model, ["ModuleList"])


def test_block_classes_are_matched_by_the_class_a_dotted_path_imports():
    """torch.nn.Embedding was refused as matching no module: its __module__ is torch.nn.modules.sparse."""
    from torch import nn

    from hydratrain.errors import ConfigError
    from hydratrain.parallel.blocks import find_blocks

    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    for names in (["torch.nn.Embedding", "torch.nn.Linear"], ["torch.nn.modules.sparse.Embedding", "Linear"]):
        assert find_blocks(model, names).describe() == "1 Embedding + 2 Linear"
    with pytest.raises(ConfigError, match="'torch.nn.Conv2d' matches no module of the model"):
        find_blocks(model, ["torch.nn.Conv2d"])


@pytest.mark.parametrize("name,why", [
    ("mypkg.nets.Nope", "'mypkg.nets.Nope' cannot be imported (ModuleNotFoundError: No module named 'mypkg')"),
    ("torch.nn.functional.relu", "'torch.nn.functional.relu' is not an nn.Module class (it is function)"),
    ("torch.optim.AdamW", "'torch.optim.AdamW' is not an nn.Module class (it is the class AdamW)"),
])
def test_a_block_class_path_that_names_no_module_class_is_refused_before_any_process_group(compose, name, why):
    """A dotted path that does not import (a typo, a package not on the path) was matched by its spelling and
    reported as matching no module only once the model was built, after the process group had started; it is now a
    config check. A bare name still waits for the model (nothing to import)."""
    from hydratrain.config.validate import validate
    from hydratrain.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        validate(compose(["strategy=fsdp", f"wrap_policy.block_classes=[{name},Block]"]))
    assert str(err.value).startswith(f"wrap_policy.block_classes=['{name}', 'Block']: {why}"), str(err.value)
    validate(compose(["strategy=fsdp", "wrap_policy.block_classes=[torch.nn.Linear,Nope]"]))


def test_blocks_held_in_nn_sequential_are_found_as_in_a_module_list():
    """torchvision's ResNet and timm's ViT hold their blocks in ``nn.Sequential`` (stages of blocks, or one run of
    them): "found no blocks", and FSDP gathered the whole model at once. ``nn.Sequential`` itself is never the block
    class (it would match every Sequential of the model), and a Sequential of mixed layers holds no blocks."""
    from torch import nn

    from hydratrain.parallel.blocks import find_blocks

    class Basic(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.conv = nn.Conv2d(width, width, 3)

    class ResNetLike(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
            self.layer1 = nn.Sequential(Basic(4), Basic(4))
            self.layer2 = nn.Sequential(Basic(8), Basic(8))
            self.head = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))

    found = find_blocks(ResNetLike())
    assert (found.describe(), found.source) == ("4 Basic", "the largest Sequential"), found
    stages = nn.Sequential(nn.Sequential(Basic(4), Basic(4)), nn.Sequential(Basic(8)))  # stages of blocks
    assert find_blocks(stages).describe() == "3 Basic"
    assert find_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))).describe() == "no blocks"

    class Block(nn.Sequential):  # a block class of the model's own, built as a Sequential (docs/recipe-cnn.md)
        def __init__(self, width):
            super().__init__(nn.Conv2d(width, width, 3), nn.BatchNorm2d(width), nn.ReLU())

    found = find_blocks(nn.Sequential(nn.Sequential(Block(4), Block(4), Block(4)), nn.Linear(4, 2)))
    assert (found.describe(), [type(m) for m in found.modules]) == ("3 Block", [Block] * 3), found


def test_parametrizations_and_lists_of_parameterless_modules_are_not_blocks():
    """weight_norm's ParametrizationList was taken as the largest nn.ModuleList: "blocks: 2 _WeightNorm", modules that
    own no parameters, became FSDP units that shard nothing and checkpointed the g * v / |v| computation."""
    from torch import nn
    from torch.nn.utils import parametrizations

    from hydratrain.parallel.blocks import find_blocks

    model = nn.Sequential(parametrizations.weight_norm(nn.Linear(4, 8)), nn.ReLU(),
                          parametrizations.spectral_norm(nn.Linear(8, 8)))
    model.acts = nn.ModuleList(nn.ReLU() for _ in range(3))
    assert find_blocks(model).describe() == "no blocks"


def test_an_output_fsdp_cannot_walk_is_one_line_at_the_first_step(cli, own):
    """A forward returning a plain object with .logits (a SimpleNamespace) left FSDP's backward on freed parameters:
    an opaque storage error. Under FSDP it is refused in one line; single and DDP train with it."""
    (own / "mypkg" / "odd_out.py").write_text(
        "import types\nfrom mypkg.nets import ResMLP\n\n"
        "class Wrapped(ResMLP):\n    def forward(self, x):\n"
        "        return types.SimpleNamespace(logits=super().forward(x))\n")
    args = [*QUICK, "model._target_=mypkg.odd_out.Wrapped", "trainer.max_steps=2"]
    r = cli([*args, "strategy=fsdp", "wrap_policy=none"], own / "fsdp", fast=False)
    assert r.returncode == 2 and r.err.strip().splitlines() == [
        "hydratrain: config error: model._target_='mypkg.odd_out.Wrapped': its forward returns a SimpleNamespace, "
        "whose tensors FSDP cannot see (it walks tensors, lists, tuples, dicts and dataclasses): return one of those "
        "(a dict {'logits': ...} or a dataclass), or use strategy=ddp"], r.output[-3000:]
    assert cli([*args, "strategy=single"], own / "single", fast=False).returncode == 0


def test_activation_checkpointing_leaves_batchnorm_statistics_as_one_step_makes_them():
    """The recomputation of a checkpointed block in backward runs its forward in train mode again: BatchNorm's
    running statistics were updated twice per step (num_batches_tracked 2 after one step), so eval and the exported
    model depended on whether activation checkpointing was on."""
    from hydratrain.examples.digits import DigitsCNN
    from hydratrain.parallel.ac_compile import apply_activation_checkpointing

    torch.manual_seed(0)
    plain = DigitsCNN(channels=8, depth=2)
    checkpointed = DigitsCNN(channels=8, depth=2)
    checkpointed.load_state_dict(plain.state_dict())
    assert apply_activation_checkpointing(checkpointed) == 2
    x, y = torch.rand(16, 1, 8, 8), torch.randint(0, 10, (16,))
    for model in (plain, checkpointed):
        torch.nn.functional.cross_entropy(model(x), y).backward()
    a, b = plain.state_dict(), checkpointed.state_dict()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert int(a["blocks.0.norm.num_batches_tracked"]) == 1


def test_a_loss_without_a_graph_and_a_parameter_ddp_never_sees_are_one_line_at_the_first_step(cli, own):
    """A loss computed on detached outputs was autograd's traceback on every rank; a parameter the forward never uses
    stalled DDP at step 2 with torch's traceback naming its constructor argument, not hydratrain's key."""
    (own / "mypkg" / "quirks.py").write_text(
        "import torch.nn.functional as F\nfrom torch import nn\nfrom mypkg.nets import ResMLP\n\n"
        "def detached_ce(outputs, targets):\n    return F.cross_entropy(outputs.detach(), targets)\n\n"
        "class WithAux(ResMLP):\n    def __init__(self, **kw):\n        super().__init__(**kw)\n"
        "        self.aux = nn.Linear(3, 3)  # used only sometimes, in a researcher's model\n\n"
        "class SometimesAux(WithAux):\n    calls = 0\n\n    def forward(self, x):\n"
        "        self.calls += 1\n        out = super().forward(x)\n"
        "        return out + self.aux(out) if self.calls % 3 else out\n\n"
        "class TrainAux(WithAux):\n    def forward(self, x):\n        out = super().forward(x)\n"
        "        return (out, self.aux(out)) if self.training else out\n\n"
        "def with_aux(outputs, targets):\n    logits, aux = outputs\n"
        "    return F.cross_entropy(logits, targets) + 0.4 * F.cross_entropy(aux, targets)\n")
    r = cli([*QUICK, "strategy=single", "loss._target_=mypkg.quirks.detached_ce"], own / "det", fast=False)
    assert r.returncode == 2 and r.err.strip().splitlines() == [
        "hydratrain: config error: loss._target_='mypkg.quirks.detached_ce': its result does not depend on the "
        "model's parameters (no grad_fn: the outputs detached, computed under no_grad, or every parameter frozen), so "
        "there is nothing to train"], r.output[-3000:]
    r = cli([*QUICK, "strategy=ddp", "model._target_=mypkg.quirks.WithAux"], own / "aux", fast=False)
    assert r.returncode == 2 and r.err.strip().splitlines() == [
        "hydratrain: config error: strategy.find_unused_parameters=False: aux.weight, aux.bias got no gradient in the "
        "first step (the forward did not use them), which stalls DistributedDataParallel's next step: set "
        "strategy.find_unused_parameters=true, or freeze them (requires_grad=False)"], r.output[-3000:]
    assert "step 1/" not in r.output  # refused before the first log line
    r = cli([*QUICK, "strategy=ddp", "model._target_=mypkg.quirks.SometimesAux"], own / "saux", fast=False)
    assert r.returncode == 2 and r.err.strip().splitlines() == [  # unused at step 3: the same line, not torch's
        "hydratrain: config error: strategy.find_unused_parameters=False: aux.weight, aux.bias got no gradient in the "
        "previous step (the forward used them only in some steps), which stops DistributedDataParallel: set "
        "strategy.find_unused_parameters=true"], r.output[-3000:]
    # an auxiliary output only in training mode (inception_v3's): refused after step 1, not at the eval after training
    r = cli([*QUICK, "strategy=single", "model._target_=mypkg.quirks.TrainAux", "loss._target_=mypkg.quirks.with_aux",
             "~metrics.accuracy", "trainer.objective=eval/loss", "trainer.eval_every_n_steps=0"], own / "train_aux",
            fast=False)
    assert r.returncode == 2 and r.err.strip().splitlines()[0].startswith(
        "hydratrain: config error: loss._target_='mypkg.quirks.with_aux': refused the model's eval-mode outputs "
        "(64, 3) float32 (model.eval(), as the eval runs it; in training mode they were accepted): ValueError: too "
        "many values to unpack"), r.output[-3000:]
    assert "step 2/" not in r.output
    ok = cli([*QUICK, "strategy=ddp", "model._target_=mypkg.quirks.WithAux", "strategy.find_unused_parameters=true",
              "trainer.max_steps=2"], own / "aux_ok", fast=False)
    assert ok.returncode == 0, ok.output[-3000:]


def test_samples_the_default_collate_cannot_batch_are_one_line_naming_collate_fn(cli, own):
    (own / "mypkg" / "var.py").write_text(
        "import torch\n\nclass Var(torch.utils.data.Dataset):\n    def __len__(self):\n        return 64\n\n"
        "    def __getitem__(self, i):\n        return torch.ones(2 + i % 3), torch.tensor(i % 3)\n\n"
        "def var():\n    return {'train': Var(), 'val': Var()}\n\n"
        "def triples():\n    x, y = torch.randn(160, 2), torch.arange(160) % 3\n"
        "    return torch.utils.data.TensorDataset(x, y, torch.arange(160))\n")
    r = cli([*QUICK, "strategy=single", "data._target_=mypkg.var.var", "~data.n"], own / "var", fast=False)
    assert r.returncode == 2 and r.err.strip().splitlines()[0].startswith(
        "hydratrain: config error: data.collate_fn=None: PyTorch's default collate cannot batch the samples (stack "
        "expects each tensor to be equal size"), r.output[-3000:]
    # (inputs, mask, labels) would train on the mask and drop the labels: batches are pairs or dicts
    r = cli([*QUICK, "strategy=single", "data._target_=mypkg.var.triples", "~data.n"], own / "triples", fast=False)
    assert r.returncode == 2 and r.err.strip().splitlines() == [
        "hydratrain: config error: data._target_='mypkg.var.triples': its batches hold 3 items ((64, 2) float32, "
        "(64,) int64, (64,) int64), not (inputs, targets) pairs or dicts: return (inputs, targets), or a dict whose "
        "keys are the forward's arguments with the targets as 'labels' (TensorDataset(ids, mask, labels): a dataset "
        "of dicts)"], r.output[-3000:]


def test_a_data_function_returns_train_and_val_by_their_names(cli, own):
    """A dict with 'validation' (Hugging Face's name) and 'test' evaluates on 'validation'; a tuple of datasets
    used to be taken as one dataset of 2 samples, and a dict's unknown keys were dropped without a word."""
    (own / "mypkg" / "named.py").write_text(
        "from mypkg.data import spirals\n\n"
        "def hf_names(n: int = 600):\n    s = spirals(n=n)\n"
        "    return {'train': s['train'], 'validation': s['val'], 'test': s['val']}\n\n"
        "def pair(n: int = 600):\n    s = spirals(n=n)\n    return s['train'], s['val']\n")
    ok = cli([*QUICK, "strategy=single", "data._target_=mypkg.named.hf_names", "trainer.max_steps=2"], own / "hf",
             fast=False)
    assert ok.returncode == 0 and "train 480 samples, val 120 samples" in ok.output, ok.output[-3000:]
    assert "test 120 samples" in ok.output  # (the test split: trainer.test_after_fit, mode=eval)
    r = cli([*QUICK, "strategy=single", "data._target_=mypkg.named.pair"], own / "pair", fast=False)
    assert r.returncode == 2 and r.err.strip().splitlines() == [
        "hydratrain: config error: data._target_='mypkg.named.pair': returned a tuple of 2 datasets; return "
        "{'train': Dataset, 'val': Dataset} ('validation' as Hugging Face names it; a 'test' Dataset may be beside "
        "them) or one Dataset (split by data.val_fraction)"], r.output[-3000:]


def test_lazy_and_sparse_parameters_are_refused_before_the_run(cli, own):
    (own / "mypkg" / "odd_params.py").write_text(
        "from torch import nn\n\n"
        "class Lazy(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.a, self.head = nn.LazyLinear(8), nn.Linear(8, 3)\n\n"
        "    def forward(self, x):\n        return self.head(self.a(x))\n\n"
        "class Sparse(Lazy):\n    def __init__(self):\n        super().__init__()\n"
        "        self.a = nn.Embedding(10, 8, sparse=True)\n")
    off = ["~model.width", "~model.depth", "~model.num_classes", "strategy=single"]
    for model, line in [("Lazy", "a.weight, a.bias are lazy module parameter(s) without a shape"),
                        ("Sparse", "a make(s) sparse gradients (sparse=True)")]:
        r = cli([*QUICK, *off, f"model._target_=mypkg.odd_params.{model}"], own / model, fast=False)
        assert r.returncode == 2 and r.err.startswith(
            f"hydratrain: config error: model._target_='mypkg.odd_params.{model}': {line}"), r.output[-2000:]
        assert "run dir" not in r.output  # before the run starts


NOISY = """
import torch
from torch import nn
from torch.utils.data import Dataset

from mypkg.data import spirals
from mypkg.nets import ResMLP


class Jittered(Dataset):
    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        return x + 0.05 * torch.randn_like(x), y


def jittered(n: int = 600):
    splits = spirals(n=n)
    return {"train": Jittered(splits["train"]), "val": splits["val"]}


class DropResMLP(ResMLP):
    def __init__(self, p: float = 0.2, **kwargs):
        super().__init__(**kwargs)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return super().forward(self.drop(x))
"""


def test_a_resume_is_exact_with_dropout_and_random_augmentation(cli, own):
    """The random numbers of dropout (the global RNG, in the training process) and of an augmentation drawn in
    __getitem__ are the same after a resume as in an uninterrupted run, whichever process loads the data and whether
    or not the run measured the peak FLOP/s or found it cached: the weights are bit-identical."""
    from safetensors.torch import load_file

    (own / "mypkg" / "noisy.py").write_text(NOISY)
    common = [*QUICK, "strategy=single", "model._target_=mypkg.noisy.DropResMLP", "data._target_=mypkg.noisy.jittered",
              "scheduler=constant", "trainer.eval_every_n_steps=0", "checkpoint.every_n_steps=4"]
    cli([*common, "trainer.max_steps=8"], own / "whole", fast=False).ok()
    cli([*common, "trainer.max_steps=4"], own / "halves", fast=False).ok()
    # the augmentation's numbers depend on the batch, not on the process that loads it: a loader worker now
    r = cli([*common, "trainer.max_steps=8", "data.num_workers=1"], own / "halves", fast=False).ok()
    assert "resumed from" in r.output
    whole, halves = (load_file(own / d / "model.safetensors") for d in ("whole", "halves"))
    assert all(whole[k].equal(halves[k]) for k in whole), [k for k in whole if not whole[k].equal(halves[k])]


def test_a_list_state_metric_that_refuses_zero_rows_is_named_at_step_one_when_a_rank_will_have_none():
    """1 eval sample on 2 ranks: rank 1 updates list-state metrics with zero rows at every eval (so their sync
    matches); a metric whose update refuses them is one line at the first step naming it and the cause, and a metric
    that takes them, or an eval set that leaves no rank empty, passes."""
    from types import SimpleNamespace

    from torchmetrics import CatMetric
    from torchmetrics.classification import MulticlassAUROC

    from hydratrain.errors import ConfigError
    from hydratrain.train.evaluate import Evaluator

    class Normalised(CatMetric):  # list states (cat), as MulticlassAUROC's
        def update(self, preds, target):
            super().update(preds.max(dim=-1).values / preds.max())  # max() of an empty tensor raises

        def compute(self):
            return super().compute().mean()

    outputs, batch = torch.randn(4, 3), (torch.randn(4, 2), torch.tensor([0, 1, 2, 0]))
    one_sample = SimpleNamespace(n_samples=1, batch_size=4, world_size=2, global_batches=1)
    with pytest.raises(ConfigError) as err:
        Evaluator(one_sample, torch.device("cpu"), None, {"ns": Normalised()}).check_metrics(outputs, batch)
    assert str(err.value).startswith("metrics.ns._target_=") and "refused an update with zero rows" in str(err.value)
    assert "(1 eval samples on 2 ranks x data.batch_size=4)" in str(err.value)
    Evaluator(one_sample, torch.device("cpu"), None, {"auroc": MulticlassAUROC(3)}).check_metrics(outputs, batch)
    every_rank = SimpleNamespace(n_samples=10, batch_size=4, world_size=2, global_batches=2)  # 2 left: 1 each
    Evaluator(every_rank, torch.device("cpu"), None, {"ns": Normalised()}).check_metrics(outputs, batch)


def test_a_models_own_loss_gets_no_perplexity_and_padded_targets_weigh_the_eval_by_their_count():
    """exp of a model's own loss (with an auxiliary term) is no perplexity: none is reported, though the loss node
    (the next-token default) has one; and the next-token eval loss of padded sequences is their tokens' mean, at any
    eval batch size."""
    from torch import nn

    from hydratrain.losses import NextTokenLoss
    from hydratrain.train.evaluate import Evaluator

    class OwnLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(2, 3)

        def forward(self, x, labels):
            logits = self.head(x)
            return {"logits": logits, "loss": nn.functional.cross_entropy(logits, labels) + logits.pow(2).mean()}

    class Lookup(nn.Module):  # (B, T) ids -> (B, T, 5) logits
        def __init__(self):
            super().__init__()
            self.table = nn.Embedding(5, 5)

        def forward(self, x):
            return self.table(x)

    def batches(samples, size):
        return [(tuple(t[i:i + size] for t in samples), torch.ones(len(samples[0][i:i + size]), dtype=torch.bool))
                for i in range(0, len(samples[0]), size)]

    cpu, plain = torch.device("cpu"), __import__("contextlib").nullcontext()
    x, labels = torch.randn(6, 2), torch.tensor([0, 1, 2, 0, 1, 2])
    dict_batches = [({"x": b[0], "labels": b[1]}, v) for b, v in batches((x, labels), 3)]
    out = Evaluator(dict_batches, cpu, NextTokenLoss()).evaluate(OwnLoss(), plain)
    assert "perplexity" not in out and out["loss"] > 0

    ids = torch.randint(0, 5, (6, 4), generator=torch.Generator().manual_seed(0))
    targets = ids.roll(1, dims=1)
    targets[torch.arange(4) >= torch.tensor([1, 4, 2, 3, 1, 4])[:, None]] = -100  # 15 real tokens of 24
    model = Lookup()
    expected = nn.functional.cross_entropy(model(ids).flatten(0, 1), targets.flatten()).item()  # over the 15
    for size in (1, 2, 6):
        out = Evaluator(batches((ids, targets), size), cpu, NextTokenLoss()).evaluate(model, plain)
        assert out["loss"] == pytest.approx(expected, rel=1e-6) and "perplexity" in out, size


def test_a_metric_that_cannot_compute_on_the_eval_set_is_left_out_with_a_warning_not_the_run(caplog):
    """R2Score on an eval set of one sample raises at compute(): the run trained every step, then ended with that
    traceback at its final eval and wrote neither weights nor results (the step-1 check saw a training batch of
    several rows). The eval now leaves that metric out with one warning, once, and keeps the others."""
    from torch import nn
    from torchmetrics import MeanSquaredError, R2Score

    from hydratrain.train.evaluate import Evaluator

    batches = [((torch.randn(1, 3), torch.randn(1)), torch.ones(1, dtype=torch.bool))]
    model, plain = nn.Sequential(nn.Linear(3, 1), nn.Flatten(0)), __import__("contextlib").nullcontext()
    evaluator = Evaluator(batches, torch.device("cpu"), nn.MSELoss(), {"r2": R2Score(), "mse": MeanSquaredError()})
    for _ in range(2):
        out = evaluator.evaluate(model, plain)
        assert sorted(out) == ["loss", "mse"] and out["mse"] == pytest.approx(out["loss"]), out
    said = [r.getMessage() for r in caplog.records if "not computed" in r.getMessage()]
    assert said == ["eval/r2 not computed: metrics.r2._target_=torchmetrics.regression.r2.R2Score raised ValueError: "
                    "Needs at least two samples to calculate r2 score.; it is left out of the eval's results (a "
                    "larger eval set, trainer.eval_samples, may give it what it needs)"], said


def test_namedtuple_batches_are_selected_moved_and_counted_and_metrics_see_float32_outputs():
    """A dataset of namedtuple samples (the default collate keeps the type): the selection of a batch's rows, its
    move to the device and its FLOPs fakes keep the type (a namedtuple is rebuilt field by field, not from one
    iterable); and bf16 outputs reach the metrics in float32, as they reach the loss."""
    from collections import namedtuple

    import torchmetrics
    from torch import nn

    from hydratrain.data.streams import to_device
    from hydratrain.flops import _meta
    from hydratrain.train.batch import select, upcast
    from hydratrain.train.evaluate import Evaluator

    Pair = namedtuple("Pair", "x y")
    batch = Pair(torch.randn(4, 2), torch.tensor([0, 1, 2, 0]))
    kept = select(batch, torch.tensor([True, False, True, False]))
    assert type(kept) is Pair and kept.y.tolist() == [0, 2]
    assert type(to_device(batch, torch.device("cpu"))) is Pair and _meta(batch).x.device.type == "meta"
    assert type(upcast(Pair(batch.x.bfloat16(), batch.y))) is Pair

    class Seen(torchmetrics.Metric):  # the dtype of the outputs it is given
        def __init__(self):
            super().__init__()
            self.add_state("n", torch.tensor(0.0), dist_reduce_fx="sum")
            self.dtypes = set()

        def update(self, outputs, targets):
            self.dtypes.add(outputs.dtype)
            self.n += targets.numel()

        def compute(self):
            return self.n

    class Short(list):  # 6 samples in batches of 4: the last one of 2
        n_samples, batch_size, world_size, global_batches = 6, 4, 1, 2

    x, y = torch.randn(6, 2), torch.tensor([0, 1, 2, 0, 1, 2])
    batches = Short([(Pair(x[:4], y[:4]), torch.ones(4, dtype=torch.bool)),
                     (Pair(x[4:], y[4:]), torch.ones(2, dtype=torch.bool))])
    seen = Seen()
    evaluator = Evaluator(batches, torch.device("cpu"), nn.CrossEntropyLoss(), {"n": seen})
    model = nn.Linear(2, 3).to(torch.bfloat16)
    out = evaluator.evaluate(model, torch.autocast("cpu", torch.bfloat16))  # bf16 outputs
    assert out["n"] == 6 and seen.dtypes == {torch.float32}


def test_a_loss_that_communicates_is_evaluated_on_whole_global_batches_only():
    """A loss that runs a collective (a contrastive loss all-gathering its embeddings) is called by every rank on
    whole global batches only: the short last one goes to the metrics alone, and an eval set that fills no global
    batch is a config error at the first step."""
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch import nn
    from torchmetrics.classification import MulticlassAccuracy

    from hydratrain.errors import ConfigError
    from hydratrain.train.evaluate import Evaluator

    class Short(list):  # EvalBatches' shape: 10 samples in global batches of 1 rank x 4, the last one of 2
        n_samples, batch_size, world_size, global_batches = 10, 4, 1, 3

    x, y = torch.randn(10, 2), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 0])
    model, plain = nn.Linear(2, 3), __import__("contextlib").nullcontext()
    batches = Short([((x[i:i + 4], y[i:i + 4]), torch.ones(4, dtype=torch.bool)) for i in (0, 4)])
    batches.append(((x[8:], y[8:]), torch.ones(2, dtype=torch.bool)))
    calls = []

    def gathered(outputs, targets):  # world size 1: the all-reduce changes nothing, but it is a collective
        calls.append(len(targets))
        dist.all_reduce(outputs.detach().clone())
        return nn.functional.cross_entropy(outputs, targets)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        accuracy = MulticlassAccuracy(3, average="micro")
        evaluator = Evaluator(batches, torch.device("cpu"), gathered, {"accuracy": accuracy})
        evaluator.check_loss(model(x[:4]), (x[:4], y[:4]))
        assert evaluator.loss_communicates
        out = evaluator.evaluate(model, plain)
        with torch.no_grad():
            assert out["loss"] == pytest.approx(nn.functional.cross_entropy(model(x[:8]), y[:8]).item(), rel=1e-6)
            assert out["accuracy"] == pytest.approx((model(x).argmax(-1) == y).float().mean().item())  # all 10
        assert calls == [4, 4, 4]  # check_loss, then the two whole batches: never the short one
        tiny = SimpleNamespace(n_samples=3, batch_size=4, world_size=2)
        with pytest.raises(ConfigError, match=r"^trainer.eval_samples=3: 3 eval samples fill no global batch of 2 "
                                              r"ranks x data.batch_size=4, and the loss communicates"):
            Evaluator(tiny, torch.device("cpu"), gathered).check_loss(model(x[:4]), (x[:4], y[:4]))
    finally:
        dist.destroy_process_group()


class _Stream(torch.utils.data.IterableDataset):
    """A stream of (x, y) samples, with or without a length."""

    def __iter__(self):
        return iter([(torch.zeros(2), 0)] * 8)


class _SizedStream(_Stream):
    def __len__(self):
        return 8


def streams(sized: bool = False):
    return {"train": (_SizedStream if sized else _Stream)(), "val": [(torch.zeros(2), 0)] * 4}


@pytest.mark.parametrize("sized", [False, True])
def test_an_iterable_dataset_is_one_line_naming_data_target_with_or_without_a_length(sized):
    """torch's IterableDataset inherits a __getitem__ that raises: with a __len__ it is still a stream, refused at
    the build with the same line as one without (not a collate_fn error, nor the fingerprint's traceback)."""
    from omegaconf import OmegaConf

    from hydratrain.data.loader import load_datasets
    from hydratrain.errors import ConfigError

    target = f"{__name__}.streams"
    with pytest.raises(ConfigError) as err:
        load_datasets(OmegaConf.create({"_target_": target, "sized": sized}))
    name = "_SizedStream" if sized else "_Stream"
    assert str(err.value) == (
        f"data._target_='{target}': its train is a {name} (an IterableDataset), not a map-style Dataset (__len__ and "
        "__getitem__(index)): samples are drawn by index, so that a resume is exact on any world size; return a "
        "map-style Dataset (a list of samples, a torch.utils.data.TensorDataset, a Dataset subclass), or for token "
        "streams use data=token_bin or data=text_files")


def no_val(key: str = "val"):
    return {"train": [(torch.zeros(2), 0)] * 8, key: []}


@pytest.mark.parametrize("key", ["val", "validation"])
def test_an_empty_val_split_a_data_function_returns_names_data_target_not_val_fraction(key):
    """data.val_fraction plays no part when the function returns the splits: the line names data._target_ and what
    to return."""
    from omegaconf import OmegaConf

    from hydratrain.data.loader import load_datasets
    from hydratrain.errors import ConfigError

    target = f"{__name__}.no_val"
    with pytest.raises(ConfigError) as err:
        load_datasets(OmegaConf.create({"_target_": target, "key": key, "val_fraction": 0.1}))
    assert str(err.value) == (
        f"data._target_='{target}': returned an empty '{key}' split: every eval (each trainer.eval_every_n_steps and "
        "the last step) runs on it; return at least one val sample, or {'train': Dataset} or one Dataset, which "
        "data.val_fraction splits")


def test_a_metric_collection_is_refused_for_what_it_is_and_told_to_list_its_metrics():
    """A MetricCollection syncs, but computes several values where each metrics: key is logged as one number."""
    from omegaconf import OmegaConf

    from hydratrain.components import build_metrics
    from hydratrain.errors import ConfigError

    acc = {"_target_": "torchmetrics.classification.MulticlassAccuracy", "num_classes": 3}
    f1 = {"_target_": "torchmetrics.classification.MulticlassF1Score", "num_classes": 3}
    cfg = OmegaConf.create({"metrics": {"both": {"_target_": "torchmetrics.MetricCollection",
                                                 "metrics": {"acc": acc, "f1": f1}}}})
    with pytest.raises(ConfigError) as err:
        build_metrics(cfg)
    assert str(err.value) == (
        "metrics.both._target_='torchmetrics.MetricCollection': built a MetricCollection, which computes several "
        "values, and each key of metrics: is one torchmetrics.Metric logged as one number (eval/<name>): list its "
        "metrics one per key under metrics: (metrics.acc._target_=..., metrics.f1._target_=...)")
    assert list(build_metrics(OmegaConf.create({"metrics": {"acc": acc, "f1": f1}}))) == ["acc", "f1"]


def test_multihead_attention_is_initialised_after_a_meta_build_as_its_constructor_does():
    """nn.MultiheadAttention has _reset_parameters(), not reset_parameters(): a meta build of an nn.TransformerEncoder
    was refused as uninitialisable."""
    from torch import nn

    from hydratrain.parallel import init as param_init

    with torch.device("meta"):
        layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True)
        model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    assert param_init.uninitialisable(model) == []
    model.to_empty(device="cpu")
    note = param_init.initialise(model, 0, torch.device("cpu"), built_on_meta=True)
    assert note == "initialised by the reset_parameters() of 12 modules"
    attn = model.layers[0].self_attn
    assert torch.equal(attn.in_proj_bias, torch.zeros(48)) and torch.equal(attn.out_proj.bias, torch.zeros(16))
    assert 0.1 < attn.in_proj_weight.std() < 0.3  # xavier-uniform over (48, 16)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_layer_used_at_every_depth_is_checkpointed_at_each_use_and_sharded_once(cli, own):
    """ALBERT-style sharing (nn.ModuleList([layer] * depth)): activation checkpointing wrapped the first use only,
    the other uses ran unchecked, and under FSDP the root sharded the layer's parameters a second time (a traceback
    inside fully_shard)."""
    from hydratrain.parallel.ac_compile import apply_activation_checkpointing

    (own / "mypkg" / "shared.py").write_text(
        "from torch import nn\nfrom mypkg.nets import ResMLP\n\n"
        "class Shared(ResMLP):\n    def __init__(self, **kw):\n        super().__init__(**kw)\n"
        "        self.blocks = nn.ModuleList([self.blocks[0]] * len(self.blocks))\n")
    sys.path.insert(0, str(own))  # (the fixture restores sys.path)
    from mypkg.shared import Shared

    model = Shared(width=8, depth=3)
    assert apply_activation_checkpointing(model) == 1
    assert len({id(b) for b in model.blocks}) == 1
    assert all(hasattr(b, "_checkpoint_wrapped_module") for b in model.blocks)
    args = [*QUICK, "model._target_=mypkg.shared.Shared", "trainer.max_steps=2", "activation_checkpointing=true"]
    r = cli([*args, "strategy=fsdp"], own / "fsdp", fast=False)
    assert r.returncode == 0, r.output[-3000:]
    assert "activation checkpointing on 1 ResidualBlock; fsdp: sharded 2 modules (1 ResidualBlock" in r.output


def test_the_fsdp_line_counts_the_units_made_not_the_blocks_found(cli, own):
    """Blocks 0 and 1 sharing a weight stay in the root (a tied weight lives in one unit), and the start-up line said
    "3 ResidualBlock" sharded."""
    (own / "mypkg" / "tied.py").write_text(
        "from mypkg.nets import ResMLP\n\n\nclass Tied(ResMLP):\n    def __init__(self, **kw):\n"
        "        super().__init__(**kw)\n        self.blocks[1].fc1.weight = self.blocks[0].fc1.weight\n")
    r = cli([*QUICK, "model._target_=mypkg.tied.Tied", "model.depth=3", "trainer.max_steps=1", "strategy=fsdp"],
            own / "tied", fast=False)
    assert r.returncode == 0 and ("fsdp: sharded 2 modules (1 ResidualBlock (and 2 more blocks that share a tied "
                                  "weight with another module, in the root) by wrap_policy=auto + root)") in r.output, \
        r.output[-3000:]


def test_parameters_of_mixed_dtypes_in_one_fsdp_unit_are_one_line_naming_them_and_their_own_unit_trains(cli, own):
    """A float64 (or complex) parameter beside float32 ones failed at step 1 inside FSDP ("uniform original parameter
    dtype"), blamed on the model's forward."""
    (own / "mypkg" / "dtypes.py").write_text(
        "import torch\nfrom torch import nn\nfrom mypkg.nets import ResMLP\n\n"
        "class Scale(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.w = nn.Parameter(torch.ones(3, dtype=torch.float64))\n\n"
        "    def forward(self, x):\n        return (x * self.w).float()\n\n"
        "class Mixed(ResMLP):\n    def __init__(self, **kw):\n        super().__init__(**kw)\n"
        "        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float64))\n\n"
        "    def forward(self, x):\n        return (super().forward(x) * self.scale).float()\n\n"
        "class OwnUnit(ResMLP):\n    def __init__(self, **kw):\n        super().__init__(**kw)\n"
        "        self.scale = Scale()\n\n"
        "    def forward(self, x):\n        return self.scale(super().forward(x))\n")
    args = [*QUICK, "trainer.max_steps=2", "strategy=fsdp"]
    r = cli([*args, "model._target_=mypkg.dtypes.Mixed"], own / "mixed", fast=False)
    assert r.returncode == 2 and r.err.strip().splitlines() == [
        "hydratrain: config error: strategy='fsdp': FSDP shards each unit's parameters as one buffer of one dtype, "
        "but scale (float64) in the root unit, whose other parameters are float32: use strategy=ddp, or give them a "
        "module of their own and add its class to wrap_policy.block_classes"], r.output[-3000:]
    r = cli([*args, "model._target_=mypkg.dtypes.OwnUnit", "wrap_policy.block_classes=[mypkg.dtypes.Scale]"],
            own / "own_unit", fast=False)
    assert r.returncode == 0 and "fsdp: sharded 2 modules (1 Scale by wrap_policy=auto + root)" in r.output, \
        r.output[-3000:]


def test_a_null_vocab_size_takes_token_datas_vocabulary_and_is_refused_naming_datasets_that_have_none(own):
    """vocab_size: null was refused as "must be int" for a model annotating vocab_size: int, before the data's
    vocabulary was put in; with a data function's datasets (no vocabulary) it said the same."""
    from omegaconf import OmegaConf

    from hydratrain.config.validate import check_components
    from hydratrain.errors import ConfigError

    (own / "mypkg" / "lm.py").write_text(
        "from torch import nn\n\nclass LM(nn.Sequential):\n    def __init__(self, vocab_size: int, width: int = 8):\n"
        "        super().__init__(nn.Embedding(vocab_size, width), nn.Linear(width, vocab_size))\n")
    cfg = OmegaConf.create({"model": {"_target_": "mypkg.lm.LM", "vocab_size": None},
                            "data": {"name": "synthetic", "seq_len": 8}, "loss": {"_target_": "torch.nn.MSELoss"}})
    check_components(cfg)
    cfg.data = {"_target_": "mypkg.data.spirals"}
    with pytest.raises(ConfigError) as err:
        check_components(cfg)
    assert str(err.value) == (
        "model.vocab_size=None: null takes the data's vocabulary, but data._target_=mypkg.data.spirals builds "
        "datasets, which have none (only token data does): set model.vocab_size to the number of ids your data holds")


def test_parametrized_layers_train_under_fsdp_in_bf16_in_float32_units(cli, own):
    """spectral_norm (both APIs) and orthogonal compute a layer's weight from its parameters and float32 buffers; FSDP
    gathered the parameters in bf16 and step 1 failed in the parametrization ("addmv input tensors must have the same
    dtype"), blamed on the model's forward. Such layers are float32 units of their own, as BatchNorm is."""
    (own / "mypkg" / "normed.py").write_text(
        "import torch\nfrom torch import nn\nfrom torch.nn.utils import parametrizations, spectral_norm\n\n"
        "class Normed(nn.Module):\n    def __init__(self, in_features=2, num_classes=3):\n        super().__init__()\n"
        "        self.a = parametrizations.spectral_norm(nn.Linear(in_features, 16))\n"
        "        self.b = parametrizations.orthogonal(nn.Linear(16, 16))\n"
        "        self.c = spectral_norm(nn.Linear(16, num_classes))\n\n"
        "    def forward(self, x):\n        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))\n")
    r = cli([*QUICK, "trainer.max_steps=2", "strategy=fsdp", "strategy.shard_on_one_rank=true", "precision=bf16",
             "model._target_=mypkg.normed.Normed", "~model.width", "~model.depth"], own / "normed", fast=False)
    assert r.returncode == 0, r.output[-3000:]
    assert "fsdp: sharded 4 modules (0 + 3 in float32 (Linear, ParametrizedLinear) by wrap_policy=auto + root)" \
        in r.output, r.output[-3000:]


def test_a_metric_that_computes_no_single_number_is_told_a_fix_it_takes():
    """A per-class metric is told to average; a metric without ``average`` (a confusion matrix) is not."""
    from torchmetrics.classification import MulticlassAccuracy, MulticlassConfusionMatrix

    from hydratrain.errors import ConfigError
    from hydratrain.train.evaluate import Evaluator

    outputs, batch = torch.randn(4, 3), (torch.randn(4, 2), torch.tensor([0, 1, 2, 0]))
    for metric, fix in [(MulticlassAccuracy(3, average=None), "average='macro' or 'micro'"),
                        (MulticlassConfusionMatrix(3), "or a metric that computes one")]:
        with pytest.raises(ConfigError, match="logged as one number") as err:
            Evaluator([], torch.device("cpu"), torch.nn.CrossEntropyLoss(), {"m": metric}).check_metrics(outputs, batch)
        assert fix in str(err.value) and ("average" in fix) == ("average" in str(err.value)), str(err.value)


@pytest.mark.parametrize("args,builds", [
    (["strategy=single"], {"meta": 1, "cpu": 1}),  # the check's meta model counts the FLOPs; the run trains a cpu one
    # the checked model is the one the run trains; the FLOP count (ResMLP has no flops_per_token) builds its own copy
    (["strategy=single", "+model.init_device=meta"], {"meta": 2}),
])
def test_start_up_builds_each_component_once_the_check_handing_its_build_to_the_run(cli, own, monkeypatch, args,
                                                                                     builds):
    """check_components built the model (on meta), the loss and the metrics before the process group, and the run
    built each again; the metrics' build imports torchmetrics (seconds), which a run without metrics paid too. Now
    what the check built is what the run uses (the memory planner's own simulation builds are left out:
    plan.enabled=false)."""
    sys.path.insert(0, str(own))  # (the fixture restores sys.path)
    import torchmetrics.classification
    from mypkg.nets import ResMLP

    counts: dict = {}
    made = {"loss": 0, "metric": 0}

    def counted(cls, what):
        init = cls.__init__

        def __init__(self, *a, **kw):
            init(self, *a, **kw)
            if what == "model":
                device = next(self.parameters()).device.type
                counts[device] = counts.get(device, 0) + 1
            elif type(self) is cls:
                made[what] += 1
        monkeypatch.setattr(cls, "__init__", __init__)

    counted(ResMLP, "model")
    counted(torch.nn.CrossEntropyLoss, "loss")
    counted(torchmetrics.classification.MulticlassAccuracy, "metric")
    r = cli([*QUICK, *args, "trainer.max_steps=1", "plan.enabled=false"], own / "once", fast=False)
    assert r.returncode == 0, r.output[-3000:]
    assert counts == builds and made == {"loss": 1, "metric": 1}, (counts, made)
