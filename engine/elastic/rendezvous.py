"""The elastic pods' rendezvous on a shared directory: membership by heartbeat files, and
numbered rounds formed by the lowest live member.

Every pod's supervisor (engine/elastic/pods.py) meets the others in one directory that
every pod mounts (a ReadWriteMany volume: NFS, Filestore), in the manner of torchelastic's
rendezvous, with no service of its own:

- `members/<id>.json`: each supervisor's heartbeat (its address and a counter rewritten every
  BEAT_SECONDS by a thread). A member is alive while its counter keeps changing: one whose file
  a reader has seen unchanged for STALE_SECONDS (by the reader's own clock, so the pods' clocks
  need not agree, and from the file's content, which an NFS client rereads at each open, not
  its cached mtime) has stopped: its pod died.
- `ready/<n>/<id>.json`: a supervisor that wants to (re)start writes it for round n.
- `rounds/<n>.json`: round n, written once (a temporary file hard-linked into place: the first
  writer wins) by the leader, the lowest live id (ids sort with their numbers as numbers:
  pod-2 before pod-10), once every live member of round n-1 is ready and the live ready set
  has not changed for SETTLE_SECONDS or holds the job's full size (round 0 waits up to
  FIRST_ROUND_SECONDS for the full size). It names the members (sorted; a member's rank is its
  position) and what the supervisor adds (the coordinator, the failures so far). A supervisor
  ready for round n that is not among its members (it came late) waits for round n+1.
- `ended/<n>/<id>.json`: how a member's process of round n ended (its exit code, whether its
  supervisor killed it, when), read by the members of that round and by round n+1's leader.

Rounds and reports name their job (its workdir and a digest of its config: elastic_pods.job_identity):
another job's, a finished one's left in the directory, is refused (exit 2) instead of ending this
one; so is any file there that is not whole and of the form above.

Imports no jax.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from engine.errors import UsageError
from engine.runtime.rundir import write_atomic

BEAT_SECONDS = 1.0  # how often a supervisor rewrites its heartbeat
STALE_SECONDS = 5.0  # a heartbeat unchanged this long: the member has stopped
SETTLE_SECONDS = 3.0  # how long the live ready set must stay the same before a smaller round is formed
FIRST_ROUND_SECONDS = 60.0  # round 0 waits this long for the full size (pods start at different times)
POLL_SECONDS = 0.25  # how often a waiting supervisor looks at the directory
FINAL = (0, 2)  # exit codes that end the whole job (done; a usage error every process meets)
MEMBER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
MAX_ROUND = 10**9  # a round number beyond it is no round a job wrote
# what a round file holds: a round to start in, or one that ends the job
ROUND_KEYS: dict[str, type | tuple[type, ...]] = {"round": int, "members": list, "coordinator": str, "failures": list}
END_KEYS: dict[str, type | tuple[type, ...]] = {"end": str, "code": int}
FAILURE_KEYS: dict[str, type | tuple[type, ...]] = {
    "attempt": int,
    "process": int,
    "how": str,
    "time": (int, float),
    "processes": int,
}
REPORT_KEYS: dict[str, type | tuple[type, ...]] = {"code": int, "time": (int, float)}


def _problem(data: dict, keys: dict) -> str:
    """What `data` lacks of `keys` (name → type), "" when nothing."""
    for key, kind in keys.items():
        value = data.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"has no {key!r}" if value is None else f"has {key!r} = {str(value)[:60]!r}, not {_kind(kind)}"
    return ""


def _kind(kind) -> str:
    names = {"int": "a whole number", "float": "a number", "str": "text", "list": "a list"}
    return " or ".join(names.get(k.__name__, k.__name__) for k in (kind if isinstance(kind, tuple) else (kind,)))


def natural(member: str) -> list[tuple[int, str]]:
    """A member id's sort key: its runs of digits as numbers (pod-2 before pod-10)."""
    return [(int(part) if part.isascii() and part.isdigit() else -1, part) for part in re.split(r"(\d+)", member)]


def read_json(path: Path) -> Optional[dict]:
    """A JSON file's object, or None when it is absent or not (yet) readable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def create_json(path: Path, data: dict) -> bool:
    """Writes `data` to `path` unless it exists (whole or not at all: a hard link of a complete
    temporary file); whether this call wrote it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")  # (pods' pids are alike: often 1)
    temporary.write_text(json.dumps(data) + "\n")
    try:
        os.link(temporary, path)
        return True
    except FileExistsError:
        return False
    except OSError:  # a file system without hard links: the check and the write are not one step there
        if path.exists():
            return False
        os.replace(temporary, path)
        return True
    finally:
        temporary.unlink(missing_ok=True)


