"""The model hooks of hydratrain.protocols: what they recognise on hydratrain's GPT, a Hugging Face-style model and
plain torch.nn modules, and that the helpers keep the call sites' test (callable, not merely present)."""
from torch import nn

from hydratrain.models import GPT
from hydratrain.protocols import (
    HasArchitecture,
    HasExportTo,
    HasFlopsPerToken,
    HasInitBuffers,
    HasInitParam,
    HasInitWeights,
    HasMaxSeqLen,
    HasMemoryPlan,
    HasNoSplitModules,
    HasResetParameters,
    has_architecture,
    has_export_to,
    has_flops_per_token,
    has_init_buffers,
    has_init_param,
    has_init_weights,
    has_memory_plan,
    max_seq_len_of,
    no_split_module_names,
    reset_parameters_of,
)


def _gpt() -> GPT:
    return GPT(vocab_size=32, d_model=16, n_layer=1, n_head=2, max_seq_len=8)


def test_gpt_has_its_hooks():
    gpt = _gpt()
    for proto in (HasInitParam, HasInitWeights, HasInitBuffers, HasFlopsPerToken, HasArchitecture, HasMemoryPlan):
        assert isinstance(gpt, proto), proto.__name__
    assert has_init_param(gpt) and has_init_weights(gpt) and has_init_buffers(gpt) and has_flops_per_token(gpt)
    assert has_init_param(GPT) and has_architecture(GPT) and has_memory_plan(GPT)  # asked of the class too
    assert gpt.flops_per_token(8) == 6 * gpt.num_params(exclude_embedding=True) + 12 * 1 * 2 * 8 * 8
    assert GPT.architecture({"d_model": 16, "n_head": 2})["n_kv_head"] == 2
    # GPT keeps max_seq_len in its config, has no export hook and no _no_split_modules
    assert not isinstance(gpt, (HasMaxSeqLen, HasExportTo, HasNoSplitModules, HasResetParameters))
    assert not has_export_to(gpt) and max_seq_len_of(gpt) is None and no_split_module_names(gpt) == []


def test_plain_modules_have_none_but_reset_parameters():
    linear = nn.Linear(3, 2)
    for proto in (HasInitParam, HasInitWeights, HasInitBuffers, HasFlopsPerToken, HasArchitecture, HasMemoryPlan,
                  HasExportTo, HasMaxSeqLen, HasNoSplitModules):
        assert not isinstance(linear, proto), proto.__name__
    assert not (has_init_param(linear) or has_init_weights(linear) or has_flops_per_token(linear)
                or has_export_to(nn.Linear) or has_architecture(nn.Linear))
    assert isinstance(linear, HasResetParameters) and reset_parameters_of(linear) == linear.reset_parameters
    mha = nn.MultiheadAttention(4, 2)  # the torch.nn layer that names it _reset_parameters
    assert reset_parameters_of(mha) == mha._reset_parameters
    assert reset_parameters_of(nn.ReLU()) is None and reset_parameters_of(nn.Sequential()) is None


class _HFLike(nn.Module):
    _no_split_modules = ["Block", "Embed"]

    def __init__(self, n_positions):
        super().__init__()
        self.n_positions = n_positions

    @property
    def max_seq_len(self):
        return self.n_positions

    def export_to(self, out_dir, state_dict, tokenizer=None):
        return out_dir


def test_attribute_hooks_and_callable_semantics():
    model = _HFLike(64)
    assert isinstance(model, (HasMaxSeqLen, HasNoSplitModules, HasExportTo)) and has_export_to(model)
    assert max_seq_len_of(model) == 64 and no_split_module_names(model) == ["Block", "Embed"]
    assert max_seq_len_of(_HFLike(None)) is None  # a rotary model: any length
    model.export_to = None  # present but not callable: the core does not call it
    assert not has_export_to(model)
    model.flops_per_token = 12.5  # an attribute, not a method: isinstance says present, the helper says no hook
    assert isinstance(model, HasFlopsPerToken) and not has_flops_per_token(model)
