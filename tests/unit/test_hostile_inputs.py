"""What a hostile (or unlucky) user does, found by trying to break the product: a launch environment no launcher
made, model settings that load a checkpoint without a shape error, token ids the start-up sample missed, a finished
run relaunched, an export onto a directory. Each is one line with the documented exit status, and nothing written
before is lost."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from helpers import ckpt_of, results
from hydratrain.errors import ConfigError

SHORT = ["strategy=single", "trainer.max_steps=2"]


@pytest.mark.parametrize("env, key", [
    ({"RANK": "1"}, "$RANK"),  # a RANK left over from another launch
    ({"WORLD_SIZE": "2"}, "$WORLD_SIZE"),  # python train.py where torchrun was meant: no MASTER_ADDR
    ({"WORLD_SIZE": "abc"}, "$WORLD_SIZE"),
])
def test_a_launch_environment_no_launcher_made_is_one_line(cli, tmp_path, monkeypatch, env, key):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    r = cli(SHORT, tmp_path / "r")
    assert r.returncode == 2, r.output[-2000:]
    lines = [ln for ln in r.err.splitlines() if ln.startswith("hydratrain: config error:")]
    assert len(lines) == 1 and lines[0].startswith(f"hydratrain: config error: {key}="), r.err[-2000:]
    assert "Traceback" not in r.output


@pytest.mark.parametrize("env, expect", [
    ({"LOCAL_WORLD_SIZE": "2"}, "$LOCAL_WORLD_SIZE=2: must be in 1..$WORLD_SIZE=1 (a LOCAL_WORLD_SIZE left from"),
    ({"LOCAL_WORLD_SIZE": "0"}, "$LOCAL_WORLD_SIZE=0: must be in 1..$WORLD_SIZE=1"),
    ({"LOCAL_RANK": "1"}, "$LOCAL_RANK=1: must be < $LOCAL_WORLD_SIZE=1 (a LOCAL_RANK left from another launch?)"),
    ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "h",
      "MASTER_PORT": "1"}, None),  # torchrun's
])
def test_a_stray_local_world_size_or_local_rank_is_refused_like_a_stray_rank(monkeypatch, env, expect):
    """A LOCAL_WORLD_SIZE left in the shell silently halved a single process's CPU threads and memory budget;
    a stray RANK was refused already (above), these now are too."""
    from hydratrain.dist.env import dist_info

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if expect is None:
        assert dist_info().local_world_size == 2
        return
    with pytest.raises(ConfigError) as err:
        dist_info()
    assert str(err.value).startswith(expect), err.value


@pytest.mark.parametrize("override, key", [
    ("model.rope_theta=0", "model.rope_theta"), ("model.rope_theta=nan", "model.rope_theta"),
    ("model.norm_eps=-1", "model.norm_eps"), ("model.vocab_size=1", "model.vocab_size"),
])
def test_model_values_that_cannot_train_are_config_errors(compose, override, key):
    from hydratrain.config.validate import validate

    with pytest.raises(ConfigError) as err:
        validate(compose(["strategy=single", override]))
    assert err.value.key == key


@pytest.mark.parametrize("override, line", [
    ("trainer.max_steps=${oc.env:HT_UNSET_VARIABLE}", "trainer.max_steps='${oc.env:HT_UNSET_VARIABLE}': cannot be "
     "resolved: KeyError raised while resolving interpolation: \"Environment variable 'HT_UNSET_VARIABLE' not found\""),
    ("optim.lr=${nope.key}", "optim.lr='${nope.key}': cannot be resolved: Interpolation key 'nope.key' not found"),
])
def test_an_interpolation_that_does_not_resolve_is_one_line(cli, tmp_path, override, line):
    """It used to be OmegaConf's 80-line traceback from the first read of the key, with exit status 1."""
    r = cli([*SHORT, override], tmp_path)
    assert r.returncode == 2 and f"hydratrain: config error: {line}" in r.err.splitlines(), r.output[-3000:]
    assert "Traceback" not in r.output


def test_a_token_id_beyond_the_vocabulary_is_a_config_error_at_its_batch():
    from hydratrain.data.streams import TokenDataset

    tokens = np.arange(100) % 50
    tokens[77] = 300  # where a start-up sample of the file may not look
    ds = TokenDataset(tokens, 8, vocab_size=256, source="train.bin")
    ds.batch([0, 1])  # tokens 0-17: fine
    with pytest.raises(ConfigError) as err:
        ds.batch([9])  # tokens 72-80
    assert err.value.key == "model.vocab_size" and "train.bin holds token id 300 (at token 77)" in str(err.value)


@pytest.mark.parametrize("change", ["model.n_head=4", pytest.param("model.rope_theta=500000", marks=pytest.mark.slow),
                                    pytest.param("model.tie_embeddings=false", marks=pytest.mark.slow)])
