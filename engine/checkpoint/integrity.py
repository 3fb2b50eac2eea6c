"""Checkpoint integrity: SHA256SUMS written on a background thread, checked before a restore, damaged steps set aside.

Once a step is complete, process 0 hashes its files into `<step>/SHA256SUMS` (`sha256sum`
format) on a background thread; before a restore process 0 checks them and every process gets
its verdict. A finished checkpoint that fails to read or to match its checksums (a truncated
file, a flipped bit) is moved into `damaged/` with the reason beside it; nothing is deleted.
"""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import numpy as np

from engine.runtime.processes import current
from engine.runtime.rundir import SUMS, check_sums, write_sums


class Damaged(Exception):
    """A checkpoint step's files do not match their SHA256SUMS."""


class Checksums:
    """Process 0's hashing of each completed step's files into its SHA256SUMS, on one
    background thread while training goes on (`enabled` False: none are written)."""

    def __init__(self, directory: Path, timeout_seconds: int, enabled: bool):
        self.directory, self.timeout_seconds = directory, timeout_seconds
        self._hashing = ThreadPoolExecutor(1, "checkpoint-sums") if enabled else None
        self._chief = current().chief  # (asked here: saves may start on a thread of their own)
        self._pending: list[Future] = []
        self._ended = threading.Event()

    @property
    def pending(self) -> bool:
        """Whether a step's checksums were asked for and not yet joined."""
        return bool(self._pending)

    def after_save(self, step: int) -> None:
        """Called once orbax's save of `step` has started: process 0 hashes it when complete."""
        if self._hashing is not None and self._chief:
            self._pending.append(self._hashing.submit(self._write, step))

    def _write(self, step: int) -> None:
        """On the hashing thread: waits for orbax to finish `step` (its temporary directory is
        renamed to the step's name when complete), then writes its SHA256SUMS."""
        final, deadline = self.directory / str(step), time.monotonic() + self.timeout_seconds
        while not final.is_dir():
            # closed (orbax's saves all ended) or past the commit timeout: this save failed, and says so
            if self._ended.wait(0.05) or time.monotonic() > deadline:
                if not final.is_dir():
                    return
        try:
            write_sums(final)
        except FileNotFoundError:
            if final.is_dir():
                raise
            # else the step was deleted meanwhile (checkpoint.keep): there is nothing to vouch for

    def join(self) -> None:
        """Waits for the checksums of every save so far; raises what hashing raised."""
        while self._pending:
            self._pending.pop(0).result()

    def saves_ended(self) -> None:
        """Orbax's saves have all ended: a step not complete by now never will be."""
        self._ended.set()

    def close(self) -> None:
        """Waits for the hashing in progress: a complete step gets its checksums before the process ends."""
        if self._hashing is not None:
            self._hashing.shutdown(wait=True)


def verdict(step_dir: Path) -> Optional[str]:
    """Why the step's files fail their SHA256SUMS (None: they match). Process 0 checks them (one
    read of the checkpoint, not one per process) and every process gets its verdict: all must
    restore the same step."""
    processes = current()
    mismatch = check_sums(step_dir) if processes.chief else None
    if processes.count > 1:
        if int(processes.broadcast(np.int32(mismatch is not None))) and mismatch is None:
            mismatch = f"its files do not match {SUMS} (checked by process 0)"
    return mismatch


def set_aside(directory: Path, damaged: dict[int, str], timeout_seconds: int) -> None:
    """Moves unreadable steps into directory/damaged/ with the reason beside them (nothing is
    deleted), so that training saves those steps again normally; returns once every process
    may see them moved (then reload the list of steps)."""
    if current().chief:
        aside = directory / "damaged"
        aside.mkdir(exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for step, reason in damaged.items():
            target = aside / f"{step}-{stamp}"
            (directory / str(step)).rename(target)
            (aside / f"{step}-{stamp}.reason.txt").write_text(reason + "\n")
            print(
                f"warning: moved the unreadable checkpoint {directory}/{step} to {target}; "
                f"training will save step {step} again",
                file=sys.stderr,
            )
    current().barrier(f"set_aside_{'_'.join(map(str, damaged))}", timeout_seconds)  # moved before anyone reloads
