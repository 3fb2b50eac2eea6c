"""A local checkpoint tier's step directories on one process's storage: a copy of one process's
shards written, listed, read back, and set aside when it does not read.

A step directory `owner_<o>/<step>/` (local_tier.py) holds packing.py's buffer `shards.bin`,
its `index.json`, the checkpoint's `meta.json`, `tier.json` (the step, its owner, the process
count, the owner's peers and the run id) and, with checkpoint.verify, `SHA256SUMS`. It is
written as `<step>.partial` and renamed when complete. Any failure to read one (a missing key,
a truncated file, a checksum mismatch) makes it damaged: moved into `damaged/` with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from engine.checkpoint.packing import packed_size
from engine.runtime.rundir import SUMS, check_sums, write_sums

SHARDS, INDEX, META, TIER = "shards.bin", "index.json", "meta.json", "tier.json"


class Copy(NamedTuple):
    """One process's shards of one step: what a step directory holds."""

    owner: int
    buffer: Any  # bytes-like: a uint8 array or bytes
    layout: dict  # packing.py's index of the buffer, and "processes"
    meta: dict


def reason(error: BaseException) -> str:
    """An error as one short line."""
    return (str(error).splitlines() or [type(error).__name__])[0][:300] or type(error).__name__


def header(copy: Copy) -> bytes:
    """A copy's owner, layout and meta, for sending beside its buffer."""
    return json.dumps({"owner": copy.owner, "layout": copy.layout, "meta": copy.meta}).encode()


def from_header(data, buffer) -> Copy:
    fields = json.loads(bytes(data))
    return Copy(int(fields["owner"]), buffer, fields["layout"], fields["meta"])


def steps(folder: Path) -> list[int]:
    """The complete steps in an owner's folder, oldest first (none when it is gone)."""
    return sorted(int(p.name) for p in subfolders(folder, "") if p.name.isdigit())


def subfolders(folder: Path, prefix: str) -> list[Path]:
    """The folders in `folder` whose names begin with `prefix`, sorted; those removed while listed
    (another process of the job clearing its own storage) are left out, as is `folder` when gone."""
    try:
        with os.scandir(folder) as entries:
            found = [Path(entry.path) for entry in entries if entry.name.startswith(prefix) and _is_dir(entry)]
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(found)


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()
    except FileNotFoundError:  # (removed since the listing)
        return False


def write_copy(folder: Path, step: int, copy: Copy, tier: dict, verify: bool) -> None:
    """`copy` as `folder/<step>/`, written under a temporary name and renamed when complete (a
    failed write leaves nothing behind)."""
    partial = folder / f"{step}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        partial.mkdir(parents=True)
        (partial / SHARDS).write_bytes(memoryview(copy.buffer))
        (partial / INDEX).write_text(json.dumps(copy.layout))
        (partial / META).write_text(json.dumps(copy.meta))
        (partial / TIER).write_text(json.dumps(tier))
        if verify:
            write_sums(partial)
        final = folder / str(step)
        if final.exists():  # a step saved again after a restore from an earlier one
            shutil.rmtree(final)
        partial.rename(final)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)  # (a full RAM disk: the space back)
        raise


def read_tier(folder: Path, owner: int, step: int) -> dict:
    """A step directory's tier.json, checked against where it lies; ValueError when it does not fit."""
    tier = json.loads((folder / TIER).read_text())
    if tier["step"] != step or tier["owner"] != owner or not isinstance(tier["processes"], int):
        raise ValueError(f"{TIER} names step {tier['step']} of owner {tier['owner']}, not where it lies")
    return tier


def read_copy(folder: Path, owner: int, verify: bool) -> Copy:
    """The copy a step directory holds; ValueError when its files fail their checksums (or, with
    `verify`, have none) or the buffer is shorter than its index says."""
    if verify and not (folder / SUMS).is_file():  # (written before the step's rename: its absence is damage)
        raise ValueError(f"{SUMS} is missing (the step was saved with checkpoint.verify=false, or it was lost)")
    mismatch = check_sums(folder) if verify else None
    if mismatch is not None:
        raise ValueError(mismatch)
    index, meta = json.loads((folder / INDEX).read_text()), json.loads((folder / META).read_text())
    buffer = np.fromfile(folder / SHARDS, np.uint8)
    if len(buffer) < packed_size(index):
        raise ValueError(f"{SHARDS} holds {len(buffer)} bytes; its index needs {packed_size(index)}")
    return Copy(owner, buffer, index, meta)


def set_aside(root: Path, folder: Path, owner: int, step: int, why: str) -> None:
    """Moves a damaged step directory into `root/damaged/` with the reason beside it, and says so."""
    aside = root / "damaged"
    target = aside / f"owner_{owner}-{step}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        aside.mkdir(exist_ok=True)
        folder.rename(target)
        (aside / f"{target.name}.reason.txt").write_text(why + "\n")
        moved = f"moved it to {target}"
    except OSError as e:  # (it is not used either way: local_tier.py remembers it)
        moved = f"could not move it aside ({reason(e)})"
    print(
        f"warning: local checkpoint {folder} is unreadable ({why}); {moved}; trying another copy or an earlier step",
        file=sys.stderr,
    )
