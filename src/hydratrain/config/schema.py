"""Typed schemas for the run config and their ConfigStore registration.

Every option name is defined once, as an :class:`Option` Enum below; Hydra rejects any other value while composing
(``strategy.name=fsdq`` -> ``Invalid value 'fsdq', expected one of [single, ddp, fsdp]``). Groups whose options take
different keys get one dataclass per option (``ddp`` has ``bucket_cap_mb``, ``fsdp`` has ``cpu_offload``), stored as
``schema/<group>/<option>`` and pulled in by each ``conf/<group>/<option>.yaml`` (``defaults: [/schema/...@_here_]``),
so a key that an option does not use is a composition error instead of being silently ignored. ``TrainConfig`` ties
the groups together and is registered as ``train_schema`` (listed first in ``conf/train.yaml``).

Importing this module has no side effects and does not import torch; call :func:`register_configs` once.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any, ClassVar, Dict, List, Optional

from omegaconf import MISSING


class Option(str, Enum):
    """A config option name. A ``str``, so ``cfg.strategy.name == "fsdp"`` holds; prints as its plain value."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def values(cls) -> list[str]:
        return [m.value for m in cls]


class StrategyName(Option):
    single = "single"
    ddp = "ddp"
    fsdp = "fsdp"
    hsdp = "hsdp"


class PrecisionName(Option):
    auto = "auto"
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class DType(Option):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class WrapPolicyName(Option):
    auto = "auto"
    none = "none"
    size_based = "size_based"
    transformer_block = "transformer_block"


class DataName(Option):
    python_stdlib = "python_stdlib"
    text_files = "text_files"
    synthetic = "synthetic"
    token_bin = "token_bin"
    tokenized_text = "tokenized_text"
    python_stdlib_bpe = "python_stdlib_bpe"
    hf_dataset = "hf_dataset"


class TokenDType(Option):
    uint16 = "uint16"
    uint32 = "uint32"


class LauncherName(Option):
    local = "local"
    torchrun = "torchrun"
    slurm = "slurm"
    submitit_local = "submitit_local"
    ray = "ray"


class OptimName(Option):
    adamw = "adamw"
    adamw8bit = "adamw8bit"


class AdamWImpl(Option):
    auto = "auto"
    for_loop = "for_loop"
    foreach = "foreach"
    fused = "fused"


class PathsName(Option):
    default = "default"
    workspace = "workspace"


class SchedulerName(Option):
    warmup_cosine = "warmup_cosine"
    constant = "constant"


class Device(Option):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Backend(Option):
    gloo = "gloo"
    nccl = "nccl"


class NonFinitePolicy(Option):
    stop = "stop"
    skip = "skip"


class MonitorMode(Option):
    min = "min"
    max = "max"


class RunMode(Option):
    train = "train"
    eval = "eval"


class ObjectiveAt(Option):
    last = "last"
    best = "best"


# ------------------------------------------------------------------------------------------------------- data
@dataclass
class LoaderKeys:
    """Keys of every data option, your own dataset node (`_target_`) included. They are in the composed config
    whether or not the option file lists them, so `data.num_workers=2` works on any option. A built-in corpus
    slices memory-mapped tokens in the training process: the DataLoader's keys (`num_workers` to `collate_fn`)
    keep their defaults there. (The one owner of these defaults; the run reads `hydratrain.config.settings`.)"""

    batch_size: Any = 8  # samples per micro-batch per rank (an int >= 1), or auto: the largest the memory plan fits
    val_fraction: float = 0.1  # share held out for eval when the data has no val split of its own
    num_workers: int = 0  # DataLoader worker processes per rank (a dataset node)
    pin_memory: Optional[bool] = None  # page-locked batches; null = on CUDA (a dataset node)
    persistent_workers: bool = False  # keep the workers between epochs and evals (a dataset node)
    prefetch_factor: Optional[int] = None  # batches each worker loads ahead; null = torch's default (a dataset node)
    collate_fn: Any = None  # a _target_ node of the collate function; null = torch's default_collate


