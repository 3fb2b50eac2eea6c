"""The elastic pods' rendezvous: one generic state machine (membership, leader, rounds) over a backend.

Every pod's supervisor (engine/elastic/pods.py) meets the others through one rendezvous state
that a backend (stores.py: a shared directory, or etcd) stores and changes only by compare-and-set
with a fencing token, in the manner of torchelastic's dynamic rendezvous. The state holds:

- `members`: each supervisor's heartbeat (its address, its start's incarnation and a counter
  raised every BEAT_SECONDS by a thread). A member is alive while its counter keeps changing: one
  whose counter a reader has seen unchanged for STALE_SECONDS (by the reader's own clock, so the
  pods' clocks need not agree) has stopped: its pod died.
- `ready[n]`: the supervisors that want to (re)start in round n.
- `rounds[n]`: round n, written once by the leader, the lowest live id (ids sort with their
  numbers as numbers: pod-2 before pod-10), once every live member of round n-1 is ready and the
  live ready set has not changed for SETTLE_SECONDS or holds the job's full size (round 0 waits up
  to FIRST_ROUND_SECONDS for the full size). It names the members (sorted; a member's rank is its
  position) and what the supervisor adds (the coordinator, the failures so far). The
  compare-and-set makes the first leader's round the only one. A supervisor ready for round n
  that is not among its members (it came late) waits for round n+1.
- `ended[n]`: how each member's process of round n ended (its exit code, whether its supervisor
  killed it, when), read by the members of that round and by round n+1's leader.

Rounds and reports name their job (its workdir and a digest of its config: elastic_pods.job_identity):
another job's, a finished one's left in the store, is refused (exit 2) instead of ending this one;
so is a state that is not of the form above. Publishing round n drops the rounds before n-2.

Imports no jax.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from engine.elastic.stores import RendezvousBackend, backend_for
from engine.errors import UsageError

BEAT_SECONDS = 1.0  # how often a supervisor raises its heartbeat
STALE_SECONDS = 5.0  # a heartbeat unchanged this long: the member has stopped
SETTLE_SECONDS = 3.0  # how long the live ready set must stay the same before a smaller round is formed
FIRST_ROUND_SECONDS = 60.0  # round 0 waits this long for the full size (pods start at different times)
POLL_SECONDS = 0.25  # how often a waiting supervisor looks at the state
FINAL = (0, 2)  # exit codes that end the whole job (done; a usage error every process meets)
MEMBER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
MAX_ROUND = 10**9  # a round number beyond it is no round a job wrote
KEEP_ROUNDS = 2  # publishing round n keeps rounds n-2.. (the leader reads n-1's reports)
SECTIONS = ("members", "ready", "rounds", "ended")
# what a round holds: a round to start in, or one that ends the job
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
State = dict[str, dict]


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


def backend_of(where: RendezvousBackend | str | Path) -> RendezvousBackend:
    """`where` as a backend: a backend itself, or what --rendezvous names (stores.backend_for)."""
    return backend_for(where) if isinstance(where, (str, Path)) else where


class Store:
    """The rendezvous state over a backend: read whole, changed by compare-and-set."""

    def __init__(self, where: RendezvousBackend | str | Path):
        self.backend = backend_of(where)

    def read(self) -> tuple[State, Any]:
        """(the state, its token); UsageError for a state this engine did not write."""
        data, token = self.backend.get_state()
        return self.parse(data), token

    def parse(self, data: Optional[bytes]) -> State:
        if data is None:
            return {section: {} for section in SECTIONS}
        try:
            state = json.loads(data)
        except (ValueError, RecursionError) as e:
            raise self.malformed("the state", f"does not read as JSON ({str(e)[:80]})") from None
        if not isinstance(state, dict):
            raise self.malformed("the state", "is not a JSON object")
        for section in SECTIONS:
            value = state.setdefault(section, {})
            items = value.items() if isinstance(value, dict) else []
            inner = [key for key, item in items if not isinstance(item, dict)]
            if not isinstance(value, dict) or inner:
                said = f"{section}.{inner[0][:20]}" if inner else section
                raise self.malformed("the state", f"has {said!r} that is not an object")
        return state

    def update(self, change: Callable[[State], Any]) -> Any:
        """Applies `change` (which edits the state it is given) until the compare-and-set takes it;
        what `change` returned for the state that was written."""
        data, token = self.backend.get_state()
        while True:
            state = self.parse(data)
            answer = change(state)
            data, token, written = self.backend.set_state(json.dumps(state, sort_keys=True).encode(), token)
            if written:
                return answer

    def malformed(self, what: str, problem: str) -> UsageError:
        return UsageError(
            f"--rendezvous {self.backend.name}: {what} {problem}: not what this engine's supervisors write; give each "
            "job its own empty directory or etcd prefix, or remove the state"
        )


class Heartbeat:
    """A thread raising `member`'s heartbeat every `every` seconds until stopped."""

    def __init__(self, where: RendezvousBackend | str | Path, member: str, address: str, every: float = BEAT_SECONDS):
        self.store, self.member = Store(where), member
        incarnation = uuid.uuid4().hex  # this supervisor's start: a restarted pod's differs
        self.data: dict[str, Any] = {"address": address, "incarnation": incarnation, "beat": 0}
        self.every, self.stopped = every, threading.Event()
        self.thread = threading.Thread(target=self._run, name="rendezvous-heartbeat", daemon=True)

    def beat(self) -> None:
        """One heartbeat: the counter goes up."""
        self.data["beat"] += 1

        def change(state: State) -> None:
            state["members"][self.member] = {**self.data, "time": time.time()}

        self.store.update(change)

    def _run(self) -> None:
        while not self.stopped.is_set():
            try:
                self.beat()
            except (OSError, UsageError) as e:  # (the store's hiccup: the next beat tries again; a long one: stale)
                print(f"warning: rendezvous: heartbeat not written: {e}", file=sys.stderr, flush=True)
            self.stopped.wait(self.every)

    def start(self) -> None:
        self.beat()  # (before anyone is told of this member)
        self.thread.start()

    def stop(self) -> None:
        """Stops beating and removes the member (a member that leaves on purpose is not waited for)."""
        self.stopped.set()
        self.thread.join(timeout=5)
        try:
            self.store.update(lambda state: state["members"].pop(self.member, None))
        except (OSError, UsageError) as e:  # (it goes stale instead)
            print(f"warning: rendezvous: heartbeat not removed: {e}", file=sys.stderr, flush=True)


