"""Which tokens of each sequence a cp rank holds: the load-balanced split.

A sequence of T tokens is cut into 2*cp chunks of c = T / (2 cp); cp rank i keeps chunks i
and 2cp-1-i. Under causal attention a query attends to every key before it, so chunk j
costs j+1 chunk-blocks of work: the pair (i, 2cp-1-i) costs 2cp+1 on every rank, where a
plain split into cp pieces would leave the last rank cp times the first's work.

Everything token-local (embeddings, norms, MLPs, the loss) runs on the rank's 2c tokens
unchanged; what needs a token's place in the whole sequence (learned positions, RoPE,
the causal mask) asks `positions`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from meshtrain.core.plan import PlanError

SEQUENCE_DIM = 1   # inputs and targets are (B, T); hidden states (B, T, d)


@dataclass(frozen=True)
class ChunkLayout:
    """cp rank `rank` of `size`: which chunks of a sequence it holds."""
    rank: int
    size: int

    @property
    def chunks(self) -> tuple[int, int]:
        """The global indices of this rank's two chunks, in the order it holds them."""
        return self.rank, 2 * self.size - 1 - self.rank

    def chunk_of(self, rank: int) -> tuple[int, int]:
        """Another cp rank's two chunks (what its K/V blocks cover)."""
        return rank, 2 * self.size - 1 - rank

    def positions(self, local_len: int, device=None) -> torch.Tensor:
        """Each local token's place in the whole sequence: (local_len,) int64, for a rank
        holding `local_len` = 2c tokens of a sequence of cp * local_len."""
        c = local_len // 2
        return torch.cat([torch.arange(k * c, (k + 1) * c, device=device)
                          for k in self.chunks])

    def split(self, tensor: torch.Tensor, dim: int = SEQUENCE_DIM) -> torch.Tensor:
        """This rank's tokens of whole sequences along `dim`: chunks i and 2cp-1-i."""
        T = tensor.size(dim)
        check_sequence(T, self.size)
        pieces = tensor.chunk(2 * self.size, dim=dim)
        return torch.cat([pieces[k] for k in self.chunks], dim=dim)


def check_sequence(length: int, cp: int) -> None:
    """Refuse a sequence the load-balanced split cannot cut evenly."""
    if length % (2 * cp):
        raise PlanError(f"context parallel with cp={cp} cuts each sequence into 2*cp = "
                        f"{2 * cp} equal chunks, but the sequence has {length} tokens; use a "
                        f"sequence length that is a multiple of {2 * cp} (e.g. "
                        f"{max(2 * cp, length // (2 * cp) * 2 * cp)}), or another cp")