#: the loader's keys, in the order the schema declares them
LOADER_KEYS = tuple(f.name for f in fields(LoaderKeys))
#: the loader's keys that only a dataset node (``_target_``) uses
DATASET_ONLY_KEYS = ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor", "collate_fn")


@dataclass
class ModelKeys:
    """Keys of every model node, your own included: hydratrain's, not passed to the constructor."""

    init_device: str = "auto"  # auto | meta | cpu | cuda (auto: meta under fsdp/hsdp for a model with an init protocol)
    init_from: Optional[str] = None  # a .safetensors file of full weights to start from (fine-tuning)


MODEL_KEYS = tuple(f.name for f in fields(ModelKeys))


@dataclass
class DataConfig(LoaderKeys):
    """Keys every built-in ``data`` option has (see :mod:`hydratrain.data`)."""

    option: ClassVar[Optional[DataName]] = None
    name: DataName = MISSING
    seq_len: int = 256  # tokens per sample (the model sees seq_len tokens and predicts the next seq_len)


@dataclass
class SplitData(DataConfig):
    """Data split into train/val here: by file for corpora (a stable hash of each path), by position for a stream."""

    val_fraction: float = 0.02  # share of files (or of the synthetic stream) held out for eval


@dataclass
class PythonStdlibData(SplitData):
    option: ClassVar[DataName] = DataName.python_stdlib
    name: DataName = DataName.python_stdlib
    cache_dir: Optional[str] = None  # where built memmaps are kept; null = $HYDRATRAIN_CACHE or ~/.cache/hydratrain


@dataclass
class TextFilesData(SplitData):
    option: ClassVar[DataName] = DataName.text_files
    name: DataName = DataName.text_files
    paths: List[str] = MISSING  # files or globs (** allowed); relative ones resolve against the launch dir
    cache_dir: Optional[str] = None


@dataclass
class SyntheticData(SplitData):
    option: ClassVar[DataName] = DataName.synthetic
    name: DataName = DataName.synthetic
    synthetic_tokens: int = 2_000_000  # stream length in tokens


@dataclass
class TokenBinData(DataConfig):
    """Flat token-id files made by another pipeline (nanoGPT / llm.c layout), one per split."""

    option: ClassVar[DataName] = DataName.token_bin
    name: DataName = DataName.token_bin
    train_path: str = MISSING  # the train split's token file (relative to the launch dir)
    val_path: str = MISSING  # the val split's token file
    dtype: Optional[TokenDType] = None  # null = the llm.c header's, else uint16
    tokenizer: Optional[str] = None  # the tokenizer.json that made the ids (for decoding samples); optional


@dataclass
class TokenizedTextData(SplitData):
    """The user's text files, tokenized once with a BPE and cached as token files."""

    option: ClassVar[DataName] = DataName.tokenized_text
    name: DataName = DataName.tokenized_text
    paths: List[str] = MISSING  # files or globs, relative to the launch dir
    tokenizer: Optional[str] = None  # a tokenizer.json; null = train a byte-level BPE of vocab_size tokens
    vocab_size: Optional[int] = None  # tokens of the BPE trained when tokenizer is null; null = 4096
    cache_dir: Optional[str] = None


@dataclass
class PythonStdlibBPEData(SplitData):
    """The python_stdlib corpus with subword tokens: a BPE trained once on its training split."""

    option: ClassVar[DataName] = DataName.python_stdlib_bpe
    name: DataName = DataName.python_stdlib_bpe
    tokenizer: Optional[str] = None  # a tokenizer.json; null = train a byte-level BPE of vocab_size tokens
    vocab_size: Optional[int] = None  # tokens of the BPE trained when tokenizer is null; null = 4096
    cache_dir: Optional[str] = None


