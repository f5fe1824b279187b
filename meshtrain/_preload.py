"""Imported once by the test forkserver so that every forked rank starts warm.

Importing torch, its distributed stack, the modules torch imports lazily on first use, and
meshtrain, and running assert_close once (whose first call costs 1.6-3 s of lazy imports),
here rather than in each rank.
"""
import signal

# Ctrl-C while the forkserver preloads (seconds): the command that started it says so in a
# line; this process would print its import stack. The ranks it forks get the handler back.
_handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
try:
    import torch
    import torch._dynamo  # noqa: F401  (the first optimizer built imports it: ~0.9 s)
    import torch.distributed  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.device_mesh  # noqa: F401
    import torch.testing

    import meshtrain  # noqa: F401
    import meshtrain.testing  # noqa: F401
    import meshtrain.train.run  # noqa: F401

    torch.testing.assert_close(torch.zeros(2), torch.zeros(2))
finally:
    signal.signal(signal.SIGINT, _handler)
