"""`launch.py sample --workdir DIR --prompt TEXT`: text from a run's newest checkpoint."""

from __future__ import annotations

import argparse

from engine.cli.common import Command, Parser


def parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="launch.py sample",
        description="Generate text from a run's newest checkpoint (key/value cache; greedy at temperature 0).",
    )
    p.add_argument("--workdir", required=True, help="the training run's directory")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument(
        "--max-tokens",
        type=int,
        help="tokens to generate at most (default: 200, or what the model's context leaves after the prompt); "
        "prompt + max-tokens must fit the context",
    )
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default 0.95)")
    p.add_argument("--seed", type=int, default=0, help="same seed, same text (default 0)")
    p.add_argument(
        "--ignore-eos", action="store_true", help="go on past the tokenizer's end-of-text token (default: stop there)"
    )
    p.add_argument(
        "--num-samples", type=int, default=1, metavar="N", help="N continuations, drawn together in one batch"
    )
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="end a sample before TEXT (repeatable)")
    return p


def run(args, argv: list[str]) -> int:
    from engine.generate import sample

    texts = sample(
        args.workdir,
        args.prompt,
        args.max_tokens,
        args.temperature,
        args.top_p,
        args.seed,
        not args.ignore_eos,
        args.num_samples,
        args.stop,
    )
    if len(texts) == 1:
        print(texts[0])
    else:
        for number, text in enumerate(texts, 1):
            print(f"=== sample {number} ===\n{text}")
    return 0


COMMAND = Command(parser, run)
