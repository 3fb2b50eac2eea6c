"""Tokenized-corpus figures: tokenize throughput, and a training run's resident memory against
the corpus size.

  python benchmarks/token_data.py tokenize [--mb 64] [--rounds 3]
      MB/s of text through `launch.py tokenize` (a trained tokenizer.json given, so no BPE
      training is timed) against the `tokenizers` library's own batch encoding
      (`encode_batch_fast`, the command's batches) of the same documents already in memory,
      rounds interleaved: what reading, writing and checksumming cost on top.

  python benchmarks/token_data.py memory [--sizes-mb 100 2000] [--steps 30]
      Writes corpora of random token ids (uint16, documents of 200–2,000 tokens, made
      directly in the tokenize command's format, checksums included) of each size, then trains
      llama_tiny on each (packing on, 30 steps) in a fresh process and reports its peak
      resident memory (VmHWM) and the data wait of the run summary.

  python benchmarks/token_data.py batches [--rounds 3] [--steps 200] [key=value ...]
      The host's time per training step to build llama_tiny's packed batches (the
      tokenized standard library, the config's batch and seq_len; overrides apply) through
      TrainBatches, as the prefetch thread does: Grain's batched read (one `_getitems` call
      per batch, what training uses) against reading the same examples one by one through
      the dataset's `__getitem__` (what it did before), rounds interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.data.documents import batches  # noqa: E402
from engine.data.pretokenize import tokenize, train_bpe  # noqa: E402
from engine.data.tokens import FORMAT, sha256_file  # noqa: E402


def _documents_of(directory: Path) -> list[str]:
    return [p.read_text(encoding="utf-8", errors="replace") for p in sorted(directory.rglob("*.txt"))]


def _text_corpus(directory: Path, megabytes: int) -> Path:
    """Plain-text documents made of the standard library's modules, repeated to the size."""
    import sysconfig

    modules = [
        p.read_text(encoding="utf-8", errors="replace")
        for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    ]
    directory.mkdir(parents=True, exist_ok=True)
    size, i = 0, 0
    while size < megabytes * 1e6:
        text = modules[i % len(modules)]
        (directory / f"{i:06d}.txt").write_text(text)
        size += len(text.encode())
        i += 1
    return directory


