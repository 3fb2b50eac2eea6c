"""The files `tokenize` reads, checked before anything is written: text that is not text, damaged Arrow files."""

from __future__ import annotations

import codecs
import sys
from dataclasses import dataclass
from pathlib import Path

from engine.data.documents import SNIFF_BYTES, check_arrow
from engine.errors import UsageError

NOT_TEXT_SHARE = 0.01  # a text file with more than this share of its bytes invalid UTF-8 or NUL is refused
CHUNK_BYTES = 1 << 22  # read at a time while counting


@dataclass(frozen=True)
class NotText:
    """The bytes of a text file that are not text (documents read them as U+FFFD). Counting stops
    once they pass NOT_TEXT_SHARE: a file past it is refused whatever the rest holds."""

    size: int  # the file's bytes
    invalid: int  # bytes that are not UTF-8
    nul: int  # NUL bytes
    binary: bool  # a NUL among the first SNIFF_BYTES (git's rule for a binary file)

    @property
    def count(self) -> int:
        return self.invalid + self.nul

    @property
    def refused(self) -> bool:
        return self.binary or self.count > NOT_TEXT_SHARE * self.size


def _escaped(text: str) -> int:
    """Bytes that surrogateescape decoding kept as lone surrogates: the invalid UTF-8 bytes."""
    return len(text.encode("utf-8", "surrogateescape")) - len(text.encode("utf-8", "ignore"))


def not_text(path: Path) -> NotText:
    """How many of the file's bytes are not text (see NotText)."""
    size = path.stat().st_size
    decoder = codecs.getincrementaldecoder("utf-8")("surrogateescape")  # one lone surrogate per bad byte
    invalid = nul = 0
    with open(path, "rb") as f:
        binary = b"\0" in f.read(SNIFF_BYTES)
        f.seek(0)
        while not binary and (chunk := f.read(CHUNK_BYTES)):
            nul += chunk.count(b"\0")
            text = decoder.decode(chunk)
            invalid += 0 if text.isascii() else _escaped(text)
            if invalid + nul > NOT_TEXT_SHARE * size:
                break
        else:
            invalid += _escaped(decoder.decode(b"", final=True))  # a sequence cut off by the end of the file
    return NotText(size, invalid, nul, binary)


def check_inputs(files: list[Path]) -> None:
    """UsageError for an input that is not text or a damaged Arrow file; one warning line on
    stderr for each text file with some bytes that are not text (read as U+FFFD)."""
    for file in files:
        suffix = file.suffix.lower()
        try:
            if suffix == ".arrow":
                check_arrow(file)
            if suffix in (".arrow", ".parquet"):  # Parquet's reader checks its own pages as it goes
                continue
            found = not_text(file)
        except OSError as e:
            raise UsageError(
                f"--input {file} cannot be read ({e.strerror}); fix its permissions or leave it out"
            ) from None
        if found.binary:
            raise UsageError(
                f"--input {file} is a binary file (a NUL byte in its first {SNIFF_BYTES // 1024} KiB), not text; give "
                "UTF-8 text, JSON Lines, Parquet or a Hugging Face datasets directory"
            )
        if found.refused:
            raise UsageError(
                f"--input {file} is not UTF-8 text: more than {NOT_TEXT_SHARE:.0%} of its {found.size:,} bytes are "
                f"invalid UTF-8 or NUL (at least {found.count:,}); convert it to UTF-8 (e.g. iconv -f latin1 -t "
                "utf-8) or leave it out of --input"
            )
        if found.count:
            sys.stderr.write(
                f"warning: tokenize: {file}: {found.count:,} of its {found.size:,} bytes are not text "
                f"({found.invalid:,} invalid UTF-8, {found.nul:,} NUL), read as U+FFFD\n"
            )
            sys.stderr.flush()