@dataclass
class HFDatasetData(SplitData):
    """Local JSON(-lines), CSV, Parquet or text files read by Hugging Face ``datasets`` (extra ``[hf]``), one text
    column tokenized once and cached as token files (``hydratrain.data.hf_dataset``)."""

    option: ClassVar[DataName] = DataName.hf_dataset
    name: DataName = DataName.hf_dataset
    paths: List[str] = MISSING  # the train files (datasets' data_files), globs allowed, relative to the launch dir
    val_paths: Optional[List[str]] = None  # the val split's files; null = data.val_fraction of the records
    format: Optional[str] = None  # json | csv | parquet | text; null = from the files' extension
    text_field: str = "text"  # the column holding each record's text
    tokenizer: Optional[str] = None  # a tokenizer.json or a dir holding one; null = train a BPE of vocab_size tokens
    vocab_size: Optional[int] = None  # tokens of the BPE trained when tokenizer is null; null = 4096
    cache_dir: Optional[str] = None


# --------------------------------------------------------------------------------------------------- strategy
@dataclass
class StrategyConfig:
    option: ClassVar[Optional[StrategyName]] = None
    name: StrategyName = MISSING


@dataclass
class SingleStrategy(StrategyConfig):
    """One process, no process group."""

    option: ClassVar[StrategyName] = StrategyName.single
    name: StrategyName = StrategyName.single


@dataclass
class DDPStrategy(StrategyConfig):
    """``torch.nn.parallel.DistributedDataParallel``: a full replica per rank, gradients all-reduced."""

    option: ClassVar[StrategyName] = StrategyName.ddp
    name: StrategyName = StrategyName.ddp
    backend: Optional[Backend] = None  # process-group backend; null = nccl on CUDA, gloo on CPU
    bucket_cap_mb: int = 25  # gradient all-reduce bucket size, MiB
    find_unused_parameters: bool = False


@dataclass
class FSDPStrategy(StrategyConfig):
    """FSDP2 ``fully_shard``: per-parameter sharding over a 1-D device mesh."""

    option: ClassVar[StrategyName] = StrategyName.fsdp
    name: StrategyName = StrategyName.fsdp
    backend: Optional[Backend] = None  # null = nccl on CUDA (plus gloo for CPU tensors with cpu_offload), gloo on CPU
    reshard_after_forward: bool = True  # free gathered params after forward (ZeRO-3) or keep them (ZeRO-2)
    cpu_offload: bool = False  # keep sharded params, grads and optimizer state in CPU memory
    # at world size 1 FSDP shards nothing: auto (train as strategy=single on a GPU, where FSDP's per-unit work
    # costs at small batches; keep FSDP on a CPU and with cpu_offload) | true (always FSDP) | false (always single)
    shard_on_one_rank: Any = "auto"


@dataclass
class HSDPStrategy(FSDPStrategy):
    """FSDP2 ``fully_shard`` over a 2-D device mesh (replicate x shard): parameters sharded within groups of
    ``shard_size`` ranks (reduce-scatter inside a group) and replicated across the groups (all-reduce between them)."""

    option: ClassVar[StrategyName] = StrategyName.hsdp
    name: StrategyName = StrategyName.hsdp
    shard_size: Optional[int] = None  # ranks per shard group; must divide the world size; null = ranks per node


# -------------------------------------------------------------------------------------------------- precision
@dataclass
class PrecisionConfig:
    """Numeric formats (see ``hydratrain.parallel.precision``). Master weights and optimizer state are always fp32;
    the compute dtype follows from ``name`` (auto: bf16 where the device computes it natively, else fp32)."""

    option: ClassVar[Optional[PrecisionName]] = None
    name: PrecisionName = MISSING
    reduce_dtype: DType = DType.float32  # dtype of the gradient reduction across ranks (ddp: a compression hook)
    tf32: bool = True  # CUDA only: let float32 matmuls use TF32 tensor cores (no effect on CPU)
    # strategy=fsdp/hsdp: also run each forward under torch.autocast to the compute dtype, as ddp and single do. FSDP's
    # MixedPrecisionPolicy alone casts the weights and each unit's floating inputs, so a float32 tensor the forward
    # makes itself (x.float() / 255 of uint8 pixels) meets bf16/fp16 weights and fails; autocast casts at each op.
    fsdp_autocast: bool = False


