"""The ``logger`` group: TensorBoard and the trackers beside it (``logger=[tensorboard,mlflow,wandb,csv]``; each
option file sets its own key, so a list composes), and its checks."""
from __future__ import annotations

import importlib.util
import urllib.parse
from dataclasses import dataclass, field
from typing import List, Optional

from omegaconf import DictConfig

from hydratrain.config.values import Option
from hydratrain.errors import ConfigError


class WandbMode(Option):
    online = "online"
    offline = "offline"  # files under <run dir>/wandb, no network and no account; `wandb sync` uploads them later


@dataclass
class MLflowConfig:
    """``logger=mlflow`` (extra ``mlflow``; docs/tracking.md)."""

    enabled: bool = False  # logger=mlflow (or a list holding it) sets it
    # null: $MLFLOW_TRACKING_URI, else a local store sqlite:///<paths.output_dir>/mlruns/mlflow.db (no network);
    # no password here (Hydra writes this key to .hydra/): give it in $MLFLOW_TRACKING_PASSWORD
    tracking_uri: Optional[str] = None
    experiment: str = "hydratrain"  # the MLflow experiment (created when absent)


@dataclass
class WandbConfig:
    """``logger=wandb`` (extra ``wandb``; docs/tracking.md). The API key comes from ``wandb login`` or
    $WANDB_API_KEY, never from the config."""

    enabled: bool = False  # logger=wandb (or a list holding it) sets it
    mode: WandbMode = WandbMode.online  # offline: files under <run dir>/wandb, no network, no account (wandb sync)
    project: str = "hydratrain"  # the W&B project
    entity: Optional[str] = None  # null: the account's default entity
    group: Optional[str] = None  # null: a multirun job's sweep dir (relative to paths.output_dir); none otherwise
    tags: List[str] = field(default_factory=list)  # the run's W&B tags


@dataclass
class LoggerConfig:
    tensorboard: bool = True  # rank 0 writes events under <run dir>/tensorboard
    csv: bool = False  # rank 0 writes <run dir>/metrics.csv: one row per logged step, one column per scalar
    mlflow: MLflowConfig = field(default_factory=MLflowConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    # per-device peak FLOP/s for MFU; null = known GPU table or a measured CPU matmul
    peak_flops: Optional[float] = None


#: tracker -> (the module it needs, the extra that installs it)
TRACKER_EXTRAS = {"mlflow": ("mlflow", "mlflow"), "wandb": ("wandb", "wandb")}


def check(cfg: DictConfig) -> None:
    """A chosen tracker's library is installed (looked up, not imported: it loads only in the run that uses it), and
    no password stands in ``logger.mlflow.tracking_uri``, which Hydra writes to ``.hydra/`` with the rest of the
    config (MLflow takes it from $MLFLOW_TRACKING_PASSWORD instead)."""
    logger = cfg.logger
    for name, (module, extra) in TRACKER_EXTRAS.items():
        if logger[name].enabled and importlib.util.find_spec(module) is None:
            raise ConfigError("logger", name, f"needs the {module} package: pip install 'hydratrain[{extra}]' "
                              f"(or drop {name} from logger=[...])")
    uri = logger.mlflow.tracking_uri
    if uri and urllib.parse.urlsplit(uri).password is not None:
        raise ConfigError("logger.mlflow.tracking_uri", "<a URI with a password>", "would be written to the run "
                          "dir's .hydra/config.yaml: give the password in $MLFLOW_TRACKING_PASSWORD (and the user in "
                          "$MLFLOW_TRACKING_USERNAME), or the whole URI in $MLFLOW_TRACKING_URI")
