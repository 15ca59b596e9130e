"""paths=workspace end to end: a run launched from elsewhere (hydra.job.chdir=true) reads its relative data from
<root>/data and its relative model.init_from from <root>/models, caches the corpus in <root>/cache and lands in
<root>/outputs (single run) or <root>/multirun (a torchrun-launcher sweep); nothing is written to the launch dir."""
from __future__ import annotations

from helpers import log_of, results, run

PATH_VARS = ("HYDRATRAIN_DATA_DIR", "HYDRATRAIN_OUTPUT_DIR", "HYDRATRAIN_CACHE", "HYDRATRAIN_MODEL_DIR")


def test_workspace_layout_for_a_run_and_a_launcher_sweep(tmp_path, monkeypatch):
    for var in PATH_VARS:
        monkeypatch.delenv(var, raising=False)
    ws, launch = tmp_path / "ws", tmp_path / "launch"
    (ws / "data" / "notes").mkdir(parents=True)
    launch.mkdir()
    for i in range(4):
        (ws / "data" / "notes" / f"n{i}.txt").write_text(f"note {i}: the quick brown fox jumps over the dog\n" * 80)
    run(["strategy=single", "trainer.max_steps=2", "checkpoint.save_last=true"], tmp_path / "src").ok()
    from hydratrain.checkpoint.export import main as export

    assert export([str(tmp_path / "src"), "w.safetensors", "--model-dir", str(ws / "models")]) == 0

    common = ["paths=workspace", "data=text_files", "data.paths=[notes/*.txt]", "data.val_fraction=0.3",
              "model.init_from=w.safetensors", "hydra.job.chdir=true", "trainer.max_steps=2"]
    env = {"WORKSPACE": str(ws)}
    run(["strategy=single", *common], cwd=launch, env=env).ok()
    (run_dir,) = [p for p in (ws / "outputs").glob("*/*") if p.is_dir()]
    assert f"initialised the model from {ws / 'models' / 'w.safetensors'}" in log_of(run_dir)
    assert results(run_dir)["steps"] == 2
    assert [p for p in (ws / "cache").iterdir() if p.is_dir()], "no corpus cache under <root>/cache"

    run(["launcher=torchrun", "launcher.nproc_per_node=2", "strategy=ddp", *common], cwd=launch, env=env).ok()
    (sweep,) = [p for p in (ws / "multirun").glob("*/*") if p.is_dir()]
    assert results(sweep / "0")["steps"] == 2 and (sweep / "sweep_report.md").is_file()
    assert "initialised the model from" in log_of(sweep / "0")
    assert list(launch.iterdir()) == []
