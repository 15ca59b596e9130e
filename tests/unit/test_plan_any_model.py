"""The memory planner for any model (hydratrain.stepsim): a user's module is planned from its meta build and one
simulated training step, exactly as real CPU tensors count; what it cannot predict is named; the planner imports no
model; and ``python -m hydratrain.plan`` says what it planned for, for the GPT and for a user's model."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import requires
from hydratrain import stepsim
from hydratrain.footprint import ModelSpec, PlanUnavailable, Setup, padded
from hydratrain.memsim import Mode
from hydratrain.plan import predict
from live_bytes import LiveBytes

SRC = Path(__file__).resolve().parents[2] / "src" / "hydratrain"
PLANNER = ["plan/__init__.py", "plan/__main__.py", "plan_cli.py", "footprint.py", "memsim.py", "stepsim.py"]


class Net(nn.Module):
    """A user's model: conv blocks with BatchNorm in an nn.ModuleList, LayerNorm, a linear head."""

    def __init__(self, channels: int = 8, depth: int = 2, classes: int = 10):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(channels if i else 1, channels, 3, padding=1),
                                                  nn.BatchNorm2d(channels), nn.ReLU()) for i in range(depth))
        self.norm = nn.LayerNorm(channels)
        self.head = nn.Linear(channels, classes)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x.mean(dim=(2, 3))))


class DictNet(nn.Module):
    """A Hugging Face-style model: ``model(**batch)`` returns a dict with its own loss."""

    def __init__(self, vocab: int = 50, width: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.out = nn.Linear(width, vocab)

    def forward(self, input_ids, labels):
        logits = self.out(self.emb(input_ids))
        return {"logits": logits, "loss": nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())}


class Positions(nn.Module):
    """A forward that makes tensors of its own on its input's device: positions and a causal averaging mask."""

    def __init__(self, vocab: int = 50, width: int = 16, max_len: int = 32):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(max_len, width)
        self.out = nn.Linear(width, vocab)

    def forward(self, idx):
        T = idx.shape[1]
        mask = torch.ones(T, T, device=idx.device).tril()
        h = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        return self.out((mask @ h) / mask.sum(-1, keepdim=True))


class Picky(nn.Module):
    """A forward whose shapes depend on the data (boolean masking): it cannot run on storage-less tensors."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x[x.sum(dim=1) > 0])


class MetaShy(nn.Module):
    """A constructor that reads its own weights' values: it cannot be built on the meta device."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = float(self.lin.weight.detach().abs().max())


class AttentionLM(nn.Module):
    """Hand-written causal attention (nanoGPT's): heads merged back by ``transpose(1, 2).reshape``, a copy."""

    def __init__(self, vocab: int = 50, width: int = 16, heads: int = 2):
        super().__init__()
        self.heads, self.tok, self.qkv = heads, nn.Embedding(vocab, width), nn.Linear(width, 3 * width)
        self.proj, self.out = nn.Linear(width, width), nn.Linear(width, vocab)

    def forward(self, idx):
        x = self.tok(idx)
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in self.qkv(x).split(C, dim=2))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(x + self.proj(y.transpose(1, 2).reshape(B, T, C)))


class TorchLayersLM(nn.Module):
    """torch's own layers: nn.TransformerEncoder (nn.MultiheadAttention) with a causal mask, then a batch-first
    nn.GRU (whose kernel transposes its output in place)."""

    def __init__(self, vocab: int = 50, width: int = 16):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, 2, 2 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.rnn = nn.GRU(width, width, batch_first=True)
        self.out = nn.Linear(width, vocab)

    def forward(self, idx):
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1], device=idx.device)
        h, _ = self.rnn(self.enc(self.tok(idx), mask=mask, is_causal=True))
        return self.out(h)


