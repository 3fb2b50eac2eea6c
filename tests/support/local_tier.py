"""Helpers of tests/**/test_local_tier*.py that other test files (or its other tiers) share."""

import threading

import numpy as np

from engine.checkpoint.local_tier import LocalTier, run_directory


def local_steps(local_dir, workdir, process=0, owner=0):
    folder = run_directory(str(local_dir), workdir / "checkpoints") / f"process_{process}" / f"owner_{owner}"
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []


class HeldTransport:
    """The local tier's transport between LocalTier objects of one test process (as if processes of
    a job), whose sends wait from `hold()` until `release()`: an exchange held back. `log` records, in order,
    each copy sent and what the test notes (`note`)."""

    def __init__(self, held=False):
        self.log: list[str] = []
        self._gate = threading.Event()
        if not held:
            self._gate.set()
        self._lock = threading.Condition()
        self._arrived: dict[str, list[np.ndarray]] = {}
        self._confirmed: set[str] = set()

    def hold(self):
        self._gate.clear()

    def release(self):
        self.note("released")
        self._gate.set()

    def note(self, event: str):
        with self._lock:
            self.log.append(event)

    def send(self, destination, key, parts, timeout):
        if not self._gate.wait(timeout):
            raise TimeoutError(f"{key} was held back")
        with self._lock:
            self._arrived[key] = [np.frombuffer(bytes(memoryview(part).cast("B")), np.uint8) for part in parts]
            self.log.append(f"sent {key}")
            self._lock.notify_all()

    def receive(self, key, timeout):
        with self._lock:
            if not self._lock.wait_for(lambda: key in self._arrived, timeout):
                raise TimeoutError(f"{key} did not arrive within {timeout}s")
            return self._arrived.pop(key)

    def confirm(self, key):
        with self._lock:
            self._confirmed.add(key)
            self._lock.notify_all()

    def confirmed(self, key, timeout):
        with self._lock:
            if not self._lock.wait_for(lambda: key in self._confirmed, timeout):
                raise TimeoutError(f"{key} was not confirmed within {timeout}s")


def two_process_tiers(tmp_path, transport, timeout=60):
    """The local tiers of processes 0 and 1 of a job, each on a host of its own (its own local_dir),
    peers of each other, exchanging through `transport` (no collective: the tier's agreement
    is set here as `_agree` would set it)."""
    tiers = []
    for process in (0, 1):
        tier = LocalTier(
            str(tmp_path / f"host{process}"), tmp_path / "run" / "checkpoints", 3, 1, False, False, timeout
        )
        tier.process, tier.count, tier.replicas, tier.peers, tier.run = process, 2, 1, [[1], [0]], 7
        tier.root = tier.root.parent / f"process_{process}"
        tier.root.mkdir(parents=True, exist_ok=True)
        tier.transport = transport
        tiers.append(tier)
    return tiers
