"""`meshtrain generate RUN_DIR`: sample text from a run's latest checkpoint, in one process,
whatever plan trained it; prompts are encoded and output decoded with the run's tokenizer
(its folder's tokenizer/), or as bytes for a byte-level run. A transformers model folder
(`meshtrain export`'s, save_pretrained's) works too, with the tokenizer.json beside it.

    meshtrain generate runs/2026-11-23_10-00-00 --prompt "def " --tokens 200
    meshtrain generate my-llama/ --prompt "def "

With a tokenizer, a sample stops where the model emits its end-of-document token (EOS);
--ignore-eos draws all --tokens.
"""
from __future__ import annotations

import argparse
import codecs
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="sample text from a trained run's latest checkpoint "
                       "or a transformers folder",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder made by meshtrain train, "
                   "or a transformers model folder with its tokenizer.json (what meshtrain "
                   "export or save_pretrained writes)")
    p.add_argument("--prompt", default="def ", help="text to continue (default: %(default)r)")
    p.add_argument("--tokens", type=int, default=200,
                   help="tokens (bytes for a byte-level run) to generate (default: 200)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="softmax temperature; 0 takes the most likely token (default: 0.8)")
    p.add_argument("--top-k", type=int, default=40,
                   help="sample among the k most likely tokens (default: 40; 0 for all)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="go on past the tokenizer's end-of-document token (default: a sample "
                   "stops there, the token left out; a byte-level run has none)")
    p.set_defaults(run=run)


def run(args) -> int:
    from meshtrain.train.errors import CheckpointError
    from meshtrain.train.generate import check_sampling, generate, load_trained, run_tokenizer

    top_k = args.top_k or None
    try:
        check_sampling(args.tokens, args.temperature, top_k)
        model, seq_len, steps = load_trained(args.run_dir)
        tokenizer = run_tokenizer(args.run_dir)   # None: a byte-level run
    except (ValueError, FileNotFoundError, CheckpointError) as exc:
        print(f"meshtrain generate: {exc}", file=sys.stderr)
        return 2
    unit = "bytes" if tokenizer is None else "tokens"
    where = f"step {steps}" if steps is not None else "a transformers model folder"
    print(f"# {args.run_dir}, {where}: {args.tokens} {unit} after {args.prompt!r}",
          file=sys.stderr)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")   # bytes may split a char
    sys.stdout.write(args.prompt)
    ids: list[int] = []

    def show(token: int) -> None:
        if tokenizer is None:
            sys.stdout.write(decoder.decode(bytes([token])))
        else:   # decode all so far: a token may complete a character the last one began
            before = tokenizer.decode(ids)
            ids.append(token)
            sys.stdout.write(tokenizer.decode(ids)[len(before):])
        sys.stdout.flush()

    generate(model, args.prompt, args.tokens, seq_len, args.temperature, top_k, args.seed,
             on_token=show, tokenizer=tokenizer, stop_at_eos=not args.ignore_eos)
    sys.stdout.write(decoder.decode(b"", final=True) + "\n")
    if tokenizer is not None and len(ids) < args.tokens:   # only an EOS ends a sample early
        print(f"# stopped at {tokenizer.eos!r} (the end of a document) after {len(ids)} "
              "tokens; --ignore-eos goes on", file=sys.stderr)
    return 0
