"""A local checkpoint step restored onto another process count or sharding: every saved process's
packed shards gathered to every process, and each array's pieces rebuilt from the saved slices.

The local tier (local_tier.py) restores a step saved by N_old processes onto a job of N_new
processes (an elastic job that lost one, or a run restarted on another mesh) when every old
owner's copy (process o's shards, `owner_<o>/`) is present at some process of the new job.
The processes agree through the tier's gathers on the step and on the process that serves each
old owner's copy (`to_all`: the copy's owner itself, else the next process that holds one);
then every served copy is sent to every other process through the tier's collective permutes
(exchange.py), and `rebuild` makes each array of the new abstract state, piece by piece in its
sharding (jax.make_array_from_callback), copying from each saved shard the part of the global
array it shares with the piece (packing.py's index records each shard's slice of the global
array): the values are the saved bytes, bit for bit. Another structure, shape or dtype (another
model), or saved shards that do not cover an array, is a LayoutMismatch: the persistent tier
restores instead.

Host memory: this first version gathers every old owner's packed buffer to every new process,
so each process holds, for a moment, the sum of all old processes' packed shards (the whole
state once per old process that held a replicated array; with the state sharded across the old
processes, about one whole state), beside the pieces it builds. Moving to each process only the
copies whose shards overlap its own pieces would cut that to its share.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from engine.checkpoint.local_files import Copy
from engine.checkpoint.packing import LayoutMismatch

Tile = tuple[Any, dict]  # (a saved copy's buffer, one shard of its index)


def to_all(holders: dict[int, int], count: int) -> list[tuple[int, int, int]]:
    """(source, destination, owner) moves that bring each old owner's copy, served by
    `holders[owner]`, to every process of a job of `count` processes that does not serve it."""
    return [
        (holder, destination, owner)
        for owner, holder in sorted(holders.items())
        for destination in range(count)
        if destination != holder
    ]


def describe(saved: int, count: int) -> str:
    """How a resharded restore reads on the console."""
    if saved == count:
        return f"saved by {saved} process(es) in another sharding, resharded onto this run's"
    return f"saved by {saved} process(es), resharded onto {count}"


def _bounds(index: tuple, shape: tuple) -> list[tuple[int, int]]:
    """A piece's index (slices of the global array) as [(start, stop), ...]."""
    return [part.indices(size)[:2] for part, size in zip(index, shape)]


def _tiles(copies: dict[int, Copy], abstract_state) -> tuple[list, Any, list[list[Tile]]]:
    """(target leaves, their tree, each leaf's distinct saved shards); LayoutMismatch when the
    saved copies hold another structure, shape or dtype than `abstract_state`."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
    paths = [jax.tree_util.keystr(path) for path, _ in flat]
    leaves = [leaf for _, leaf in flat]
    tiles: list[list[Tile]] = [[] for _ in flat]
    seen: list[set] = [set() for _ in flat]
    for owner in sorted(copies):
        layout = copies[owner].layout
        if layout["paths"] != paths:
            missing = sorted(set(paths) ^ set(layout["paths"]))[:3]
            raise LayoutMismatch(f"another train state structure (differs at {', '.join(missing) or 'its order'})")
        for number, (target, saved) in enumerate(zip(leaves, layout["shapes"])):
            if list(target.shape) != saved:
                raise LayoutMismatch(f"{paths[number]} was saved with shape {saved}, not {list(target.shape)}")
        for shard in layout["shards"]:
            number, key = shard["leaf"], tuple(map(tuple, shard["slices"]))
            if np.dtype(shard["dtype"]) != np.dtype(leaves[number].dtype):
                raise LayoutMismatch(f"{paths[number]} was saved as {shard['dtype']}, not {leaves[number].dtype}")
            if key not in seen[number]:  # (a replicated shard, saved by several processes: once)
                seen[number].add(key)
                tiles[number].append((copies[owner].buffer, shard))
    return leaves, treedef, tiles


def _piece(where: tuple, shape: tuple, dtype, tiles: list[Tile], path: str) -> np.ndarray:
    """The part `where` of the global array, copied from the saved shards that overlap it;
    LayoutMismatch when they do not cover it."""
    bounds = _bounds(where, shape)
    out = np.empty([stop - start for start, stop in bounds], dtype)
    covered = 0
    if not out.size:
        return out
    for buffer, shard in tiles:
        saved = shard["slices"]
        low = [max(a, c) for (a, _), (c, _) in zip(bounds, saved)]
        high = [min(b, d) for (_, b), (_, d) in zip(bounds, saved)]
        if any(lo >= hi for lo, hi in zip(low, high)):
            continue
        extent = [stop - start for start, stop in saved]
        count = int(np.prod(extent, dtype=np.int64))
        data = np.frombuffer(buffer, np.dtype(shard["dtype"]), count, shard["offset"]).reshape(extent)
        into = tuple(slice(lo - a, hi - a) for lo, hi, (a, _) in zip(low, high, bounds))
        out[into] = data[tuple(slice(lo - c, hi - c) for lo, hi, (c, _) in zip(low, high, saved))]
        covered += int(np.prod([hi - lo for lo, hi in zip(low, high)], dtype=np.int64))
    if covered != out.size:  # (the distinct shards of one sharding never overlap)
        raise LayoutMismatch(f"the saved shards of {path} cover {covered} of its {out.size} values there")
    return out


def rebuild(copies: dict[int, Copy], abstract_state):
    """The state saved as `copies` (every old owner's, by owner), in the shapes, dtypes and
    shardings of `abstract_state`, exactly; LayoutMismatch when it does not fit."""
    if not copies:
        raise LayoutMismatch("no saved copy to rebuild from")
    leaves, treedef, tiles = _tiles(copies, abstract_state)
    paths = copies[min(copies)].layout["paths"]
    arrays = []
    for target, saved, path in zip(leaves, tiles, paths):

        def piece(where, target=target, saved=saved, path=path):
            return _piece(where, tuple(target.shape), np.dtype(target.dtype), saved, path)

        arrays.append(jax.make_array_from_callback(tuple(target.shape), target.sharding, piece))
    return jax.tree_util.tree_unflatten(treedef, arrays)