@dataclass
class AutoPrecision(PrecisionConfig):
    option: ClassVar[PrecisionName] = PrecisionName.auto
    name: PrecisionName = PrecisionName.auto


@dataclass
class FP32Precision(PrecisionConfig):
    option: ClassVar[PrecisionName] = PrecisionName.fp32
    name: PrecisionName = PrecisionName.fp32


@dataclass
class BF16Precision(PrecisionConfig):
    option: ClassVar[PrecisionName] = PrecisionName.bf16
    name: PrecisionName = PrecisionName.bf16


@dataclass
class FP16Precision(PrecisionConfig):
    """float16 compute with dynamic loss scaling (``torch.amp.GradScaler``)."""

    option: ClassVar[PrecisionName] = PrecisionName.fp16
    name: PrecisionName = PrecisionName.fp16
    init_scale: float = 65536.0  # the scaler's first scale
    growth_interval: int = 2000  # clean steps before the scale doubles


# ------------------------------------------------------------------------------------------------ wrap policy
@dataclass
class WrapPolicyConfig:
    """Which submodules FSDP shards as their own unit before the root (see ``hydratrain.parallel.wrap_policy``).
    Only ``strategy=fsdp`` and ``hsdp`` shard; other strategies allow ``auto`` (the default) and ``none`` only."""

    option: ClassVar[Optional[WrapPolicyName]] = None
    name: WrapPolicyName = MISSING


@dataclass
class NamedWrapPolicy(WrapPolicyConfig):
    """``none``: the root only; no further keys."""


@dataclass
class BlockWrapPolicy(WrapPolicyConfig):
    """``auto`` (transformer_block under fsdp, else none) and ``transformer_block``: each block is its own unit."""

    # the block classes, as dotted names (mypkg.nets.Block) or class names (LlamaDecoderLayer); null = found in the
    # model: a Hugging Face model's _no_split_modules, else the class of the children of its largest nn.ModuleList
    # or nn.Sequential. A dotted name must import to an nn.Module class (checked before the run starts). Activation
    # checkpointing and trainer.compile use the same blocks.
    block_classes: Optional[List[str]] = None


@dataclass
class SizeBasedWrapPolicy(WrapPolicyConfig):
    option: ClassVar[WrapPolicyName] = WrapPolicyName.size_based
    name: WrapPolicyName = WrapPolicyName.size_based
    min_num_params: int = 100_000  # a module with at least this many not-yet-sharded parameters becomes a unit


# --------------------------------------------------------------------------------------------------- launcher
@dataclass
class LauncherConfig:
    """Who starts the processes (see docs/launching.md). The keys of each option are the
    user-facing ones; ``conf/launcher/<option>.yaml`` maps them onto the Hydra launcher plugin's ``hydra.launcher``."""

    option: ClassVar[Optional[LauncherName]] = None
    name: LauncherName = MISSING


@dataclass
class LocalLauncher(LauncherConfig):
    """You start the processes: ``python train.py`` or ``torchrun ... train.py``."""

    option: ClassVar[LauncherName] = LauncherName.local
    name: LauncherName = LauncherName.local


@dataclass
class TorchrunLauncher(LauncherConfig):
    """hydratrain's Hydra launcher plugin: every job is one elastic launch (torchrun's engine)."""

    option: ClassVar[LauncherName] = LauncherName.torchrun
    name: LauncherName = LauncherName.torchrun
    nproc_per_node: int = 2  # workers (ranks) per node
    nnodes: int = 1  # nodes; > 1 needs rdzv_endpoint and one launch per node with its node_rank
    node_rank: int = 0  # this node's index in [0, nnodes); node 0 hosts the rendezvous store
    rdzv_endpoint: Optional[str] = None  # HOST:PORT of node 0's rendezvous store; null = a free port per job
    rdzv_timeout: int = 600  # seconds to wait for all nodes to join a job's rendezvous
    max_restarts: int = 0  # times the agent restarts all workers of a job after one fails


