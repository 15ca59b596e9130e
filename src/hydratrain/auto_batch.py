"""``data.batch_size=auto``: the largest micro-batch whose predicted peak memory fits the budget.

:func:`largest_fitting` is the search, over any ``predict(batch_size) -> peak bytes`` (the memory planner's in a
run: ``hydratrain.run.build``; a fake one in the tests). :func:`resolve` is its one use in a run: it asks the planner
(:mod:`hydratrain.plan`, through its public names) and returns the config with the number in place of ``auto``.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

from omegaconf import OmegaConf, read_write

from hydratrain import plan
from hydratrain.config.settings import DataSettings
from hydratrain.errors import ConfigError

log = logging.getLogger("hydratrain.auto_batch")

#: the largest micro-batch ``auto`` picks (samples per rank): beyond it a step is large enough to keep any device
#: busy, and a tiny model on a large budget would otherwise get batches larger than its data
LIMIT = 1024
#: the most ``auto`` picks on a CPU: there memory rarely binds before time does (gpt_tiny at 1024 x 256 tokens took
#: 78 s a step on 2 cores), and a CPU gains no throughput from batches far past what keeps its cores busy
CPU_LIMIT = 32


def largest_fitting(predict: Callable[[int], int], budget: int, limit: int = LIMIT) -> Optional[int]:
    """The largest batch size ``b`` in ``[1, limit]`` with ``predict(b) <= budget`` (bytes), or None when not even 1
    fits. ``predict`` must not decrease as ``b`` grows (more samples never need less memory).

    Doubles from 1 while the prediction fits (powers of two), then bisects between the last power of two that fits
    and the first that does not: about ``2 log2(b)`` calls of ``predict``. Raises ValueError when ``limit < 1``."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if predict(1) > budget:
        return None
    fits, over = 1, None  # predict(fits) <= budget; predict(over) > budget (None: not found below the limit)
    while fits < limit:
        b = min(2 * fits, limit)
        if predict(b) > budget:
            over = b
            break
        fits = b
    if over is None:
        return fits
    while over - fits > 1:
        mid = (fits + over) // 2
        if predict(mid) <= budget:
            fits = mid
        else:
            over = mid
    return fits


def resolve(cfg, strategy, info, precision, vocab_size: Optional[int], limit: int = LIMIT):
    """``cfg`` with ``data.batch_size=auto`` replaced by the largest micro-batch the memory planner predicts to fit
    this rank's budget (``plan.memory_gb``, else the device's) with the planner's error margin
    (:func:`hydratrain.plan.error_margin`) on its predicted part (:meth:`hydratrain.footprint.Plan.with_margin`), at
    most ``limit``, logged in one line; ``cfg`` itself when the batch size is a number.
    The result is a copy (the composed config is never written).

    Raises :class:`~hydratrain.errors.ConfigError` naming ``data.batch_size`` when the planner cannot model this
    setup (a strategy it does not model) or cannot predict all of a step (no example batch of a dataset node).
    When not even one sample per rank is predicted to fit, picks 1 and warns (the memory plan's line then lists
    changes that fit)."""
    if DataSettings.of(cfg.data).batch_size != "auto":
        return cfg

    try:
        setup = plan.setup_for(with_value(cfg, "data.batch_size", 1), strategy, world_size=info.world_size,
                               precision=precision.name, vocab_size=vocab_size, device=info.device.type,
                               baseline=plan.baseline_bytes(info.device), local_world_size=info.local_world_size)
    except plan.PlanUnavailable as err:
        raise ConfigError("data.batch_size", "auto", f"needs the memory planner, but {err}; allowed here: a "
                          "positive integer") from None
    budget, source = plan.budget_bytes(cfg.plan.get("memory_gb"), info.device, info.local_world_size)
    margin = plan.error_margin(info.device.type)
    peaks: dict[int, int] = {}

    first = plan.predict(setup)
    if first.unpredicted:  # (a dataset node gives an example batch only once built)
        raise ConfigError("data.batch_size", "auto", f"needs the memory planner's whole step, but it does not "
                          f"predict {'; '.join(first.unpredicted)}; allowed here: a positive integer")

    def predict(batch_size: int) -> int:  # the peak with the margin on its predicted part (Plan.with_margin)
        predicted = plan.predict(setup.replace(batch_size=batch_size))
        peaks[batch_size] = predicted.peak
        return predicted.with_margin(margin)

    if info.device.type == "cpu":
        limit = min(limit, CPU_LIMIT)
    chosen = largest_fitting(predict, budget, limit)
    where = (f"budget {budget / plan.GiB:.2f} GiB per rank ({source}), with a x{margin:g} margin for the planner's "
             f"error on all but the measured baseline ({setup.baseline / plan.GiB:.2f} GiB)")
    if chosen is None:
        log.warning("data.batch_size=auto: not even 1 sample per rank is predicted to fit (predicted peak %.2f GiB; "
                    "%s): training with data.batch_size=1", peaks[1] / plan.GiB, where)
        chosen = 1
    else:
        capped = f", the most auto picks ({limit})" if chosen == limit else ""
        log.info("data.batch_size=auto: %d samples per micro-batch per rank%s (predicted peak %.2f GiB; %s)",
                 chosen, capped, peaks[chosen] / plan.GiB, where)
    return with_value(cfg, "data.batch_size", chosen)


def with_value(cfg, key: str, value):
    """A copy of ``cfg`` with ``key`` set to ``value`` (the copy is read-only when ``cfg`` is)."""
    import copy


    new = copy.deepcopy(cfg)
    with read_write(new):
        OmegaConf.update(new, key, value, merge=False)
    return new
