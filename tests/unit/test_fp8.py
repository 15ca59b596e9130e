"""precision=fp8 on CPU: which Linear layers torchao's float8 training converts (llama_1b built on meta, gpt_tiny),
the config error on a device without float8 compute (a run and ``--cfg job``), and a checkpoint that goes
fp8 -> bf16 -> fp8 with equal weights (torchao's emulation, ``precision.fp8_emulate=true``)."""
from __future__ import annotations

import torch
from omegaconf import OmegaConf

from helpers import ROOT, assert_same_tensors, ckpt_of, load_weights, log_of, requires, results
from hydratrain.checkpoint.io import read_all
from hydratrain.parallel import float8
from hydratrain.parallel.float8 import Float8, convert

pytestmark = requires("lowbit")

EMULATED = ["precision=fp8", "precision.fp8_emulate=true"]


def _meta_gpt(preset: str, **changes):
    """The built-in GPT of ``conf/model/<preset>.yaml`` on the meta device (no memory, any size)."""
    from hydratrain.models.gpt import GPT, GPTConfig

    node = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / f"{preset}.yaml"))
    kwargs = {k: v for k, v in node.items() if k not in ("_target_", "init_device", "init_from")}
    kwargs.update(vocab_size=kwargs["vocab_size"] or 256, **changes)
    with torch.device("meta"):
        return GPT(GPTConfig(**kwargs))


def _kinds(names) -> set:
    return {name.rsplit(".", 1)[-1] for name in names}


def test_llama_1b_converts_the_layers_torchaos_rule_says_gain():
    """tensorwise: q, o and the SwiGLU's three of each of the 16 blocks; k and v (2048 -> 512) too small to gain; the
    head tied to the embedding stays. rowwise (a stricter rule): only w1 and w3 (2048 -> 8192)."""
    from torchao.float8.float8_linear import Float8Linear

    model = _meta_gpt("llama_1b")
    done = convert(model, Float8("tensorwise"), all_gather=False)
    assert len(done.converted) == 80 and _kinds(done.converted) == {"wq", "wo", "w1", "w2", "w3"}
    assert {why: len(names) for why, names in done.kept.items()} == {"too small to gain": 32,
                                                                     "tied to another module": 1}
    assert _kinds(done.kept["too small to gain"]) == {"wk", "wv"} and done.kept["tied to another module"] == ["lm_head"]
    assert sum(isinstance(m, Float8Linear) for m in model.modules()) == 80
    assert model.lm_head.weight is model.tok_emb.weight  # still tied
    line = done.describe()
    assert line.startswith("float8 tensorwise: 80 of 113 Linear layers converted; kept in bf16: 32 too small to gain "
                           "(blocks.0.attn.wk, blocks.0.attn.wv, blocks.1.attn.wk and 29 more)"), line
    assert line.endswith("1 tied to another module (lm_head)")

    rowwise = convert(_meta_gpt("llama_1b"), Float8("rowwise"), all_gather=False)
    assert len(rowwise.converted) == 32 and _kinds(rowwise.converted) == {"w1", "w3"}


def test_gpt_tiny_is_too_small_and_the_size_rule_can_be_left_off():
    """gpt_tiny (128 wide) gains nothing by torchao's rule; without it every Linear with dims % 16 == 0 converts,
    and one whose width is not a multiple of 16 never does."""
    assert convert(_meta_gpt("gpt_tiny"), Float8(), all_gather=False).converted == ()
    done = convert(_meta_gpt("gpt_tiny"), Float8(size_rule=False), all_gather=False)
    assert len(done.converted) == 4 * 7 and list(done.kept) == ["tied to another module"]
    odd = convert(_meta_gpt("gpt_tiny", d_ff=200), Float8(size_rule=False), all_gather=False)
    assert _kinds(odd.kept["dims not multiples of 16"]) == {"w1", "w2", "w3"}


def test_float8_all_gather_only_where_torchao_and_the_backend_have_it():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert Float8("tensorwise").all_gather(True, cuda)
    assert not Float8("rowwise").all_gather(True, cuda)  # torchao gathers tensorwise scales only
    assert not Float8("tensorwise").all_gather(False, cuda)  # nothing sharded
    assert not Float8("tensorwise", emulate=True).all_gather(True, cpu)  # gloo has no float8 dtype


def test_a_device_without_float8_compute_is_one_config_error(cli, tmp_path, monkeypatch):
    r = cli(["strategy=single", "precision=fp8"], tmp_path)
    assert r.returncode == 2 and "process group" not in r.output
    line = ("hydratrain: config error: precision='fp8': needs a GPU of compute capability 8.9+ (H100, L4, ...); this "
            "device is the CPU")
    assert line in r.output, r.output[-2000:]
    r = cli(["--cfg", "job", "strategy=single", "precision=fp8"], tmp_path / "job")
    assert r.returncode == 2 and line in r.output
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (8, 0))
    assert float8.device_problem("cuda", emulate=False).endswith(
        "this device is NVIDIA A100-SXM4-80GB (compute capability 8.0)")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (9, 0))
    assert float8.device_problem("cuda", emulate=False) is None
    assert float8.device_problem("cpu", emulate=True) is None


