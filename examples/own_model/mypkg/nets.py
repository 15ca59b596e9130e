"""A researcher's own model: nothing in it knows about hydratrain."""
import torch
from torch import nn


class ResidualBlock(nn.Module):
    """``x + MLP(LayerNorm(x))``: ``(B, width) -> (B, width)``."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class ResMLP(nn.Module):
    """``(B, in_features)`` points -> ``(B, num_classes)`` logits through ``depth`` residual blocks."""

    def __init__(self, in_features: int = 2, width: int = 64, depth: int = 4, num_classes: int = 3):
        super().__init__()
        self.embed = nn.Linear(in_features, width)
        self.blocks = nn.ModuleList(ResidualBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)
