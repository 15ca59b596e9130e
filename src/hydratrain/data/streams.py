"""This rank's resumable micro-batches and the eval set, over token streams or any map-style dataset.

Each rank reads only its share: sample indices come from ``torch.utils.data.DistributedSampler`` (shuffled with the
run seed, ``set_epoch`` every epoch), so the order is reproducible and changes every epoch; the position in it is
one global sample count, which checkpoints store and a resume on another world size continues from.

Samples are fetched either by the dataset itself (:class:`TokenDataset`: ``batch(indices)``, windows of a token
stream) or by a ``fetch`` function that turns an iterable of index lists into batches
(:mod:`hydratrain.data.loader`: a ``torch.utils.data.DataLoader`` with that iterable as its batch sampler, so its
workers never choose samples and a resume continues exactly where the checkpoint's position says).
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence

import numpy as np
import torch

from hydratrain.errors import CheckpointError, ConfigError
from hydratrain.train.batch import rebuilt

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: ``fetch(index lists) -> batches``: one batch per index list, in order; an item of a training list is an
#: ``(epoch, index)`` pair (the epoch seeds the batch's random numbers: :func:`hydratrain.data.loader.loader_fetch`),
#: of an eval or example list a plain index
Fetch = Callable[[Iterable[list]], Iterator[Any]]


def to_device(batch: Any, device: Optional[torch.device]) -> Any:
    """``batch`` (a tensor, or tuples, lists and dicts of them) with every tensor on ``device``, copied
    ``non_blocking`` (from pinned memory on CUDA, so the copy overlaps the step before it)."""

    if device is None:
        return batch
    if isinstance(batch, torch.Tensor):
        if device.type == "cuda" and not batch.is_pinned():
            batch = batch.pin_memory()
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return rebuilt(batch, [to_device(v, device) for v in batch])
    return batch

class TokenDataset:
    """Fixed windows over a 1-D token array: sample ``i`` is tokens ``[i*seq_len, i*seq_len + seq_len + 1)``.

    ``batch(indices)`` returns ``(x, y)``, each ``(len(indices), seq_len)`` int64, ``y`` shifted by one. With
    ``vocab_size``, a batch holding an id >= it raises :class:`~hydratrain.errors.ConfigError` naming
    ``model.vocab_size`` and ``source`` (the start-up check of a large token file reads a sample only; an embedding
    lookup out of range would be an opaque IndexError on CPU and a device-side assert on CUDA). The check is one
    ``max`` over the batch's B x (T + 1) ids on the host.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, vocab_size: Optional[int] = None, source: str = "data"):
        self.tokens, self.seq_len, self.vocab_size, self.source = tokens, seq_len, vocab_size, source
        self.n = max(0, (len(tokens) - 1) // seq_len)

    def __len__(self) -> int:
        return self.n

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        starts = np.asarray(indices, dtype=np.int64)[:, None] * self.seq_len

        window = np.asarray(self.tokens[starts + np.arange(self.seq_len + 1)], dtype=np.int64)
        if self.vocab_size is not None and window.size and int(window.max()) >= self.vocab_size:
            bad = int(window.max())
            at = int(starts[int(np.argwhere(window == bad)[0][0]), 0]) + int(np.argwhere(window == bad)[0][1])
            raise ConfigError("model.vocab_size", self.vocab_size, f"{self.source} holds token id {bad} (at token "
                              f"{at}), which needs model.vocab_size > {bad}")
        t = torch.from_numpy(window)
        return t[:, :-1], t[:, 1:]


@dataclass
class LoaderState:
    """Position of a :class:`ShardedBatches` iterator: ``epoch`` and micro-batches already taken in it.

    ``start_sample``: samples of the epoch's global order consumed (by all ranks together) before its micro-batch 0;
    0 except after :meth:`ShardedBatches.seek` to a position that another world size or batch size reached.
    """

    epoch: int = 0
    batch_in_epoch: int = 0
    start_sample: int = 0


class ShardedBatches:
    """This rank's micro-batches of a :class:`TokenDataset`, epoch after epoch, resumable from a LoaderState.

    Each epoch has one global order of samples: ``DistributedSampler(shuffle, seed, drop_last=True)`` with
    ``set_epoch(epoch)`` over one replica, i.e. a permutation that does not depend on the world size, cut to
    ``len(dataset) // world_size * world_size`` samples. Micro-batch ``k`` of rank ``r`` takes positions
    ``start + k*B*W + r + W*j`` (``j < B``), which is exactly what a per-rank ``DistributedSampler`` gives rank ``r``
    (every rank ``len(dataset) // world_size`` samples per epoch, disjoint from the other ranks'). So after any
    number of micro-batches all ranks together have consumed a prefix of the order, :meth:`position` is one number,
    and :meth:`seek` continues at that sample on any world size or batch size: nothing skipped or repeated.
    An epoch has ``batches_per_epoch`` micro-batches (a trailing partial global batch is dropped).
    """

    def __init__(self, dataset: TokenDataset, batch_size: int, rank: int, world_size: int, seed: int,
                 shuffle: bool = True, device: Optional[torch.device] = None, strict_position: bool = True,
                 fetch: Optional[Fetch] = None):
        from torch.utils.data import DistributedSampler  # imported here: the corpus helpers need no torch

        samples = "samples of data.seq_len tokens" if fetch is None else "samples"
        if len(dataset) < world_size:
            raise ValueError(f"the split has {len(dataset)} {samples}, fewer than world_size={world_size}: use more "
                             f"data{' or a smaller data.seq_len' if fetch is None else ''}")
        self.dataset, self.batch_size, self.device, self.fetch = dataset, batch_size, device, fetch
        self.rank, self.world_size, self.seed, self.strict_position = rank, world_size, seed, strict_position
        # (a sampler reads only the dataset's len(): TokenDataset is no torch Dataset, the corpus helpers need no torch)
        self.sampler: DistributedSampler[int] = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed,  # type: ignore[arg-type]
            drop_last=True)
        # The global order: the same permutation the per-rank samplers slice, independent of world_size.
        self.order: DistributedSampler[int] = DistributedSampler(
            # (as above): why the ignore below
            dataset, num_replicas=1, rank=0, shuffle=shuffle, seed=seed, drop_last=True)  # type: ignore[arg-type]
        self.epoch_samples = len(self.sampler) * world_size  # samples of the order used per epoch
        self.state = LoaderState()
        self.batches_per_epoch = len(self.sampler) // batch_size
        if self.batches_per_epoch == 0:
            raise ValueError(f"each rank has {len(self.sampler)} samples per epoch, fewer than data.batch_size="
                             f"{batch_size}: use more data or a smaller data.batch_size"
                             f"{' / data.seq_len' if fetch is None else ''}")

    def example(self, n: int = 2) -> Any:
        """A batch of the dataset's first ``n`` samples, on the host (for counting FLOPs and building fake inputs);
        the data position does not move."""
        indices = list(range(min(n, len(self.dataset))))
        return self.dataset.batch(indices) if self.fetch is None else next(iter(self.fetch([indices])))

    def batches_left_in_epoch(self) -> int:
        """Micro-batches per rank still to come in the current epoch."""
        total = max(0, self.epoch_samples - self.state.start_sample) // (self.batch_size * self.world_size)
        return max(0, total - self.state.batch_in_epoch)

    def batches_left(self, until_epoch: int) -> int:
        """Micro-batches per rank from the current position to the end of epoch ``until_epoch - 1`` (0-based)."""
        epoch = self.state.epoch
        if epoch >= until_epoch:
            return 0
        return self.batches_left_in_epoch() + (until_epoch - epoch - 1) * self.batches_per_epoch

    def position(self) -> tuple[int, int]:
        """(epoch, samples of its global order consumed by all ranks together)."""
        s = self.state
        return s.epoch, s.start_sample + s.batch_in_epoch * self.batch_size * self.world_size

    def seek(self, epoch: int, samples_consumed: int) -> None:
        """Continue at sample ``samples_consumed`` of epoch ``epoch``'s global order (see :meth:`position`)."""
        self.state = LoaderState(epoch, 0, samples_consumed)

    # --------------------------------------------------------------------------------------------- Stateful
    def state_dict(self) -> dict:
        """The data position and what the order depends on (so a resume can check it is the same order)."""
        epoch, consumed = self.position()
        return {"epoch": epoch, "samples_in_epoch": consumed, "world_size": self.world_size,
                "batch_size": self.batch_size, "seed": self.seed, "train_samples": len(self.dataset),
                "seq_len": getattr(self.dataset, "seq_len", 0)}

    def load_state_dict(self, state: dict) -> None:
        """Continue at the saved position, remapped to this world size and batch size (nothing skipped or repeated).

        Raises :class:`~hydratrain.errors.CheckpointError` when the saved order differs (another ``trainer.seed``,
        ``data.seq_len`` or train split), unless the iterator was made with ``strict_position=False``: then the
        saved epoch starts over from its first sample.
        """
        mismatch = [(key, state[name], now) for key, name, now in (
            ("trainer.seed", "seed", self.seed), ("data.seq_len", "seq_len", getattr(self.dataset, "seq_len", 0)),
            ("data (train split size, in samples)", "train_samples", len(self.dataset))) if state[name] != now]
        if mismatch and self.strict_position:
            what = "; ".join(f"{k} was {a}, now {b}" for k, a, b in mismatch)
            raise CheckpointError(f"cannot restore the data position ({what}): the sample order would differ and "
                                  "samples would be skipped or repeated. Use the saved values, or set "
                                  "checkpoint.restore_data_position=false to start that epoch over")
        if not self.strict_position:
            log.warning("checkpoint.restore_data_position=false: epoch %d starts over from its first sample "
                        "(samples already seen in it will be seen again)", state["epoch"])
            self.seek(int(state["epoch"]), 0)
            return
        self.seek(int(state["epoch"]), int(state["samples_in_epoch"]))
        if state["world_size"] != self.world_size or state["batch_size"] != self.batch_size:
            log.warning("data position remapped: %d ranks x batch %d -> %d ranks x batch %d; epoch %d continues at "
                        "sample %d of its order (nothing skipped or repeated); %d micro-batches per rank left in it",
                        state["world_size"], state["batch_size"], self.world_size, self.batch_size, state["epoch"],
                        state["samples_in_epoch"], self.batches_left_in_epoch())

    def _positions(self) -> Iterator[tuple[list[int], LoaderState]]:
        """This rank's index lists from the current position on, each with the position after it."""
        B, W = self.batch_size, self.world_size
        cursor = LoaderState(**vars(self.state))
        while True:
            self.order.set_epoch(cursor.epoch)
            order = list(self.order)
            while True:
                left = max(0, self.epoch_samples - cursor.start_sample) // (B * W) - cursor.batch_in_epoch
                if left <= 0:
                    break
                first = cursor.start_sample + cursor.batch_in_epoch * B * W + self.rank
                cursor = LoaderState(cursor.epoch, cursor.batch_in_epoch + 1, cursor.start_sample)
                yield order[first:first + B * W:W], cursor
            cursor = LoaderState(cursor.epoch + 1, 0)

    def _produce(self) -> Iterator[tuple[Any, LoaderState]]:
        """Micro-batches from the current position on, each with the position after it, already on the device."""
        if self.fetch is None:
            for indices, cursor in self._positions():
                yield to_device(self.dataset.batch(indices), self.device), cursor
            return
        cursors: deque = deque()

        def index_lists() -> Iterator[list]:
            for indices, cursor in self._positions():
                cursors.append(cursor)
                yield [(cursor.epoch, i) for i in indices]

        for batch in self.fetch(index_lists()):  # in order: the loader hands batches out as their lists came
            yield to_device(batch, self.device), cursors.popleft()

    def __iter__(self) -> Iterator[Any]:
        """This rank's micro-batches from the current position on: ``(x, y)``, each ``(batch_size, seq_len)`` int64,
        for token data; whatever the loader's ``collate_fn`` makes for a dataset.

        The next micro-batch is gathered and its copy to the device started before the current one is handed out
        (one batch ahead), so a step never waits for its data; :meth:`position` counts only batches handed out.
        """
        ahead = None
        for produced in self._produce():
            if ahead is not None:
                batch, self.state = ahead
                yield batch
            ahead = produced


