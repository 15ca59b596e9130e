"""A small CNN with BatchNorm on scikit-learn's handwritten digits: a model, datasets and a metric that are not a
language model, trained through the same seams as a user's own (``+experiment=digits_cnn``; extra ``[examples]``).

The data are the 1,797 8x8 grey images (16 levels) that ship inside scikit-learn (``sklearn.datasets.load_digits``,
the UCI "Optical Recognition of Handwritten Digits" test set): nothing is downloaded.
"""
from __future__ import annotations

import torch
from torch import nn


class ConvBlock(nn.Module):
    """``conv 3x3 -> BatchNorm -> ReLU``: ``(B, c_in, H, W) -> (B, c_out, H, W)``; the unit FSDP shards and
    activation checkpointing recomputes (found as the children of the model's ``nn.ModuleList``)."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(c_out)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.norm(self.conv(x)))


class DigitsCNN(nn.Module):
    """``(B, 1, 8, 8)`` images in [0, 1] -> ``(B, num_classes)`` logits: ``depth`` conv blocks of ``channels``
    (a 2x2 max-pool after the second), global average pooling, a linear head."""

    def __init__(self, channels: int = 32, depth: int = 4, num_classes: int = 10):
        super().__init__()
        widths = [1] + [channels] * depth
        self.blocks = nn.ModuleList(ConvBlock(a, b) for a, b in zip(widths, widths[1:]))
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == 1:
                x = self.pool(x)
        return self.head(x.mean(dim=(2, 3)))


def digits(val_fraction: float = 0.2, seed: int = 0) -> dict:
    """``{"train": TensorDataset, "val": TensorDataset}`` of scikit-learn's digits: samples ``(image (1, 8, 8)
    float32 in [0, 1], label int64)``, split stratified by label with ``seed`` (independent of the run's seed).

    Raises ImportError naming the extra when scikit-learn is not installed."""
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as err:
        raise ImportError("the digits example needs scikit-learn: pip install -e '.[examples]'") from err
    from torch.utils.data import TensorDataset

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(data.target, dtype=torch.int64)
    train, val = train_test_split(range(len(labels)), test_size=val_fraction, random_state=seed, stratify=data.target)
    return {"train": TensorDataset(images[train], labels[train]), "val": TensorDataset(images[val], labels[val])}