class Rendezvous:
    """One supervisor's view of the state: who is alive, who is ready, the rounds."""

    def __init__(
        self,
        where: RendezvousBackend | str | Path,
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
        """`where`: the backend, or --rendezvous's value; `job`: what names this job (its workdir and
        config digest, pods.job_identity): a round or report of another job is refused (None: not checked)."""
        self.store, self.member, self.address, self.job = Store(where), member, address, job
        self.processes, self.fewest = processes, fewest
        self.clock, self.stale, self.settle, self.first = clock, stale, settle, first
        self.seen: dict[str, tuple[object, float]] = {}  # member → (its last counter, when it changed)
        self.stable: tuple[int, frozenset, float] = (-1, frozenset(), 0.0)  # (round, ready set, since)
        self.started = clock()

    def _state(self) -> State:
        return self.store.read()[0]

    def live(self) -> list[str]:
        """The members whose heartbeat changed within the last `stale` seconds (sorted)."""
        now, alive = self.clock(), []
        for member, data in self._state()["members"].items():
            if not isinstance(data, dict):
                continue
            last = self.seen.get(member)
            beat = (data.get("beat"), data.get("time"), data.get("incarnation"))  # (a restarted member's starts again)
            if last is None or last[0] != beat:
                last = self.seen[member] = (beat, now)
            if now - last[1] < self.stale:
                alive.append(member)
        return sorted(alive, key=natural)

    def incarnation(self, member: str) -> Optional[str]:
        """Which start of `member`'s supervisor beats now (None: no heartbeat)."""
        data = self._state()["members"].get(member)
        return data.get("incarnation") if isinstance(data, dict) else None

    def ready(self, n: int) -> None:
        """Says this member wants to start in round n."""
        self.store.update(lambda state: state["ready"].setdefault(str(n), {}).update({self.member: time.time()}))

    def ready_members(self, n: int) -> list[str]:
        """The members that said they are ready for round n."""
        ready = self._state()["ready"].get(str(n))
        return sorted(ready if isinstance(ready, dict) else [], key=natural)

    def round(self, n: int) -> Optional[dict]:
        """Round n, once its leader wrote it; UsageError for one that is no round of this job."""
        return self._round(self._state(), n)

    def _round(self, state: State, n: int) -> Optional[dict]:
        data = state["rounds"].get(str(n)) if n >= 0 else None
        if data is None:
            return None
        what = f"round {n}"
        if not isinstance(data, dict):
            raise self.store.malformed(what, "is not a JSON object")
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
            raise self.store.malformed(what, problem)
        self._same_job(what, data)
        return data

    def latest(self) -> int:
        """The newest round written (-1: none yet)."""
        keys = [key for key in self._state()["rounds"] if key.isascii() and key.isdigit()]
        huge = [key for key in keys if len(key) > len(str(MAX_ROUND))]
        if huge:
            raise self.store.malformed(f"round {huge[0][:20]}...", f"numbers a round beyond {MAX_ROUND}")
        return max(map(int, keys), default=-1)

    def end(self, n: int, report: dict) -> None:
        """How this member's process of round n ended (`report`: code, killed, time, ...)."""
        job = {"job": self.job} if self.job is not None else {}
        entry = {"member": self.member, **report, **job}
        self.store.update(lambda state: state["ended"].setdefault(str(n), {}).update({self.member: entry}))

    def reports(self, n: int) -> dict[str, dict]:
        """member → how its process of round n ended, for those that said so; UsageError for one
        that is no report of this job."""
        found = self._state()["ended"].get(str(n)) or {}
        for member, report in found.items():
            what = f"the report of {str(member)[:40]} on round {n}"
            problem = _problem(report, REPORT_KEYS) if isinstance(report, dict) else "is not a JSON object"
            if problem:
                raise self.store.malformed(what, problem)
            self._same_job(what, report)
        return dict(found)

    def _same_job(self, what: str, data: dict) -> None:
        """UsageError when `data` (a round or a report) is another job's than this one."""
        if self.job is None or data.get("job") == self.job:
            return
        theirs = data.get("job")
        said = f"workdir {theirs.get('workdir')}, config {theirs.get('config')}" if isinstance(theirs, dict) else "?"
        raise UsageError(
            f"--rendezvous {self.store.backend.name}: {what} is another job's ({said}; this job: workdir "
            f"{self.job.get('workdir')}, config {self.job.get('config')}): give each job its own empty "
            "directory or etcd prefix (a finished job's rounds would end this one), or empty this one"
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
        """Writes round n (unless another leader wrote it first), dropping the rounds before n-2."""
        job = {"job": self.job} if self.job is not None else {}

        def change(state: State) -> None:
            if str(n) in state["rounds"]:
                return  # (the first leader's round stands)
            state["rounds"][str(n)] = {**content, "round": n, **job}
            for section in ("ready", "rounds", "ended"):
                for key in [k for k in state[section] if k.isascii() and k.isdigit() and int(k) < n - KEEP_ROUNDS]:
                    del state[section][key]

        self.store.update(change)

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