class LSTMNet(nn.Module):
    def __init__(self, vocab: int = 50, width: int = 16):
        super().__init__()
        self.tok, self.rnn, self.out = nn.Embedding(vocab, width), nn.LSTM(width, width, batch_first=True), \
            nn.Linear(width, vocab)

    def forward(self, idx):
        return self.out(self.rnn(self.tok(idx))[0])


def spec_of(cls, batch, loss="torch.nn.CrossEntropyLoss", **kwargs) -> ModelSpec:
    target = f"{cls.__module__}.{cls.__qualname__}"
    return ModelSpec(target, json.dumps({"_target_": target, **kwargs}), json.dumps({"_target_": loss}),
                     stepsim.describe(batch))


def _real_step(model, batch, loss_fn, autocast, drop_grads: bool) -> tuple[int, int, int]:
    """(forward peak, kept for backward, backward peak) of one real CPU step, bytes beyond the model and batch."""
    from hydratrain.train.batch import forward, loss_of

    model.train()
    if drop_grads:
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    live = LiveBytes()
    for t in (*model.parameters(), *model.buffers(), *torch.utils._pytree.tree_leaves(batch)):
        live.track(t)
    fixed = live.now
    with live:
        outputs = forward(model, batch, torch.autocast("cpu", dtype=autocast or torch.bfloat16,
                                                       enabled=autocast is not None))
        loss = loss_of(outputs, batch, loss_fn)
        del outputs
        fwd, kept = live.peak - fixed, live.now - fixed
        live.peak = live.now
        loss.backward()
    return fwd, kept, live.peak - fixed


# ------------------------------------------------------------------------------------------------ the seam
def test_the_planner_imports_no_model():
    """The planner asks a model class for its memory model by convention (``memory_plan``), as MFU asks for
    ``flops_per_token``: no planner module imports hydratrain.models (at its top or inside a function)."""
    for name in PLANNER:
        tree = ast.parse((SRC / name).read_text())
        for node in ast.walk(tree):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(m == "hydratrain.models" or m.startswith("hydratrain.models.") for m in modules), \
                (name, node.lineno, modules)


def test_a_gpt_subclass_is_simulated_not_given_the_gpts_model():
    """The GPT's analytic model describes its own forward; a subclass may change it, so it gets the generic plan."""
    from hydratrain.models.gpt import GPT

    class Wider(GPT):
        pass

    kw = dict(vocab_size=64, max_seq_len=32, d_model=32, n_layer=2, n_head=2)
    batch = (torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 16, dtype=torch.long))
    gpt = predict(Setup(spec_of(GPT, batch, "hydratrain.losses.NextTokenLoss", **kw), batch_size=2, seq_len=16))
    assert "logits/loss" in gpt.notes and gpt.model_desc.startswith("model 2 x 32")
    Wider.__qualname__ = "Wider"
    globals()["Wider"] = Wider  # importable by its dotted name, as a user's class is
    try:
        sub = predict(Setup(spec_of(Wider, batch, "hydratrain.losses.NextTokenLoss", **kw), batch_size=2,
                            seq_len=16))
    finally:
        del globals()["Wider"]
    assert "logits/loss" not in sub.notes and sub.model_desc == f"model {__name__}.Wider (34,976 parameters)"
    assert sub.n_params == gpt.n_params and not sub.unpredicted


