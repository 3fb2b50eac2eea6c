"""Bytes between processes over the devices' own links: buffers moved between chosen pairs of
processes by collective permutes, and small integer tables gathered to every process.

The local checkpoint tier (local_tier.py) moves copies of processes' shards between processes
when it restores (its saves send theirs from a background thread, transport.py, where a
collective must not run). It does not assume a shared filesystem: the bytes travel as a uint8
array through the job's collectives (gloo between CPU processes, NCCL on GPUs, ICI/DCN on
TPUs), one device per process, in chunks of at most CHUNK bytes so that a transfer needs
little device memory. Every process calls these
functions at the same point of its program, in the same order (they are collectives).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

CHUNK = 64 * 2**20  # the most bytes one permute moves per process
_AXIS = "processes"
Pairs = tuple[tuple[int, int], ...]  # (source process, destination process)


@lru_cache(maxsize=None)
def _process_mesh(count: int) -> Mesh:
    """A 1-D mesh of one device per process (each process's first device), in process order."""
    firsts: dict[int, jax.Device] = {}
    for device in jax.devices():
        firsts.setdefault(device.process_index, device)
    return Mesh(np.array([firsts[p] for p in range(count)]), (_AXIS,))


@lru_cache(maxsize=None)
def _permute(count: int, pairs: Pairs):
    """The compiled permute: each source's row goes to its destination (the others get zeros)."""
    mesh = _process_mesh(count)
    spec = PartitionSpec(_AXIS)
    moved = jax.shard_map(lambda x: jax.lax.ppermute(x, _AXIS, pairs), mesh=mesh, in_specs=spec, out_specs=spec)
    return jax.jit(moved), NamedSharding(mesh, spec)


def rounds(pairs) -> list[Pairs]:
    """`pairs` split, in order, into rounds in which each process sends at most once and receives
    at most once (what one permute can move)."""
    result: list[list[tuple[int, int]]] = []
    for source, destination in pairs:
        for batch in result:
            if all(source != s and destination != d for s, d in batch):
                batch.append((source, destination))
                break
        else:
            result.append([(source, destination)])
    return [tuple(batch) for batch in result]


def gather_rows(rows: np.ndarray) -> list[np.ndarray]:
    """Every process's int64 table [k, width] (k may differ between processes), on every process,
    exact (each number travels as two int32 halves: without jax_enable_x64 an int64 array would
    be cut to int32 on its way)."""
    rows = np.asarray(rows, np.int64)
    if jax.process_count() == 1:
        return [rows]
    from jax.experimental import multihost_utils

    counts = np.asarray(multihost_utils.process_allgather(np.int32(len(rows)))).reshape(-1)
    padded = np.zeros((max(int(counts.max()), 1), rows.shape[1]), np.int64)
    padded[: len(rows)] = rows
    halves = np.asarray(multihost_utils.process_allgather(padded.view(np.int32)), np.int32)
    tables = np.ascontiguousarray(halves).view(np.int64)
    return [tables[p, : int(counts[p])] for p in range(jax.process_count())]


def _as_bytes(payload) -> np.ndarray:
    return np.frombuffer(payload, np.uint8) if len(payload) else np.zeros(0, np.uint8)


def exchange(payload, pairs: Pairs) -> Optional[np.ndarray]:
    """Moves each source's `payload` (bytes-like; ignored on a process that is no source) to its
    destination, and returns what this process received as a uint8 array (None when it is no
    destination). `pairs` is one of `rounds`'; every process calls this with the same pairs.
    The received bytes are written straight into one array: no other copy of a payload is made
    beyond a chunk."""
    count, me = jax.process_count(), jax.process_index()
    source = _as_bytes(payload) if any(s == me for s, _ in pairs) else np.zeros(0, np.uint8)
    sender = next((s for s, d in pairs if d == me), None)
    if count == 1:
        return source.copy() if sender is not None else None
    sizes = [int(table[0, 0]) for table in gather_rows(np.array([[len(source)]]))]
    incoming = sizes[sender] if sender is not None else 0
    longest = max(sizes[s] for s, _ in pairs) if pairs else 0
    received = np.empty(incoming, np.uint8) if sender is not None else None
    if longest == 0:
        return received
    chunk = min(CHUNK, -(-longest // 4096) * 4096)  # one compiled shape per run, a small one for small states
    permute, sharding = _permute(count, tuple(pairs))
    device = sharding.mesh.devices[me]
    for begin in range(0, longest, chunk):
        block = source[begin : begin + chunk]
        if len(block) < chunk:  # the tail (or nothing): padded
            block = np.concatenate([block, np.zeros(chunk - len(block), np.uint8)])
        piece = jax.device_put(block.reshape(1, chunk), device)
        moved = permute(jax.make_array_from_single_device_arrays((count, chunk), sharding, [piece]))
        if received is not None and begin < incoming:
            end = min(begin + chunk, incoming)
            received[begin:end] = np.asarray(moved.addressable_shards[0].data).reshape(-1)[: end - begin]
    return received
