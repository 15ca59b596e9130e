"""The run config: typed schemas (:mod:`.schema`) and checks (:mod:`.validate`). No torch import, no side effects."""
from hydratrain.config.schema import TrainConfig, register_configs
from hydratrain.config.validate import validate, validate_launcher
from hydratrain.errors import ConfigError

__all__ = ["ConfigError", "TrainConfig", "register_configs", "validate", "validate_launcher"]
