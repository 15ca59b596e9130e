"""This process's TCPStore at ``MASTER_ADDR:MASTER_PORT`` (:func:`base_store`), shared by the run-dir stamp, the
run-dir lock and every process group of this process, and a poll of it that signals can interrupt
(:func:`store_get`). Importing this module imports no torch."""
from __future__ import annotations

import os
import time
from datetime import timedelta

from hydratrain.dist.env import dist_info

_BASE_STORE = None  # this process's client (or, on rank 0 without an agent store, server) of MASTER_ADDR:PORT


def _store_client(timeout_s: float):
    from torch.distributed import TCPStore

    return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, is_master=False,
                    timeout=timedelta(seconds=timeout_s), wait_for_workers=False, use_libuv=True)


def base_store():
    """This process's TCPStore at ``MASTER_ADDR:MASTER_PORT``, made once and shared by the run-dir stamp and every
    process group of this process. Rank 0 hosts it unless a torch elastic agent already does
    (``TORCHELASTIC_USE_AGENT_STORE=True``, torchrun's c10d rendezvous)."""
    global _BASE_STORE
    if _BASE_STORE is None:
        import torch.distributed as dist
        from torch.distributed import TCPStore

        info = dist_info()
        # a torch elastic agent (torchrun's c10d rendezvous) or an existing default group (Ray Train's env://
        # rendezvous, hosted by rank 0's group) already serves a store at MASTER_ADDR:MASTER_PORT
        agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true" or (
            dist.is_available() and dist.is_initialized())
        if info.rank == 0 and not agent_hosts:
            _BASE_STORE = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), info.world_size,
                                   is_master=True, timeout=timedelta(minutes=5), wait_for_workers=False,
                                   use_libuv=True)
        else:
            _BASE_STORE = _store_client(300)
    return _BASE_STORE


def store_get(store, key: str, timeout_s: float = 300.0) -> bytes:
    """``store.get(key)`` once another process has set ``key``, waited for in short polls (``store.check``, 50 ms)
    instead of one blocking ``get``: a blocked C++ call defers every Python signal handler, so a rank whose rank 0
    died before answering ignored its launcher's SIGTERM until the SIGKILL 30 s later; now the start-up guard ends
    it at once. Raises TimeoutError (naming ``key``) after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no answer in the launch's store after {timeout_s:.0f} s ({key}): the rank that "
                               "answers (rank 0) did not get this far")
        time.sleep(0.05)
    return store.get(key)
