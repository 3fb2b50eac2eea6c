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
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import jax
import numpy as np


@dataclass(frozen=True)
class RunProcesses:
    ids: tuple[int, ...]  # the run's processes, lowest first

    @classmethod
    def of(cls, devices: Optional[Sequence] = None) -> "RunProcesses":
        """The processes of `devices` (None: every process of the job)."""
        if devices is None:
            return cls(tuple(range(jax.process_count())))
        return cls(tuple(sorted({device.process_index for device in devices})))

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

    def _several(self, what: str) -> bool:
        """Whether `what` needs other processes (the run's being the whole job's; a run on some of
        several processes is not built: launch.py sweep refuses such sub-meshes)."""
        if self.count == 1:
            return False
        assert self.whole_job, f"{what} among processes {self.ids} of {jax.process_count()}"
        return True

    def barrier(self, name: str, timeout_seconds: int) -> None:
        """Waits until every process of the run reaches `name`."""
        if self._several("a barrier"):
            from engine.runtime.distributed import barrier

            barrier(name, timeout_seconds)

    def broadcast(self, value: Any) -> np.ndarray:
        """The chief's `value` (an array of one shape on every process), on each of the run's processes."""
        if not self._several("a broadcast"):
            return np.asarray(value)
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.broadcast_one_to_all(value))


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
