"""Trackers on 2 gloo ranks under torchrun: MLflow, the CSV file and W&B (offline) hold TensorBoard's values at every
logged step; no credential reaches a file; a killed and resumed run stays one MLflow run. Each tracker's own file
format is read with its own library (MlflowClient; W&B's records with ``wandb.proto``)."""
from __future__ import annotations

import csv
import json
import struct
from pathlib import Path

import pytest

from helpers import FAULTY, run, tb_all

SECRETS = {"WANDB_API_KEY": "wandb-key-0123456789abcdef0123456789abcdef01234567",
           "MLFLOW_TRACKING_PASSWORD": "mlflow-password-7f3a9c"}
RUN = ["strategy=ddp", "trainer.max_steps=6", "trainer.log_every_n_steps=2", "trainer.eval_every_n_steps=3"]
LOGGED = ("train/", "perf/", "mem/", "eval/", "test/")  # the scalars of the run (not the hparams row's hparam/*)


def tensorboard(run_dir: Path) -> dict[str, dict[int, float]]:
    return {tag: points for tag, points in tb_all(run_dir).items() if tag.startswith(LOGGED)}


def mlflow_history(output_dir: Path, run_id: str, tags) -> tuple[object, dict[str, dict[int, list[float]]]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{output_dir / 'mlruns' / 'mlflow.db'}")
    history = {tag: {} for tag in tags}
    for tag in tags:
        for m in client.get_metric_history(run_id, tag):
            history[tag].setdefault(m.step, []).append(m.value)
    return client, history


def wandb_history(run_dir: Path) -> dict[str, dict[int, float]]:
    """The history rows of the offline W&B run in ``run_dir``: its ``.wandb`` file is W&B's record log (LevelDB's
    log format: 32 KiB blocks of records with a 7-byte header, after a 7-byte file header) of ``wandb.proto``
    Records."""
    from wandb.proto.wandb_internal_pb2 import Record

    (path,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    data, pos, part, out = path.read_bytes(), 7, b"", {}
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if not kind:
            break
        part, pos = part + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last part of one
            record = Record()
            record.ParseFromString(part)
            part = b""
            if record.WhichOneof("record_type") == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                       for item in record.history.item}
                for tag, value in row.items():
                    if tag.startswith(LOGGED):
                        out.setdefault(tag, {})[int(row["_step"])] = value
    return out


def test_two_rank_run_mlflow_csv_and_wandb_hold_tensorboards_values_and_no_credential(tmp_path):
    pytest.importorskip("mlflow", reason="logger=mlflow needs the extra: pip install 'hydratrain[mlflow]'")
    pytest.importorskip("wandb", reason="logger=wandb needs the extra: pip install 'hydratrain[wandb]'")
    run_dir = tmp_path / "outputs" / "run"
    run([*RUN, "logger=[tensorboard,mlflow,csv,wandb]", "logger.wandb.mode=offline",
         f"paths.output_dir={tmp_path}"], run_dir, nproc=2, env=SECRETS).ok()
    tb = tensorboard(run_dir)
    assert {"train/loss", "perf/tokens_per_sec", "mem/peak", "eval/loss"} <= set(tb), sorted(tb)
    assert sorted(tb["train/loss"]) == [1, 2, 4, 6] and sorted(tb["eval/loss"]) == [3, 6]

    def same(got: dict[str, dict[int, float]], name: str) -> None:  # TensorBoard keeps float32
        assert set(got) == set(tb), f"{name}: {sorted(got)}"
        for tag, points in tb.items():
            assert got[tag] == pytest.approx(points, rel=1e-6), f"{name} {tag}: {got[tag]} vs {points}"

    ids = json.loads((run_dir / "trackers.json").read_text())
    client, history = mlflow_history(tmp_path, ids["mlflow"], tb)
    assert all(len(v) == 1 for points in history.values() for v in points.values())  # each step once
    same({tag: {s: v[0] for s, v in points.items()} for tag, points in history.items()}, "mlflow")
    mlflow_run = client.get_run(ids["mlflow"])
    assert mlflow_run.info.status == "FINISHED" and mlflow_run.info.run_name == "outputs/run"
    assert mlflow_run.data.params["optim.lr"] and "strategy=ddp" in mlflow_run.data.params["overrides"]
    assert "final/eval_loss" in mlflow_run.data.metrics and "final/objective" in mlflow_run.data.metrics
    with (run_dir / "metrics.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 6]  # one row per logged step (3: the eval alone)
    same({tag: {int(r["step"]): float(r[tag]) for r in rows if r[tag]} for tag in rows[0] if tag != "step"}, "csv")
    same(wandb_history(run_dir), "wandb")
    assert ids["wandb"] in str(next((run_dir / "wandb").glob("offline-run-*")))
    leaks = [p for p in tmp_path.rglob("*") if p.is_file() and any(s.encode() in p.read_bytes()
                                                                    for s in SECRETS.values())]
    assert not leaks, leaks


@pytest.mark.slow  # two one-process launches (the trackers are rank 0's: the 2-rank test above covers rank 1)
def test_a_killed_and_resumed_run_stays_one_mlflow_run(tmp_path):
    pytest.importorskip("mlflow", reason="logger=mlflow needs the extra: pip install 'hydratrain[mlflow]'")
    run_dir = tmp_path / "outputs" / "run"
    args = [*RUN, "strategy=single", "trainer.log_every_n_steps=1", "checkpoint.every_n_steps=3",
            "logger=[tensorboard,mlflow,csv]", f"paths.output_dir={tmp_path}"]
    killed = run(args, run_dir, script=FAULTY, env={"HT_FAULT": "kill", "HT_FAULT_STEP": "3",
                                                     "HT_FAULT_AT": "after_step", "HT_FAULT_RANK": "all"})
    assert killed.returncode != 0 and not (run_dir / "results.json").exists(), killed.output[-3000:]
    first = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    run(args, run_dir).ok()
    assert json.loads((run_dir / "trackers.json").read_text())["mlflow"] == first
    tb = tensorboard(run_dir)
    client, history = mlflow_history(tmp_path, first, tb)
    (only,) = client.search_runs([client.get_experiment_by_name("hydratrain").experiment_id])
    assert only.info.run_id == first and only.info.status == "FINISHED"
    assert sorted(history["train/loss"]) == list(range(1, 7))  # steps 4-6 follow the resume point
    for tag, points in tb.items():
        assert {s: v[-1] for s, v in history[tag].items()} == pytest.approx(points, rel=1e-6), tag
    with (run_dir / "metrics.csv").open(newline="") as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == list(range(1, 7))
