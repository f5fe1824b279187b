"""A model of the user's own, for `meshtrain train --model tests.multirank.own_model:build`:
token ids (B, T) -> logits (B, T, 256), no `.loss` (the run uses cross-entropy), widths that
divide no world size."""
import torch
from torch import nn


class Recurrent(nn.Module):
    def __init__(self, width: int = 37) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.mix = nn.Conv1d(width, width, kernel_size=3, padding=2)   # causal after the crop
        self.mlp = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 3 * width), nn.GELU(),
                                 nn.Linear(3 * width, width))
        self.head = nn.Linear(width, 256)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        h = h + self.mix(h.transpose(1, 2))[..., :idx.shape[1]].transpose(1, 2)
        return self.head(h + self.mlp(h))


def build() -> nn.Module:
    return Recurrent()
