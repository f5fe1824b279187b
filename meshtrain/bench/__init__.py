"""Benchmarks: meshtrain's strategies side by side with PyTorch's own, in one run, as ratios."""
