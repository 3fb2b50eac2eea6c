"""`python launch.py tokenize`: text corpora → a directory of token shards, once.

Reads plain text (a file is one document, or a line with --text-unit line), JSON Lines (one
document per record, its `--text-field`) and Parquet (one per row of that column) as a
stream, never the whole corpus; tokenizes in batches with a Hugging Face `tokenizers`
tokenizer (its Rust encoder uses every core), appends the end-of-document token, and writes

  DIR/manifest.json              written last: the corpus exists only once it is there
  DIR/tokenizer.json             the tokenizer, as `tokenizers` saves it
  DIR/{train,eval}-NNNNN.tokens  token ids, uint16 (vocabularies up to 65,536) or uint32
  DIR/{train,eval}-NNNNN.docs    int64 end offset of every document in the shard

A document goes to the held-out split by a hash of its index (a fixed fraction, whatever the
batch or shard sizes). A shard closes after the document that fills it, so shard contents
depend on the input alone. After every batch the open shards are flushed and
`progress.json` records how far they go; an interrupted run (Ctrl-C, SIGTERM, SIGKILL)
re-run with the same command truncates the open shards to that point and goes on, and ends
with the same bytes as an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from engine.data.documents import batches, documents, first_bytes, input_files, split_one_document, with_last
from engine.data.input_checks import check_inputs
from engine.data.shards import ShardWriter
from engine.data.tokens import FORMAT, manifest_digest
from engine.errors import UsageError
from engine.lm.tokenizer import END_OF_TEXT, MAX_TOKENIZER_BYTES, check_size
from engine.runtime.rundir import LOCK, WorkdirLock, write_json
from engine.runtime.watchdog import Heartbeat

EOD_TOKEN = "<|endoftext|>"  # the end-of-document token of the BPEs this command trains
EOD_CANDIDATES = END_OF_TEXT  # the first of them the tokenizer has ends each document
SPLITS = ("train", "eval")
_MASK64 = (1 << 64) - 1


# How documents are read (engine/data/documents.py): a resumed tokenization counts the documents
# already written, so a partial one made by a version that read them otherwise is not resumed.
DOCUMENTS_FORMAT = 2  # 2: NUL read as U+FFFD; documents over MAX_DOCUMENT_CHARS in pieces


@dataclass(frozen=True)
class Settings:
    """What decides the output; a re-run into the same directory must repeat it exactly."""

    inputs: list[str]  # the files read, in order (directories expanded, sorted)
    input_sizes: list[int]
    tokenizer: str  # a tokenizer.json path, or bpe:N
    vocab_size: int  # the vocabulary the corpus declares (≥ the tokenizer's)
    eval_fraction: float
    text_field: str
    text_unit: str
    shard_tokens: int
    bpe_train_bytes: int = 0
    eod_token: str = ""


def held_out(indices: np.ndarray, fraction: float) -> np.ndarray:
    """Which documents (by index in the corpus) belong to the held-out split: a splitmix64
    hash of the index below `fraction`, so the split does not depend on batching."""
    z = indices.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53) < fraction


def load_tokenizer(spec: str):
    from tokenizers import Tokenizer

    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise UsageError(
            f"--tokenizer {spec}: no such tokenizer.json; give a Hugging Face tokenizer.json (what "
            "transformers models ship) or bpe:N to train a byte-level BPE of N tokens on the input"
        )
    check_size(path, MAX_TOKENIZER_BYTES, "tokenizer.json")  # before it is read
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own Exception type for a malformed file
        raise UsageError(f"--tokenizer {spec} is not a readable tokenizers file: {e}") from None


MAX_PIECE = 64  # characters without white space in one piece of a trained BPE's input


def train_bpe(texts: Iterator[str], vocab_size: int):
    """A byte-level BPE (GPT-2's scheme) of `vocab_size` tokens, trained on `texts`; the
    end-of-document token is id 0."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    # A run of MAX_PIECE characters without white space is cut into pieces of that length first:
    # BPE training is superlinear in a piece's length (a 4 MB one-line document never ended)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(rf"\S{{{MAX_PIECE}}}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def eod_id(tokenizer, name: str = "") -> tuple[str, int]:
    """(token, id) of the end-of-document token: `name`, or the first known one the
    tokenizer has."""
    for token in [name] if name else EOD_CANDIDATES:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token, token_id
    if name:
        raise UsageError(f"--eod-token {name!r} is not in the tokenizer's vocabulary")
    raise UsageError(
        f"the tokenizer has none of the end-of-document tokens {list(EOD_CANDIDATES)}; pass --eod-token TOKEN"
    )


class Interrupted(Exception):
    """Stopped by a signal (or `stop_after_batches`) after committing a batch; re-run to go on."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signum)
        self.exit_code = 128 + int(signum)


def tokenize(
    paths: list[str],
    out: str,
    tokenizer_spec: str,
    vocab_size: int = 0,
    eval_fraction: float = 0.01,
    text_field: str = "text",
    text_unit: str = "file",
    shard_tokens: int = 1 << 27,
    bpe_train_bytes: int = 1 << 28,
    eod_token: str = "",
    batch_bytes: int = 1 << 22,
    progress: bool = True,
    stop_after_batches: int = 0,
    heartbeat_seconds: float = 30.0,
) -> dict:
    """Tokenizes `paths` into `out` (see the module doc) → the manifest. Re-running an
    interrupted call continues it; re-running a finished one returns its manifest.
    `stop_after_batches` (tests) interrupts after that many batches, as a signal would. No phase
    is silent for longer than `heartbeat_seconds`: a line says what is still going on."""
    _check_options(eval_fraction, text_unit, shard_tokens)
    files = input_files(paths)
    out_dir = Path(out).expanduser()
    bpe_size = _bpe_size(tokenizer_spec, vocab_size)
    spec = tokenizer_spec if bpe_size else str(Path(tokenizer_spec).expanduser().resolve())
    sizes = (vocab_size, eval_fraction, text_field, text_unit, shard_tokens, bpe_train_bytes if bpe_size else 0)
    settings = Settings([str(f.resolve()) for f in files], [f.stat().st_size for f in files], spec, *sizes, eod_token)
    state = _state(out_dir, settings)
    if "manifest" in state:
        return state["manifest"]
    check_inputs(files)  # all of them, before anything is written
    if next(documents(files, text_field, text_unit), None) is None:
        raise UsageError(f"--input {' '.join(paths)} holds no non-empty documents; give files with text")
    stop = {"signal": 0}

    def on_signal(signum, frame):
        stop["signal"] = signum

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    created = not out_dir.exists()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with WorkdirLock(out_dir, wait_seconds=0.0, job="tokenize", option="--out"):  # one writer per --out
            state = _state(out_dir, settings)  # again: another writer may have gone on meanwhile
            if "manifest" in state:
                return state["manifest"]
            with _kept_only_if_done(out_dir, created), Heartbeat(heartbeat_seconds) as beat:
                stopping = _Stopping(stop, stop_after_batches)
                run = _Run(files, out_dir, settings, state, bpe_size, batch_bytes, progress, stopping, beat)
                manifest = _tokenize(run)
            (out_dir / LOCK).unlink()  # a finished corpus is only read (a late second writer finds the manifest)
            return manifest
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _check_options(eval_fraction: float, text_unit: str, shard_tokens: int) -> None:
    if not 0.0 <= eval_fraction < 1.0:
        raise UsageError(f"--eval-fraction {eval_fraction} must be in [0, 1)")
    if text_unit not in ("file", "line"):
        raise UsageError(f"--text-unit {text_unit!r}: use file or line")
    if shard_tokens < 1:
        raise UsageError("--shard-tokens must be at least 1")


@contextlib.contextmanager
def _kept_only_if_done(out_dir: Path, created: bool) -> Iterator[None]:
    """A new run (--out empty, under its lock) stopped by bad input found on the way (a JSON Lines
    record) removes what it wrote, and --out if it made it; an interrupted or resumed run keeps it."""
    fresh = not (out_dir / "progress.json").exists()
    try:
        yield
    except UsageError:
        if fresh:
            for pattern in ("*.tokens", "*.docs", "tokenizer.json*", "progress.json", LOCK):
                for path in out_dir.glob(pattern):
                    path.unlink()
            if created and not any(out_dir.iterdir()):
                out_dir.rmdir()
        raise


def _bpe_size(spec: str, vocab_size: int) -> int:
    """N of --tokenizer bpe:N (or bpe with --vocab-size N); 0 for a tokenizer file."""
    if not (spec.startswith("bpe:") or spec == "bpe"):
        return 0
    size_text = spec[4:] or str(vocab_size)
    if not size_text.isdigit() or int(size_text) < 257:
        raise UsageError(
            f"--tokenizer {spec}: a byte-level BPE needs bpe:N with N ≥ 257 (256 bytes and the "
            "end-of-document token), e.g. bpe:8192"
        )
    return int(size_text)


def _state(out_dir: Path, settings: Settings) -> dict:
    """Where --out stands: {"manifest": ...} when finished with these settings, the progress of an
    interrupted run with them, or a fresh start; UsageError for a directory of anything else."""
    manifest_path, progress_path = out_dir / "manifest.json", out_dir / "progress.json"
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("settings") != asdict(settings):
            raise UsageError(
                f"--out {out_dir} already holds a corpus tokenized with other settings; use a new --out "
                "directory, or delete that one"
            )
        return {"manifest": manifest}
    if progress_path.is_file():
        state = json.loads(progress_path.read_text())
        if state.get("documents_format") != DOCUMENTS_FORMAT:  # an older engine split documents otherwise
            raise UsageError(
                f"--out {out_dir} holds an unfinished tokenization by an older version of this engine, which "
                "reads documents otherwise; delete the directory and run again"
            )
        if state.get("settings") != asdict(settings):
            raise UsageError(
                f"--out {out_dir} holds an unfinished tokenization with other settings (inputs, "
                "tokenizer or sizes changed); re-run it with the same arguments, or delete the directory"
            )
        return state
    if out_dir.exists() and any(p.name != LOCK for p in out_dir.iterdir()):
        raise UsageError(
            f"--out {out_dir} is not empty and holds no tokenization of this command; give a new or empty directory"
        )
    return {"settings": asdict(settings), "documents": 0, "splits": {}, "documents_format": DOCUMENTS_FORMAT}


@dataclass
class _Run:
    """One tokenization: its inputs, output directory, settings and progress so far."""

    files: list
    out_dir: Path
    settings: Settings
    state: dict
    bpe_size: int
    batch_bytes: int
    progress: bool
    stopping: _Stopping
    beat: "Heartbeat"


def _tokenize(run: _Run) -> dict:
    _make_tokenizer(run.files, run.out_dir, run.settings, run.state, run.bpe_size, run.beat)
    run.stopping.check(batch_done=False)
    tokenizer = load_tokenizer(str(run.out_dir / "tokenizer.json"))
    eod_name, eod = eod_id(tokenizer, run.settings.eod_token)
    declared = run.settings.vocab_size if not run.bpe_size and run.settings.vocab_size else tokenizer.get_vocab_size()
    if declared < tokenizer.get_vocab_size():
        raise UsageError(
            f"--vocab-size {run.settings.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer.get_vocab_size()}); leave it out or give at least that"
        )
    dtype = "uint16" if declared <= 1 << 16 else "uint32"
    splits = run.state["splits"]
    writers = {
        split: ShardWriter(run.out_dir, split, dtype, run.settings.shard_tokens, **splits.get(split, {}))
        for split in SPLITS
    }
    for writer in writers.values():
        writer.open()
    try:
        _write_documents(run, tokenizer, eod, writers)
    except Interrupted:
        for writer in writers.values():
            writer.abandon()
        raise
    for writer in writers.values():
        writer.close()
    counts = {
        split: {
            "tokens": sum(s["tokens"] for s in w.done),
            "documents": sum(s["documents"] for s in w.done),
            "bytes": run.state.get("bytes", {}).get(split, 0),
            "shards": w.done,
        }
        for split, w in writers.items()
    }
    if counts["train"]["documents"] == 0:
        raise UsageError("every document went to the held-out split; lower --eval-fraction")
    manifest = {
        "format": FORMAT,
        "settings": asdict(run.settings),
        "tokenizer": "tokenizer.json",
        "vocab_size": declared,
        "eod_token": eod_name,
        "eod_id": eod,
        "dtype": dtype,
        "splits": counts,
    }
    manifest["sha256"] = manifest_digest(manifest)
    write_json(run.out_dir / "manifest.json", manifest)  # the commit of the whole corpus
    (run.out_dir / "progress.json").unlink()
    return manifest


def _make_tokenizer(files, out_dir: Path, settings: Settings, state: dict, bpe_size: int, beat: "Heartbeat") -> None:
    """out_dir/tokenizer.json: trained (or copied) once; a resumed run reuses it."""
    tokenizer_path = out_dir / "tokenizer.json"
    if tokenizer_path.is_file():
        return
    if bpe_size:
        megabytes = min(sum(settings.input_sizes), settings.bpe_train_bytes) / 1e6
        print(
            f"tokenize: training a byte-level BPE of {bpe_size:,} tokens on {megabytes:,.1f} MB of the input",
            flush=True,
        )
        beat.phase(f"training the BPE on {megabytes:,.1f} MB")
        tokenizer = train_bpe(
            first_bytes(documents(files, settings.text_field, settings.text_unit), settings.bpe_train_bytes), bpe_size
        )
        beat.phase("encoding")
    else:
        tokenizer = load_tokenizer(settings.tokenizer)
    tmp = tokenizer_path.with_suffix(".json.tmp")
    tokenizer.save(str(tmp))
    os.replace(tmp, tokenizer_path)
    write_json(out_dir / "progress.json", state)


@dataclass
class _Stopping:
    """When the writing stops early: a signal noted in `stop`, or (tests) after N batches."""

    stop: dict
    after_batches: int
    batches: int = 0

    def check(self, batch_done: bool = True) -> None:
        self.batches += batch_done
        if self.stop["signal"] or (self.after_batches and self.batches >= self.after_batches and batch_done):
            raise Interrupted(self.stop["signal"] or signal.SIGINT)


def _write_documents(run: _Run, tokenizer, eod: int, writers: dict) -> None:
    """Encodes the documents not yet written, a batch at a time; after each batch the shards are
    flushed and progress.json records how far they count (the commit point of the batch)."""
    settings, state = run.settings, run.state
    stream = documents(run.files, settings.text_field, settings.text_unit)
    done_bytes = sum(len(next(stream).encode("utf-8")) for _ in range(state["documents"]))  # already written
    bar = _progress_bar(sum(settings.input_sizes), run.progress)
    if bar is not None:
        bar.update(done_bytes)
    started, new_tokens, index = time.perf_counter(), 0, state["documents"]
    text_bytes = dict(state.get("bytes") or {split: 0 for split in SPLITS})  # UTF-8 bytes of each split's text
    try:
        for batch, last in with_last(batches(stream, run.batch_bytes)):
            encoded = (
                tokenizer.encode_batch_fast(batch, add_special_tokens=False)
                if hasattr(tokenizer, "encode_batch_fast")
                else tokenizer.encode_batch(batch, add_special_tokens=False)
            )
            is_eval = held_out(np.arange(index, index + len(batch)), settings.eval_fraction)
            small = last and settings.eval_fraction > 0 and index + len(batch) > 1
            if small and not is_eval.any() and not _held(writers):
                is_eval[-1] = True  # a small corpus: the share held out no document, so its last one is
                print(
                    f"tokenize: --eval-fraction {settings.eval_fraction} of {index + len(batch)} documents is "
                    "less than one; the last document is held out for evaluation",
                    file=sys.stderr,
                    flush=True,
                )
            one = last and index == 0 and len(batch) == 1 and settings.eval_fraction > 0  # the corpus's only document
            if one:
                new_tokens += split_one_document(batch[0], tokenizer, eod, settings.eval_fraction, writers, text_bytes)
            for text, encoding, to_eval in [] if one else zip(batch, encoded, is_eval):
                ids = encoding.ids
                ids.append(eod)
                split = "eval" if to_eval else "train"
                writers[split].add(ids)
                text_bytes[split] += len(text.encode("utf-8"))
                new_tokens += len(ids)
            index += len(batch)
            for writer in writers.values():
                writer.flush()
            state.update(documents=index, splits={split: w.state() for split, w in writers.items()}, bytes=text_bytes)
            write_json(run.out_dir / "progress.json", state)  # the commit point of this batch
            run.beat.phase(f"encoding (document {index:,})")
            if bar is not None:
                bar.update(sum(len(text.encode("utf-8")) for text in batch))
                bar.set_postfix_str(f"{new_tokens / max(time.perf_counter() - started, 1e-9):,.0f} tokens/s")
            run.stopping.check()
    finally:
        if bar is not None:
            bar.close()


def _held(writers: dict) -> int:
    """Documents written to the held-out split so far."""
    return sum(s["documents"] for s in writers["eval"].done) + writers["eval"].documents


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="tokenize", dynamic_ncols=True)
