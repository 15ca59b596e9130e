"""A researcher's own data: a function that returns map-style datasets of (inputs, targets) samples."""
import math

import torch
from torch.utils.data import TensorDataset


def spirals(n: int = 3000, classes: int = 3, noise: float = 0.15, seed: int = 0, test_fraction: float = 0.0) -> dict:
    """``classes`` interleaved spiral arms of 2-D points (``n`` in all): ``{"train": ..., "val": ...}``, 80/20, and
    with ``test_fraction`` a ``"test"`` split of that share of the points, held out first."""
    g = torch.Generator().manual_seed(seed)
    label = torch.arange(n) % classes
    radius = torch.rand(n, generator=g)
    angle = label * (2 * math.pi / classes) + 3 * radius + noise * torch.randn(n, generator=g)
    points = torch.stack([radius * angle.cos(), radius * angle.sin()], dim=1)
    held = n - int(test_fraction * n)
    cut = int(0.8 * held)
    out = {"train": TensorDataset(points[:cut], label[:cut]), "val": TensorDataset(points[cut:held], label[cut:held])}
    if held < n:
        out["test"] = TensorDataset(points[held:], label[held:])
    return out
