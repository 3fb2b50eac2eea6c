"""A process's part of a train state as bytes: its addressable shards packed into one buffer
with an index, and arrays rebuilt from it in the target shardings.

The local checkpoint tier (local_tier.py) saves what `pack` gives: each array's distinct shards
held by this process's devices (a replicated array once), their raw bytes one after another,
and an index naming each shard's array (its path in the state), global slice, dtype and place
in the buffer. `unpack` rebuilds the arrays from the same process's buffer, byte for byte; a
target whose structure, shapes or dtypes differ (another model) is a LayoutMismatch, and the
persistent tier restores instead; one whose shard slices differ (another mesh or process count)
is a ShardingMismatch, and local_reshard.py rebuilds the arrays from every process's shards.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np


class LayoutMismatch(Exception):
    """A packed state does not fit the target: another structure, shape, dtype or sharding."""


def refitted(target, paths: list[str], shapes: list) -> Any:
    """`target`, or, when it is a refit (a function of the saved arrays' shapes by path, "a/b/c" →
    shape), the abstract state it gives for those: a state read into another shape than the run's
    (DiLoCo's replicas on another count, engine/parallel/diloco_shrink.py)."""
    if not callable(target):
        return target
    return target({"/".join(re.findall(r"\w+", path)): tuple(shape) for path, shape in zip(paths, shapes)})


class ShardingMismatch(LayoutMismatch):
    """A packed state holds the target's arrays in another sharding (mesh or process count): the
    local tier reshards it (local_reshard.py)."""


def _slices(index: tuple, shape: tuple) -> list[list[int]]:
    """A shard's index (slices of the global array) as [[start, stop], ...]."""
    return [list(part.indices(size)[:2]) for part, size in zip(index, shape)]


def _key(slices: list[list[int]]) -> str:
    return ",".join(f"{start}:{stop}" for start, stop in slices)


def pack(state) -> tuple[np.ndarray, dict]:
    """(buffer, index) of this process's distinct shards of every array of `state`; the buffer is
    one uint8 array (the shards are copied into it one by one, each host copy dropped after)."""
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    picked: list[tuple[int, list[list[int]], Any]] = []
    for number, (_, leaf) in enumerate(leaves):
        if not isinstance(leaf, jax.Array):  # a host value: one whole shard
            picked.append((number, [[0, size] for size in np.shape(leaf)], np.asarray(leaf)))
            continue
        seen: set[str] = set()
        for shard in leaf.addressable_shards:
            slices = _slices(shard.index, leaf.shape)
            if _key(slices) not in seen:
                seen.add(_key(slices))
                picked.append((number, slices, shard.data))
    hosted = jax.device_get([data for _, _, data in picked])  # one transfer of them all
    buffer = np.empty(sum(np.asarray(data).nbytes for data in hosted), np.uint8)
    shards, offset = [], 0
    hosted.reverse()  # (popped in order from the end)
    for number, slices, _ in picked:
        data = np.ascontiguousarray(hosted.pop())
        buffer[offset : offset + data.nbytes] = data.reshape(-1).view(np.uint8)
        shards.append({"leaf": number, "slices": slices, "dtype": data.dtype.name, "offset": offset})
        offset += data.nbytes
    paths = [jax.tree_util.keystr(path) for path, _ in leaves]
    shapes = [list(np.shape(leaf)) for _, leaf in leaves]
    return buffer, {"paths": paths, "shapes": shapes, "shards": shards}


def packed_size(index: dict) -> int:
    """The bytes a buffer with this index holds (where its last shard ends)."""
    ends = [
        shard["offset"]
        + int(np.prod([stop - start for start, stop in shard["slices"]], dtype=np.int64))
        * np.dtype(shard["dtype"]).itemsize
        for shard in index["shards"]
    ]
    return max(ends, default=0)


def _table(index: dict, abstract_state) -> tuple[list, Any, list[dict[str, dict]]]:
    """(target leaves, their tree, each leaf's shards by key); LayoutMismatch if the structure differs."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
    paths = [jax.tree_util.keystr(path) for path, _ in flat]
    if paths != index["paths"]:
        missing = sorted(set(paths) ^ set(index["paths"]))[:3]
        raise LayoutMismatch(f"another train state structure (differs at {', '.join(missing) or 'its order'})")
    by_leaf: list[dict[str, dict]] = [{} for _ in flat]
    for shard in index["shards"]:
        by_leaf[shard["leaf"]][_key(shard["slices"])] = shard
    return [leaf for _, leaf in flat], treedef, by_leaf


def check_fits(index: dict, abstract_state) -> None:
    """LayoutMismatch unless every shard this process's devices need of `abstract_state` (shapes,
    dtypes, shardings) is in the packed `index`."""
    leaves, _, by_leaf = _table(index, abstract_state)
    for number, (target, saved, shards) in enumerate(zip(leaves, index["shapes"], by_leaf)):
        if list(target.shape) != saved:
            raise LayoutMismatch(f"{index['paths'][number]} was saved with shape {saved}, not {list(target.shape)}")
        for where in target.sharding.addressable_devices_indices_map(target.shape).values():
            shard = shards.get(_key(_slices(where, target.shape)))
            if shard is None:
                path = index["paths"][number]
                raise ShardingMismatch(f"{path} was saved in another sharding (mesh or process count)")
            if np.dtype(shard["dtype"]) != np.dtype(target.dtype):
                raise LayoutMismatch(f"{index['paths'][number]} was saved as {shard['dtype']}, not {target.dtype}")


def unpack(buffer, index: dict, abstract_state):
    """The state `pack` packed, in the shapes, dtypes and shardings of `abstract_state` (check_fits first)."""
    leaves, treedef, by_leaf = _table(index, abstract_state)
    arrays = []
    for target, shards in zip(leaves, by_leaf):

        def piece(where, target=target, shards=shards):
            slices = _slices(where, target.shape)
            shard = shards[_key(slices)]
            shape = [stop - start for start, stop in slices]
            count = int(np.prod(shape, dtype=np.int64))
            data = np.frombuffer(buffer, np.dtype(shard["dtype"]), count, shard["offset"])
            return data.reshape(shape)

        arrays.append(jax.make_array_from_callback(tuple(target.shape), target.sharding, piece))
    return jax.tree_util.tree_unflatten(treedef, arrays)
