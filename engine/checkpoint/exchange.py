"""Bytes between processes over the devices' own links: each process's buffer sent to a peer
process by one collective permute, and small integer tables gathered to every process.

The local checkpoint tier (local_tier.py) copies each process's shards to a peer process. It does
not assume a shared filesystem: the bytes travel as a uint8 array through the job's
collectives (gloo between CPU processes, NCCL on GPUs, ICI/DCN on TPUs), one device per
process, in chunks of at most CHUNK bytes so that a transfer needs little device memory,
and the receiving process writes them to its own storage. Every process calls these
functions at the same point of its program, in the same order (they are collectives).
"""

from __future__ import annotations

from functools import lru_cache

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

CHUNK = 64 * 2**20  # the most bytes one permute moves per process
_AXIS = "processes"


@lru_cache(maxsize=None)
def _process_mesh(count: int) -> Mesh:
    """A 1-D mesh of one device per process (each process's first device), in process order."""
    firsts: dict[int, jax.Device] = {}
    for device in jax.devices():
        firsts.setdefault(device.process_index, device)
    return Mesh(np.array([firsts[p] for p in range(count)]), (_AXIS,))


@lru_cache(maxsize=None)
def _permute(count: int, shift: int):
    """The compiled permute: process p's row goes to process (p + shift) mod count."""
    mesh = _process_mesh(count)
    spec = PartitionSpec(_AXIS)
    pairs = [(p, (p + shift) % count) for p in range(count)]
    moved = jax.shard_map(lambda x: jax.lax.ppermute(x, _AXIS, pairs), mesh=mesh, in_specs=spec, out_specs=spec)
    return jax.jit(moved), NamedSharding(mesh, spec)


def gather_rows(rows: np.ndarray) -> list[np.ndarray]:
    """Every process's int64 table [k, width] (k may differ between processes), on every process."""
    rows = np.asarray(rows, np.int64)
    if jax.process_count() == 1:
        return [rows]
    from jax.experimental import multihost_utils

    counts = np.asarray(multihost_utils.process_allgather(np.int64(len(rows)))).reshape(-1)
    padded = np.zeros((max(int(counts.max()), 1), rows.shape[1]), np.int64)
    padded[: len(rows)] = rows
    tables = np.asarray(multihost_utils.process_allgather(padded))
    return [tables[p, : int(counts[p])] for p in range(jax.process_count())]


def send(payload: bytes, shift: int) -> bytes:
    """Sends `payload` to process (this + shift) mod the process count and returns what process
    (this - shift) sent here (b"" when it sent nothing). Every process calls it with the same shift."""
    count = jax.process_count()
    if count == 1 or shift % count == 0:
        return payload
    sizes = gather_rows(np.array([[len(payload)]]))
    incoming = int(sizes[(jax.process_index() - shift) % count][0, 0])
    longest = max(int(size[0, 0]) for size in sizes)
    if longest == 0:
        return b""
    chunk = min(CHUNK, -(-longest // 4096) * 4096)  # one compiled shape per run, a small one for small states
    permute, sharding = _permute(count, shift % count)
    device = sharding.mesh.devices[jax.process_index()]
    source = np.frombuffer(payload, np.uint8)
    received = bytearray()
    for begin in range(0, longest, chunk):
        block = np.zeros(chunk, np.uint8)
        part = source[begin : begin + chunk]
        block[: len(part)] = part
        piece = jax.device_put(block.reshape(1, chunk), device)
        array = jax.make_array_from_single_device_arrays((count, chunk), sharding, [piece])
        moved = permute(array)
        received += np.asarray(moved.addressable_shards[0].data).tobytes()
    return bytes(received[:incoming])
