"""How the lean cross-entropy (models/lean_cross_entropy.py) splits the logits' rows: shared
with the planner, which prices its working memory (and imports no torch)."""

CHUNK_BYTES = 64 * 2**20   # fp32 working rows per chunk: two of these live at once


def chunk_rows(vocab: int) -> int:
    """Rows of logits per fp32 chunk."""
    return max(1, CHUNK_BYTES // (4 * vocab))
