"""Building blocks that several strategy folders use, so that each folder depends on these
and never on a sibling (tests/unit/test_strategy_independence.py holds them to it):

    buckets.py           flat gradient buffers over groups of parameters
    gradient_buckets.py  backward hooks filling buckets, launched in order (DDP, ZeRO, PS)
    flat.py              flat padded shards and their per-parameter views (ZeRO, PS)
    precision.py         compute dtype against fp32 master weights (DDP, ZeRO)
    replicas.py          replicas made equal at start (DDP, ZeRO, PS)
"""
