"""A run's directory on disk: atomic file writes, `metrics.jsonl` records and `status.json`.

Shared by the trainer, the evaluator, sweeps and reports; of the engine it imports only
its error type and a byte formatter. Files that readers may open at any moment are replaced whole (a temporary file,
then `os.replace`), so nobody ever reads half of one.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Optional, TextIO

from engine.errors import UsageError
from engine.runtime.units import human_bytes

METRICS = "metrics.jsonl"
STATUS = "status.json"


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Writes `text` to `path` so that readers see the old file or the new one, never a part
    (and no temporary file is left when the write fails: a full disk)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # per process: SLURM array tasks write at once
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def append_line(path: Path, line: str) -> None:
    """Appends one line whole or not at all: a failed write (a full disk) is cut back off."""
    data = line.encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.lseek(fd, 0, os.SEEK_END)
        try:
            written = 0
            while written < len(data):
                written += os.write(fd, data[written:])
        except OSError:
            os.ftruncate(fd, size)  # unbuffered: nothing is left to flush into the full disk first
            raise
    finally:
        os.close(fd)


STORAGE_ERRNOS = {
    errno.ENOSPC: "no space left",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
}
STORAGE_TEXTS = {
    "No space left on device": errno.ENOSPC,
    "Disk quota exceeded": errno.EDQUOT,
    "Read-only file system": errno.EROFS,
    "Permission denied": errno.EACCES,
}


def storage_errno(error: Optional[BaseException], directory: Path) -> Optional[int]:
    """The storage fault (ENOSPC, EDQUOT, EROFS, EACCES) behind `error` or the errors it came
    from, as Python's OSError or as the text of orbax's and tensorstore's wrapped errors, when
    it concerns a file under `directory` (an unreadable data file is not the workdir's fault)."""
    seen, where = set(), str(Path(directory).absolute())
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in STORAGE_ERRNOS:
            name = error.filename if isinstance(error.filename, str) else ""
            if str(Path(name).absolute()).startswith(where) or (not name and error.errno != errno.EACCES):
                return error.errno
        for text, number in STORAGE_TEXTS.items():
            if text in str(error) and where in str(error):
                return number
        error = error.__cause__ or error.__context__
    return None


class StorageError(UsageError):
    """The workdir's file system refused a write (full, read-only, no permission): exit 2."""


def storage_error(workdir: Path, number: int, doing: str) -> StorageError:
    """One line naming the directory, the fault, the free space and what to do."""
    try:
        usage = shutil.disk_usage(workdir if workdir.exists() else workdir.parent)
        space = f"; {human_bytes(usage.free)} free of {human_bytes(usage.total)}"
    except OSError:
        space = ""
    fix = (
        "free some space (or raise the quota) and re-run the same command: it resumes from the newest complete "
        "checkpoint"
        if number in (errno.ENOSPC, errno.EDQUOT)
        else "give a --workdir you can write to (or fix its permissions)"
    )
    return StorageError(f"cannot write to {workdir} while {doing}: {STORAGE_ERRNOS[number]}{space}; {fix}")


def write_json(path: str | os.PathLike, record: dict) -> None:
    write_atomic(path, json.dumps(record) + "\n")


def read_json(path: str | os.PathLike) -> Optional[dict]:
    """A JSON object file (status.json, sweep.json): None when it is missing or damaged (not a
    JSON object: a disk error, a hand edit). A damaged file's text is kept in `<name>.damaged`
    beside it, with one warning; writers replace the file whole, so the next write mends it."""
    path = Path(path)
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if isinstance(value, dict):
        return value
    keep_aside(path, text)
    _warn_once(
        path, text, f"warning: {path} is damaged (not a JSON object); ignored, its text kept in {path.name}.damaged"
    )
    return None


def read_status(workdir: Path) -> dict:
    """A run's status.json ({} when it has none yet, or when it is damaged)."""
    return read_json(Path(workdir) / STATUS) or {}


def keep_aside(path: Path, text: str) -> None:
    """Appends damaged text of `path` to `<path>.damaged` (once per distinct text)."""
    aside = path.with_name(path.name + ".damaged")
    if not text or (aside.exists() and text in aside.read_text(errors="replace")):
        return
    try:
        append_line(aside, text if text.endswith("\n") else text + "\n")
    except OSError as e:  # a read-only archive of runs: reading goes on, the damage is only reported
        print(f"warning: could not keep the damaged text of {path} in {aside.name}: {e.strerror}", file=sys.stderr)


def _parse_records(path: Path) -> tuple[list[dict], list[tuple[int, str]]]:
    """metrics.jsonl → (records, damaged (line number, line)); an unfinished last line is neither."""
    text = Path(path).read_text(errors="replace")
    lines = text.split("\n")
    complete = lines[:-1] if not text.endswith("\n") else lines
    records, damaged = [], []
    for number, line in enumerate(complete, 1):
        if line.strip():
            record = _record(line)
            if record is None:
                damaged.append((number, line))
            else:
                records.append(record)
    return records, damaged


def read_records(path: Path) -> list[dict]:
    """The records of a metrics.jsonl; a last line still being written (no newline yet) is
    skipped. Damaged lines (not a JSON object with `step` and `split`: a disk error, a hand
    edit) are skipped with one warning naming them; a resumed run moves them to
    `metrics.jsonl.damaged` (drop_records_after)."""
    if not Path(path).exists():
        return []
    records, damaged = _parse_records(path)
    if damaged:
        numbers = [number for number, _ in damaged]
        shown = ", ".join(map(str, numbers[:5])) + (", ..." if len(numbers) > 5 else "")
        _warn_once(path, len(damaged), f"warning: {path}: {len(damaged)} damaged line(s) skipped (line {shown})")
    return records


_WARNED: set[tuple[str, object]] = set()


def _warn_once(path: Path, damage, message: str) -> None:
    """One warning per file and damage, not one per reader."""
    if (str(path), damage) not in _WARNED:
        _WARNED.add((str(path), damage))
        print(message, file=sys.stderr)


def _record(line: str) -> Optional[dict]:
    """One metrics.jsonl line as a record, or None where it is not one."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("step"), int) and "split" in record else None


def final_metrics(workdir: Path) -> dict[str, float]:
    """The last value of each split/name in a run's metrics.jsonl."""
    final: dict[str, float] = {}
    for record in read_records(Path(workdir) / METRICS):
        for name, value in record.items():
            if name not in ("step", "split", "source") and isinstance(value, (int, float)):
                final[f"{record['split']}/{name}"] = value
    return final


def drop_records_after(path: Path, step: int) -> int:
    """On resume, forget metrics logged after the checkpoint: those steps run again, identically
    (a failure's `recovery` records stay: they are the run's history, not its steps).

    Returns how many logged training steps will be redone (badput of the restart)."""
    if not path.exists():
        return 0
    records, damaged = _parse_records(path)
    if damaged:
        keep_aside(path, "".join(line + "\n" for _, line in damaged))
        print(f"warning: {path}: moved {len(damaged)} damaged line(s) to {path.name}.damaged", file=sys.stderr)
    logged = max((r["step"] for r in records if r["split"] == "train"), default=step)
    kept = [r for r in records if r["step"] <= step or r["split"] == "recovery"]  # (fault.elastic's: history)
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))
    return max(logged - step, 0)


