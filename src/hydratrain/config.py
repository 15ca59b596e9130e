"""Typed schemas for the run config, their ConfigStore registration, and value checks.

The YAML files under ``conf/`` are merged onto :class:`TrainConfig` (registered as ``train_schema`` and listed first
in ``conf/train.yaml``'s defaults), so a misspelt key or a value of the wrong type is rejected by Hydra while the
config is composed. :func:`validate` then checks values (ranges, allowed option names, cross-field rules) and raises
:class:`ConfigError` naming the key, before any process group exists.

Importing this module has no side effects and does not import torch; call :func:`register_configs` once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, List, Optional

from omegaconf import MISSING, DictConfig, OmegaConf


class ConfigError(ValueError):
    """A config value is invalid. ``str(err)`` is one line: ``<key>=<value>: <why> (allowed: ...)``."""

    def __init__(self, key: str, value: Any, why: str):
        self.key, self.value, self.why = key, value, why
        super().__init__(f"{key}={value!r}: {why}")


@dataclass
class ModelConfig:
    """Decoder-only transformer size (see ``hydratrain.models.gpt``)."""

    name: str = MISSING  # preset name: gpt_tiny, gpt_small, llama_1b, llama_8b
    vocab_size: int = 256  # tokens; 256 for the byte-level corpora
    max_seq_len: int = 256  # longest sequence the rotary table covers, tokens
    d_model: int = 128  # residual width
    n_layer: int = 4  # decoder blocks
    n_head: int = 4  # query heads; head_dim = d_model // n_head
    n_kv_head: Optional[int] = None  # key/value heads for grouped-query attention; null = n_head
    d_ff: Optional[int] = None  # SwiGLU hidden width; null = 8/3 * d_model rounded up to ff_multiple_of
    ff_multiple_of: int = 64
    tie_embeddings: bool = True  # share the token embedding with the output projection
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    # "cpu"/"cuda": build with real storage on that device kind; "meta": build without storage, shard, then
    # materialise and initialise (so no rank holds the whole model); "auto": meta for strategy=fsdp, else device.
    init_device: str = "auto"
    init_from: Optional[str] = None  # a .safetensors file of full weights to start from (fine-tuning)


@dataclass
class DataConfig:
    """Token stream and batching (see ``hydratrain.data``)."""

    name: str = MISSING  # python_stdlib | text_files | synthetic | token_bin | tokenized_text | python_stdlib_bpe
    paths: List[str] = field(default_factory=list)  # text_files, tokenized_text: files/globs, relative to the launch dir
    seq_len: int = 256  # tokens per sample (the model sees seq_len tokens and predicts the next seq_len)
    batch_size: int = 8  # samples per micro-batch per rank
    val_fraction: float = 0.02  # share of files (or of the synthetic stream) held out for eval
    cache_dir: Optional[str] = None  # where built memmaps are kept; null = $HYDRATRAIN_CACHE or ~/.cache/hydratrain
    synthetic_tokens: int = 2_000_000  # synthetic: stream length in tokens
    # --- subword data (see hydratrain.tokenized)
    train_path: Optional[str] = None  # token_bin: the train split's token file (relative to the launch dir)
    val_path: Optional[str] = None  # token_bin: the val split's token file
    dtype: Optional[str] = None  # token_bin: uint16 | uint32; null = the llm.c header's, else uint16
    tokenizer: Optional[str] = None  # a tokenizer.json; null = tokenized_text / python_stdlib_bpe train a BPE
    vocab_size: int = 4096  # tokenized_text / python_stdlib_bpe: tokens of the BPE trained when data.tokenizer is null


@dataclass
class StrategyConfig:
    """How the model is distributed (see ``hydratrain.parallelize``)."""

    name: str = MISSING  # single | ddp | fsdp
    backend: Optional[str] = None  # process-group backend; null = nccl on CUDA, gloo on CPU
    reshard_after_forward: bool = True  # fsdp: free gathered params after forward (ZeRO-3) or keep them (ZeRO-2)
    cpu_offload: bool = False  # fsdp: keep sharded params, grads and optimizer state in CPU memory
    find_unused_parameters: bool = False  # ddp
    bucket_cap_mb: int = 25  # ddp: gradient all-reduce bucket size, MiB


@dataclass
class PrecisionConfig:
    """Numeric formats (see ``hydratrain.precision``). Master weights and optimizer state are always fp32."""

    name: str = MISSING  # auto | fp32 | bf16 | fp16
    compute_dtype: str = "float32"  # dtype of matmuls/activations: float32 | bfloat16 | float16 (auto: resolved)
    reduce_dtype: str = "float32"  # dtype of gradient reduction across ranks
    grad_scaler: bool = False  # dynamic loss scaling (needed for float16)
    init_scale: float = 65536.0  # GradScaler's first scale


@dataclass
class WrapPolicyConfig:
    """Which submodules get their own FSDP unit before the root (see ``hydratrain.parallelize``)."""

    name: str = MISSING  # none | size_based | transformer_block
    min_num_params: Optional[int] = None  # size_based: a module with at least this many unsharded params is sharded


@dataclass
class LauncherConfig:
    """How processes are started (see README.md, "Launching and sweeping").

    ``local``: by you (``python train.py`` or ``torchrun ... train.py``). ``torchrun``: the hydratrain Hydra launcher
    plugin starts ``nproc_per_node`` workers per Hydra job through torch's elastic launch API. ``slurm`` /
    ``submitit_local``: hydra-submitit-launcher starts one task per GPU (extra ``[slurm]``).
    """

    name: str = MISSING  # local | torchrun | slurm | submitit_local
    # --- launcher=torchrun (the elastic agent's settings, as torchrun's flags of the same names)
    nproc_per_node: int = 1  # workers (ranks) per node
    nnodes: int = 1  # nodes; > 1 needs rdzv_endpoint and one launch per node with its node_rank
    node_rank: int = 0  # this node's index in [0, nnodes); node 0 hosts the rendezvous store
    rdzv_endpoint: Optional[str] = None  # HOST:PORT of node 0's rendezvous store; null = a free port per job
    rdzv_timeout: int = 600  # seconds to wait for all nodes to join a job's rendezvous
    max_restarts: int = 0  # times the agent restarts all workers of a job after one fails
    # --- launcher=slurm / submitit_local (mapped onto hydra-submitit-launcher; one task per GPU)
    nodes: int = 1  # SLURM nodes per job
    tasks_per_node: int = 1  # ranks per node; must equal gpus_per_node when gpus_per_node > 0
    gpus_per_node: int = 0  # GPUs per node (0: CPU-only tasks)
    cpus_per_task: Optional[int] = None  # null = submitit's default
    partition: Optional[str] = None  # SLURM partition; null = the cluster's default
    account: Optional[str] = None  # SLURM account to charge; null = your default
    timeout_min: int = 60  # job time limit, minutes


@dataclass
class OptimConfig:
    name: str = MISSING  # adamw
    lr: float = 1e-3  # peak learning rate
    weight_decay: float = 0.1  # applied to matrices only (not norms or biases)
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8


@dataclass
class SchedulerConfig:
    name: str = MISSING  # warmup_cosine | constant
    warmup_steps: int = 0  # linear warm-up from 0 to optim.lr, optimizer steps
    min_lr_ratio: float = 0.1  # warmup_cosine: final lr = min_lr_ratio * optim.lr


@dataclass
class TrainerConfig:
    max_steps: Optional[int] = 300  # optimizer steps; null = until max_epochs
    max_epochs: Optional[int] = None  # passes over the train split; null = until max_steps
    grad_accum_steps: int = 1  # micro-batches per optimizer step
    grad_clip: float = 1.0  # max global grad norm; 0 = no clipping (the norm is still logged)
    eval_every_n_steps: int = 100  # 0 = only at the end
    eval_batches: int = 20  # micro-batches per eval, per rank; 0 = the whole val split
    log_every_n_steps: int = 10
    seed: int = 1234
    compile: bool = False  # torch.compile each decoder block
    progress_bar: bool = True  # rank-0 tqdm bar
    sample_tokens: int = 120  # tokens of text generated at the end; 0 = none
    save_weights: bool = True  # write the full model as model.safetensors in the run dir at the end


@dataclass
class CheckpointConfig:
    """Sharded checkpoints under ``<run dir>/checkpoints`` and resuming (see ``hydratrain.checkpoint``)."""

    every_n_steps: int = 100  # save every N optimizer steps; 0 = none (only save_last and SIGTERM saves)
    keep_last: int = 2  # complete checkpoints kept in the run dir (older ones deleted); 0 = keep all
    save_last: bool = False  # also save when training ends (true: a finished run can be extended or exported)
    auto_resume: bool = True  # start from the latest complete checkpoint in this run dir, if there is one
    resume_from: Optional[str] = None  # a step_XXXXXXXX dir, or a checkpoints/run dir (its latest); used when the
    #                                    run dir has no checkpoint of its own
    restore_data_position: bool = True  # false: start the saved epoch over when its order cannot be kept
    save_on_sigterm: bool = True  # on SIGTERM: finish the step, save, exit with preempt_exit_code
    preempt_exit_code: int = 75  # exit status after a SIGTERM save (EX_TEMPFAIL: relaunch to resume)
    debug_kill_at_step: Optional[int] = None  # testing only: SIGKILL every rank right after this step (and its save)


@dataclass
class LoggerConfig:
    tensorboard: bool = True  # rank 0 writes events under <run dir>/tensorboard
    peak_flops: Optional[float] = None  # per-device peak FLOP/s for MFU; null = known GPU table or a measured CPU matmul


@dataclass
class TrainConfig:
    """The whole run config: one field per config group, plus a few top-level switches."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    wrap_policy: WrapPolicyConfig = field(default_factory=WrapPolicyConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    activation_checkpointing: bool = False  # recompute each decoder block's activations in backward
    device: str = "auto"  # auto (cuda if available) | cpu | cuda


