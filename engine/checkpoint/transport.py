"""Bytes between two processes off the training thread: the local tier's peer copies sent over
TCP from one process's background thread straight into its peer's memory.

The local tier (local_tier.py) exchanges each save's copies on its background thread, so the
save returns once the state is packed. The job's collectives cannot carry them there: a
collective on a second thread could interleave with the training step's collectives (gloo
and NCCL match them by order). So each process listens on a TCP port (found at its first
exchange, and published with a random token through the coordination service's key-value
store; the address is the one this host uses to reach the coordinator), a sender connects to
its peer and streams the header and the packed buffer, and the receiver reads them into one
array. Small notes ("this copy is written") go through the key-value store. Every wait ends
after `timeout` seconds (distributed.barrier_timeout) with an error naming the peer and the key.
The key-value store itself is not used for the buffers: it moved 32 MB in 17 s here.

A `Transport` is what the tier needs (`PeerSockets` in a job of several processes; tests
provide their own, e.g. one that holds an exchange back).
"""

from __future__ import annotations

import secrets
import socket
import struct
import threading
from functools import lru_cache
from typing import Protocol, Sequence

import numpy as np

_PREFIX = "engine/local_tier"
_HEAD = struct.Struct("<16sII")  # token, key length, part count
_LENGTH = struct.Struct("<Q")


class Transport(Protocol):
    def send(self, destination: int, key: str, parts: Sequence, timeout: float) -> None:
        """Sends `parts` (bytes-like) to process `destination` under `key`; returns once they arrived whole."""

    def receive(self, key: str, timeout: float) -> list[np.ndarray]:
        """The parts sent under `key` (each a uint8 array), once they have all arrived."""

    def confirm(self, key: str) -> None:
        """Tells the sender of `key` that its copy is in place."""

    def confirmed(self, key: str, timeout: float) -> None:
        """Waits until the receiver of `key` has confirmed it."""


def _client():
    from jax._src import distributed as jax_distributed  # the coordination-service client

    client = jax_distributed.global_state.client
    assert client is not None, "jax.distributed is initialised when there are several processes"
    return client, jax_distributed.global_state.coordinator_address or "127.0.0.1:0"


def _own_address(coordinator: str) -> str:
    """The address of this host on the route to the coordinator (no packet is sent)."""
    host = coordinator.rsplit(":", 1)[0].strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]


def _read_exactly(connection: socket.socket, size: int) -> np.ndarray:
    data = np.empty(size, np.uint8)
    view, got = data.data, 0  # (a memoryview of the array)
    while got < size:
        count = connection.recv_into(view[got:])
        if not count:
            raise ConnectionError(f"the connection closed after {got} of {size} bytes")
        got += count
    return data


class PeerSockets:
    """This process's end of the exchange: a listening socket and a thread that accepts copies."""

    def __init__(self, process: int):
        self.client, coordinator = _client()
        self.process = process
        self._arrived: dict[str, list[np.ndarray]] = {}
        self._lock = threading.Condition()
        self._addresses: dict[int, tuple[str, int]] = {}
        host = _own_address(coordinator)
        self._server = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        port = self._server.getsockname()[1]
        self.token = secrets.token_bytes(16)
        self.client.key_value_set(f"{_PREFIX}/peer/{process}", f"{host}|{port}|{self.token.hex()}", True)
        threading.Thread(target=self._accept, name="local-checkpoint-listener", daemon=True).start()

    def _accept(self) -> None:
        while True:
            connection, _ = self._server.accept()
            threading.Thread(
                target=self._take, args=(connection,), name="local-checkpoint-receiver", daemon=True
            ).start()

    def _take(self, connection: socket.socket) -> None:
        """One message: the token, the key, the parts (an unknown token is dropped unread)."""
        with connection:
            token, key_length, count = _HEAD.unpack(bytes(_read_exactly(connection, _HEAD.size)))
            if token != self.token:
                return
            key = bytes(_read_exactly(connection, key_length)).decode()
            parts = []
            for _ in range(count):
                (length,) = _LENGTH.unpack(bytes(_read_exactly(connection, _LENGTH.size)))
                parts.append(_read_exactly(connection, length))
            connection.sendall(b"\x01")  # (the sender knows its bytes arrived whole)
        with self._lock:
            self._arrived[key] = parts
            self._lock.notify_all()

    def _address(self, process: int, timeout: float) -> tuple[str, int, bytes]:
        host, port, token = self.client.blocking_key_value_get(f"{_PREFIX}/peer/{process}", int(timeout * 1000)).split(
            "|"
        )
        return host, int(port), bytes.fromhex(token)

    def send(self, destination: int, key: str, parts: Sequence, timeout: float) -> None:
        host, port, token = self._address(destination, timeout)
        with socket.create_connection((host, port), timeout=timeout) as connection:
            connection.sendall(_HEAD.pack(token, len(key.encode()), len(parts)) + key.encode())
            for part in parts:
                view = memoryview(part).cast("B")
                connection.sendall(_LENGTH.pack(len(view)))
                connection.sendall(view)
            if connection.recv(1) != b"\x01":
                raise ConnectionError(f"process {destination} did not take {key}")

    def receive(self, key: str, timeout: float) -> list[np.ndarray]:
        with self._lock:
            if not self._lock.wait_for(lambda: key in self._arrived, timeout):
                raise TimeoutError(f"{key} did not arrive within {timeout:.0f}s (distributed.barrier_timeout)")
            return self._arrived.pop(key)

    def confirm(self, key: str) -> None:
        self.client.key_value_set(f"{_PREFIX}/done/{key}", "1", True)

    def confirmed(self, key: str, timeout: float) -> None:
        try:
            self.client.blocking_key_value_get(f"{_PREFIX}/done/{key}", int(timeout * 1000))
        except Exception as e:  # jaxlib's own error type: said as one line, with the peer's key
            raise TimeoutError(
                f"{key} was not confirmed written within {timeout:.0f}s ({str(e).splitlines()[0][:200]})"
            ) from None
        self.client.key_value_delete(f"{_PREFIX}/done/{key}")


@lru_cache(maxsize=None)
def peer_sockets(process: int) -> PeerSockets:
    """This process's transport (one listener per process, whatever the number of tiers)."""
    return PeerSockets(process)
