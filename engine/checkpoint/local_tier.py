"""The local checkpoint tier: each process's shards saved every few steps to node-local storage,
with a copy at a peer process, and restored from wherever a complete step survives.

checkpoint.local_dir holds, per run (named after its workdir) and per process,
`process_<i>/owner_<o>/<step>/`: process o's shards of that step (packing.py's buffer
`shards.bin`, its `index.json`, the checkpoint's `meta.json`, `tier.json` and, with
checkpoint.verify, `SHA256SUMS`). Process i keeps its own (o = i) and the copies of the
checkpoint.local_replicas processes before it (the peer of process o is o + 1, o + 2, ...,
modulo the process count); the copies travel through the job's collectives (exchange.py), not a
shared filesystem. A step directory is written under a temporary name and renamed when
complete; the newest checkpoint.local_keep steps are kept.

Restore gathers every process's inventory and takes the newest step that is complete across
the processes (each process's shards present at itself or at a peer), newer than the
persistent tier's newest or as new; a step whose files fail their checksums or do not read is
set aside into `process_<i>/damaged/` with the reason, and the next candidate is tried.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple, Optional

import jax
import numpy as np

from engine.checkpoint.exchange import gather_rows, send
from engine.checkpoint.packing import LayoutMismatch, check_fits, pack, unpack
from engine.checkpoint.staging import InBackground
from engine.runtime.rundir import check_sums, write_sums

SHARDS, INDEX, META, TIER = "shards.bin", "index.json", "meta.json", "tier.json"


class Copy(NamedTuple):
    """One process's shards of one step: what a step directory holds."""

    owner: int
    buffer: bytes
    layout: dict  # packing.py's index of the buffer
    meta: dict


class LocalRestored(NamedTuple):
    state: Any
    meta: dict
    step: int
    source: str  # which tier and copies, for the console


def run_directory(local_dir: str, persistent: Path) -> Path:
    """The run's folder in checkpoint.local_dir: named after its workdir (name and a hash of its path),
    so that runs sharing a local_dir (a sweep's) keep apart."""
    workdir = Path(persistent).absolute().parent
    digest = hashlib.sha256(str(workdir).encode()).hexdigest()[:10]
    return Path(local_dir).expanduser().absolute() / f"{workdir.name}-{digest}"


def _frame(copy: Copy) -> bytes:
    header = json.dumps({"owner": copy.owner, "layout": copy.layout, "meta": copy.meta}).encode()
    return len(header).to_bytes(8, "little") + header + copy.buffer


def _unframe(data: bytes) -> Copy:
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    return Copy(header["owner"], data[8 + size :], header["layout"], header["meta"])


