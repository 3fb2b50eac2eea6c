"""Staging of checkpoint saves: the copy of the state orbax writes, and the thread that writes it in the background.

checkpoint.staging="host" copies the state into its devices' pinned host memory and saves that
copy from a background thread, so orbax's bookkeeping overlaps training; "device" does the same
with the copy on the devices; "host_sync" lets orbax copy the arrays off the devices before
save() returns. "host" falls back to "host_sync" where the devices have no pinned host memory, or
where (several processes) orbax's barriers could interleave with the step's collectives.
"""

from __future__ import annotations

import threading
from typing import Optional

import jax
import jax.numpy as jnp

from engine.runtime.settings import distributed_client_barriers_on

# A copy of every array, made on the devices where it lives (the jit keeps each sharding).
_device_copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))


def pinned_host_copy(state):
    """A copy of every array in its devices' pinned host memory, each sharded as before: the
    transfers are dispatched and this returns at once (a later use of the arrays, such as
    the next step donating them, runs after the copies have read them)."""
    return jax.device_put(state, jax.tree.map(lambda array: array.sharding.with_memory_kind("pinned_host"), state))


def _has_pinned_host() -> bool:
    return any(memory.kind == "pinned_host" for memory in jax.local_devices()[0].addressable_memories())


def effective_staging(staging: str) -> str:
    """The staging saves use for checkpoint.staging=`staging` on these devices and processes
    ("host" where it can save in the background, else "host_sync"); RuntimeError for "device"
    where orbax's barriers could interleave with the step's collectives."""
    background_ok = jax.process_count() == 1 or distributed_client_barriers_on()
    if staging == "device" and not background_ok:
        raise RuntimeError(
            "checkpoint.staging=device with several processes needs orbax's distributed-client "
            "barriers: call engine.runtime.settings.use_distributed_client_barriers() at start-up "
            "(launch.py does)"
        )
    if staging == "host" and background_ok and _has_pinned_host():
        return "host"
    return "host_sync" if staging in ("host", "host_sync") else staging


def staged_copy(state, staging: str):
    """The copy of `state` that a background save writes: in pinned host memory ("host") or on
    the devices ("device"); training may change (or donate) `state` once this returns."""
    return pinned_host_copy(state) if staging == "host" else _device_copy(state)


class InBackground:
    """Work on one background thread, one piece at a time and in order: `start` first waits
    for the previous piece; what a piece raised is raised again by `join`, on the caller's
    thread."""

    def __init__(self, name: str):
        self.name = name
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    def start(self, work, *args) -> None:
        self.join()
        self._thread = threading.Thread(target=self._run, args=(work, *args), name=self.name, daemon=True)
        self._thread.start()

    def _run(self, work, *args) -> None:
        try:
            work(*args)
        except BaseException as error:  # noqa: BLE001 -- raised again on the caller's thread (join)
            self._error = error

    def join(self) -> None:
        """Waits for the piece in progress; raises what it raised."""
        self.finish()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def finish(self) -> None:
        """Waits for the piece in progress, raising nothing: for clean-up while another error
        is on its way (a piece cut short by that error still ends)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