# ---------------------------------------------------------------------------------------- the simulated step
@pytest.mark.parametrize("autocast, checkpointed", [(None, False), (torch.bfloat16, False), (None, True)])
def test_the_simulated_step_of_a_user_model_is_what_real_cpu_tensors_hold(autocast, checkpointed):
    """One real training step on CPU (forward under autocast, the loss, backward; activation checkpointing on the
    model's blocks) against the simulation on storage-less tensors: the same bytes at the forward's peak, after it
    and at the backward's peak, exactly; and with the gradients kept, the same whole-step peak."""
    from hydratrain.parallel.ac_compile import apply_activation_checkpointing
    from hydratrain.parallel.blocks import find_blocks

    batch = (torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,)))
    trace = stepsim.trace(spec_of(Net, batch), 16, Mode(torch.float32, autocast), checkpointed, False)
    assert not trace.error

    def model():
        net = Net()
        if checkpointed:
            apply_activation_checkpointing(net, find_blocks(net))
        return net
    assert (trace.fwd_peak, trace.kept, trace.bwd_peak) == _real_step(model(), batch, nn.CrossEntropyLoss(),
                                                                      autocast, drop_grads=True)
    alive, phase, grads = trace.peak(1.0)  # fp32 gradients of a full replica, from each parameter's backward
    assert alive + grads == _real_step(model(), batch, nn.CrossEntropyLoss(), autocast, drop_grads=False)[2]
    assert phase == "backward"


def test_a_dict_batch_and_the_models_own_loss_are_simulated_too():
    batch = {"input_ids": torch.randint(0, 50, (4, 12)), "labels": torch.randint(0, 50, (4, 12))}
    trace = stepsim.trace(spec_of(DictNet, batch), 4, Mode(torch.float32, None), False, False)
    assert not trace.error
    assert (trace.fwd_peak, trace.kept, trace.bwd_peak) == _real_step(DictNet(), batch, None, None, True)


def test_tensors_a_forward_makes_are_simulated_and_counted_too():
    """torch.arange / torch.ones on the input's device inside forward: storage-less in the simulation (a causal mask
    of a long sequence is not allocated by the planner) and counted as the real step holds them."""
    batch = (torch.randint(0, 50, (4, 12)), torch.randint(0, 50, (4, 12)))
    trace = stepsim.trace(spec_of(Positions, batch, "hydratrain.losses.NextTokenLoss"), 4, Mode(torch.float32, None),
                          False, False)
    assert not trace.error
    from hydratrain.losses import NextTokenLoss

    assert (trace.fwd_peak, trace.kept, trace.bwd_peak) == _real_step(Positions(), batch, NextTokenLoss(), None, True)


@pytest.mark.parametrize("cls", [AttentionLM, TorchLayersLM])
def test_transformers_and_rnns_are_simulated_as_real_cpu_tensors_hold_them(cls):
    """A reshape that copies (heads merged after a transpose), nn.MultiheadAttention, nn.TransformerEncoder and a
    batch-first nn.GRU run on storage-less tensors, with the bytes of the real step."""
    from hydratrain.losses import NextTokenLoss

    batch = (torch.randint(0, 50, (4, 12)), torch.randint(0, 50, (4, 12)))
    trace = stepsim.trace(spec_of(cls, batch, "hydratrain.losses.NextTokenLoss"), 4, Mode(torch.float32, None),
                          False, False)
    assert not trace.error and not trace.unsized, trace
    torch.manual_seed(0)
    assert (trace.fwd_peak, trace.kept, trace.bwd_peak) == _real_step(cls(), batch, NextTokenLoss(), None, True)


def test_a_kernel_buffer_no_shape_tells_is_named_as_a_limit_of_the_planner():
    """oneDNN's LSTM keeps a workspace whose size torch's meta kernel does not know: the plan says so."""
    batch = (torch.randint(0, 50, (4, 12)), torch.randint(0, 50, (4, 12)))
    plan = predict(Setup(spec_of(LSTMNet, batch, "hydratrain.losses.NextTokenLoss"), batch_size=4, seq_len=0))
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch runs nn.LSTM without oneDNN")
    assert "activations" in plan.parts and plan.unpredicted == [
        "the oneDNN workspace of nn.LSTM layers on a CPU (its size is the library's own, not known from shapes: a "
        "limit of the planner)"]


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        logits = self.lin(x)
        return logits, logits.softmax(-1)