def bench_tokenize(args) -> None:
    from tokenizers import Tokenizer

    work = Path(tempfile.mkdtemp(prefix="tokenize-bench-"))
    try:
        text = _text_corpus(work / "text", args.mb)
        tokenize([str(text)], str(work / "bpe"), "bpe:8192", progress=False, bpe_train_bytes=20_000_000)
        tokenizer_file = work / "bpe" / "tokenizer.json"
        documents = _documents_of(text)
        megabytes = sum(len(d.encode()) for d in documents) / 1e6
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        ours, library = [], []
        for r in range(args.rounds):
            out = work / f"out{r}"
            start = time.perf_counter()
            tokenize([str(text)], str(out), str(tokenizer_file), progress=False)
            ours.append(time.perf_counter() - start)
            shutil.rmtree(out)
            start = time.perf_counter()
            for batch in batches(iter(documents), 1 << 22):  # the command's batches, texts already in memory
                tokenizer.encode_batch_fast(batch, add_special_tokens=False)
            library.append(time.perf_counter() - start)
        print(
            f"corpus {megabytes:.1f} MB in {len(documents)} documents, bpe:8192, {os.cpu_count()} cores, "
            f"{args.rounds} interleaved rounds"
        )
        print(
            f"  launch.py tokenize (read, encode, write shards, checksums): {megabytes / np.median(ours):.1f} MB/s "
            f"(rounds: {', '.join(f'{megabytes / t:.1f}' for t in ours)})"
        )
        print(
            f"  tokenizers encode_batch_fast alone (same batches):       {megabytes / np.median(library):.1f} MB/s "
            f"(rounds: {', '.join(f'{megabytes / t:.1f}' for t in library)})"
        )
        print(f"  ratio: {np.median(library) / np.median(ours):.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def write_random_corpus(out: Path, megabytes: int, vocab: int = 2048, seed: int = 0) -> None:
    """A corpus in the tokenize command's format of random ids (no tokenizer run), written
    shard by shard so it never sits in memory."""
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True)
    sample = (p.read_text(errors="replace") for p in sorted(Path(json.__file__).parent.parent.glob("*.py"))[:40])
    train_bpe(sample, vocab).save(str(out / "tokenizer.json"))  # for the manifest; ids are random
    splits = {}
    for split, size in (("train", megabytes), ("eval", max(1, megabytes // 100))):
        shards, remaining, index = [], int(size * 1e6 // 2), 0
        while remaining > 0:
            count = min(remaining, 1 << 27)
            lengths = rng.integers(200, 2000, count // 200 + 2)
            ends = np.cumsum(lengths)
            ends = ends[ends < count]
            ends = np.append(ends, count)
            stem = out / f"{split}-{index:05d}"
            tokens_file, docs_file = stem.with_suffix(".tokens"), stem.with_suffix(".docs")
            with open(tokens_file, "wb") as f:
                for start in range(0, count, 1 << 24):
                    f.write(rng.integers(1, vocab, min(1 << 24, count - start), dtype=np.uint16).tobytes())
            ends.astype(np.int64).tofile(docs_file)
            shards.append(
                {
                    "tokens_file": tokens_file.name,
                    "docs_file": docs_file.name,
                    "tokens": count,
                    "documents": len(ends),
                    "tokens_sha256": sha256_file(tokens_file),
                    "docs_sha256": sha256_file(docs_file),
                }
            )
            remaining -= count
            index += 1
        splits[split] = {
            "tokens": sum(s["tokens"] for s in shards),
            "documents": sum(s["documents"] for s in shards),
            "shards": shards,
        }
    (out / "manifest.json").write_text(
        json.dumps(
            {
                "format": FORMAT,
                "settings": {"random": True},
                "tokenizer": "tokenizer.json",
                "vocab_size": vocab,
                "eod_token": "<|endoftext|>",
                "eod_id": 0,
                "dtype": "uint16",
                "splits": splits,
            }
        )
    )


def bench_memory(args) -> None:
    work = Path(tempfile.mkdtemp(prefix="token-memory-"))
    try:
        print(f"llama_tiny, packing on, {args.steps} steps, one process; corpora of random uint16 ids")
        for megabytes in args.sizes_mb:
            corpus = work / f"c{megabytes}"
            start = time.perf_counter()
            write_random_corpus(corpus, megabytes)
            made = time.perf_counter() - start
            argv = [
                "launch.py",
                "--config",
                "llama_tiny",
                "--workdir",
                str(work / f"run{megabytes}"),
                "data.name=tokens",
                f"data.path={corpus}",
                f"train.steps={args.steps}",
                "eval.every_steps=0",
                "log.progress=false",
                "log.tensorboard=false",
                "checkpoint.every_steps=0",
                "optimizer.warmup_steps=2",
            ]
            script = (
                f"import resource, runpy, sys; sys.argv = {argv!r}\n"
                "try:\n    runpy.run_path('launch.py', run_name='__main__')\n"
                "finally:\n    print('VmHWM', open('/proc/self/status').read().split('VmHWM:')[1].split()[0])"
            )
            result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)
            peak = re.search(r"VmHWM (\d+)", result.stdout)
            wait = re.search(r"data wait ([\d.]+)s", result.stdout + result.stderr)
            mean = re.search(r"mean step ([\d.]+) ms", result.stdout + result.stderr)
            if not peak or result.returncode not in (0, None):
                print(result.stdout[-2000:], result.stderr[-2000:])
            print(
                f"  {megabytes:>6} MB corpus (made in {made:.0f}s): peak RSS {int(peak.group(1)) / 1024:.0f} MiB, "
                f"data wait {wait.group(1) if wait else '?'} s over {args.steps} steps of "
                f"{mean.group(1) if mean else '?'} ms"
            )
            shutil.rmtree(corpus)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def bench_batches(args) -> None:
    from engine.config import load_config
    from engine.data.tokens import Examples
    from engine.run.setup import trace_run, train_batches

    cfg = load_config(
        ROOT / "configs" / "llama_tiny.yaml",
        ["log.progress=false", *args.overrides],
        tempfile.mkdtemp(prefix="token_batches_"),
    )
    batches = train_batches(cfg, trace_run(cfg), np.arange(cfg.train.global_batch_size))
    examples = batches.examples

    def one_by_one(indices):
        rows = [examples.dataset[int(i)] for i in indices]
        return {name: np.stack([row[name] for row in rows]) for name in examples.spec}

    ways = {"batched (_getitems)": Examples.take.__get__(examples), "one by one (__getitem__)": one_by_one}
    seconds = {name: [] for name in ways}
    for round_ in range(args.rounds):
        for name, read in ways.items():
            examples.take = read
            first = round_ * len(ways) * args.steps + list(ways).index(name) * args.steps  # new steps each time
            began = time.perf_counter()
            for step in range(first, first + args.steps):
                batches(step)
            seconds[name].append((time.perf_counter() - began) / args.steps)
    print(
        f"llama_tiny batches: global batch {cfg.train.global_batch_size} x seq_len {cfg.data.seq_len} "
        f"(packed), {args.steps} steps per round"
    )
    for name, values in seconds.items():
        print(f"{name:<28}{np.median(values) * 1e6:>8.0f} us/step   [{' '.join(f'{v * 1e6:.0f}' for v in values)}]")
    old, new = (np.median(seconds[name]) for name in ("one by one (__getitem__)", "batched (_getitems)"))
    print(f"one by one / batched = {old / new:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    t = sub.add_parser("tokenize")
    t.add_argument("--mb", type=int, default=64)
    t.add_argument("--rounds", type=int, default=3)
    m = sub.add_parser("memory")
    m.add_argument("--sizes-mb", type=int, nargs="+", default=[100, 2000])
    m.add_argument("--steps", type=int, default=30)
    b = sub.add_parser("batches")
    b.add_argument("--rounds", type=int, default=3)
    b.add_argument("--steps", type=int, default=200)
    b.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()
    {"tokenize": bench_tokenize, "memory": bench_memory, "batches": bench_batches}[args.what](args)


if __name__ == "__main__":
    main()