class LocalTier:
    """One run's local tier, seen from this process (every process holds one; save and restore are
    collectives: every process calls them at the same step)."""

    def __init__(self, local_dir: str, persistent: Path, keep: int, replicas: int, verify: bool, fresh: bool):
        """`fresh`: the run's persistent directory did not exist yet (a new run): what the local
        tier holds of an earlier run in this workdir is removed at restore."""
        self.setting = local_dir
        self.process, self.count = jax.process_index(), jax.process_count()
        self.root = run_directory(local_dir, persistent) / f"process_{self.process}"
        self.keep, self.verify, self.fresh = keep, verify, fresh
        self.replicas = min(replicas, self.count - 1)
        self._writing = InBackground("local-checkpoint")
        self.root.mkdir(parents=True, exist_ok=True)

    def _owner_dir(self, owner: int) -> Path:
        return self.root / f"owner_{owner}"

    def save(self, step: int, state, meta: dict) -> None:
        """This process's shards of `state` to its local storage, and a copy to each of its peers;
        returns once the bytes are on the host and exchanged (the files are written in the background)."""
        self._writing.join()
        buffer, index = pack(state)
        mine = Copy(self.process, buffer, {**index, "processes": self.count}, meta)
        copies = [mine]
        for shift in range(1, self.replicas + 1):  # to process + shift; from process - shift
            copies.append(_unframe(send(_frame(mine), shift)))
        self._writing.start(self._write, step, copies)

    def _write(self, step: int, copies: list[Copy]) -> None:
        for copy in copies:
            folder = self._owner_dir(copy.owner)
            partial = folder / f"{step}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
            (partial / SHARDS).write_bytes(copy.buffer)
            (partial / INDEX).write_text(json.dumps(copy.layout))
            (partial / META).write_text(json.dumps(copy.meta))
            (partial / TIER).write_text(json.dumps({"step": step, "owner": copy.owner, "processes": self.count}))
            if self.verify:
                write_sums(partial)
            final = folder / str(step)
            if final.exists():  # a step saved again after a restore from an earlier one
                shutil.rmtree(final)
            partial.rename(final)
            for old in _steps(folder)[: -self.keep]:
                shutil.rmtree(folder / str(old), ignore_errors=True)

    def wait(self) -> None:
        self._writing.join()

    def close(self) -> None:
        self._writing.finish()

    def _inventory(self) -> np.ndarray:
        """[(owner, step, processes)] of the complete step directories this process holds."""
        rows = []
        for folder in sorted(self.root.glob("owner_*")):
            for step in _steps(folder):
                try:
                    tier = json.loads((folder / str(step) / TIER).read_text())
                except (OSError, ValueError):
                    continue  # unreadable: not counted (a read would fail the same way)
                rows.append((int(tier["owner"]), step, int(tier["processes"])))
        return np.array(rows, np.int64).reshape(-1, 3)

    def restore(self, abstract_state, persistent_newest: Optional[int]) -> Optional[LocalRestored]:
        """The newest step complete across the processes and not older than `persistent_newest`,
        read into `abstract_state`'s shardings; None when there is none (or it does not fit)."""
        if any(table[0, 0] for table in gather_rows(np.array([[int(self.fresh)]]))):
            shutil.rmtree(self.root, ignore_errors=True)  # an earlier run's, in a workdir begun afresh
            self.root.mkdir(parents=True, exist_ok=True)
            return None
        while True:
            chosen = self._choose(gather_rows(self._inventory()), persistent_newest)
            if chosen is None:
                return None
            step, holders = chosen
            loaded = {owner: self._load(owner, step) for owner, holder in holders.items() if holder == self.process}
            copies = {owner: copy for owner, copy in loaded.items() if copy is not None}
            failed = len(copies) < len(loaded)
            if not any(table[0, 0] for table in gather_rows(np.array([[int(failed)]]))):
                return self._assemble(step, holders, copies, abstract_state)

    def _choose(self, tables: list[np.ndarray], persistent_newest: Optional[int]):
        """(step, {owner: the process that serves its shards}) of the newest usable step, or None."""
        held: dict[tuple[int, int], list[int]] = {}
        for holder, table in enumerate(tables):
            for owner, step, processes in table.tolist():
                if processes == self.count:
                    held.setdefault((owner, step), []).append(holder)
        complete = {step for _, step in held if all((owner, step) in held for owner in range(self.count))}
        usable = sorted((s for s in complete if persistent_newest is None or s >= persistent_newest), reverse=True)
        if not usable:
            return None
        step = usable[0]
        holders = {}
        for owner in range(self.count):
            present = held[(owner, step)]
            holders[owner] = owner if owner in present else min(present, key=lambda h: (h - owner) % self.count)
        return step, holders

    def _load(self, owner: int, step: int) -> Optional[Copy]:
        """The copy this process holds of `owner`'s shards at `step`; None (after setting it aside) when
        its files fail their checksums or do not read."""
        folder = self._owner_dir(owner) / str(step)
        try:
            mismatch = check_sums(folder) if self.verify else None
            if mismatch is None:
                index, meta = json.loads((folder / INDEX).read_text()), json.loads((folder / META).read_text())
                return Copy(owner, (folder / SHARDS).read_bytes(), index, meta)
        except (OSError, ValueError) as e:
            mismatch = (str(e).splitlines() or [type(e).__name__])[0][:300]
        self._set_aside(folder, owner, step, mismatch)
        return None

    def _set_aside(self, folder: Path, owner: int, step: int, reason: str) -> None:
        aside = self.root / "damaged"
        aside.mkdir(exist_ok=True)
        target = aside / f"owner_{owner}-{step}-{time.strftime('%Y%m%d-%H%M%S')}"
        folder.rename(target)
        (aside / f"{target.name}.reason.txt").write_text(reason + "\n")
        print(
            f"warning: local checkpoint {folder} is unreadable ({reason}); moved it to {target}; trying "
            f"another copy or an earlier step",
            file=sys.stderr,
        )

    def _assemble(self, step: int, holders: dict[int, int], loaded: dict[int, Copy], abstract_state):
        """Each copy sent to its owner, then this process's arrays rebuilt from its own copy."""
        mine = loaded.get(self.process)
        for shift in sorted({(holder - owner) % self.count for owner, holder in holders.items()} - {0}):
            owner = (self.process - shift) % self.count  # the process this one may serve at this shift
            outgoing = loaded.get(owner) if holders[owner] == self.process and owner != self.process else None
            received = send(_frame(outgoing) if outgoing else b"", -shift)
            if holders[self.process] == (self.process + shift) % self.count:
                mine = _unframe(received)
        assert mine is not None, "every owner's shards are served by one holder"
        problem = ""
        try:
            check_fits(mine.layout, abstract_state)
        except LayoutMismatch as e:
            problem = str(e)
        if any(table[0, 0] for table in gather_rows(np.array([[int(bool(problem))]]))):
            print(
                f"note: local checkpoint step {step} does not fit this run ({problem or 'on another process'}); "
                "restoring the persistent tier",
                file=sys.stderr,
            )
            return None
        peers = sorted(owner for owner, holder in holders.items() if holder != owner)
        source = f"the local tier, checkpoint.local_dir={self.setting}"
        if peers:
            source += f"; the shards of process(es) {', '.join(map(str, peers))} from a peer's copy"
        return LocalRestored(unpack(mine.buffer, mine.layout, abstract_state), mine.meta, step, source)

    def discard_after(self, step: int) -> None:
        """Removes the steps after `step` (the run goes on from `step`: those belong to a past it
        will train again), and the partial ones."""
        for folder in self.root.glob("owner_*"):
            for partial in folder.glob("*.partial"):
                shutil.rmtree(partial, ignore_errors=True)
            for later in (s for s in _steps(folder) if s > step):
                shutil.rmtree(folder / str(later), ignore_errors=True)


def _steps(folder: Path) -> list[int]:
    """The complete steps in an owner's folder, oldest first."""
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []
