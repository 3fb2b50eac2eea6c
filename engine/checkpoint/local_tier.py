"""The local checkpoint tier: each process's shards saved every few steps to node-local storage,
with a copy at a peer process on another host, and restored from wherever a complete step survives.

checkpoint.local_dir holds, per run (named after its workdir) and per process,
`process_<i>/owner_<o>/<step>/` (local_files.py): process o's shards of that step. Process i
keeps its own (o = i) and the copies of the processes whose peer it is: each process's
checkpoint.local_replicas peers are the next processes on other hosts (peers.py), so that
losing one host's local storage loses no local step while there are several hosts. A save
returns once the state is packed into host memory; on the tier's background thread the copies
then travel (transport.py: TCP between the processes, off the job's collectives, which a second
thread must not use), each received copy is written and confirmed, and a process's own copy is
written only once every peer has confirmed its copy: a step directory is complete, and its
peers' copies are in place, or it is a `.partial` folder that no restore takes. The next save,
a restore and the end wait for that piece; its failure (a full RAM disk, a peer that never
sent) is a warning at the next save, agreed on by every process, and the next local saves try
again. The newest checkpoint.local_keep steps are kept. Every step records the run's id
(peers.py): another run's steps are never restored.

Restore first agrees, through one gather, on the hosts (the peers), the run id, a new run (what
the local tier holds then is removed) and the persistent tier's newest step (the newest any
process lists). It then gathers every process's inventory and takes the newest step that is
complete across the processes (each process's shards present at itself or at a peer) and as
new as that persistent step; a step directory that does not read (whatever the error) is set
aside into `process_<i>/damaged/` with the reason, and the next candidate is tried. Whether the
chosen step fits and reads is agreed again before any process uses it; if not, every process
restores the persistent tier (`declined` says why). A step saved by another process count, or
in another sharding of the same arrays, is restored too: local_reshard.py gathers every saved
process's shards to every process and rebuilds the arrays in this run's shardings, exactly.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple, Optional, cast

import jax
import numpy as np

from engine.checkpoint.exchange import exchange, gather_rows, rounds
from engine.checkpoint.local_files import (
    Copy,
    from_header,
    header,
    read_copy,
    read_tier,
    reason,
    set_aside,
    steps,
    subfolders,
    write_copy,
)
from engine.checkpoint.local_reshard import describe, rebuild, to_all
from engine.checkpoint.packing import LayoutMismatch, ShardingMismatch, check_fits, pack, refitted, unpack
from engine.checkpoint.peers import (
    choose_peers,
    host_key,
    host_name,
    keep_run_id,
    new_run_id,
    one_host,
    stored_run_id,
)
from engine.checkpoint.staging import InBackground
from engine.checkpoint.transport import Transport, peer_sockets
from engine.errors import UsageError


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


def _any(flag: bool) -> list[int]:
    """The processes for which `flag` holds (a collective)."""
    return [p for p, table in enumerate(gather_rows(np.array([[int(flag)]]))) if table[0, 0]]


class LocalTier:
    """One run's local tier, seen from this process (every process holds one; save and restore are
    collectives: every process calls them at the same step)."""

    def __init__(
        self, local_dir: str, persistent: Path, keep: int, replicas: int, verify: bool, fresh: bool, timeout: int = 600
    ):
        """`fresh`: the run's persistent directory did not exist yet (a new run): what the local
        tier holds of an earlier run in this workdir is removed at restore. `timeout`: the seconds
        a background exchange waits for a peer (distributed.barrier_timeout)."""
        self.setting = local_dir
        self.workdir = Path(persistent).absolute().parent
        self.process, self.count = jax.process_index(), jax.process_count()
        self.root = run_directory(local_dir, persistent) / f"process_{self.process}"
        self.keep, self.verify, self.fresh = keep, verify, fresh
        self.replicas = min(replicas, self.count - 1)
        self.peers: Optional[list[list[int]]] = None  # each process's peers (agreed at the first collective)
        self.run = 0  # the run id (agreed with the peers)
        self.declined = ""  # why the last restore used no local step
        self._unusable: set[Path] = set()  # step directories found damaged here
        self._found: dict[tuple[int, int, int], Path] = {}  # (owner, step, processes) → its directory here
        self._from_peers: list[int] = []  # the owners whose restored copy is a peer's (for the console)
        self._orphans = True  # the folders of process indices beyond the job's may remain (until a save)
        self._writing = InBackground("local-checkpoint")
        self._writing_step = self._saves = 0
        self.timeout = timeout
        self.transport: Optional[Transport] = None  # (made at the first save with a peer; tests set their own)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # (before any collective: the launcher sees this process's exit 2 at once)
            raise UsageError(
                f"checkpoint.local_dir={local_dir}: {self.root} cannot be created ({e.strerror or e}); set "
                "checkpoint.local_dir to a folder on node-local storage this user can write, e.g. /dev/shm/checkpoints"
            ) from None

    def _owner_dir(self, owner: int) -> Path:
        return self.root / f"owner_{owner}"

    def _owner_dirs(self) -> list[Path]:
        """Every owner folder on this process's storage, its own process index's first: an elastic
        job's survivors are renumbered, so a survivor's copies lie under its old index's folder (on
        its host; on one host, every process's folders)."""
        folders = [f for process in subfolders(self.root.parent, "process_") for f in subfolders(process, "owner_")]
        return [*subfolders(self.root, "owner_"), *(f for f in folders if f.parent != self.root)]

    def _agree(self, persistent_newest: Optional[int]) -> tuple[bool, Optional[int]]:
        """The first collective: every process's host (→ the peers), process 0's run id, whether
        the run is new (any process says so) and the persistent tier's newest step (the newest any
        process lists: a local step older than what one process sees is never preferred to it)."""
        kept = stored_run_id(self.workdir) if self.process == 0 and not self.fresh else 0
        newest = -1 if persistent_newest is None else persistent_newest
        made = new_run_id() if self.process == 0 else 0  # (used when the run is new, or has no id yet)
        mine = [int(self.fresh), host_key(host_name(self.process)), newest, kept, made]
        table = np.concatenate(gather_rows(np.array([mine])))
        afresh, hosts, listed, kept_ids, new_ids = table.T.tolist()  # (a column per field; a row per process)
        fresh = any(afresh)
        self.peers = choose_peers(hosts, self.replicas)
        self.run = new_ids[0] if fresh or not kept_ids[0] else kept_ids[0]
        if self.process == 0 and self.run != kept:
            failure = keep_run_id(self.workdir, self.run)
            if failure:
                print(
                    f"warning: could not record the local tier's run id ({failure}); after a restart "
                    "this run's local steps are not restored",
                    file=sys.stderr,
                )
        if self.process == 0 and self.replicas and one_host(hosts):
            print(
                "note: every process of this job runs on one host: the local tier's peer copies guard against a "
                "lost process's storage, not a lost host (the persistent tier does)",
                file=sys.stderr,
            )
        newest = max(listed)
        return fresh, newest if newest >= 0 else None

    def save(self, step: int, state, meta: dict) -> None:
        """This process's shards of `state` to its local storage, and a copy to each of its peers;
        returns once the bytes are packed on the host (`_exchange` sends and writes them in the
        background). The previous save's failure on any process is a warning here."""
        if self.peers is None:
            self._agree(None)
        failure = self._written()
        failed = _any(bool(failure))
        if failure:
            self._unwritten(failure)
        elif failed and self.process == 0:
            print(
                f"warning: local checkpoint step {self._writing_step} was not written on process(es) "
                f"{', '.join(map(str, failed))} (their output says why)",
                file=sys.stderr,
            )
        buffer, index = pack(state)
        mine = Copy(self.process, buffer, {**index, "processes": self.count}, meta)
        if self.transport is None and self.count > 1:
            self.transport = peer_sockets(self.process)
        self._writing_step, self._saves = step, self._saves + 1
        self._writing.start(self._exchange, step, mine, f"{self.run}/{step}/{self._saves}")

    def _exchange(self, step: int, mine: Copy, key: str) -> None:
        """A save's background piece: this process's copy sent to each peer, the copies it keeps
        received, written and confirmed, then its own written once each peer confirmed its copy
        (sends first and receives before waiting: no process waits on one that waits on it)."""
        assert self.peers is not None
        transport, mine_to = cast(Transport, self.transport), self.peers[self.process]  # (set when there are peers)
        deadline = time.monotonic() + self.timeout  # (for the whole exchange, not each wait)

        def left() -> float:
            return max(deadline - time.monotonic(), 0.001)

        for peer in mine_to:
            transport.send(peer, f"{key}/{self.process}-{peer}", [header(mine), mine.buffer], left())
        for owner in (owner for owner in range(self.count) if self.process in self.peers[owner]):
            head, buffer = transport.receive(f"{key}/{owner}-{self.process}", left())
            self._write(step, [from_header(head, buffer)])
            transport.confirm(f"{key}/{owner}-{self.process}")
        for peer in mine_to:
            transport.confirmed(f"{key}/{self.process}-{peer}", left())
        self._write(step, [mine])

    def _transfer(self, moves: list[tuple[int, int, int]], held: dict[int, Copy]) -> list[tuple[Any, Any]]:
        """For each (source, destination, owner) of `moves`, the source's copy of owner's shards
        sent to the destination; the (header, buffer) pairs this process received."""
        owners: dict[tuple[int, int], list[int]] = {}  # (a pair moves several owners' copies in several rounds)
        for source, destination, owner in moves:
            owners.setdefault((source, destination), []).append(owner)
        got = []
        for batch in rounds([(source, destination) for source, destination, _ in moves]):
            outgoing = next((held[owners[pair].pop(0)] for pair in batch if pair[0] == self.process), None)
            head = exchange(header(outgoing) if outgoing else b"", batch)
            buffer = exchange(outgoing.buffer if outgoing else b"", batch)
            if head is not None:
                got.append((head, buffer))
        return got

    def _write(self, step: int, copies: list[Copy]) -> None:
        assert self.peers is not None
        for copy in copies:
            folder = self._owner_dir(copy.owner)
            tier = dict(step=step, owner=copy.owner, processes=self.count, peers=self.peers[copy.owner], run=self.run)
            write_copy(folder, step, copy, tier, self.verify)
            for old in steps(folder)[: -self.keep]:
                shutil.rmtree(folder / str(old), ignore_errors=True)
        if self._orphans:  # a step of this job is saved: the folders of indices beyond it are not needed
            self._orphans = False
            for folder in self.root.parent.glob("process_*"):
                if folder.name[8:].isdigit() and int(folder.name[8:]) >= self.count:
                    shutil.rmtree(folder, ignore_errors=True)

    def _written(self) -> str:
        """Waits for the write in progress; why it failed ("" when it did not)."""
        try:
            self._writing.join()
        except Exception as e:  # reported by the caller: a warning, the persistent tier untouched
            return reason(e)
        return ""

    def _unwritten(self, failure: str) -> None:
        print(
            f"warning: local checkpoint step {self._writing_step} was not written on process {self.process} to "
            f"{self.root} ({failure}); the persistent tier is untouched, and the next local saves try again",
            file=sys.stderr,
        )

    def wait(self) -> None:
        """Waits for the write in progress; its failure is a warning (on this process)."""
        failure = self._written()
        if failure:
            self._unwritten(failure)

    def close(self) -> None:
        self.wait()

    def _inventory(self) -> np.ndarray:
        """[(owner, step, processes, peer)] of the complete step directories of this run that this
        process holds, in any process index's folder (`_owner_dirs`; `_found` says where; `peer`: 1 when
        only a peer's copy, in another index's folder than the owner's); one that does not read is set
        aside, one of another run removed (each said)."""
        peers: dict[tuple[int, int, int], int] = {}  # (owner, step, processes) → whether only a peer's copy
        others: list[str] = []
        self._found = {}
        for folder in self._owner_dirs():
            for step in steps(folder):
                owner = int(folder.name.removeprefix("owner_")) if folder.name[6:].isdigit() else -1
                if folder / str(step) in self._unusable:
                    continue
                try:
                    tier = read_tier(folder / str(step), owner, step)
                except Exception as e:  # any failure to read makes it damaged, whatever the error
                    if (folder / str(step)).is_dir():  # (not one another process removed meanwhile)
                        self._damaged(folder / str(step), owner, step, f"{folder.name}/{step}/tier.json: {reason(e)}")
                    continue
                if tier.get("run") != self.run:
                    others.append(
                        f"{'' if folder.parent == self.root else '../' + folder.parent.name + '/'}{folder.name}/{step}"
                    )
                    shutil.rmtree(folder / str(step), ignore_errors=True)
                    continue
                key, peer = (owner, step, tier["processes"]), int(folder.parent.name != f"process_{owner}")
                if key not in peers or peers[key] > peer:  # (the owner's own copy, else the first peer's found)
                    self._found[key], peers[key] = folder / str(step), peer
        if others:
            print(
                f"note: removed local checkpoint(s) {', '.join(others)} from {self.root}: another run's "
                f"(not run id {self.run})",
                file=sys.stderr,
            )
        return np.array([(*key, peer) for key, peer in peers.items()], np.int64).reshape(-1, 4)

    def _damaged(self, folder: Path, owner: int, step: int, why: str) -> None:
        self._unusable.add(folder)  # (not tried again, even where it cannot be moved aside)
        set_aside(folder.parent.parent, folder, owner, step, why)

    def restore(self, abstract_state, persistent_newest: Optional[int]) -> Optional[LocalRestored]:
        """The newest step complete across the processes and not older than the persistent tier's
        newest, read into `abstract_state`'s shardings (or a refit's: packing.refitted); None when there
        is none or it does not fit or read (on any process: all then restore the persistent tier;
        `declined` says why)."""
        self.wait()  # (a save in flight ends first)
        fresh, newest = self._agree(persistent_newest)
        self.fresh = False  # (the run has begun: a later restore keeps what it saves)
        if fresh:
            shutil.rmtree(self.root, ignore_errors=True)  # an earlier run's, in a workdir begun afresh
            self.root.mkdir(parents=True, exist_ok=True)
            _any(False)  # (a barrier: no process lists the others' folders, discard_after, while they are removed)
            self.declined = "the run begins afresh"
            return None
        while True:
            chosen = self._choose(gather_rows(self._inventory()), newest)
            if chosen is None:
                return None
            step, saved, holders = chosen
            loaded: dict[int, Copy] = {}
            for owner in (owner for owner, holder in holders.items() if holder == self.process):
                folder = self._found[(owner, step, saved)]
                try:
                    loaded[owner] = read_copy(folder, owner, self.verify)
                except Exception as e:  # any failure to read makes it damaged, whatever the error
                    self._damaged(folder, owner, step, reason(e))
            if not _any(len(loaded) < sum(holder == self.process for holder in holders.values())):
                if saved != self.count:
                    return self._reshard(step, saved, holders, loaded, abstract_state)
                return self._assemble(step, holders, loaded, abstract_state)

    def _choose(self, tables: list[np.ndarray], newest: Optional[int]):
        """(step, the process count that saved it, {owner: the process that serves its shards}) of
        the newest usable step, or None (with `declined` saying why). A step is complete when every
        process that saved it (owners 0..count-1) has its copy at some process of this job."""
        held: dict[tuple[int, int, int], list[tuple[int, int]]] = {}  # → (whether a peer's copy, holder)
        for holder, table in enumerate(tables):
            for owner, step, processes, peer in table.tolist():
                held.setdefault((owner, step, processes), []).append((peer, holder))
        saves = {(step, processes) for _, step, processes in held}
        whole = [(s, n) for s, n in saves if all((o, s, n) in held for o in range(n))]
        # the newest step; of two saves of it (by other process counts), this job's count, else the larger
        whole.sort(key=lambda save: (save[0], save[1] == self.count, save[1]))
        complete = [s for s, _ in whole]
        usable = [save for save in whole if newest is None or save[0] >= newest]
        if not usable:
            self.declined = (
                f"the local tier's newest complete step, {complete[-1]}, is older than step {newest}"
                if complete
                else "the local tier holds no complete step of this run"
            )
            return None
        step, saved = usable[-1]
        holders, self._from_peers = {}, []
        for owner in range(saved):  # the owner's own copy first, then the process of its index, the next
            peer, holders[owner] = min(held[(owner, step, saved)], key=lambda c: (c[0], (c[1] - owner) % self.count))
            self._from_peers += [owner] if peer else []
        return step, saved, holders

    def _assemble(self, step: int, holders: dict[int, int], loaded: dict[int, Copy], abstract_state):
        """Each copy sent to its owner, then this process's arrays rebuilt from its own copy, once
        every process has found that its copy fits and reads; resharded (on every process) when a
        copy holds the arrays in another sharding."""
        moves = [(holder, owner, owner) for owner, holder in sorted(holders.items()) if holder != owner]
        received = self._transfer(moves, loaded)  # (a collective: nothing here raises before it ends)
        problem, state, mine, other = "", None, loaded.get(self.process), False
        try:
            mine = mine or from_header(*received[0])
            abstract_state = refitted(abstract_state, mine.layout["paths"], mine.layout["shapes"])
            check_fits(mine.layout, abstract_state)
            state = unpack(mine.buffer, mine.layout, abstract_state)
        except ShardingMismatch:
            other = True  # (another mesh: every process reshards below)
        except LayoutMismatch as e:
            problem = f"does not fit this run ({e})"
        except Exception as e:  # any failure to read: every process restores the persistent tier
            problem = f"does not read ({reason(e)})"
        if self._refused(step, problem):
            return None
        if _any(other):
            return self._reshard(step, self.count, holders, loaded, abstract_state)
        assert state is not None and mine is not None
        return LocalRestored(state, mine.meta, step, self._source(holders, ""))

    def _reshard(self, step: int, saved: int, holders: dict[int, int], loaded: dict[int, Copy], abstract_state):
        """Every served copy sent to every process, then this process's arrays rebuilt from all of
        them in `abstract_state`'s shardings (local_reshard.py), once every process has found that
        they fit and read."""
        received = self._transfer(to_all(holders, self.count), loaded)  # (a collective)
        problem, state = "", None
        copies = dict(loaded)
        try:
            copies.update((copy.owner, copy) for copy in (from_header(*pair) for pair in received))
            layout = copies[min(copies)].layout if copies else {"paths": [], "shapes": []}
            state = rebuild(copies, refitted(abstract_state, layout["paths"], layout["shapes"]))
        except LayoutMismatch as e:
            problem = f"does not fit this run ({e})"
        except Exception as e:  # any failure to read: every process restores the persistent tier
            problem = f"does not read ({reason(e)})"
        if self._refused(step, problem):
            return None
        assert state is not None
        return LocalRestored(state, copies[0].meta, step, self._source(holders, describe(saved, self.count)))

    def _refused(self, step: int, problem: str) -> bool:
        """Whether any process found a problem with the chosen step (a collective); `declined`
        then says which (every process then restores the persistent tier)."""
        failed = _any(bool(problem))
        if failed:
            if problem:
                print(
                    f"note: local checkpoint step {step} {problem} on process {self.process}; restoring the "
                    "persistent tier",
                    file=sys.stderr,
                )
            on = f"process(es) {', '.join(map(str, failed))}"
            self.declined = f"the local tier's step {step} {problem or 'does not fit or read'} on {on}"
        return bool(failed)

    def _source(self, holders: dict[int, int], resharded: str) -> str:
        """Where a restored step came from, for the console."""
        source = f"the local tier, checkpoint.local_dir={self.setting}"
        if resharded:
            source += f"; {resharded}"
        peers = sorted(self._from_peers)
        if peers:
            source += f"; the shards of process(es) {', '.join(map(str, peers))} from a peer's copy"
        return source

    def discard_after(self, step: int) -> None:
        """Removes the steps after `step` (the run goes on from `step`: those belong to a past it
        will train again), and the partial ones; in every process index's folder here (`_owner_dirs`)."""
        for folder in self._owner_dirs():
            for partial in folder.glob("*.partial"):
                shutil.rmtree(partial, ignore_errors=True)
            for later in (s for s in steps(folder) if s > step):
                shutil.rmtree(folder / str(later), ignore_errors=True)
