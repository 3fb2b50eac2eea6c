"""A tokenized corpus's shard files as they are written: token ids (`*.tokens`) and each
document's end offset (`*.docs`), appended per document and flushed per batch, so that an
interrupted run's re-run can cut them back to what progress.json recorded."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.runtime.rundir import sha256_file


@dataclass
class ShardWriter:
    """One split's shards: appends documents; closes a shard after the document that fills it."""

    out: Path
    split: str
    dtype: str
    shard_tokens: int
    done: list = field(default_factory=list)  # manifest entries of closed shards
    tokens: int = 0  # in the open shard
    documents: int = 0

    def _paths(self, index: int) -> tuple[Path, Path]:
        stem = self.out / f"{self.split}-{index:05d}"
        return stem.with_suffix(".tokens"), stem.with_suffix(".docs")

    def open(self) -> None:
        """Opens the current shard for appending, cut back to what progress.json recorded."""
        tokens_path, docs_path = self._paths(len(self.done))
        for path, size in ((tokens_path, self.tokens * np.dtype(self.dtype).itemsize), (docs_path, self.documents * 8)):
            with open(path, "ab") as f:
                f.truncate(size)
        self._tokens_file, self._docs_file = open(tokens_path, "ab"), open(docs_path, "ab")

    def add(self, ids: list[int]) -> None:
        self._tokens_file.write(np.asarray(ids, self.dtype).tobytes())
        self.tokens += len(ids)
        self.documents += 1
        self._docs_file.write(np.int64(self.tokens).tobytes())
        if self.tokens >= self.shard_tokens:
            self.close()
            self.open()

    def close(self) -> None:
        """Closes the open shard; an empty one is removed, a filled one is listed with checksums."""
        self._tokens_file.close()
        self._docs_file.close()
        tokens_path, docs_path = self._paths(len(self.done))
        if self.documents == 0:
            tokens_path.unlink()
            docs_path.unlink()
            return
        self.done.append(
            {
                "tokens_file": tokens_path.name,
                "docs_file": docs_path.name,
                "tokens": self.tokens,
                "documents": self.documents,
                "tokens_sha256": sha256_file(tokens_path),
                "docs_sha256": sha256_file(docs_path),
            }
        )
        self.tokens = self.documents = 0

    def abandon(self) -> None:
        """Closes the open shard's files as they are (progress.json says how far they count)."""
        self._tokens_file.close()
        self._docs_file.close()

    def flush(self) -> None:
        for f in (self._tokens_file, self._docs_file):
            f.flush()
            os.fsync(f.fileno())

    def state(self) -> dict:
        return {"done": self.done, "tokens": self.tokens, "documents": self.documents}
