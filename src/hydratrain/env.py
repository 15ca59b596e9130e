"""``python -m hydratrain.env``: what this machine can run.

Prints the torch version, CUDA availability and device count, the distributed backends compiled in, whether bf16 is
native, which ``strategy=`` and ``precision=`` options this machine supports, whether ``optim=adamw8bit`` can run
(torchao, and a C++ compiler for its ``torch.compile`` on CPU), which launcher extras are installed (and, for
``launcher=slurm``, whether SLURM's ``sbatch`` and ``srun`` are on PATH), and the per-rank memory budget the memory
planner (``hydratrain.plan``) would use.
"""
from __future__ import annotations

import os
import sys

from hydratrain.config.launcher import missing_slurm_commands
from hydratrain.parallel.precision import cpu_has_native_bf16
from hydratrain.plan import GiB, budget_bytes


def report() -> list[str]:
    """The report as lines of text (no side effects)."""
    import torch
    import torch.distributed as dist


    cuda = torch.cuda.is_available()
    lines = [f"torch {torch.__version__} (python {sys.version.split()[0]})",
             f"cuda available: {cuda}; devices: {torch.cuda.device_count()}"]
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        lines.append(f"  cuda:{i} {p.name}, {p.total_memory / 2**30:.1f} GiB")
    backends = [b for b, ok in (("gloo", dist.is_available() and dist.is_gloo_available()),
                                ("nccl", dist.is_available() and dist.is_nccl_available()),
                                ("mpi", dist.is_available() and dist.is_mpi_available())) if ok]
    lines.append(f"distributed available: {dist.is_available()}; backends: {', '.join(backends) or 'none'}")
    lines.append(f"cpu cores: {os.cpu_count()}; cpu capability: {torch.backends.cpu.get_cpu_capability()}; "
                 f"native bf16 on cpu: {cpu_has_native_bf16()}")
    strategies = ["single"] + (["ddp", "fsdp", "hsdp"] if dist.is_available() and backends else [])
    lines.append(f"strategies: {', '.join(strategies)}")
    bf16_fast = torch.cuda.is_bf16_supported() if cuda else cpu_has_native_bf16()
    precisions = ["fp32", f"bf16{'' if bf16_fast else ' (slow here: no native bf16)'}",
                  f"fp16{'' if cuda else ' (slow on CPU: no native fp16 matmul)'}",
                  f"auto (-> {'bf16' if bf16_fast else 'fp32'})"]
    lines.append(f"precisions: {', '.join(precisions)}")
    lines.append(f"optimizers: adamw, {_lowbit()}")
    submitit = _installed("submitit", "slurm")
    missing = missing_slurm_commands()
    slurm = f"; needs SLURM's {' and '.join(missing)}, missing here" if missing else ""
    lines.append(f"launchers: local, torchrun, slurm ({submitit}{slurm}), submitit_local ({submitit}), "
                 f"ray ({_installed('ray', 'ray')})")
    optuna = _installed("hydra-optuna-sweeper", "optuna")
    lines.append(f"sweepers: basic, optuna for +hparams_search=lr_optuna ({optuna})")
    lines.append(memory_budget_line(cuda))
    return lines


def _installed(package: str, extra: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"{package} {version(package)}"
    except PackageNotFoundError:
        return f"not installed: pip install -e '.[{extra}]'"


def _lowbit() -> str:
    """How ``optim=adamw8bit`` stands here: torchao's version, or what it lacks."""
    import shutil
    from importlib.metadata import PackageNotFoundError, version

    import torch

    try:
        ao = version("torchao")
    except PackageNotFoundError:
        return "adamw8bit (not installed: pip install -e '.[lowbit]')"
    compiler = torch.cuda.is_available() or any(shutil.which(c) for c in ("g++", "c++", "clang++"))
    return f"adamw8bit (torchao {ao}" + ("" if compiler else "; no C++ compiler for torch.compile on CPU") + ")"


def memory_budget_line(cuda: bool) -> str:
    """The per-rank memory budget a run would warn against (``hydratrain.plan``, ``plan.memory_gb=null``), for
    ``LOCAL_WORLD_SIZE`` ranks on this node (1 when unset)."""
    import torch


    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()) if cuda \
        else torch.device("cpu")
    budget, source = budget_bytes(None, device, ranks, in_run=False)
    return (f"memory budget per rank (hydratrain.plan, plan.memory_gb=null): {budget / GiB:.1f} GiB ({source}; "
            "set plan.memory_gb to use another)")


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(prog="python -m hydratrain.env", description=__doc__.split("\n\n")[1].replace("\n", " "),
                            ).parse_args()  # no arguments: --help, or one line and status 2 for anything else
    print("\n".join(report()))
