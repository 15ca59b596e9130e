"""The paths group: both presets, environment overrides, data.cache_dir winning, and run dirs built from
paths.output_dir unless hydra.run.dir / hydra.sweep.dir are given."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from hydratrain.paths import Paths

STAMP = r"\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d"
PATH_VARS = ("HYDRATRAIN_DATA_DIR", "HYDRATRAIN_OUTPUT_DIR", "HYDRATRAIN_CACHE", "HYDRATRAIN_MODEL_DIR", "WORKSPACE")


@pytest.fixture
def no_path_env(monkeypatch):
    for var in PATH_VARS:
        monkeypatch.delenv(var, raising=False)


def test_default_preset_is_the_old_layout(compose, no_path_env, tmp_path):
    cfg = compose(return_hydra_config=True)
    assert re.fullmatch(f"outputs/{STAMP}", cfg.hydra.run.dir), cfg.hydra.run.dir
    assert re.fullmatch(f"multirun/{STAMP}", cfg.hydra.sweep.dir), cfg.hydra.sweep.dir
    p = Paths.resolve(cfg, tmp_path)
    assert (p.data, p.output, p.model) == (tmp_path, tmp_path, tmp_path)
    assert p.cache == Path.home() / ".cache" / "hydratrain"


def test_workspace_preset_puts_everything_under_one_root(compose, no_path_env, monkeypatch, tmp_path):
    monkeypatch.setenv("WORKSPACE", str(tmp_path / "ws"))
    cfg = compose(["paths=workspace"], return_hydra_config=True)
    ws = tmp_path / "ws"
    assert re.fullmatch(f"{ws}/outputs/{STAMP}", cfg.hydra.run.dir)
    assert re.fullmatch(f"{ws}/multirun/{STAMP}", cfg.hydra.sweep.dir)
    p = Paths.resolve(cfg, tmp_path / "launch")
    assert (p.data, p.output, p.cache, p.model) == (ws / "data", ws, ws / "cache", ws / "models")
    monkeypatch.delenv("WORKSPACE")
    assert compose(["paths=workspace"]).paths.data_dir == "/workspace/data"


@pytest.mark.parametrize("preset", ["default", "workspace"])
def test_each_key_is_overridable_from_the_environment(compose, no_path_env, monkeypatch, tmp_path, preset):
    for var, sub in (("HYDRATRAIN_DATA_DIR", "d"), ("HYDRATRAIN_OUTPUT_DIR", "o"), ("HYDRATRAIN_CACHE", "c"),
                     ("HYDRATRAIN_MODEL_DIR", "m")):
        monkeypatch.setenv(var, str(tmp_path / sub))
    cfg = compose([f"paths={preset}"], return_hydra_config=True)
    p = Paths.resolve(cfg, tmp_path)
    assert (p.data, p.output, p.cache, p.model) == tuple(tmp_path / s for s in "docm")
    assert cfg.hydra.run.dir.startswith(f"{tmp_path}/o/outputs/")


def test_relative_values_resolve_against_the_launch_dir_and_data_cache_dir_wins(compose, no_path_env, tmp_path):
    cfg = compose(["paths.data_dir=corpora", "paths.cache_dir='~/c'", "paths.model_dir=../models",
                   "paths.output_dir=runs"], return_hydra_config=True)
    p = Paths.resolve(cfg, tmp_path)
    assert (p.data, p.cache, p.model) == (tmp_path / "corpora", Path.home() / "c", tmp_path / "../models")
    assert re.fullmatch(f"runs/outputs/{STAMP}", cfg.hydra.run.dir)
    cfg = compose(["data=python_stdlib", "data.cache_dir=mycache", "paths=workspace"])
    assert Paths.resolve(cfg, tmp_path).cache == tmp_path / "mycache"


def test_run_and_sweep_dirs_given_on_the_command_line_are_honoured(compose, no_path_env):
    cfg = compose(["paths=workspace", "hydra.run.dir=here/run", "hydra.sweep.dir=/abs/sweep"],
                  return_hydra_config=True)
    assert (cfg.hydra.run.dir, cfg.hydra.sweep.dir) == ("here/run", "/abs/sweep")


def test_export_of_a_byte_level_model_removes_an_earlier_exports_tokenizer(monkeypatch, tmp_path, capsys):
    """Exporting a byte-level checkpoint over an earlier subword export of the same name leaves no stale
    ``<name>.tokenizer.json`` (it would be taken as the new model's), and the message names only what was written."""
    import torch

    import hydratrain.checkpoint.export as export
    import hydratrain.checkpoint.io as io
    from hydratrain.checkpoint.export import main

    monkeypatch.setattr(io, "read_model_weights", lambda ckpt: {"w": torch.zeros(2)})  # (export imports it per call)
    monkeypatch.setattr(export, "resolve_checkpoint", lambda path: path)
    bpe, byte = tmp_path / "bpe" / "step_00000002", tmp_path / "byte" / "step_00000002"
    bpe.mkdir(parents=True)
    byte.mkdir(parents=True)
    (bpe / "tokenizer.json").write_text("{}")
    out = tmp_path / "out" / "m.safetensors"
    assert main([str(bpe), str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out} and {out.with_name('m.tokenizer.json')}"
    assert main([str(byte), str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    assert sorted(p.name for p in out.parent.iterdir()) == ["m.safetensors"]


def test_export_writes_a_relative_file_under_the_model_dir(monkeypatch, tmp_path):
    import hydratrain.checkpoint.export as export

    written = []
    monkeypatch.setattr(export, "export", lambda ckpt, out: written.append(out) or out)
    monkeypatch.setenv("HYDRATRAIN_MODEL_DIR", str(tmp_path / "env"))
    export.main(["ckpt", "a.safetensors"])
    export.main(["ckpt", "b.safetensors", "--model-dir", str(tmp_path / "flag")])
    export.main(["ckpt", str(tmp_path / "c.safetensors")])
    assert written == [tmp_path / "env" / "a.safetensors", tmp_path / "flag" / "b.safetensors",
                       tmp_path / "c.safetensors"]


def test_a_valid_long_file_name_is_written_through_a_temporary_name_that_fits(tmp_path):
    """A 252-byte export name is valid, but its temporary name ``.<name>.tmp<pid>`` passed the 255-byte limit:
    ``File name too long``, nothing written."""
    import torch

    from hydratrain.checkpoint.export import write_safetensors
    from hydratrain.paths import temporary_sibling

    out = tmp_path / ("b" * 240 + ".safetensors")
    assert temporary_sibling(out).parent == tmp_path and len(temporary_sibling(out).name) <= 255
    assert temporary_sibling(tmp_path / "w.safetensors").name.startswith(".w.safetensors.tmp")
    write_safetensors({"w": torch.ones(2)}, out, metadata={})
    assert [p.name for p in tmp_path.iterdir()] == [out.name]
