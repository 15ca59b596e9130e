"""The decoder: shapes, causality, tied embeddings, meta-device build, FLOP count."""
from __future__ import annotations

import pytest
import torch

from hydratrain.models.gpt import GPT, GPTConfig, apply_rotary, rotary_tables


def tiny(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(d_model=32, n_layer=2, n_head=4, max_seq_len=16, **kw))


def test_forward_shape_and_dtype():
    logits = tiny()(torch.randint(0, 256, (3, 16)))
    assert logits.shape == (3, 16, 256) and logits.dtype == torch.float32


def test_causal_future_tokens_do_not_change_past_logits():
    m = tiny()
    x = torch.randint(0, 256, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 256
    torch.testing.assert_close(m(x)[0, :10], m(y)[0, :10])
    assert not torch.allclose(m(x)[0, 10:], m(y)[0, 10:])


def test_tied_embeddings_share_storage_and_grouped_query_attention_runs():
    m = tiny(tie_embeddings=True, n_kv_head=2)
    assert m.lm_head.weight is m.tok_emb.weight
    assert m.blocks[0].attn.wk.weight.shape == (2 * 8, 32)
    m(torch.randint(0, 256, (2, 8))).sum().backward()
    untied = tiny(tie_embeddings=False)
    assert untied.num_params() == m.num_params() + 256 * 32 + 2 * 2 * 16 * 32  # lm_head + full-width k/v


def test_rotary_preserves_norm_and_is_relative():
    cos, sin = rotary_tables(8, 16, 10000.0)
    q = torch.randn(1, 1, 16, 8)
    torch.testing.assert_close(apply_rotary(q, cos, sin).norm(dim=-1), q.norm(dim=-1))
    # <R(m)q, R(n)k> depends on m - n only
    k = torch.randn(1, 1, 1, 8).expand(1, 1, 16, 8)
    qq = q[:, :, :1].expand(1, 1, 16, 8)
    dots = (apply_rotary(qq, cos, sin)[0, 0, 3:] * apply_rotary(k, cos, sin)[0, 0, :13]).sum(-1)
    torch.testing.assert_close(dots, dots[0].expand_as(dots), rtol=1e-4, atol=1e-4)


def test_meta_build_then_materialise_and_init():
    with torch.device("meta"):
        m = GPT(GPTConfig(d_model=32, n_layer=2, n_head=4, max_seq_len=16))
    assert m.tok_emb.weight.is_meta
    m.to_empty(device="cpu")
    m.init_weights()
    ref = tiny()
    torch.testing.assert_close(m.rope_cos, ref.rope_cos)
    assert abs(m.tok_emb.weight.std().item() - 0.02) < 0.005
    assert torch.isfinite(m(torch.randint(0, 256, (1, 16)))).all()


def test_flops_per_token_matches_palm_formula():
    m = tiny()
    c = m.cfg
    n = m.num_params(exclude_embedding=True)
    assert m.flops_per_token(16) == 6 * n + 12 * c.n_layer * c.n_head * c.head_dim * 16


def test_too_long_sequence_is_a_clear_error():
    with pytest.raises(ValueError, match="max_seq_len=16"):
        tiny()(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("tie", [True, False])
def test_counted_flops_agree_with_the_palm_formula_within_two_percent(tie):
    """MFU of a model without a formula counts its FLOPs on a meta copy (hydratrain.flops); on the GPT, which has
    one (6N + 12LHQT), the two agree."""
    from hydratrain.flops import counted_flops_per_sample
    from hydratrain.losses import NextTokenLoss

    cfg = GPTConfig(vocab_size=256, max_seq_len=128, d_model=128, n_layer=4, n_head=4, tie_embeddings=tie)

    def build():
        with torch.device("meta"):
            return GPT(cfg)

    T = 128
    batch = (torch.zeros(2, T, dtype=torch.long), torch.zeros(2, T, dtype=torch.long))
    counted = counted_flops_per_sample(build, batch, NextTokenLoss()) / T
    formula = GPT(cfg).flops_per_token(T)
    assert abs(counted / formula - 1) < 0.02, (counted, formula)


def test_flops_are_counted_with_a_loss_module_that_holds_a_buffer():
    """A loss module's buffers (class weights) are on the run's device while the count runs on meta: a meta copy of
    the loss is counted, and the run's loss is left where it is."""
    from hydratrain.flops import counted_flops_per_sample

    def build():
        with torch.device("meta"):
            return torch.nn.Linear(8, 3)

    weighted = torch.nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 3.0]))
    batch = (torch.zeros(4, 8), torch.zeros(4, dtype=torch.long))
    counted = counted_flops_per_sample(build, batch, weighted)
    # per sample: 2 FLOPs per multiply-add forward, 2 for the weight's gradient (the input needs none)
    assert counted == counted_flops_per_sample(build, batch, torch.nn.CrossEntropyLoss()) == 4 * 8 * 3
    assert weighted.weight.device.type == "cpu"
    # a loss that is no scalar (the run's check names it): counted through its sum, no warning blaming the model
    per_sample = torch.nn.CrossEntropyLoss(reduction="none")
    assert counted_flops_per_sample(build, batch, per_sample) == 4 * 8 * 3


def test_a_configured_loss_gets_low_precision_predictions_in_float32():
    """The loss runs outside autocast: torch.nn.CrossEntropyLoss on bf16 logits computed in bf16 (3 significant
    digits); it is handed float32 logits, as autocast's policy would give it, and computes what fp32 computes."""
    from hydratrain.train.batch import loss_of

    logits, targets = torch.randn(8, 5).bfloat16(), torch.arange(8) % 5
    loss = loss_of(logits, (None, targets), torch.nn.CrossEntropyLoss())
    assert loss.dtype == torch.float32
    assert loss == torch.nn.functional.cross_entropy(logits.float(), targets)
    pair = loss_of((logits, logits), (None, targets), lambda out, y: out[0].sum() + out[1].sum())  # in a tuple too
    assert pair.dtype == torch.float32


def test_a_loss_that_refuses_the_outputs_leaves_the_flops_counted_and_warns_nothing(caplog):
    """A model returning (logits, probs) with loss=cross_entropy: the first step names the loss in one line, so the
    FLOP count does not warn with the same error before it; the model's FLOPs are those of a loss that takes them."""
    from hydratrain.flops import counted_flops_per_sample

    class Pair(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 3)

        def forward(self, x):
            logits = self.lin(x)
            return logits, logits.softmax(-1)

    def build(cls):
        with torch.device("meta"):
            return cls()

    batch = (torch.zeros(4, 8), torch.zeros(4, dtype=torch.long))
    with caplog.at_level("WARNING", logger="hydratrain.flops"):
        counted = counted_flops_per_sample(lambda: build(Pair), batch, torch.nn.CrossEntropyLoss())
    assert not caplog.records, caplog.text
    assert counted == counted_flops_per_sample(lambda: torch.nn.Linear(8, 3, device="meta"), batch,
                                               torch.nn.CrossEntropyLoss()) == 4 * 8 * 3
