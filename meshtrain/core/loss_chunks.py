"""When the Trainer uses the lean cross-entropy (models/lean_cross_entropy.py) and how it
splits the logits' rows: shared with the planner, which prices its memory (and imports no
torch)."""


def uses_lean_loss(recompute: str, tp: int) -> bool:
    """Recomputation plans without tensor parallelism (whose loss is vocab-parallel) train
    the token cross-entropy with the lean loss."""
    return recompute != "none" and tp == 1

CHUNK_BYTES = 64 * 2**20   # fp32 working rows per chunk: two of these live at once


def chunk_rows(vocab: int) -> int:
    """Rows of logits per fp32 chunk."""
    return max(1, CHUNK_BYTES // (4 * vocab))
