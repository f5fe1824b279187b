"""Imported by a forkserver whose ranks build transformers models (the test harness's, and
`meshtrain train --model` of a transformers preset or config.json): transformers' modeling
stack costs each rank ~1.4 s of imports otherwise, paid again by every rank of every start.

Where transformers is not installed, the forkserver skips this module (it ignores an
ImportError in a preloaded module)."""
import signal

_handler = signal.signal(signal.SIGINT, signal.SIG_IGN)   # as meshtrain._preload: Ctrl-C
try:
    import transformers.modeling_utils  # noqa: F401  (the bulk: ~1.4 s)
    from transformers import (AutoModelForCausalLM, GPT2LMHeadModel,  # noqa: F401
                              LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)
finally:
    signal.signal(signal.SIGINT, _handler)
