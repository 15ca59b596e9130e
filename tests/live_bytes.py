"""Live bytes of real CPU tensor storages: what the memory planner's simulation (:class:`hydratrain.memsim.Tracker`)
counts on storage-less tensors, counted on real ones, so a test can set the two side by side."""
from __future__ import annotations

import weakref

import torch


class LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """A dispatch mode that counts every storage an op returns once, until it is freed: ``now`` (bytes live) and
    ``peak`` (the most at once since the mode was created)."""

    def __init__(self):
        super().__init__()
        self.now = self.peak = 0
        self.live = {}

    def track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        if st._cdata in self.live:
            return
        n = st.nbytes()

        def freed(_, key=st._cdata, n=n):
            if self.live.pop(key, None) is not None:
                self.now -= n

        self.live[st._cdata] = weakref.ref(st, freed)
        self.now += n
        self.peak = max(self.peak, self.now)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out
