"""`launch.py sample --workdir DIR --prompt TEXT | --prompts FILE [--chat] [--step best|N]`: text
from a run's newest checkpoint (or the one --step names)."""

from __future__ import annotations

import argparse

from engine.cli.common import Command, Parser


def parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="launch.py sample",
        description="Generate text from a run's newest checkpoint (key/value cache; greedy at temperature 0).",
    )
    p.add_argument("--workdir", required=True, help="the training run's directory")
    p.add_argument(
        "--step",
        metavar="best|N",
        help="the checkpoint to sample from: best (the one checkpoint.keep_best kept) or a step number; "
        "default: the newest",
    )
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", help="the text to continue")
    given.add_argument(
        "--prompts",
        metavar="FILE",
        help="a UTF-8 file of prompts, one per line (blank lines skipped), continued together in one batch "
        "(at most 16 MiB; the batch must fit the key/value cache's share of a device's memory)",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="put each prompt as a user's message through the model's chat template (an imported model's "
        "tokenizer_config.json or chat_template.jinja), ready for the assistant's reply",
    )
    p.add_argument("--system", default="", metavar="TEXT", help="with --chat: a system message before each prompt")
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
    from engine.hub.generate import sample

    prompts = [args.prompt] if args.prompt is not None else _read_prompts(args.prompts)
    if args.chat:
        from pathlib import Path

        from engine.lm.chat import chat_prompts

        prompts = chat_prompts(Path(args.workdir), prompts, args.system)
    texts = sample(
        args.workdir,
        prompts,
        args.max_tokens,
        args.temperature,
        args.top_p,
        args.seed,
        not args.ignore_eos,
        args.num_samples,
        args.stop,
        args.step,
    )
    if len(texts) == 1:
        print(texts[0])
        return 0
    for number, text in enumerate(texts):
        prompt, drawn = divmod(number, args.num_samples)
        names = ([f"prompt {prompt + 1}"] if len(prompts) > 1 else []) + (
            [f"sample {drawn + 1}"] if args.num_samples > 1 else []
        )
        print(f"=== {', '.join(names)} ===\n{text}")
    return 0


# A --prompts file's size at most: prompts that are continued in one batch, each within the
# model's context (a million prompts of 16 characters); a larger file is refused unread.
MAX_PROMPTS_BYTES = 16 * 2**20


def _read_prompts(path: str) -> list[str]:
    import os

    from engine.errors import UsageError

    too_big = f"more than {MAX_PROMPTS_BYTES:,} bytes (16 MiB), the most --prompts takes; split it into smaller files"
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size > MAX_PROMPTS_BYTES:
                raise UsageError(f"--prompts {path} holds {os.fstat(f.fileno()).st_size:,} bytes: {too_big}")
            data = f.read(MAX_PROMPTS_BYTES + 1)  # (a pipe or a device has no size: one byte past the bound)
        if len(data) > MAX_PROMPTS_BYTES:
            raise UsageError(f"--prompts {path} holds {too_big}")
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--prompts {path}: cannot be read as UTF-8 text ({e})") from None
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")  # (as text mode's universal newlines)
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise UsageError(f"--prompts {path} holds no prompt; write one prompt per line")
    return prompts


COMMAND = Command(parser, run)
