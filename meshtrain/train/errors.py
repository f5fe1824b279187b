"""Errors a user sees about their run folder and checkpoints (importable without torch)."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded: missing, corrupted, unsafe, or from another model."""
