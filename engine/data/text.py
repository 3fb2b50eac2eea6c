"""Text sources: byte-level text files, the Python standard library's own source, a corpus
made by `launch.py tokenize` (or a weighted mixture of them), and synthetic token streams."""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

import numpy as np

from engine.data.base import SPLIT_SEED, DataInfo, Dataset
from engine.errors import UsageError
from engine.runtime.caches import cache_path
from engine.runtime.rundir import sha256_file


def _windows(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """Non-overlapping examples of seq_len + 1 tokens (inputs and shifted targets), as a view."""
    count = max((len(tokens) - 1) // seq_len, 0)
    return np.lib.stride_tricks.as_strided(
        tokens, (count, seq_len + 1), (seq_len * tokens.strides[0], tokens.strides[0]), writeable=False
    )


def _token_dataset(
    tokens: np.ndarray, cfg, vocab_size: int, where: str, text_codec: str = "", held_out: np.ndarray | None = None
) -> Dataset:
    """Windows of `tokens`: the last data.eval_fraction of them held out, or all trained and
    `held_out` (data.eval_path's) evaluated."""
    n_eval = int(len(tokens) * cfg.eval_fraction) if held_out is None else 0
    train_tokens, eval_tokens = tokens[: len(tokens) - n_eval], tokens[len(tokens) - n_eval :]
    eval_tokens = eval_tokens if held_out is None else held_out
    train, evals = _windows(train_tokens, cfg.seq_len), _windows(eval_tokens, cfg.seq_len)
    if len(train) == 0 or len(evals) == 0:
        split = f"data.eval_fraction={cfg.eval_fraction}" if held_out is None else f"data.eval_path={cfg.eval_path}"
        raise UsageError(
            f"{where} has {len(train_tokens)} tokens to train on and {len(eval_tokens)} held out ({split}): too few "
            f"for data.seq_len={cfg.seq_len}; use more text or a shorter seq_len"
        )
    info = DataInfo(
        "tokens",
        len(train),
        len(evals),
        vocab_size=vocab_size,
        seq_len=cfg.seq_len,
        text_codec=text_codec,
        bytes_per_token=1.0 if text_codec == "bytes" else 0.0,
    )
    return Dataset({"tokens": train}, {"tokens": evals}, info)


def text(cfg) -> Dataset:
    """Byte-level text: a file, or every file under a directory (sorted), as tokens 0..255
    (data.eval_path's, the held-out split)."""
    tokens = _text_bytes(Path(cfg.path), "data.path")
    if cfg.eval_path:
        train, held = Path(cfg.path).resolve(), Path(cfg.eval_path).resolve()
        if train == held or train in held.parents or held in train.parents:
            raise UsageError(
                f"data.eval_path={cfg.eval_path} overlaps data.path={cfg.path}: the held-out text would be trained "
                "on; give data.eval_path text of its own"
            )
    held_out = _text_bytes(Path(cfg.eval_path), "data.eval_path") if cfg.eval_path else None
    return _token_dataset(tokens, cfg, 256, f"data.path={cfg.path}", text_codec="bytes", held_out=held_out)


def _text_bytes(path: Path, key: str) -> np.ndarray:
    if path.is_file():
        return np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        if not files:
            raise UsageError(f"{key}={path} holds no files; expected text files")
        return np.concatenate([np.fromfile(p, dtype=np.uint8) for p in files])
    raise UsageError(f"{key}={path} does not exist; expected a text file or a directory of them")


def _stdlib_files(max_bytes: int) -> list[Path]:
    files, size = [], 0
    for file in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        files.append(file)
        size += file.stat().st_size
        if size >= max_bytes:
            break
    return files


def python_source(cfg) -> Dataset:
    """The Python standard library's own modules: real text (code and English docstrings)
    present wherever Python is, so it needs no download. data.tokenizer=bytes: byte-level
    tokens of the first max_bytes; bpe:N: a byte-level BPE trained on those files, tokenized
    once (one document per module) into data.cache_dir and read as data.name=tokens."""
    files = _stdlib_files(cfg.max_bytes)
    stdlib = files[0].parent
    if cfg.tokenizer != "bytes":
        return _tokens_dataset(cfg, [(str(_stdlib_corpus(cfg, files)), 1.0, "python_source")])
    tokens = np.concatenate([np.fromfile(file, dtype=np.uint8) for file in files])
    return _token_dataset(tokens[: cfg.max_bytes], cfg, 256, f"the Python library at {stdlib}", text_codec="bytes")


def stdlib_corpus_dir(cfg, files: list[Path]) -> Path:
    """Where the tokenized corpus of `files` is kept in data.cache_dir: one directory per
    tokenizer (a file by its content), held-out share and files, whichever config asks."""
    import hashlib

    from engine.data.tokens import FORMAT

    bpe = cfg.tokenizer.startswith("bpe:")
    # a tokenizer file counts by its content (the same tokenizer anywhere shares one corpus)
    tokenizer = cfg.tokenizer if bpe else sha256_file(Path(cfg.tokenizer).expanduser())
    key = hashlib.sha256(
        repr([FORMAT, tokenizer, cfg.eval_fraction, [(str(f), f.stat().st_size) for f in files]]).encode()
    ).hexdigest()[:16]
    kind = cfg.tokenizer.replace(":", "") if bpe else "tokenizer"
    return cache_path(cfg.cache_dir) / f"python-stdlib-{kind}-{key}"


def _stdlib_corpus(cfg, files: list[Path]) -> Path:
    """The tokenized corpus of `files` in the cache (made on first use; a lock keeps two
    processes from making it at once)."""
    import fcntl

    from engine.data.pretokenize import tokenize

    out = stdlib_corpus_dir(cfg, files)
    if not (out / "manifest.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out.parent / f".{out.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (out / "manifest.json").is_file():
                print(
                    f"data: tokenizing {len(files)} Python modules with a {cfg.tokenizer} tokenizer into {out} "
                    "(once; later runs reuse it)",
                    file=sys.stderr,
                    flush=True,
                )
                tokenize(
                    [str(f) for f in files], str(out), cfg.tokenizer, eval_fraction=cfg.eval_fraction, progress=False
                )
    return out


def source_name(source: dict, index: int) -> str:
    """A mixture source's name in metrics: its `name`, else its directory's name."""
    return str(source.get("name") or Path(str(source["path"])).name or f"source{index}")


def tokens(cfg) -> Dataset:
    """Tokenized corpora (`python launch.py tokenize`): data.path, or a mixture in data.sources."""
    if cfg.sources:
        return _tokens_dataset(
            cfg, [(str(s["path"]), float(s.get("weight", 1.0)), source_name(s, i)) for i, s in enumerate(cfg.sources)]
        )
    return _tokens_dataset(cfg, [(cfg.path, 1.0, Path(cfg.path).name)])


def _bytes_per_token(splits: list[dict]) -> float:
    """Text bytes per token of eval splits whose manifests count their bytes (0: one does not)."""
    if not all(split.get("bytes") for split in splits):
        return 0.0
    return sum(split["bytes"] for split in splits) / sum(split["tokens"] for split in splits)


def _tokens_dataset(cfg, sources: list[tuple[str, float, str]]) -> Dataset:
    from engine.data import tokens as tk

    where = "data.path" if len(sources) == 1 else "data.sources"
    corpora = [tk.open_corpus(path, cfg.verify, where) for path, _, _ in sources]
    first = corpora[0]
    for corpus, (path, _, _) in zip(corpora[1:], sources[1:]):
        if corpus.tokenizer_file.read_bytes() != first.tokenizer_file.read_bytes():
            raise UsageError(
                f"data.sources: {path} was tokenized with another tokenizer than {sources[0][0]}; "
                "a mixture's corpora must share one tokenizer"
            )
    mixed = len(sources) > 1
    train, evals = [], []
    for k, (corpus, (path, _, _)) in enumerate(zip(corpora, sources)):
        source = k if mixed else None
        train.append(tk.Windows(corpus.stream("train"), cfg.seq_len, cfg.packing, source))
        evals.append(tk.Windows(corpus.stream("eval"), cfg.seq_len, cfg.packing, source))
        if len(train[-1]) == 0:
            raise UsageError(
                f"{where}: {path} has {corpus.stream('train').size} train tokens: too few for "
                f"data.seq_len={cfg.seq_len}; use more text or a shorter seq_len"
            )
    evals = [w for w in evals if len(w)]
    if not evals:
        raise UsageError(
            f"{where}: no held-out windows of data.seq_len={cfg.seq_len} tokens; tokenize with a "
            "larger --eval-fraction or use a shorter seq_len"
        )
    info = DataInfo(
        "tokens",
        sum(len(w) for w in train),
        sum(len(w) for w in evals),
        vocab_size=first.vocab_size,
        seq_len=cfg.seq_len,
        text_codec="tokenizer",
        tokenizer=str(first.tokenizer_file),
        bytes_per_token=_bytes_per_token([corpus.manifest["splits"]["eval"] for corpus in corpora]),
        sources=tuple(name for _, _, name in sources) if mixed else (),
    )
    return Dataset(tk.Mixture(train, [w for _, w, _ in sources]), tk.eval_examples(evals), info)


def synthetic_text(cfg) -> Dataset:
    """A stream of 64 fixed random 6-token "words" in random order: within a word the next
    token is predictable from the context, so the loss can fall well below log(vocab)."""
    rng = np.random.default_rng(SPLIT_SEED)
    length = int(cfg.num_examples * 1.25) * cfg.seq_len + 1
    words = rng.integers(0, cfg.vocab_size, (64, 6), dtype=np.int32)
    tokens = words[rng.integers(0, len(words), length // 6 + 1)].reshape(-1)[:length]
    return _token_dataset(tokens, cfg, cfg.vocab_size, "data.name=synthetic_text")