def test_a_loss_that_refuses_the_outputs_is_not_called_a_limit_of_the_planner_nor_quoted_before_the_first_step():
    batch = (torch.randn(8, 4), torch.randint(0, 3, (8,)))
    plan = predict(Setup(spec_of(Pair, batch), batch_size=8, seq_len=0))
    assert plan.unpredicted == ["activations and the loss (the loss did not take the model's storage-less outputs "
                                "(TypeError; if the real outputs fail too, the first step says why))"]


def test_state_bytes_come_exactly_from_the_meta_build():
    """Parameters (and buffers), gradients and AdamW's moments of the generic plan are the real model's bytes,
    and under FSDP this rank's padded shard of each."""
    net = Net(channels=6)
    batch = (torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,)))
    spec = spec_of(Net, batch, channels=6)
    plan = predict(Setup(spec, batch_size=4, seq_len=0, grad_accum_steps=2))  # gradients held at every moment
    param_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    buffers = sum(b.numel() * b.element_size() for b in net.buffers())
    optimizer = torch.optim.AdamW(net.parameters())
    net(batch[0]).sum().backward()
    optimizer.step()
    moments = sum(v.numel() * v.element_size() for st in optimizer.state.values() for k, v in st.items()
                  if k != "step")
    assert plan.parts["parameters"] == param_bytes + buffers and plan.parts["optimizer"] == moments
    assert plan.parts["gradients"] == param_bytes
    fsdp = predict(Setup(spec, strategy="fsdp", world_size=2, batch_size=4, seq_len=0))
    shards = sum(padded(tuple(p.shape), 2)[1] * 4 for p in net.parameters())
    assert fsdp.parts["parameters"] == shards + buffers and fsdp.parts["optimizer"] == 2 * shards
    assert fsdp.parts["fsdp buffers"] > 0


def test_what_cannot_be_simulated_is_named_not_guessed():
    batch = (torch.randn(8, 4), torch.randint(0, 4, (8,)))
    plan = predict(Setup(spec_of(Picky, batch), batch_size=8, seq_len=0))
    assert "activations" not in plan.parts and plan.parts["parameters"] == 4 * (16 + 4)
    assert plan.unpredicted and plan.unpredicted[0].startswith("activations and the loss (the planner could not "
                                                               "simulate the step on storage-less tensors, a limit "
                                                               "of the planner")
    assert "not predicted: activations" in plan.summary() and plan.not_covered()[0] == plan.unpredicted[0]
    with pytest.raises(PlanUnavailable, match=r"MetaShy does not build on the meta device"):
        predict(Setup(spec_of(MetaShy, batch), batch_size=8, seq_len=0))