@dataclass
class SubmititLauncher(LauncherConfig):
    """hydra-submitit-launcher (extra ``[slurm]``): one task, i.e. one rank, per GPU."""

    nodes: int = 1  # nodes per job
    tasks_per_node: int = 1  # ranks per node; must equal gpus_per_node when gpus_per_node > 0
    gpus_per_node: int = 0  # GPUs per node (0: CPU-only tasks)
    cpus_per_task: Optional[int] = None  # null = submitit's default
    timeout_min: int = 60  # job time limit, minutes


@dataclass
class SlurmLauncher(SubmititLauncher):
    option: ClassVar[LauncherName] = LauncherName.slurm
    name: LauncherName = LauncherName.slurm
    gpus_per_node: int = 8
    tasks_per_node: int = 8
    partition: Optional[str] = None  # SLURM partition; null = the cluster's default
    account: Optional[str] = None  # SLURM account to charge; null = your default


@dataclass
class SubmititLocalLauncher(SubmititLauncher):
    option: ClassVar[LauncherName] = LauncherName.submitit_local
    name: LauncherName = LauncherName.submitit_local
    tasks_per_node: int = 2


@dataclass
class RayLauncher(LauncherConfig):
    """hydratrain's Ray launcher plugin (extra ``[ray]``): every job is one Ray Train ``TorchTrainer`` run."""

    option: ClassVar[LauncherName] = LauncherName.ray
    name: LauncherName = LauncherName.ray
    num_workers: int = 2  # workers (ranks) per job, anywhere in the cluster
    resources_per_worker: Dict[str, float] = field(default_factory=lambda: {"CPU": 1.0})  # Ray resources per rank
    use_gpu: bool = False  # one GPU per worker (unless resources_per_worker says otherwise); nccl instead of gloo
    backend: Optional[str] = None  # backend of the process group Ray Train makes; null = nccl with use_gpu, else gloo
    address: Optional[str] = None  # an existing cluster (HOST:6379, ray://HOST:10001, auto); null = a local one
    max_failures: int = 0  # restarts of a job's workers after a failure, each resuming from the latest checkpoint


# ------------------------------------------------------------------------------------------- optim, schedule
@dataclass
class AdamWConfig:
    """``torch.optim.AdamW``; weight decay on matrices only (see ``hydratrain.optim``)."""

    option: ClassVar[OptimName] = OptimName.adamw
    name: OptimName = OptimName.adamw
    lr: float = 1e-3  # peak learning rate
    weight_decay: float = 0.1  # applied to matrices only (not norms or biases)
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    # torch's implementation: auto = fused where torch has the fused kernel for the parameters' device (CPU, CUDA),
    # else foreach (decided at run time and logged); for_loop | foreach | fused force one
    impl: AdamWImpl = AdamWImpl.auto
    # [{match: <glob on parameter names>, lr_scale: 0.1, weight_decay: 0.0}, ...]: the first match wins
    param_groups: List[Dict[str, Any]] = field(default_factory=list)


@dataclass
class AdamW8bitConfig:
    """torchao's ``AdamW8bit``: both moments kept as 8-bit codes with one fp32 scale per ``block_size`` values
    (about 1/4 of fp32 AdamW's state); tensors under 4096 values, or not a multiple of block_size, stay fp32."""

    option: ClassVar[OptimName] = OptimName.adamw8bit
    name: OptimName = OptimName.adamw8bit
    lr: float = 1e-3  # peak learning rate
    weight_decay: float = 0.1  # applied to matrices only (not norms or biases)
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    block_size: int = 256  # values per quantisation block (one fp32 scale each)
    # [{match: <glob on parameter names>, lr_scale: 0.1, weight_decay: 0.0}, ...]: the first match wins
    param_groups: List[Dict[str, Any]] = field(default_factory=list)


@dataclass
class SchedulerConfig:
    option: ClassVar[Optional[SchedulerName]] = None
    name: SchedulerName = MISSING
    warmup_steps: int = 0  # linear warm-up from optim.lr / warmup_steps (step 1) to optim.lr, optimizer steps