class Heartbeat:
    """A thread rewriting `members/<member>.json` every `every` seconds until stopped."""

    def __init__(self, directory: Path, member: str, address: str, every: float = BEAT_SECONDS):
        self.path = Path(directory) / "members" / f"{member}.json"
        incarnation = uuid.uuid4().hex  # this supervisor's start: a restarted pod's differs
        self.data: dict[str, Any] = {"member": member, "address": address, "incarnation": incarnation, "beat": 0}
        self.every, self.stopped = every, threading.Event()
        self.thread = threading.Thread(target=self._run, name="rendezvous-heartbeat", daemon=True)

    def beat(self) -> None:
        """One heartbeat: the counter goes up."""
        self.data["beat"] += 1
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path, json.dumps({**self.data, "time": time.time()}) + "\n")

    def _run(self) -> None:
        while not self.stopped.is_set():
            try:
                self.beat()
            except OSError as e:  # (the volume's hiccup: the next beat tries again; a long one makes us stale)
                print(f"warning: rendezvous: heartbeat not written: {e}", flush=True)
            self.stopped.wait(self.every)

    def start(self) -> None:
        self.beat()  # (before anyone is told of this member)
        self.thread.start()

    def stop(self) -> None:
        """Stops beating and removes the file (a member that leaves on purpose is not waited for)."""
        self.stopped.set()
        self.thread.join(timeout=5)
        self.path.unlink(missing_ok=True)


class Rendezvous:
    """One supervisor's view of the directory: who is alive, who is ready, the rounds."""

    def __init__(
        self,
        directory: Path,
        member: str,
        address: str,
        processes: int,
        fewest: int = 1,
        clock: Callable[[], float] = time.monotonic,
        stale: float = STALE_SECONDS,
        settle: float = SETTLE_SECONDS,
        first: float = FIRST_ROUND_SECONDS,
        job: Optional[dict] = None,
    ):
        """`job`: what names this job (its workdir and config digest, elastic_pods.job_identity): a
        round or report of another job in the directory is refused (None: not checked)."""
        self.dir, self.member, self.address = Path(directory), member, address
        self.job = job
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # (a regular file there, a path that cannot be created)
            raise UsageError(
                f"--rendezvous {directory}: not a directory this pod can use ({e.strerror or e}); pass a directory "
                "every pod mounts (a ReadWriteMany volume)"
            ) from None
        self.processes, self.fewest = processes, fewest
        self.clock, self.stale, self.settle, self.first = clock, stale, settle, first
        self.seen: dict[str, tuple[object, float]] = {}  # member → (its last counter, when it changed)
        self.stable: tuple[int, frozenset, float] = (-1, frozenset(), 0.0)  # (round, ready set, since)
        self.started = clock()

    def live(self) -> list[str]:
        """The members whose heartbeat changed within the last `stale` seconds (sorted)."""
        now, alive = self.clock(), []
        for path in (self.dir / "members").glob("*.json"):
            data = read_json(path)
            if data is None:
                continue
            member = path.name[: -len(".json")]
            last = self.seen.get(member)
            beat = (data.get("beat"), data.get("time"))  # (a restarted member's counter starts again)
            if last is None or last[0] != beat:
                last = self.seen[member] = (beat, now)
            if now - last[1] < self.stale:
                alive.append(member)
        return sorted(alive, key=natural)

    def incarnation(self, member: str) -> Optional[str]:
        """Which start of `member`'s supervisor beats now (None: no heartbeat readable)."""
        data = read_json(self.dir / "members" / f"{member}.json")
        return data.get("incarnation") if data else None

    def ready(self, n: int) -> None:
        """Says this member wants to start in round n."""
        path = self.dir / "ready" / str(n) / f"{self.member}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({"member": self.member, "time": time.time()}) + "\n")

    def ready_members(self, n: int) -> list[str]:
        """The members that said they are ready for round n."""
        return sorted((p.name[: -len(".json")] for p in (self.dir / "ready" / str(n)).glob("*.json")), key=natural)

    def round(self, n: int) -> Optional[dict]:
        """Round n, once its leader wrote it; UsageError for a file that is no round of this job."""
        path = self.dir / "rounds" / f"{n}.json"
        data = self._read(path) if n >= 0 else None
        if data is None:
            return None
        problem = _problem(data, END_KEYS if "end" in data else ROUND_KEYS)
        if not problem and "end" not in data:
            members, failures = data["members"], data["failures"]
            if not members or not all(isinstance(m, str) and MEMBER.match(m) for m in members):
                problem = f"has 'members' = {str(members)[:60]!r}, not a list of member ids"
            bad = [f for f in failures if not isinstance(f, dict) or _problem(f, FAILURE_KEYS)]
            problem = problem or (f"has a failure {str(bad[0])[:80]!r} without {list(FAILURE_KEYS)}" if bad else "")
        if not problem and data.get("round", n) != n:
            problem = f"says it is round {str(data['round'])[:20]}"
        if problem:
            raise self._malformed(path, problem)
        self._same_job(path, data)
        return data

    def latest(self) -> int:
        """The newest round written (-1: none yet)."""
        stems = [p.stem for p in (self.dir / "rounds").glob("*.json") if p.stem.isascii() and p.stem.isdigit()]
        huge = [stem for stem in stems if len(stem) > len(str(MAX_ROUND))]
        if huge:
            name = self.dir / "rounds" / f"{huge[0][:20]}....json"
            raise self._malformed(name, f"numbers a round beyond {MAX_ROUND}")
        return max(map(int, stems), default=-1)

    def end(self, n: int, report: dict) -> None:
        """How this member's process of round n ended (`report`: code, killed, time, ...)."""
        path = self.dir / "ended" / str(n) / f"{self.member}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        job = {"job": self.job} if self.job is not None else {}
        write_atomic(path, json.dumps({"member": self.member, **report, **job}) + "\n")

    def reports(self, n: int) -> dict[str, dict]:
        """member → how its process of round n ended, for those that said so; UsageError for a file
        that is no report of this job."""
        found = {}
        for path in (self.dir / "ended" / str(n)).glob("*.json"):
            report = self._read(path)
            if report is None:
                continue
            problem = _problem(report, REPORT_KEYS)
            if problem:
                raise self._malformed(path, problem)
            self._same_job(path, report)
            found[path.name[: -len(".json")]] = report
        return found

    def _read(self, path: Path) -> Optional[dict]:
        """A round's or report's object (each is written whole: a hard link or a rename); None when
        absent; UsageError when something else is there."""
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError, RecursionError) as e:
            raise self._malformed(path, f"does not read as JSON ({str(e)[:80]})") from None
        if not isinstance(data, dict):
            raise self._malformed(path, "is not a JSON object")
        return data

    def _malformed(self, path: Path, problem: str) -> UsageError:
        return UsageError(
            f"--rendezvous {self.dir}: {path.relative_to(self.dir)} {problem}: not a file this engine's supervisors "
            "wrote; give each job its own empty directory, or remove the file"
        )

    def _same_job(self, path: Path, data: dict) -> None:
        """UsageError when `data` (a round or a report) is another job's than this one."""
        if self.job is None or data.get("job") == self.job:
            return
        theirs = data.get("job")
        said = f"workdir {theirs.get('workdir')}, config {theirs.get('config')}" if isinstance(theirs, dict) else "?"
        raise UsageError(
            f"--rendezvous {self.dir}: {path.relative_to(self.dir)} is another job's ({said}; this job: workdir "
            f"{self.job.get('workdir')}, config {self.job.get('config')}): give each job its own empty "
            "directory (a finished job's rounds would end this one), or empty this one"
        )

    def finished(self, n: int) -> Optional[int]:
        """The job's exit code when a process of round n ended it (FINAL), else None."""
        codes = [report.get("code") for report in self.reports(n).values()]
        return next((code for code in codes if code in FINAL), None)

    def propose(self, n: int, previous: Optional[dict]) -> Optional[list[str]]:
        """The members of round n when this member leads and the round is due now, else None."""
        live = self.live()
        ready = [member for member in self.ready_members(n) if member in live]
        if not live or live[0] != self.member or self.member not in ready:
            return None
        if previous and any(m in live and m not in ready for m in previous["members"]):
            return None  # a member of the round before is still running, or has not yet noticed it ended
        chosen = ready[: self.processes]
        now = self.clock()
        if self.stable[:2] != (n, frozenset(chosen)):
            self.stable = (n, frozenset(chosen), now)
        if len(chosen) == self.processes:
            return chosen
        if now - self.stable[2] < self.settle:
            return None
        if previous is None and (len(chosen) < self.fewest or now - self.started < self.first):
            return None  # the first round waits for the pods still starting
        return chosen

    def publish(self, n: int, content: dict) -> None:
        """Writes round n (unless another leader wrote it first)."""
        job = {"job": self.job} if self.job is not None else {}
        create_json(self.dir / "rounds" / f"{n}.json", {**content, "round": n, **job})

    def step(self, n: int, form: Callable[[int, list[str], Optional[dict]], dict]) -> tuple[int, Optional[dict]]:
        """One look at the directory while waiting for round n: (the round waited for now, the round
        to start in, or one that ends the job, when there is one). `form(n, members, previous)`: the
        leader's content of round n."""
        found = self.round(n)
        if found is not None and (found.get("end") or self.member in found["members"]):
            return n, found
        if found is not None:  # formed without this member (it came late): the next one
            self.ready(n + 1)
            return n + 1, None
        previous = self.round(n - 1)
        if previous is not None and previous.get("end"):
            return n, previous  # (a supervisor started again after the job gave up)
        code = self.finished(n - 1)
        if code is not None:
            how = "finished" if code == 0 else "ended with a usage error every process meets"
            return n, {"end": f"elastic: the job {how} (a process of round {n - 1} exited {code})\n", "code": code}
        members = self.propose(n, previous)
        if members:
            self.publish(n, form(n, members, previous))
        return n, None

    def join(self, n: int, form: Callable[[int, list[str], Optional[dict]], dict]) -> dict:
        """Waits for a round this member is in, from round n on (or one that ends the job)."""
        self.ready(n)
        while True:
            n, found = self.step(n, form)
            if found is not None:
                return found
            time.sleep(POLL_SECONDS)