# ------------------------------------------------------------------------------------------------------ CLI
def test_the_cli_first_states_what_it_planned_for(capsys, monkeypatch):
    """The first line names the device, the ranks, the micro-batch and its length, and the precision; a device
    chosen by device=auto for lack of a GPU, and a sequence far below the model's max_seq_len, are warned about; on
    CPU the plan says what it does not cover (the allocator's heap that made a run 44 % above its plan)."""
    from hydratrain.plan_cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["model=gpt_tiny", "strategy=single", "precision=fp32", "data=synthetic", "data.batch_size=4",
                 "data.seq_len=64", "plan.memory_gb=8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("planned for: device cpu (device=auto on this host, which has no GPU), 1 rank "
                        "(strategy=single), micro-batch 4 x 64 tokens, precision=fp32"), lines[0]
    assert lines[1].startswith("warning: planned for this host's CPU because device=auto found no GPU here")
    assert lines[2].startswith("warning: data.seq_len=64 is far below model.max_seq_len=256")
    assert lines[3].startswith("not covered: glibc malloc's heap") and "evaluation, checkpoint saves" in lines[3]
    assert lines[4].startswith("memory plan per rank: model 4 x 128")
    assert main(["model=gpt_tiny", "strategy=ddp", "plan.world_size=2", "device=cuda", "precision=bf16",
                 "data=synthetic", "data.batch_size=8", "data.seq_len=128", "plan.memory_gb=8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("planned for: device cuda (planned from this host, which has no GPU), 2 ranks (strategy=ddp), "
                        "micro-batch 8 x 128 tokens, precision=bf16"), lines[0]
    assert lines[1].startswith("not covered: CUDA's context")


def test_the_cli_plans_a_users_model_from_a_config_dir(tmp_path, capsys, monkeypatch):
    """``python -m hydratrain.plan --config-dir my_conf ...`` as train.py takes it, the user's package imported from
    the current dir: the plan is the generic one, on the shapes of the data's first samples."""
    from hydratrain.plan_cli import main

    (tmp_path / "plan_pkg").mkdir()
    (tmp_path / "plan_pkg" / "__init__.py").write_text(
        "import torch\nfrom torch import nn\n"
        "class MLP(nn.Module):\n"
        "    def __init__(self, width: int = 8):\n"
        "        super().__init__()\n"
        "        self.net = nn.Sequential(nn.Linear(3, width), nn.ReLU(), nn.Linear(width, 2))\n"
        "    def forward(self, x):\n"
        "        return self.net(x)\n"
        "def blobs(n: int = 64):\n"
        "    from torch.utils.data import TensorDataset\n"
        "    return TensorDataset(torch.randn(n, 3), torch.arange(n) % 2)\n")
    for group, text in (("model/mlp.yaml", "_target_: plan_pkg.MLP\nwidth: 16\n"),
                        ("data/blobs.yaml", "_target_: plan_pkg.blobs\nbatch_size: 16\nnum_workers: 2\n")):
        (tmp_path / "my_conf" / group).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "my_conf" / group).write_text(text)
    monkeypatch.chdir(tmp_path)
    assert main(["--config-dir", "my_conf", "model=mlp", "data=blobs", "loss=cross_entropy", "strategy=single",
                 "device=cpu", "precision=fp32", "plan.memory_gb=8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("planned for: device cpu, 1 rank (strategy=single), micro-batch 16 x samples of (3,) "
                        "float32, () int64, precision=fp32"), lines[0]
    assert "the 2 DataLoader worker process(es) (data.num_workers)" in lines[1], lines[1]
    assert lines[2].startswith("memory plan per rank: model plan_pkg.MLP (98 parameters)"), lines[2]
    assert any(line.split()[:1] == ["activations"] for line in lines)
    assert main(["--config-dir=my_conf", "model=mlp", "model._target_=plan_pkg.nope", "data=blobs"]) == 2
    assert "model._target_='plan_pkg.nope': cannot be imported" in capsys.readouterr().err


# -------------------------------------------------------------------------------------------------- the run
@requires("examples")
def test_a_runs_plan_of_a_users_model_leaves_its_random_state_as_seeded(compose, tmp_path):
    """The plan runs before the model is built, on the data's example batch (a DataLoader iterator, which draws its
    base seed from the global generator): an eagerly built model must start from the same weights with the plan on
    and off."""
    from hydratrain.dist.env import DistInfo
    from hydratrain.parallel.build import build_strategy
    from hydratrain.plan import OutOfMemoryGuard
    from hydratrain.run import build

    weights = {}
    for enabled in (True, False):
        cfg = compose(["+experiment=digits_cnn", "strategy=single", "precision=fp32", "device=cpu",
                       "logger.tensorboard=false", "logger.peak_flops=1e12", f"plan.enabled={enabled}"])
        run_dir, guard = tmp_path / str(enabled), OutOfMemoryGuard()
        job = build(cfg, build_strategy(cfg), DistInfo(device=torch.device("cpu")), run_dir, run_dir, guard)
        weights[enabled] = [p.detach().clone() for p in job.raw.parameters()]
        planned = guard.run_plan.plan if enabled else None
        assert not enabled or planned.model_desc.startswith("model hydratrain.examples.digits.DigitsCNN")
    assert all(torch.equal(a, b) for a, b in zip(weights[True], weights[False]))
