"""The run's processes: those that hold its devices. A run alone trains on every process of the
job; a sub-mesh sweep's trial (engine/sweep/submesh.py) on the processes of its sub-mesh only.
The run's chief (the lowest of them) writes its files; its barriers, broadcasts, preemption
sync and checkpoint commits are among its processes alone, never the job's, so trials on other
processes' devices train on undisturbed.

`fit` sets the run's processes for the thread that trains it (`running`); the code a run calls
asks `current()` (the whole job where no run set one: an ordinary run's behaviour)."""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import jax
import numpy as np

WAIT_MS = 24 * 3600 * 1000  # how long a process of a run waits for its chief's broadcast


@dataclass(frozen=True)
class RunProcesses:
    ids: tuple[int, ...]  # the run's processes, lowest first
    name: str = ""  # the run's (its keys in the job's store: unique in the job, the same on its processes)
    _sent: Iterator[int] = field(default_factory=itertools.count, compare=False, repr=False)
    _asked: Iterator[int] = field(default_factory=itertools.count, compare=False, repr=False)

    @classmethod
    def of(cls, devices: Optional[Sequence] = None, name: str = "") -> "RunProcesses":
        """The processes of `devices` (None: every process of the job)."""
        if devices is None:
            return cls(tuple(range(jax.process_count())), name)
        return cls(tuple(sorted({device.process_index for device in devices})), name)

    @classmethod
    def for_run(cls, devices: Optional[Sequence], workdir) -> "RunProcesses":
        """The processes of a run on `devices`, named after its workdir (its keys in the job's store)."""
        return cls.of(devices, name=f"{zlib.crc32(str(Path(workdir).absolute()).encode()):08x}")

    @property
    def chief(self) -> bool:
        """Whether this process writes the run's files (the lowest of its processes)."""
        return jax.process_index() == self.ids[0]

    @property
    def index(self) -> int:
        """This process's place among the run's processes (the watchdog's, the profile's name)."""
        return self.ids.index(jax.process_index())

    @property
    def count(self) -> int:
        return len(self.ids)

    @property
    def whole_job(self) -> bool:
        return self.count == jax.process_count()

    def barrier(self, name: str, timeout_seconds: int) -> None:
        """Waits until every process of the run reaches `name`."""
        from engine.runtime.distributed import barrier

        if self.count > 1:
            barrier(name, timeout_seconds, None if self.whole_job else self)

    def broadcast(self, value: Any) -> np.ndarray:
        """The chief's `value` (an array of one shape on every process), on each of the run's processes
        (the job's: a collective; some of its processes: through the coordination service's store)."""
        if self.count == 1:
            return np.asarray(value)
        if self.whole_job:
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.broadcast_one_to_all(value))
        from jax._src import distributed

        client, key = distributed.global_state.client, f"engine_run/{self.name}/{self.ids}/{next(self._sent)}"
        assert client is not None, "several processes: jax.distributed is initialised"
        array = np.asarray(value)
        if self.chief:
            client.key_value_set(key, json.dumps(array.tolist()))
            return array
        text = client.blocking_key_value_get(key, WAIT_MS)
        if client.key_value_increment(f"{key}/read", 1) == self.count - 1:  # the last reader: the store keeps nothing
            client.key_value_delete(key)
            client.key_value_delete(f"{key}/read")
        return np.asarray(json.loads(text), array.dtype).reshape(array.shape)

    def any_of(self, flag: bool) -> bool:
        """Whether any of the run's processes passes True, on each of them (each calls it at the same
        points of the run, as it would a collective). Through the coordination service's store, so it
        needs no devices: a sub-mesh trial's processes agree on the step a stop takes effect."""
        if self.count == 1:
            return flag
        from jax._src import distributed

        client, asked = distributed.global_state.client, next(self._asked)
        assert client is not None, "several processes: jax.distributed is initialised"
        prefix = f"engine_run/{self.name}/{self.ids}/any"
        client.key_value_set(f"{prefix}{asked}/{jax.process_index()}", "1" if flag else "0")
        if asked >= 2:  # every process has read that one: each had set its key of the question after it
            client.key_value_delete(f"{prefix}{asked - 2}/{jax.process_index()}")
        return any(client.blocking_key_value_get(f"{prefix}{asked}/{pid}", WAIT_MS) == "1" for pid in self.ids)


_CURRENT: contextvars.ContextVar[Optional[RunProcesses]] = contextvars.ContextVar("run_processes", default=None)


def current() -> RunProcesses:
    """The processes of the run this thread trains (every process of the job outside one)."""
    return _CURRENT.get() or RunProcesses.of(None)


@contextlib.contextmanager
def running(processes: RunProcesses) -> Iterator[RunProcesses]:
    """The run's processes, for the code this thread runs inside."""
    token = _CURRENT.set(processes)
    try:
        yield processes
    finally:
        _CURRENT.reset(token)
