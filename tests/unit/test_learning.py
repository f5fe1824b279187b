"""The reference GPT learns the default corpus: the loop `meshtrain train` runs, in miniature."""
import torch

import meshtrain as mt
from meshtrain.data.corpus import load_corpus
from meshtrain.data.sampler import BatchSampler, eval_batches
from meshtrain.models.gpt import GPT, gpt_config


def test_validation_loss_falls_well_below_its_start():
    config = gpt_config("tiny", n_layer=2, d_model=64, n_head=2, seq_len=64)
    corpus = load_corpus(max_bytes=2 * 2**20)
    torch.manual_seed(0)
    trainer = mt.Trainer(GPT(config), mt.Plan(),
                         optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3))
    sampler = BatchSampler(corpus.train, 16, config.seq_len, seed=0)
    val = eval_batches(corpus.val, 16, config.seq_len, 4)
    start = trainer.evaluate(val)
    assert abs(start - torch.log(torch.tensor(256.0)).item()) < 0.1  # uniform over bytes
    for step in range(80):
        trainer.step(*sampler.batch(step))
    end = trainer.evaluate(val)
    print(f"val loss {start:.3f} -> {end:.3f} ({end / start:.2f}x)")
    assert end < 0.6 * start