SUMS = "SHA256SUMS"  # a checkpoint step's or an export's checksums, in `sha256sum` format


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()  # releases the GIL on large chunks: a thread can hash while training goes on
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def write_sums(directory: Path) -> None:
    """directory/SHA256SUMS: the SHA-256 of every file under `directory`, as `sha256sum` writes
    them (so `cd DIR && sha256sum -c SHA256SUMS` checks them without this code)."""
    directory = Path(directory)
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != SUMS)
    write_atomic(directory / SUMS, "".join(f"{sha256_file(p)}  {p.relative_to(directory).as_posix()}\n" for p in files))


def check_sums(directory: Path) -> Optional[str]:
    """The first file under `directory` that is missing or differs from its SHA256SUMS line
    (as a reason), or None when all match or there is no SHA256SUMS (not yet written)."""
    directory = Path(directory)
    try:
        lines = (directory / SUMS).read_text().splitlines()
    except FileNotFoundError:
        return None
    for line in lines:
        digest, _, name = line.partition("  ")
        path = directory / name
        if not name or not path.is_file():
            return f"{name or line!r} listed in {SUMS} is missing"
        if sha256_file(path) != digest:
            return f"{name} does not match its checksum in {SUMS} (the file changed on disk)"
    return None


LOCK = ".lock"  # a directory's lock file (WorkdirLock)


class WorkdirBusy(UsageError):
    """Another job holds the workdir (a UsageError: exit 2); `holder` says who."""

    def __init__(self, workdir: Path, holder: str, job: str = "training job", option: str = "--workdir"):
        super().__init__(
            f"{workdir} is in use by another {job} ({holder}); wait for it to finish or stop "
            f"it, or give this one another {option}"
        )
        self.holder = holder


class WorkdirLock:
    """One training job per workdir: an exclusive `flock` on workdir/.lock, held for the life
    of the job. The OS drops it when the process ends however it ends (a SIGKILL too), so no
    stale lock is ever left; the file only says who held it last."""

    def __init__(self, workdir: Path, wait_seconds: float = 3.0, job: str = "training job", option: str = "--workdir"):
        self.path = Path(workdir) / LOCK
        self.wait_seconds = wait_seconds  # rides out a reader's momentary probe (lock_holder)
        self.job, self.option = job, option  # what the error calls the holder and the directory
        self.handle: Optional[TextIO] = None

    def __enter__(self) -> "WorkdirLock":
        import fcntl
        import socket
        import time

        handle = open(self.path, "a+")
        deadline = time.monotonic() + self.wait_seconds
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(0.1)
                    continue
                handle.seek(0)
                holder = handle.read().strip() or "unknown"
                handle.close()
                raise WorkdirBusy(self.path.parent, holder, self.job, self.option) from None
        handle.seek(0)
        handle.truncate()
        handle.write(
            f"host {socket.gethostname()}, pid {os.getpid()}, started "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime())}\n"
        )
        handle.flush()
        self.handle = handle
        return self

    def __exit__(self, *exc) -> None:
        if self.handle is not None:
            self.handle.close()  # closing the file releases the lock
            self.handle = None


def lock_holder(workdir: Path) -> str | None:
    """Who holds workdir's lock now ("host …, pid …, started …"), or None if nobody does. A
    probe: a shared lock taken and dropped at once, the file neither truncated nor written."""
    import fcntl

    path = Path(workdir) / LOCK
    try:
        with open(path) as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return handle.read().strip() or "unknown"
            return None  # closing the file drops the shared lock
    except FileNotFoundError:
        return None