def test_a_checkpoint_of_another_architecture_with_the_same_shapes_is_refused(cli, tmp_path, change):
    cli([*SHORT, "checkpoint.save_last=true", "trainer.save_weights=true"], tmp_path / "a").ok()
    for source in (f"checkpoint.resume_from={ckpt_of(tmp_path / 'a', 2)}",
                   f"model.init_from={tmp_path / 'a' / 'model.safetensors'}"):
        r = cli([*SHORT, change, source], tmp_path / f"b{len(source)}")
        assert r.returncode == 3, r.output[-2000:]
        lines = [ln for ln in r.err.splitlines() if ln.startswith("hydratrain: checkpoint error:")]
        assert len(lines) == 1 and f"model.{change.split('=')[0].split('.')[1]}:" in lines[0], r.err[-2000:]
        assert "Traceback" not in r.output


@pytest.mark.slow  # two launches
def test_relaunching_a_finished_run_keeps_its_results(cli, tmp_path):
    run = tmp_path / "r"
    cli([*SHORT, "checkpoint.save_last=true"], run).ok()
    before = results(run)
    assert before["train_loss"] is not None and before["tokens_per_sec"] > 0
    cli([*SHORT, "checkpoint.save_last=true"], run).ok()  # a requeue of a finished run: nothing to train
    after = results(run)
    assert after["steps_this_launch"] == 0
    for key in ("train_loss", "tokens_per_sec", "mfu", "first_loss"):
        assert after[key] == before[key], key


@pytest.mark.slow  # a sibling of it runs by default; CI runs this too (default suite near 4 minutes)
def test_a_relaunch_with_nothing_to_train_reports_no_figures_of_steps_it_does_not_have(cli, tmp_path):
    """The run trained to step 9, its newest checkpoint is step 5 (no save at the end): a relaunch resumes at 5 and,
    with max_steps=3, trains nothing. The results.json of step 9 is not this run's any more: its train loss, tokens/s
    and MFU used to be carried over as step 5's; now there is no train loss rather than a wrong one."""
    run = tmp_path / "r"
    common = ["strategy=single", "checkpoint.every_n_steps=5", "checkpoint.save_last=false"]
    cli([*common, "trainer.max_steps=9"], run).ok()
    assert results(run)["steps"] == 9 and results(run)["train_loss"] is not None
    r = cli([*common, "trainer.max_steps=3"], run).ok()
    after = results(run)
    assert (after["steps"], after["steps_this_launch"]) == (5, 0), r.output[-3000:]
    assert after["eval_loss"] is not None and after["first_loss"] is not None  # measured now / in the checkpoint
    for key in ("train_loss", "tokens_per_sec", "mfu"):
        assert after[key] is None, key
    (done,) = [ln for ln in r.output.splitlines() if "done: step 5" in ln]
    assert "train loss" not in done and "from results.json" not in done, done

def test_export_onto_a_directory_is_refused_and_leaves_no_file(cli, tmp_path, capsys):
    from hydratrain.checkpoint.export import main

    cli([*SHORT, "checkpoint.save_last=true"], tmp_path / "a").ok()
    target = tmp_path / "weights"
    target.mkdir()
    with pytest.raises(SystemExit) as exit_:
        main([str(ckpt_of(tmp_path / "a", 2)), str(target)])
    assert exit_.value.code == 2 and "must be a file path ending in .safetensors" in capsys.readouterr().err
    assert list(tmp_path.glob(".*tmp*")) == [] and list(target.iterdir()) == []
    # an OUT that cannot be written is one line (not a traceback, exit 1), before the checkpoint is read
    (tmp_path / "afile").write_text("x")
    for out, why in ((tmp_path / "afile" / "w.safetensors", "FileExistsError"),
                     (Path("/proc/w.safetensors"), "No such file or directory")):
        assert main([str(ckpt_of(tmp_path / "a", 2)), str(out)]) == 3
        err = capsys.readouterr().err
        assert err.startswith("hydratrain: output error: ") and str(out) in err and why in err, err
        assert err.count("\n") == 1 and "Traceback" not in err


def test_a_run_dir_whose_path_is_not_utf8_is_one_config_line(cli, tmp_path, monkeypatch):
    """A launch from a dir whose name is in a legacy encoding (Latin-1 ``lat\\xe9n``): every log line naming the run
    dir was a ``--- Logging error ---`` and TensorBoard's writer then failed with a traceback, exit 1."""
    import os

    launch = tmp_path / os.fsdecode(b"lat\xe9n")
    launch.mkdir()
    monkeypatch.chdir(launch)
    r = cli(["strategy=single", "trainer.max_steps=1"])
    assert r.returncode == 2, r.output[-3000:]
    assert r.err.strip().startswith("hydratrain: config error: hydra.run.dir=") and "holds bytes that are not UTF-8 " \
        "(b'\\xe9': a dir name in another encoding?)" in r.err, r.err[-3000:]
    assert "Logging error" not in r.output and "Traceback" not in r.output
    assert list(launch.iterdir()) == []  # the run dir this launch made for nothing is removed