class EvalBatches:
    """The eval set: the first ``n_samples`` samples (all when 0 or more than there are) of a fixed shuffled order
    of a split (seed 0, independent of the run), in global batches of ``world_size x batch_size``.

    Rank ``r`` takes positions ``g*W*B + r + W*j`` (``j < B``) of global batch ``g``; in the last global batch a rank
    takes only the positions that hold a sample, and a rank left with none takes sample 0 once, flagged invalid, so
    every rank runs the same number of forwards (FSDP needs that) and each sample of the set counts exactly once,
    whatever the world size and batch size. No sample is padded into a batch beside real ones: a batch whose layout
    has no row per sample (``nn.EmbeddingBag``'s flat ``input`` with its ``offsets``) could not drop it again.
    Iterating yields ``(batch, valid)``: the batch as training gets it (``(x, y)`` for token data) and ``valid``, one
    bool per sample of it (all true but for that lone padding sample).
    """

    def __init__(self, dataset: TokenDataset, n_samples: int, batch_size: int, rank: int, world_size: int,
                 device: Optional[torch.device] = None, fetch: Optional[Fetch] = None):
        if len(dataset) == 0:
            raise ValueError("the split has no sample" + (" of data.seq_len + 1 tokens: use more data or a smaller "
                                                          "data.seq_len" if fetch is None else ": use more data"))
        from torch.utils.data import DistributedSampler

        self.dataset, self.batch_size, self.rank, self.world_size, self.device = (dataset, batch_size, rank,
                                                                                  world_size, device)
        self.fetch = fetch
        order: DistributedSampler[int] = DistributedSampler(
            dataset, num_replicas=1, rank=0, shuffle=True, seed=0)  # type: ignore[arg-type]  # (reads its len())
        order.set_epoch(0)
        self.order = list(order)[:n_samples or None]
        self.n_samples = len(self.order)
        self.global_batches = -(-self.n_samples // (batch_size * world_size))

    def __len__(self) -> int:
        return self.global_batches

    def _positions(self) -> list[list[int]]:
        B, W = self.batch_size, self.world_size
        return [[g * W * B + self.rank + W * j for j in range(B)] for g in range(self.global_batches)]

    def __iter__(self) -> Iterator[tuple[Any, torch.Tensor]]:
        positions = [[p for p in ps if p < self.n_samples] or [-1] for ps in self._positions()]  # -1: sample 0, padding
        indices = [[self.order[max(p, 0)] for p in ps] for ps in positions]
        batches = (self.dataset.batch(i) for i in indices) if self.fetch is None else self.fetch(indices)
        for ps, batch in zip(positions, batches):
            valid = torch.tensor([p >= 0 for p in ps])
            yield to_device(batch, self.device), to_device(valid, self.device)