def test_checkpoints_go_fp8_to_bf16_and_back_with_equal_weights(cli, tmp_path):
    """A float8 run's checkpoint holds the parameters in their own dtype under the names a bf16 run has: a bf16 run
    resumes from it, and a float8 run from the bf16 run's, each with exactly the weights saved (the resumed runs have
    no step left to train: each writes the weights it loaded, and the bf16 run saves them again at its end)."""
    common = ["strategy=single", "trainer.eval_every_n_steps=0", "trainer.eval_samples=4", "trainer.save_weights=true",
              "trainer.max_steps=1", "logger.peak_flops=1e12"]
    fp8 = [*EMULATED, "precision.fp8_size_rule=false"]
    a = cli([*common, *fp8, "checkpoint.every_n_steps=1"], tmp_path / "a").ok()
    assert "float8 tensorwise (emulated): 14 of 15 Linear layers converted" in a.output
    cli([*common, "precision=bf16", "checkpoint.save_last=true",
         f"checkpoint.resume_from={ckpt_of(tmp_path / 'a', 1)}"], tmp_path / "b").ok()
    cli([*common, *fp8, f"checkpoint.resume_from={ckpt_of(tmp_path / 'b', 1)}"], tmp_path / "c").ok()
    saved = {run: {k: v for k, v in read_all(ckpt_of(tmp_path / run, 1)).items() if k.startswith("model.")}
             for run in ("a", "b")}
    assert {v.dtype for v in saved["a"].values()} == {torch.float32}  # Float8Linear keeps its weight's own dtype
    assert_same_tensors(saved["a"], saved["b"], "the float8 run's checkpoint, saved again by the bf16 run")
    weights = {run: load_weights(tmp_path / run / "model.safetensors") for run in "abc"}
    assert_same_tensors(weights["a"], weights["b"], "bf16 run resumed from the float8 run's checkpoint")
    assert_same_tensors(weights["a"], weights["c"], "float8 run resumed from the bf16 run's checkpoint")
    assert "float8" not in log_of(tmp_path / "b") and results(tmp_path / "c")["steps"] == 1


def test_float8_all_gather_weights_initialise_save_and_load_as_plain_tensors(compose, tmp_path, monkeypatch):
    """The GPU path's FSDP float8 all-gather wraps each converted weight in torchao's float8-cast tensor; gloo has no
    float8 all-gather, so this builds it on one CPU rank without a forward (the wrapper forced on): the meta build
    initialises the same weights as bf16's, the exported weights and the checkpoint hold plain float32 tensors (a
    wrapper's storage made safetensors fail), a checkpoint loads back into the wrapped weights, an optimizer step
    precomputes torchao's scales, and the EMA's copies are plain tensors whose evaluation drops those scales."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.tensor import DTensor
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from hydratrain.parallel.build import build_model, build_strategy
    from hydratrain.parallel.precision import Precision
    from hydratrain.train.outputs import save_weights

    monkeypatch.setattr(Float8, "all_gather", lambda self, shards, device: shards)
    cpu = torch.device("cpu")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        built = {}
        for name, precision in (("bf16", ["precision=bf16"]), ("fp8", [*EMULATED, "precision.fp8_size_rule=false"])):
            cfg = compose(["strategy=fsdp", "model.init_device=meta", "device=cpu", *precision])
            strategy = build_strategy(cfg)
            model, raw, _, _ = build_model(cfg, strategy, Precision.resolve(cfg.precision, cpu), cpu, 256)
            save_weights(model, tmp_path / f"{name}.safetensors", True)
            built[name] = (model, raw, strategy, cfg)
        model, raw, strategy, cfg = built["fp8"]
        assert strategy.float8.all_gather and isinstance(raw.blocks[0].attn.wq.weight._local_tensor,
                                                         WeightWithDynamicFloat8CastTensor)
        weights = {name: load_weights(tmp_path / f"{name}.safetensors") for name in built}
        assert_same_tensors(weights["bf16"], weights["fp8"], "float8 all-gather build against bf16's")
        dcp.save({"model": get_model_state_dict(built["bf16"][0])}, checkpoint_id=str(tmp_path / "ckpt"))
        state = get_model_state_dict(model)
        assert all(type(v._local_tensor) is torch.Tensor for v in state.values() if isinstance(v, DTensor))
        for v in state.values():
            v.to_local().zero_() if isinstance(v, DTensor) else v.zero_()  # (into the wrapped weights themselves)
        assert not raw.blocks[0].attn.wq.weight.full_tensor().any()
        dcp.load({"model": state}, checkpoint_id=str(tmp_path / "ckpt"))
        set_model_state_dict(model, state)
        save_weights(model, tmp_path / "loaded.safetensors", True)
        assert_same_tensors(weights["bf16"], load_weights(tmp_path / "loaded.safetensors"), "loaded into float8")

        from hydratrain.optim import build_optimizer

        optimizer = build_optimizer(model, cfg.optim)
        float8.precompute_scales_after_each_step(optimizer, model, strategy.float8)
        for p in model.parameters():
            p.grad = DTensor.from_local(torch.zeros(p.to_local().shape), p.device_mesh, p.placements, shape=p.shape,
                                        stride=p.stride())
        optimizer.step()
        wq = raw.blocks[0].attn.wq.weight
        assert wq._local_tensor._precomputed_scale is not None

        from hydratrain.train.ema import EMA

        ema = EMA(model, decay=0.9)  # trainer.ema: its copies (checkpointed, written as safetensors) are plain too
        assert all(type(v._local_tensor) is torch.Tensor for v in ema.state_dict()["weights"].values())
        with ema.swapped(raw):  # the EMA's values in the weights: the raw weights' precomputed scales are dropped
            assert wq._local_tensor._precomputed_scale is None
    finally:
        dist.destroy_process_group()
