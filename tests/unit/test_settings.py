"""One owner per setting: hydratrain's keys of every group are in the composed config with the schema's default,
whether or not the option file lists them, and the run reads them through one resolved object
(:mod:`hydratrain.config.settings`), so ``--cfg job`` and the run agree on every key."""
from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from helpers import log_of, results
from hydratrain.config.schema import LOADER_KEYS, MODEL_KEYS, SCHEMAS, LoaderKeys, ModelKeys
from hydratrain.config.settings import DataSettings, ModelSettings, option_value, plus_as_force
from hydratrain.config.validate import validate


def test_a_data_file_holding_only_its_function_trains_with_the_documented_loader_defaults(cli, own):
    """A data file with ``_target_`` and its own keyword only: ``--cfg job`` printed it and exited 0, and the run
    ended on every rank with ``Key 'batch_size' is not in struct`` after the process group had started. A loader
    key the file leaves out is set on the command line without Hydra's ``+``."""
    (own / "my_conf" / "data" / "bare.yaml").write_text("_target_: mypkg.data.spirals\nn: 600\n")
    (own / "my_conf" / "model" / "bare.yaml").write_text("_target_: mypkg.nets.ResMLP\n")
    args = ["--config-dir", "my_conf", "data=bare", "model=bare", "loss=cross_entropy", "strategy=single",
            "device=cpu", "precision=fp32", "logger.peak_flops=1e11", "trainer.max_steps=1",
            "trainer.eval_every_n_steps=0", "trainer.eval_samples=16", "trainer.progress_bar=false",
            "data.val_fraction=0.25"]
    printed = cli(["--cfg", "job", *args], fast=False)
    assert printed.returncode == 0, printed.output[-2000:]
    data = OmegaConf.create(printed.out).data
    assert {k: data[k] for k in LOADER_KEYS} == {**dataclasses.asdict(LoaderKeys()), "val_fraction": 0.25}
    r = cli(args, own / "run", fast=False)  # (spirals returns its own val split: val_fraction is composed, unused)
    assert r.returncode == 0, r.output[-3000:]
    assert "train 480 samples, val 120 samples (eval on 16), 8 per micro-batch per rank, 0 loader worker(s)" in \
        log_of(own / "run")
    assert results(own / "run")["hparams"]["data.batch_size"] == 8


def test_hand_made_nodes_read_the_schema_defaults():
    """A config made by hand (no composition) gets the values a composed one holds."""
    assert DataSettings.of(OmegaConf.create({"_target_": "mypkg.data.spirals"})) == DataSettings(
        **dataclasses.asdict(LoaderKeys()), seq_len=0, is_dataset=True)
    corpus = DataSettings.of(OmegaConf.create({"name": "synthetic", "seq_len": 64, "batch_size": "AUTO"}))
    assert (corpus.batch_size, corpus.seq_len, corpus.is_dataset) == ("auto", 64, False)
    assert corpus.with_batch_size(12).batch_size == 12
    assert ModelSettings.of(None) == ModelSettings(**dataclasses.asdict(ModelKeys()))
    assert option_value(OmegaConf.create({"name": "none"}), "min_num_params", SCHEMAS["wrap_policy"]["size_based"]) \
        == 100_000


@pytest.mark.parametrize("group", sorted(SCHEMAS))
def test_an_option_file_that_leaves_out_every_optional_key_composes_to_the_schema_defaults(compose, tmp_path, group):
    """Each option of each typed group, written with only its schema line and its name (and what has no default),
    composes to every key of its schema with the schema's default, and passes the run's checks."""
    conf = tmp_path / "conf"
    for option, schema in SCHEMAS[group].items():
        required = {f.name: _stand_in(f) for f in dataclasses.fields(schema) if f.default == "???"}
        required.pop("name", None)
        (conf / group).mkdir(parents=True, exist_ok=True)
        (conf / group / f"bare_{option}.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(
            {"defaults": [f"/schema/{group}/{option}@_here_", "_self_"], "name": option, **required})))
        overrides = [f"hydra.searchpath=[file://{conf}]", f"{group}=bare_{option}"]
        if group == "wrap_policy" and option in ("size_based", "transformer_block"):
            overrides.append("strategy=fsdp")
        cfg = compose(overrides)
        node = cfg[group]
        for f in dataclasses.fields(schema):
            if f.name not in required and f.name != "name":
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                assert node[f.name] == default, (group, option, f.name)
        if group == "data":  # and the loader's keys, which every data option holds
            assert set(LOADER_KEYS) <= set(node)
        if group != "launcher":  # (a launcher's own checks need its plugin's extras)
            validate(cfg)


def _stand_in(f: dataclasses.Field):
    return ["notes/*.md"] if "List" in str(f.type) else "x.bin"


def test_a_loader_key_on_a_built_in_corpus_is_refused_and_plus_still_sets_a_key_every_node_has(compose):
    cfg = compose(["data.num_workers=2"])
    with pytest.raises(Exception, match=r"data.num_workers=2: not used by data=python_stdlib"):
        validate(cfg)
    assert set(MODEL_KEYS) <= set(compose([]).model)
    assert plus_as_force(["+model.init_device=meta", "+data.num_workers=2", "+model.dropout=0.1", "++data.n=3"]) == \
        ["++model.init_device=meta", "++data.num_workers=2", "+model.dropout=0.1", "++data.n=3"]