@dataclass
class ConstantSchedule(SchedulerConfig):
    option: ClassVar[SchedulerName] = SchedulerName.constant
    name: SchedulerName = SchedulerName.constant


@dataclass
class WarmupCosineSchedule(SchedulerConfig):
    option: ClassVar[SchedulerName] = SchedulerName.warmup_cosine
    name: SchedulerName = SchedulerName.warmup_cosine
    min_lr_ratio: float = 0.1  # final lr = min_lr_ratio * optim.lr


# ------------------------------------------------------------------------------------------------------ paths
@dataclass
class PathsConfig:
    """Where data, run dirs, caches and model files live (see ``hydratrain.paths``). Relative values resolve
    against the launch dir; each preset reads an environment variable first (``${oc.env:VAR,default}``)."""

    option: ClassVar[Optional[PathsName]] = None
    name: PathsName = MISSING
    data_dir: str = "."  # relative data paths (data.paths, data.train_path, data.tokenizer, ...) resolve here
    output_dir: str = "."  # run dirs: <output_dir>/outputs/<stamp> (single runs), <output_dir>/multirun/<stamp>
    cache_dir: str = "~/.cache/hydratrain"  # corpus and token caches, the CPU peak FLOP/s (data.cache_dir wins)
    model_dir: str = "."  # relative model.init_from files are read, and exported weights written, here


@dataclass
class DefaultPaths(PathsConfig):
    option: ClassVar[PathsName] = PathsName.default
    name: PathsName = PathsName.default


@dataclass
class WorkspacePaths(PathsConfig):
    """One mounted directory holds everything: <root>/data, <root>/outputs and <root>/multirun, <root>/cache,
    <root>/models (a container or a Ray/Kubernetes pod with a shared volume)."""

    option: ClassVar[PathsName] = PathsName.workspace
    name: PathsName = PathsName.workspace
    root: str = "/workspace"


# ------------------------------------------------------------------------------------------ trainer and rest
@dataclass
class EarlyStoppingConfig:
    """Stop when a metric stops improving (``hydratrain.train.early_stopping``); off while ``monitor`` is null."""

    monitor: Optional[str] = None  # eval/loss, eval/<metric>, eval_ema/* (with trainer.ema); null = no early stopping
    mode: MonitorMode = MonitorMode.min  # min: lower is better; max: higher is better
    patience: int = 3  # evaluations in a row without an improvement before the run stops
    min_delta: float = 0.0  # an improvement must beat the best value by more than this


@dataclass
class EMAConfig:
    """An exponential moving average of the trainable weights (``hydratrain.train.ema``); off while ``decay`` is
    null."""

    # in (0, 1), e.g. 0.999: evaluated as eval_ema/* beside eval/*, written as model_ema.safetensors; null = no EMA
    decay: Optional[float] = None
    warmup_steps: int = 0  # the decay ramps linearly from 0 to `decay` over these steps (0: `decay` from step 1)


@dataclass
class ProfileConfig:
    """A ``torch.profiler`` trace of a window of steps on every rank (``hydratrain.train.profiler``); off while
    ``steps`` is null."""

    # [first, last] optimizer steps traced, e.g. [10, 12]: <run dir>/profile/rank{N}.pt.trace.json; null = none
    steps: Optional[List[int]] = None


