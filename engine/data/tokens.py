"""`data.name=tokens`: training on tokenized corpora (see tokenize.py) through Grain.

A corpus split is its shards end to end, read by position (see ShardFile): nothing is read
until a row is asked for, and a process asks only for the rows its devices hold. An example is a window of
seq_len + 1 tokens (inputs and shifted targets):

- unpacked (`data.packing=false`): window w is tokens [w·L, w·L + L + 1) of the split's
  concatenated stream, as for the byte-level text sources;
- packed (default): documents are laid into windows in corpus order; a document that does
  not fit in what is left of a window starts the next one (the rest is padding), and one
  longer than a window fills windows of its own. Each window also carries `segments` (1, 2,
  … per document, 0 for padding: attention stays within a document and the loss skips
  padding and document boundaries) and `positions` (the offset in the document's part in
  this window: positions restart with every document; attention never leaves the window,
  so only these relative positions matter, and they stay below seq_len + 1).

The training order is Grain's: each source is a `grain.MapDataset` over its windows,
shuffled with a seed derived from `seed` (reshuffled every epoch) and repeated; several
sources are mixed with `MapDataset.mix` by their weights. All of it is random access, so
example i of training is a function of (seed, i) and the step alone resumes the data order.
"""

from __future__ import annotations

import hashlib
import json
import os
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from engine.errors import UsageError
from engine.runtime.rundir import sha256_file

FORMAT = "jax-engine-tokens/2"  # 2: the manifest carries its own sha256


@dataclass(frozen=True)
class Corpus:
    """A finished tokenized directory: its manifest and its splits as token streams."""

    path: Path
    manifest: dict

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["vocab_size"])

    @property
    def tokenizer_file(self) -> Path:
        return self.path / self.manifest["tokenizer"]

    def stream(self, split: str) -> "TokenStream":
        shards = self.manifest["splits"][split]["shards"]
        dtype = np.dtype(self.manifest["dtype"])
        tokens = [ShardFile(self.path / s["tokens_file"], dtype) for s in shards]
        ends = [np.fromfile(self.path / s["docs_file"], dtype=np.int64) for s in shards]
        return TokenStream(tokens, ends)


def manifest_digest(manifest: dict) -> str:
    """The SHA-256 of a manifest's content (its own `sha256` left out), which it carries: a
    changed byte anywhere in manifest.json (a count, a checksum, the vocabulary) is found."""
    content = {key: value for key, value in manifest.items() if key != "sha256"}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def open_corpus(path: str, verify: bool = True, where: str = "data.path") -> Corpus:
    """Reads DIR/manifest.json and checks every shard's size and (with `verify`) checksum:
    a UsageError naming the file and the fix otherwise. Nothing is loaded into memory."""
    directory = Path(path).expanduser()
    manifest_file = directory / "manifest.json"
    if not manifest_file.is_file():
        unfinished = (directory / "progress.json").is_file()
        raise UsageError(
            f"{where}={path} is not a tokenized corpus"
            + (
                " (its tokenization was interrupted: re-run the tokenize command to finish it)"
                if unfinished
                else " (no manifest.json); make one with: python launch.py tokenize --input TEXT... --out DIR "
                "--tokenizer bpe:8192"
            )
        )
    try:
        manifest = json.loads(manifest_file.read_text())
        manifest["splits"]["train"]["shards"], manifest["dtype"], manifest["vocab_size"]
    except (ValueError, KeyError, TypeError) as e:
        raise UsageError(f"{manifest_file} is damaged ({type(e).__name__}: {e}); tokenize the corpus again") from None
    if manifest.get("format") != FORMAT:
        raise UsageError(f"{manifest_file} has format {manifest.get('format')!r}, not {FORMAT!r}; tokenize again")
    if manifest.get("sha256") != manifest_digest(manifest):
        raise UsageError(
            f"{manifest_file} does not match its own checksum (the file changed or is damaged); tokenize the "
            "corpus again into a new --out directory"
        )
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            for name, size, digest in (
                ("tokens_file", shard["tokens"] * itemsize, "tokens_sha256"),
                ("docs_file", shard["documents"] * 8, "docs_sha256"),
            ):
                file = directory / shard[name]
                if not file.is_file() or file.stat().st_size != size:
                    found = file.stat().st_size if file.is_file() else "missing"
                    raise UsageError(
                        f"{file}: the manifest says {size} bytes, found {found}; the corpus is damaged: "
                        "tokenize it again"
                    )
                if verify and sha256_file(file) != shard[digest]:
                    raise UsageError(
                        f"{file}: checksum does not match the manifest (the file changed or is "
                        "damaged); tokenize the corpus again, or set data.verify=false to skip the check"
                    )
    return Corpus(directory, manifest)


