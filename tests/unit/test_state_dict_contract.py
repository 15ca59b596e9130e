"""What a model's ``state_dict()`` may hold, in this process: a module's extra state (``get_extra_state()``, plain
values or tensors) is saved, resumed and exported (the safetensors file holds the tensors only); a state_dict that
checkpoints cannot hold (a hook renaming a key, an extra state that a weights-only load refuses) is one config-error
line naming ``model._target_`` before any step, not a traceback after training."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from helpers import forget_mypkg
from hydratrain.components import check_state_dict
from hydratrain.errors import ConfigError

QUICK = ["--config-dir", "my_conf", "+experiment=spirals", "device=cpu", "precision=fp32", "logger.peak_flops=1e11",
         "trainer.eval_every_n_steps=0", "trainer.log_every_n_steps=2", "trainer.progress_bar=false", "data.n=300",
         "strategy=single", "checkpoint.every_n_steps=2"]

MODELS = '''
import torch
from torch import nn
from mypkg.nets import ResMLP


class Counted(ResMLP):
    """Counts its training forwards in extra state that is a plain dict."""
    def __init__(self, **kw):
        super().__init__(**kw)
        self.calls = 0

    def get_extra_state(self):
        return {"calls": self.calls, "version": 3}

    def set_extra_state(self, state):
        self.calls = state["calls"]

    def forward(self, x):
        if self.training:
            self.calls += 1
        return super().forward(x)


class Legacy(ResMLP):
    """Stores head.weight transposed under another key (a legacy layout), with the load hook that undoes it."""
    def __init__(self, **kw):
        super().__init__(**kw)
        self._register_state_dict_hook(Legacy._save)
        self._register_load_state_dict_pre_hook(Legacy._load, with_module=True)

    @staticmethod
    def _save(module, sd, prefix, local_metadata):
        sd[prefix + "head.weight_t"] = sd.pop(prefix + "head.weight").t()

    @staticmethod
    def _load(module, sd, prefix, *args):
        if prefix + "head.weight_t" in sd:
            sd[prefix + "head.weight"] = sd.pop(prefix + "head.weight_t").t()
'''


@pytest.fixture
def own(own):
    """The own-model example's launch dir (conftest's ``own``) with :data:`MODELS` as ``mypkg.custom``."""
    (own / "mypkg" / "custom.py").write_text(MODELS)
    return own


def test_a_state_dict_hook_that_renames_a_key_is_refused_before_any_step(cli, own):
    """DCP's get_model_state_dict maps every state_dict key back to a module attribute: the renamed key failed the
    first checkpoint save (or the weights export) after training, with a traceback."""
    r = cli([*QUICK, "trainer.max_steps=4", "model._target_=mypkg.custom.Legacy"], own / "legacy", fast=False)
    assert r.returncode == 2, r.output[-3000:]
    assert ("hydratrain: config error: model._target_='mypkg.custom.Legacy': its state_dict() holds head.weight_t, "
            "not the name of a parameter or buffer; lacks head.weight (a state_dict hook or _save_to_state_dict that "
            "renames, adds or drops keys)") in r.output, r.output[-3000:]
    assert "Traceback" not in r.output
    assert not (own / "legacy" / "checkpoints").exists()


@pytest.mark.slow
def test_extra_state_of_plain_values_is_checkpointed_resumed_and_left_out_of_the_weights_file(cli, own):
    """A dict from get_extra_state() goes into the DCP checkpoints and comes back on resume (the count goes on from
    4, not from the new model's 0); safetensors holds tensors only, so the weights file has the parameters and a
    warning says what was left out. It failed at the export ('dict' object has no attribute 'clone') and at the
    resume ('dict' object has no attribute 'shape')."""
    from safetensors.torch import load_file

    from hydratrain.checkpoint.io import read_all

    args = [*QUICK, "model._target_=mypkg.custom.Counted"]
    run = own / "counted"
    r = cli([*args, "trainer.max_steps=4"], run, fast=False)
    assert r.returncode == 0, r.output[-3000:]
    assert ("model.safetensors holds tensors only: left out the model's extra state _extra_state (a dict from "
            "get_extra_state()); the checkpoints keep it") in r.output
    assert json.loads((run / "results.json").read_text())["steps"] == 4
    weights = load_file(str(run / "model.safetensors"))
    forget_mypkg()
    from mypkg.custom import Counted

    model = Counted(width=64, depth=4, num_classes=3)
    assert model.load_state_dict(weights, strict=False).missing_keys == ["_extra_state"]
    assert read_all(run / "checkpoints" / "step_00000004")["model._extra_state.calls"] == 4

    r = cli([*args, "trainer.max_steps=6"], run, fast=False)
    assert r.returncode == 0, r.output[-3000:]
    assert "resumed from" in r.output and "Traceback" not in r.output
    assert read_all(run / "checkpoints" / "step_00000006")["model._extra_state.calls"] == 6


class _Plain:
    pass


class _Extra(nn.Module):
    def __init__(self, value):
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.value = value

    def get_extra_state(self):
        return self.value

    def set_extra_state(self, state):
        self.value = state


@pytest.mark.parametrize("value", [torch.arange(3.0), {"n": 1, "t": torch.zeros(2), "name": "x", "xs": [1.5, None]},
                                   7])
def test_extra_state_a_checkpoint_restores_is_accepted(value):
    model = nn.Sequential(nn.Linear(2, 2), _Extra(value))
    check_state_dict(model, "mypkg.M")
    with torch.device("meta"):
        check_state_dict(nn.Sequential(_Extra(value)), "mypkg.M", built_on_meta=True)


@pytest.mark.parametrize("value, why", [
    (_Plain(), "torch.load(weights_only=True) refuses it (UnpicklingError: WeightsUnpickler error: Unsupported "
               "global: GLOBAL test_state_dict_contract._Plain"),
    ({"f": lambda x: x}, "torch.save cannot pickle it")])
def test_extra_state_a_checkpoint_cannot_restore_is_refused(value, why):
    """Checkpoints store a non-tensor extra state pickled and read it back weights-only (no code runs on load): a
    class of one's own fails the resume, an unpicklable object the first save."""
    with pytest.raises(ConfigError) as err:
        check_state_dict(nn.Sequential(nn.Linear(2, 2), _Extra(value)), "mypkg.M")
    message = str(err.value)
    assert message.startswith(f"model._target_='mypkg.M': its 1._extra_state (get_extra_state()) is a "
                              f"{type(value).__name__} that a checkpoint cannot restore: {why}"), message
    assert message.endswith("return a tensor, or plain containers (dict, list, tuple) of tensors, numbers, strings "
                            "and None")


def test_a_weights_file_without_the_extra_state_initialises_the_model(tmp_path):
    """model.init_from of the file a run with non-tensor extra state wrote: the parameters load, the model keeps
    its own extra state."""
    from hydratrain.checkpoint.io import init_from_file
    from hydratrain.train.outputs import save_weights

    saved = nn.Sequential(nn.Linear(2, 2), _Extra({"n": 5}))
    path = save_weights(saved, tmp_path / "model.safetensors", True)
    model = nn.Sequential(nn.Linear(2, 2), _Extra({"n": 0}))
    assert init_from_file(model, path) == 4
    assert torch.equal(model[0].weight, saved[0].weight) and model[1].value == {"n": 0}


def test_extra_state_saves_and_resumes_through_the_checkpoint_manager(tmp_path):
    """The resume path alone (fast): a dict extra state and a tensor one are stored by DCP and restored on load; the
    shape check before the load compares tensors only. The dict failed it ('dict' object has no attribute 'shape')."""
    from hydratrain.checkpoint.manager import CheckpointManager
    from hydratrain.checkpoint.stateful import ModelState

    def manager(model):
        return CheckpointManager(tmp_path / "checkpoints", {"model": ModelState(model)}, {}, {}, 0,
                                 torch.device("cpu"))

    saved = nn.Sequential(nn.Linear(2, 2), _Extra({"calls": 5, "t": torch.ones(2)}), _Extra(torch.arange(3.0)))
    ckpt = manager(saved).save(1)
    model = nn.Sequential(nn.Linear(2, 2), _Extra({"calls": 0, "t": torch.zeros(2)}), _Extra(torch.zeros(3)))
    manager(model).load(ckpt)
    assert torch.equal(model[0].weight, saved[0].weight)
    assert model[1].value["calls"] == 5 and torch.equal(model[1].value["t"], torch.ones(2))
    assert torch.equal(model[2].value, torch.arange(3.0))


def test_the_weights_file_holds_the_tensors_and_says_what_it_left_out(tmp_path, caplog):
    """safetensors holds tensors only: a dict extra state is left out with a warning (it failed: 'dict' object has
    no attribute 'clone'), a tensor one is kept; the file loads with strict=False."""
    from safetensors.torch import load_file

    from hydratrain.train.outputs import save_weights

    model = nn.Sequential(nn.Linear(2, 2), _Extra({"calls": 5}), _Extra(torch.arange(3.0)))
    with caplog.at_level("WARNING", logger="hydratrain"):
        path = save_weights(model, tmp_path / "model.safetensors", True)
    weights = load_file(str(path))
    assert sorted(weights) == ["0.bias", "0.weight", "1.fc.bias", "1.fc.weight", "2._extra_state", "2.fc.bias",
                               "2.fc.weight"]
    assert ("model.safetensors holds tensors only: left out the model's extra state 1._extra_state (a dict from "
            "get_extra_state()); the checkpoints keep it; load the file with load_state_dict(..., strict=False)"
            in caplog.text)
    fresh = nn.Sequential(nn.Linear(2, 2), _Extra({"calls": 0}), _Extra(torch.zeros(3)))
    assert fresh.load_state_dict(weights, strict=False).missing_keys == ["1._extra_state"]
    assert torch.equal(fresh[2].value, torch.arange(3.0))