@dataclass
class TrainerConfig:
    max_steps: Optional[int] = 300  # optimizer steps; null = until max_epochs
    max_epochs: Optional[int] = None  # passes over the train split; null = until max_steps
    grad_accum_steps: int = 1  # micro-batches per optimizer step
    grad_clip: float = 1.0  # max global grad norm; 0 = no clipping (the norm is still logged)
    eval_every_n_steps: int = 100  # 0 = only at the end
    eval_samples: int = 256  # val samples per eval, the same set whatever the world size and batch; 0 = all
    log_every_n_steps: int = 10  # a log line and the train/* and perf/* scalars (also at step 1 and the last step)
    seed: int = 1234  # model init (every rank alike), data order (per epoch), dropout (per rank); eval order: seed 0
    # torch.compile: auto (on CUDA: the whole model, or per block under fsdp/hsdp and ddp with activation
    # checkpointing; elsewhere none) | true (the same on any device) | false | model | blocks
    compile: Any = "auto"
    progress_bar: bool = True  # rank-0 tqdm bar
    sample_tokens: int = 120  # tokens generated at the end (text for byte corpora, ids otherwise); 0 = none
    save_weights: bool = True  # write the full model as model.safetensors in the run dir at the end
    on_nonfinite: NonFinitePolicy = NonFinitePolicy.stop  # non-finite loss/grad norm (outside fp16): stop | skip
    max_consecutive_nonfinite: int = 20  # skip (and fp16's scaler): stop after this many skipped steps in a row
    # what the run returns to a sweeper (Optuna minimises or maximises it): eval/loss, eval/perplexity (token data)
    # or eval/<name> of a metric in `metrics` (eval_ema/* of these with trainer.ema); the final evaluation's value
    objective: str = "eval/loss"
    # which evaluation's value of `objective` results.json and a sweeper get: last (the final evaluation) | best (the
    # evaluation that was best by checkpoint.monitor and checkpoint.mode; monitor null = objective itself)
    objective_at: ObjectiveAt = ObjectiveAt.last
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    test_after_fit: bool = False  # evaluate the data's test split with the best (else the last) weights at the end
    ema: EMAConfig = field(default_factory=EMAConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)


@dataclass
class CheckpointConfig:
    """Sharded checkpoints under ``<run dir>/checkpoints`` and resuming (see ``hydratrain.checkpoint``)."""

    every_n_steps: int = 100  # save every N optimizer steps; 0 = none (only save_last and SIGTERM saves)
    keep_last: int = 2  # complete checkpoints kept in the run dir (older ones deleted); 0 = keep all
    save_last: bool = False  # also save when training ends (true: a finished run can be extended or exported)
    auto_resume: bool = True  # start from the latest complete checkpoint in this run dir, if there is one
    resume_from: Optional[str] = None  # a step_XXXXXXXX dir, or a checkpoints/run dir (its latest); used when the
    #                                    run dir has no checkpoint of its own; relative to the launch dir
    restore_data_position: bool = True  # false: start the saved epoch over from its first sample
    save_on_sigterm: bool = True  # on SIGTERM (SIGUSR2 under submitit): save, exit with preempt_exit_code
    preempt_exit_code: int = 75  # exit status after a SIGTERM save (EX_TEMPFAIL: relaunch to resume)
    # keep the save_top_k best checkpoints by this metric (eval/loss, eval/<metric>, eval_ema/* with trainer.ema)
    # beside the keep_last latest, and write the best weights as best/model.safetensors; null = by step only
    monitor: Optional[str] = None
    mode: MonitorMode = MonitorMode.min  # min: lower is better; max: higher is better
    save_top_k: int = 1  # best checkpoints kept (with checkpoint.monitor); each evaluation that enters them saves one


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


@dataclass
class DistributedConfig:
    """Process-group behaviour (see ``hydratrain.dist.process_group``)."""

    failure_timeout_s: float = 60.0  # when a rank raises or dies, every other rank exits within this many seconds
    collective_timeout_s: float = 600.0  # a collective that waits longer than this fails (process-group timeout)


@dataclass
class PlanConfig:
    """The memory planner (``hydratrain.plan``): the per-rank peak predicted at the start of every run and by
    ``python -m hydratrain.plan``, against a budget."""

    enabled: bool = True  # log the prediction at the start of every run (and warn when it exceeds the budget)
    memory_gb: Optional[float] = None  # per-rank budget, GiB; null = the device's (CUDA: total memory; CPU: the
    #                                    available RAM shared by the node's ranks)
    world_size: Optional[int] = None  # python -m hydratrain.plan: ranks to plan for; null = WORLD_SIZE or 1
    ranks_per_node: Optional[int] = None  # python -m hydratrain.plan on CPU: ranks sharing this node's RAM; null = all