class ShardFile:
    """A token shard read by positioned reads (`os.pread`), sliced like an array.

    Not memory-mapped on purpose: a mapped page of a file already in the page cache joins
    the process's resident set together with its neighbours (up to a whole large folio, ~2
    MB, per touch), so random windows over a mapped corpus made a 2 GB corpus cost ~1 GB of
    RSS. A read copies just the window; hot pages stay in the OS page cache, shared."""

    def __init__(self, path: Path, dtype: np.dtype):
        self.path, self.dtype = path, np.dtype(dtype)
        self.fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self.fd).st_size // self.dtype.itemsize

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, window: slice) -> np.ndarray:
        start, stop, _ = window.indices(self.size)
        count = max(stop - start, 0)
        data = os.pread(self.fd, count * self.dtype.itemsize, start * self.dtype.itemsize)
        return np.frombuffer(data, self.dtype, count=len(data) // self.dtype.itemsize)

    def __del__(self):
        os.close(self.fd)

    def __getstate__(self):  # worker processes reopen the file
        return {"path": self.path, "dtype": self.dtype}

    def __setstate__(self, state):
        self.__init__(state["path"], state["dtype"])


class TokenStream:
    """One split's shards as a single token sequence, read by range."""

    def __init__(self, shards: list, doc_ends: list[np.ndarray]):  # shards: arrays or ShardFiles (read by range)
        self.shards = shards
        sizes = np.array([len(s) for s in shards], np.int64)
        self.starts = np.concatenate([[0], np.cumsum(sizes)])  # where each shard begins in the stream
        self.size = int(self.starts[-1])
        # every document's end in the stream (shard-local ends shifted by the shard's start)
        self.doc_ends = np.concatenate(
            [e + start for e, start in zip(doc_ends, self.starts[:-1])] or [np.zeros(0, np.int64)]
        )

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the stream (across shard boundaries)."""
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        pieces = []
        while start < stop:
            shard, offset = self.shards[first], start - int(self.starts[first])
            piece = shard[offset : offset + (stop - start)]
            pieces.append(piece)
            start += len(piece)
            first += 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


def pack(doc_ends: np.ndarray, window: int) -> np.ndarray:
    """Cut points of the packed windows: window w holds stream[cuts[w]:cuts[w + 1]] (at most
    `window` tokens). Documents go in order; one that does not fit in what is left of the
    current window starts the next window; one longer than a window is split."""
    cuts = array("q", [0])  # cuts[-1] is where the open window begins; 8 bytes per window
    previous = 0  # where the document begins
    for first in range(0, len(doc_ends), 1 << 20):  # a million documents at a time as Python ints
        for end in doc_ends[first : first + (1 << 20)].tolist():
            start = cuts[-1]
            if end - start > window:  # the document does not fit in what is left
                if end - previous <= window:
                    cuts.append(previous)  # close the window before it; it starts the next
                else:  # fill the open window, then whole windows; the tail (≤ window) stays open
                    cuts.extend(range(start + window, start + window * ((end - start - 1) // window) + 1, window))
            previous = end
    if previous > cuts[-1]:
        cuts.append(previous)
    return np.frombuffer(cuts, np.int64)


class Windows:
    """A Grain data source (len and random access) over one split's examples."""

    def __init__(self, stream: TokenStream, seq_len: int, packing: bool, source: Optional[int] = None):
        self.stream, self.window, self.packing, self.source = stream, seq_len + 1, packing, source
        if packing:
            self.cuts = pack(stream.doc_ends, self.window)
            self.count = len(self.cuts) - 1
        else:
            self.count = max((stream.size - 1) // seq_len, 0)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        index = int(index)
        if not self.packing:
            start = index * (self.window - 1)
            return self._tagged({"tokens": np.asarray(self.stream.read(start, start + self.window))})
        start, stop = int(self.cuts[index]), int(self.cuts[index + 1])
        tokens = np.zeros(self.window, self.stream.shards[0].dtype)
        tokens[: stop - start] = self.stream.read(start, stop)
        ends = self.stream.doc_ends
        doc = np.searchsorted(ends, np.arange(start, stop), side="right")  # each token's document
        doc_start = np.where(doc > 0, ends[np.maximum(doc - 1, 0)], 0)
        segments = np.zeros(self.window, np.int32)
        positions = np.zeros(self.window, np.int32)
        segments[: stop - start] = doc - doc[0] + 1  # 1 for the document the window starts in
        positions[: stop - start] = np.arange(start, stop) - np.maximum(doc_start, start)
        return self._tagged({"tokens": tokens, "segments": segments, "positions": positions})

    def _getitems(self, indices: Sequence[int]) -> list[dict[str, np.ndarray]]:
        """Several examples (Grain's batched read: one call and one metrics record per batch);
        packed windows get their segments and positions computed for the batch at once."""
        if not self.packing or not len(indices):
            return [self[i] for i in indices]
        index = np.asarray(indices, np.int64)
        starts, stops = self.cuts[index], self.cuts[index + 1]
        tokens = np.zeros((len(index), self.window), self.stream.shards[0].dtype)
        for row, (start, stop) in enumerate(zip(starts.tolist(), stops.tolist())):
            tokens[row, : stop - start] = self.stream.read(start, stop)
        offset = np.arange(self.window)
        position = starts[:, None] + offset  # each slot's place in the stream
        inside = offset < (stops - starts)[:, None]
        ends = self.stream.doc_ends
        doc = np.searchsorted(ends, position, side="right")  # each token's document
        doc_start = np.where(doc > 0, ends[np.maximum(doc - 1, 0)], 0)
        segments = np.where(inside, doc - doc[:, :1] + 1, 0).astype(np.int32)
        positions = np.where(inside, position - np.maximum(doc_start, starts[:, None]), 0).astype(np.int32)
        return [
            self._tagged({"tokens": tokens[row], "segments": segments[row], "positions": positions[row]})
            for row in range(len(index))
        ]

    def _tagged(self, example: dict) -> dict:
        if self.source is not None:
            example["source"] = np.int32(self.source)
        return example

    def spec(self) -> dict[str, np.ndarray]:
        """Zero-length arrays with each field's per-example shape and dtype."""
        return {name: np.zeros((0, *np.shape(value)), np.asarray(value).dtype) for name, value in self[0].items()}


class Examples:
    """Records by index: what TrainBatches and eval_batches read when the data is not a
    dict of in-memory arrays. `ordered` = index i is already the i-th example of training
    (shuffling and mixing happened upstream), so TrainBatches must not permute."""

    def __init__(self, dataset, length: int, spec: dict[str, np.ndarray], ordered: bool):
        self.dataset, self.length, self.spec, self.ordered = dataset, length, spec, ordered

    def __len__(self) -> int:
        return self.length

    def take(self, indices: Sequence[int]) -> dict[str, np.ndarray]:
        read = getattr(self.dataset, "_getitems", None)  # Grain's batched read: one call per batch
        rows = read([int(i) for i in indices]) if read is not None else [self.dataset[int(i)] for i in indices]
        return {name: np.stack([row[name] for row in rows]) for name in self.spec}


class Mixture:
    """The training split: one or more sources (Windows) and their weights."""

    def __init__(self, sources: list[Windows], weights: Sequence[float]):
        self.sources, self.weights = sources, [float(w) for w in weights]
        self.spec = sources[0].spec()

    def __len__(self) -> int:  # examples of one epoch of the smallest source
        return min(len(w) for w in self.sources)

    def examples(self, seed: int, shuffle: bool) -> Examples:
        """The training order: Grain MapDatasets over each source, shuffled per epoch (with a
        seed drawn from (seed, source index)), repeated and, for several, mixed by weight."""
        import grain

        parts = []
        for k, windows in enumerate(self.sources):
            dataset = grain.MapDataset.source(windows)
            if shuffle:
                dataset = dataset.shuffle(seed=int(np.random.SeedSequence([seed, k]).generate_state(1)[0]))
            parts.append(dataset.repeat())
        dataset = parts[0] if len(parts) == 1 else grain.MapDataset.mix(parts, self.weights)
        return Examples(dataset, len(self), self.spec, ordered=True)


class _Concat:
    def __init__(self, parts: list[Windows]):
        self.parts = parts
        self.starts = np.cumsum([0] + [len(p) for p in parts])

    def __getitem__(self, index: int):
        k = int(np.searchsorted(self.starts, index, side="right")) - 1
        return self.parts[k][index - int(self.starts[k])]


def eval_examples(sources: list[Windows]) -> Examples:
    """Every source's held-out windows, in order, one source after the other."""
    return Examples(_Concat(sources), sum(len(w) for w in sources), sources[0].spec(), ordered=True)
