"""`launch.py tokenize --input PATH... --out DIR --tokenizer bpe:N|tokenizer.json`: text corpora
into token shards, once."""

from __future__ import annotations

import argparse
import time

from engine.cli.common import Command, Parser


def parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="launch.py tokenize",
        description="Tokenize text corpora once into token shards for "
        "data.name=tokens (train with data.path=OUT). Streams the input; an interrupted run re-run with the "
        "same arguments continues where it stopped.",
    )
    p.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="PATH",
        help="text files (a file is a document; see --text-unit), .jsonl records, .parquet rows, a Hugging "
        "Face datasets directory (save_to_disk; a DatasetDict's train split), or directories of them",
    )
    p.add_argument("--out", required=True, help="the corpus directory to write")
    p.add_argument(
        "--tokenizer",
        required=True,
        metavar="T",
        help="a Hugging Face tokenizer.json (or a directory with one), or bpe:N to train a byte-level BPE "
        "of N tokens on the input itself",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        metavar="N",
        help="the vocabulary the corpus declares (at least the tokenizer's; e.g. rounded up to a multiple "
        "of 128), or N for --tokenizer bpe",
    )
    p.add_argument(
        "--eval-fraction",
        type=float,
        default=0.01,
        metavar="F",
        help="share of documents held out for evaluation (default 0.01)",
    )
    p.add_argument("--text-field", default="text", help="the JSON Lines field / Parquet or datasets column of the text")
    p.add_argument(
        "--text-unit",
        choices=("file", "line"),
        default="file",
        help="plain text files: one document per file (default) or per line",
    )
    p.add_argument(
        "--shard-tokens", type=int, default=1 << 27, metavar="N", help="tokens per shard file (default 134,217,728)"
    )
    p.add_argument(
        "--eod-token", help="the end-of-document token (default: the tokenizer's own, e.g. <|endoftext|> or </s>)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def run(args, argv: list[str]) -> int:
    """Exit 0 done, 2 bad input (engine/cli turns UsageError into it), 130/143 interrupted (re-run to go on)."""
    from engine.data.pretokenize import Interrupted, tokenize

    started = time.perf_counter()
    try:
        manifest = tokenize(
            args.input,
            args.out,
            args.tokenizer,
            args.vocab_size or 0,
            args.eval_fraction,
            args.text_field,
            args.text_unit,
            args.shard_tokens,
            eod_token=args.eod_token or "",
            progress=not args.no_progress,
        )
    except Interrupted as stopped:
        print("tokenize: interrupted; what is written is kept: re-run the same command to continue", flush=True)
        return stopped.exit_code
    splits = manifest["splits"]
    print(
        f"tokenize: {args.out}: {splits['train']['tokens']:,} train tokens in {splits['train']['documents']:,} "
        f"documents, {splits['eval']['tokens']:,} in {splits['eval']['documents']:,} held out; "
        f"vocabulary {manifest['vocab_size']:,} "
        f"({manifest['dtype']}); {time.perf_counter() - started:,.1f} s; train with data.name=tokens "
        f"data.path={args.out}",
        flush=True,
    )
    return 0


COMMAND = Command(parser, run)