@dataclass
class LoraConfig:
    """``+peft=lora``: LoRA adapters (Hu et al. 2021) through ``peft`` (extra ``[peft]``) on the model's named Linear
    layers; the base weights stay frozen (see ``hydratrain.parallel.lora``)."""

    r: int = 8  # rank of each adapter (A: r x in, B: out x r)
    alpha: float = 16.0  # the update B @ A is scaled by alpha / r
    dropout: float = 0.0  # dropout on the adapter's input
    # module names (or name suffixes) to adapt: [q_proj, v_proj]; null = peft's default for the architecture
    target_modules: Optional[List[str]] = None


@dataclass
class TrainConfig:
    """The whole run config: one field per config group, plus a few top-level switches."""

    # Components, each a Hydra node built with hydra.utils.instantiate (see hydratrain.components): the model
    # (_target_ + keyword arguments; init_device and init_from are hydratrain's), the loss (a callable
    # loss(outputs, targets) -> mean), the eval metrics ({name: torchmetrics node}, logged as eval/<name>); data is
    # a built-in corpus (name: ...) or a _target_ node returning datasets.
    model: Any = field(default_factory=lambda: asdict(ModelKeys()))  # the option file's keys merge onto these
    loss: Any = MISSING
    metrics: Dict[str, Any] = field(default_factory=dict)  # {name: _target_ node}: eval metrics, logged eval/<name>
    callbacks: Dict[str, Any] = field(default_factory=dict)  # {name: _target_ node}: hooks into the loop, in order
    data: Any = field(default_factory=lambda: asdict(LoaderKeys()))  # the option file's keys merge onto these
    strategy: Any = MISSING
    precision: Any = MISSING
    wrap_policy: Any = MISSING
    launcher: Any = MISSING
    optim: Any = MISSING
    scheduler: Any = MISSING
    paths: Any = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    peft: Optional[LoraConfig] = None  # +peft=lora: train LoRA adapters, the base frozen (extra [peft])
    activation_checkpointing: bool = False  # recompute each decoder block's activations in backward
    # train | eval: evaluate checkpoint.resume_from (a run dir: its best, else its latest checkpoint) or
    # model.init_from on the val and test splits, training nothing (eval_results.json)
    mode: RunMode = RunMode.train
    device: Device = Device.auto  # auto (cuda if available) | cpu | cuda


# group -> {option: schema}; each conf/<group>/<option>.yaml starts with `- /schema/<group>/<option>@_here_`
SCHEMAS: dict[str, dict[str, type]] = {
    "data": {o.value: c for c in (PythonStdlibData, TextFilesData, SyntheticData, TokenBinData, TokenizedTextData,
                                  PythonStdlibBPEData, HFDatasetData) for o in [c.option]},
    "strategy": {o.value: c for c in (SingleStrategy, DDPStrategy, FSDPStrategy, HSDPStrategy) for o in [c.option]},
    "precision": {o.value: c for c in (AutoPrecision, FP32Precision, BF16Precision, FP16Precision) for o in [c.option]},
    "wrap_policy": {"auto": BlockWrapPolicy, "none": NamedWrapPolicy, "transformer_block": BlockWrapPolicy,
                    "size_based": SizeBasedWrapPolicy},
    "launcher": {o.value: c for c in (LocalLauncher, TorchrunLauncher, SlurmLauncher, SubmititLocalLauncher,
                                      RayLauncher) for o in [c.option]},
    "optim": {o.value: c for c in (AdamWConfig, AdamW8bitConfig) for o in [c.option]},
    "paths": {o.value: c for c in (DefaultPaths, WorkspacePaths) for o in [c.option]},
    "scheduler": {o.value: c for c in (ConstantSchedule, WarmupCosineSchedule) for o in [c.option]},
}


def register_configs() -> None:
    """Store :class:`TrainConfig` as ``train_schema`` and every option schema as ``schema/<group>/<option>`` in
    Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    for group, options in SCHEMAS.items():
        for option, schema in options.items():
            cs.store(group=f"schema/{group}", name=option, node=schema)
