"""The run config: typed schemas (:mod:`.schema`, each group's beside its checks in ``.<group>``) and the walk over the
checks (:mod:`.validate`, which imports torch). No torch import here, no side effects."""
from hydratrain.config.schema import TrainConfig, register_configs
from hydratrain.errors import ConfigError

__all__ = ["ConfigError", "TrainConfig", "flat_keys", "register_configs"]


def flat_keys(tree, prefix: str = "") -> dict:
    """``{"a.b.c": leaf}`` of a nested mapping (a resolved config, a state dict): non-empty mappings are walked,
    everything else (lists, empty mappings, tensors) is a leaf. The keys are the dotted config keys, and DCP's flat
    keys of a state dict."""
    from collections.abc import Mapping

    out = {}
    for k, v in tree.items():
        if isinstance(v, Mapping) and v:
            out.update(flat_keys(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