def register_configs() -> None:
    """Store :class:`TrainConfig` in Hydra's ConfigStore as ``train_schema`` (idempotent)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


ALLOWED = {
    "model.init_device": ("auto", "meta", "cpu", "cuda"),
    "data.name": ("python_stdlib", "text_files", "synthetic", "token_bin", "tokenized_text", "python_stdlib_bpe"),
    "strategy.name": ("single", "ddp", "fsdp"),
    "strategy.backend": (None, "gloo", "nccl"),
    "precision.name": ("auto", "fp32", "bf16", "fp16"),
    "precision.compute_dtype": ("auto", "float32", "bfloat16", "float16"),
    "precision.reduce_dtype": ("float32", "bfloat16", "float16"),
    "wrap_policy.name": ("none", "size_based", "transformer_block"),
    "launcher.name": ("local", "torchrun", "slurm", "submitit_local"),
    "optim.name": ("adamw",),
    "scheduler.name": ("warmup_cosine", "constant"),
    "device": ("auto", "cpu", "cuda"),
}


def _get(cfg: DictConfig, key: str) -> Any:
    return OmegaConf.select(cfg, key, throw_on_missing=False)


def validate(cfg: DictConfig) -> None:
    """Check values that the schema's types cannot. Raises :class:`ConfigError` on the first bad key."""
    for key, allowed in ALLOWED.items():
        value = _get(cfg, key)
        if value not in allowed:
            raise ConfigError(key, value, "allowed: " + ", ".join(map(str, allowed)))

    def positive(key: str, allow_zero: bool = False, allow_none: bool = False) -> None:
        value = _get(cfg, key)
        if value is None and allow_none:
            return
        if value is None or not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            raise ConfigError(key, value, "must be finite and " + (">= 0" if allow_zero else "> 0"))

    for key in ("model.vocab_size", "model.max_seq_len", "model.d_model", "model.n_layer", "model.n_head",
                "data.seq_len", "data.batch_size", "data.synthetic_tokens", "optim.lr", "optim.eps",
                "trainer.grad_accum_steps",
                "trainer.log_every_n_steps", "precision.init_scale"):
        positive(key)
    for key in ("optim.weight_decay", "scheduler.warmup_steps", "trainer.grad_clip", "trainer.eval_every_n_steps",
                "trainer.eval_batches", "trainer.sample_tokens", "checkpoint.every_n_steps", "checkpoint.keep_last"):
        positive(key, allow_zero=True)
    for key in ("trainer.max_steps", "trainer.max_epochs", "model.n_kv_head", "model.d_ff", "logger.peak_flops",
                "checkpoint.debug_kill_at_step"):
        positive(key, allow_none=True)

    m = cfg.model
    if m.d_model % m.n_head:
        raise ConfigError("model.n_head", m.n_head, f"must divide model.d_model={m.d_model}")
    if (m.d_model // m.n_head) % 2:
        raise ConfigError("model.n_head", m.n_head, "head_dim = d_model // n_head must be even for rotary embeddings")
    kv = m.n_kv_head or m.n_head
    if m.n_head % kv:
        raise ConfigError("model.n_kv_head", m.n_kv_head, f"must divide model.n_head={m.n_head}")
    if cfg.data.seq_len > m.max_seq_len:
        raise ConfigError("data.seq_len", cfg.data.seq_len, f"must be <= model.max_seq_len={m.max_seq_len}")
    if cfg.data.name in ("python_stdlib", "text_files") and m.vocab_size < 256:
        raise ConfigError("model.vocab_size", m.vocab_size, f"byte-level data={cfg.data.name} needs >= 256")
    if cfg.data.name == "text_files" and not cfg.data.paths:
        raise ConfigError("data.paths", list(cfg.data.paths), "data=text_files needs at least one file or glob")
    if not 0.0 < cfg.data.val_fraction < 1.0:
        raise ConfigError("data.val_fraction", cfg.data.val_fraction, "must be in (0, 1)")
    if not 0.0 <= cfg.optim.beta1 < 1.0 or not 0.0 <= cfg.optim.beta2 < 1.0:
        raise ConfigError("optim.beta1/beta2", (cfg.optim.beta1, cfg.optim.beta2), "must be in [0, 1)")
    if not 0.0 <= cfg.scheduler.min_lr_ratio <= 1.0:
        raise ConfigError("scheduler.min_lr_ratio", cfg.scheduler.min_lr_ratio, "must be in [0, 1]")
    if cfg.trainer.max_steps is None and cfg.trainer.max_epochs is None:
        raise ConfigError("trainer.max_steps", None, "set trainer.max_steps and/or trainer.max_epochs")
    if cfg.wrap_policy.name == "size_based":
        mnp = cfg.wrap_policy.min_num_params
        if mnp is None or mnp <= 0:
            raise ConfigError("wrap_policy.min_num_params", mnp, "wrap_policy=size_based needs a threshold > 0")
    if (cfg.precision.compute_dtype == "auto") != (cfg.precision.name == "auto"):
        raise ConfigError("precision.compute_dtype", cfg.precision.compute_dtype, "auto goes with precision=auto only")
    if cfg.precision.compute_dtype == "float16" and not cfg.precision.grad_scaler:
        raise ConfigError("precision.grad_scaler", False, "float16 compute needs the grad scaler (true)")
    code = cfg.checkpoint.preempt_exit_code
    if not 3 < code < 126:
        raise ConfigError("checkpoint.preempt_exit_code", code, "must be in 4..125 (0-3 mean success, error, "
                          "config error, checkpoint error; 126+ are the shell's)")
    init_from = cfg.model.init_from
    if init_from is not None and not str(init_from).endswith(".safetensors"):
        raise ConfigError("model.init_from", init_from, "must be a .safetensors file (python -m hydratrain.export "
                          "CHECKPOINT_DIR OUT.safetensors makes one)")
    if cfg.strategy.cpu_offload and cfg.strategy.name != "fsdp":
        raise ConfigError("strategy.cpu_offload", True, "only strategy=fsdp can offload to CPU")
    validate_launcher(cfg.launcher)
    launched = {"torchrun": cfg.launcher.nproc_per_node * cfg.launcher.nnodes,
                "slurm": cfg.launcher.tasks_per_node * cfg.launcher.nodes,
                "submitit_local": cfg.launcher.tasks_per_node * cfg.launcher.nodes}.get(cfg.launcher.name, 1)
    if cfg.strategy.name == "single" and launched > 1:
        raise ConfigError("strategy.name", "single", f"runs one process but launcher={cfg.launcher.name} starts "
                          f"{launched}; allowed: ddp, fsdp")


def validate_launcher(launcher: DictConfig) -> None:
    """Check the ``launcher`` group alone (the launchers call it before starting any process).

    Raises :class:`ConfigError` naming the key, e.g. a GPUs-per-node / tasks-per-node mismatch for SLURM.
    """
    name = launcher.name
    if name not in ALLOWED["launcher.name"]:
        raise ConfigError("launcher.name", name, "allowed: " + ", ".join(ALLOWED["launcher.name"]))
    for key in ("nproc_per_node", "nnodes", "nodes", "tasks_per_node", "timeout_min", "rdzv_timeout"):
        if launcher[key] is None or launcher[key] <= 0:
            raise ConfigError(f"launcher.{key}", launcher[key], "must be > 0")
    for key in ("max_restarts", "gpus_per_node"):
        if launcher[key] is None or launcher[key] < 0:
            raise ConfigError(f"launcher.{key}", launcher[key], "must be >= 0")
    if not 0 <= launcher.node_rank < launcher.nnodes:
        raise ConfigError("launcher.node_rank", launcher.node_rank, f"must be in [0, launcher.nnodes={launcher.nnodes})")
    endpoint = launcher.rdzv_endpoint
    if endpoint is not None:
        host, _, port = str(endpoint).rpartition(":")
        if not host or not port.isdigit() or not 0 <= int(port) < 65536:
            raise ConfigError("launcher.rdzv_endpoint", endpoint, "must be HOST:PORT (port in 0-65535)")
    if launcher.nnodes > 1 and (endpoint is None or str(endpoint).endswith(":0")):
        raise ConfigError("launcher.rdzv_endpoint", endpoint,
                          f"launcher.nnodes={launcher.nnodes} needs node 0's HOST:PORT, the same on every node")
    if name in ("slurm", "submitit_local") and launcher.gpus_per_node and \
            launcher.tasks_per_node != launcher.gpus_per_node:
        raise ConfigError("launcher.tasks_per_node", launcher.tasks_per_node,
                          f"must equal launcher.gpus_per_node={launcher.gpus_per_node} (one task per GPU)")
