"""Deterministic, resumable batching and background prefetch to device.

The global batch for step s is a function of (seed, s) alone: epoch e = s // steps_per_epoch
is a permutation drawn from (seed, e), and the step takes its slice. So the iterator's whole
state is the next step number, and a resumed run sees exactly the batches it would have.
Each process gathers only the rows of the global batch that its own devices hold (so it
reads only its share); which rows those are follows from the batch sharding (see `process_rows`).
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Iterator

import numpy as np

from engine.errors import UsageError


def process_rows(sharding, global_batch: int, per_row: int = 1) -> np.ndarray:
    """Positions in the global batch that this process's devices hold, in order.

    `sharding` shards dimension 0; with per_row > 1 (pmap's [devices, rows per device]
    layout) each index along dimension 0 stands for per_row consecutive rows.
    """
    size = global_batch // per_row
    index_map = sharding.addressable_devices_indices_map((size,))
    blocks = sorted({idx[0].indices(size) for idx in index_map.values()})
    return np.concatenate([np.arange(start * per_row, stop * per_row) for start, stop, _ in blocks])


def example_spec(split) -> dict[str, np.ndarray]:
    """A split's fields: name → an array whose shape[1:] and dtype are one example's (the
    arrays themselves, or zero-length stand-ins for a split read by index)."""
    return split if isinstance(split, dict) else split.spec


class TrainBatches:
    """Host batches of one process's rows of the global batch, by step.

    `arrays` is a dict of in-memory arrays (shuffled here: epoch e's order is a permutation
    drawn from (seed, e)) or a split read by index with its own order (tokens.Mixture:
    Grain's shuffle and mix, seeded with `seed`): then example step·batch + r is row r of
    the batch at `step`."""

    def __init__(
        self,
        arrays,
        global_batch: int,
        seed: int,
        shuffle: bool = True,
        rows: np.ndarray | None = None,
        indices_only: bool = False,
    ):
        """indices_only: batches are {"index": int32 [rows]}, the example indices of this
        process's rows (the data itself is on the devices: data.placement=device)."""
        self.indices_only = indices_only
        self.arrays = arrays if isinstance(arrays, dict) else None
        self.examples: Any = None if self.arrays is not None else arrays.examples(seed, shuffle)
        self.num_examples = len(next(iter(arrays.values()))) if self.arrays is not None else len(arrays)
        if global_batch > self.num_examples:
            raise UsageError(
                f"train.global_batch_size={global_batch} is larger than the training split "
                f"({self.num_examples} examples); use at most {self.num_examples}"
            )
        self.global_batch = global_batch
        self.steps_per_epoch = self.num_examples // global_batch  # the remainder is dropped
        self.seed, self.shuffle = seed, shuffle
        self.rows = np.arange(global_batch) if rows is None else rows
        self._order_epoch, self._order = -1, np.zeros(0, np.int64)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)
            else:
                self._order = np.arange(self.num_examples)
            self._order_epoch = epoch
        return self._order

    def indices(self, step: int) -> np.ndarray:
        """Example indices of the whole global batch at `step`."""
        if self.examples is not None:
            return step * self.global_batch + np.arange(self.global_batch)
        epoch, within = divmod(step, self.steps_per_epoch)
        start = within * self.global_batch
        return self._epoch_order(epoch)[start : start + self.global_batch]

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        rows = self.indices(step)[self.rows]
        if self.indices_only:
            return {"index": rows.astype(np.int32)}
        if self.arrays is None:
            return self.examples.take(rows)
        return {name: np.asarray(array[rows]) for name, array in self.arrays.items()}

    def block(self, index: int, steps: int) -> dict[str, np.ndarray]:
        """The batches of steps [index * steps, (index + 1) * steps), stacked: [steps, rows, ...]."""
        batches = [self(index * steps + i) for i in range(steps)]
        return {name: np.stack([batch[name] for batch in batches]) for name in batches[0]}


def eval_batches(
    arrays, batch_size: int, max_batches: int = 0, rows: np.ndarray | None = None
) -> Iterator[dict[str, np.ndarray]]:
    """The eval split in order, the last batch padded; `mask` is 1 for real examples.

    `arrays`: a dict of arrays, or a split read by index (`take`). `rows` are the positions
    within each batch that this process loads (default all)."""
    num = len(next(iter(arrays.values()))) if isinstance(arrays, dict) else len(arrays)
    count = -(-num // batch_size)
    if max_batches:
        count = min(count, max_batches)
    rows = np.arange(batch_size) if rows is None else rows
    for b in range(count):
        idx = b * batch_size + rows
        if isinstance(arrays, dict):
            batch = {name: np.asarray(array[np.minimum(idx, num - 1)]) for name, array in arrays.items()}
        else:
            batch = arrays.take(np.minimum(idx, num - 1))
        batch["mask"] = (idx < num).astype(np.float32)
        yield batch


class Prefetcher:
    """Runs `make(step)` for steps start, start+1, … in a background thread, `depth` ahead.

    `make` builds the host batch and puts it on device, so both overlap the running step.
    `wait_seconds` adds up the time the training loop spent waiting for a batch.
    """

    _DONE = object()

    def __init__(self, make: Callable[[int], object], start_step: int, depth: int):
        self.make, self.next_step, self.depth = make, start_step, depth
        self.wait_seconds = 0.0
        if depth > 0:
            self._queue: queue.Queue = queue.Queue(maxsize=depth)
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._fill, args=(start_step,), daemon=True, name="prefetch")
            self._thread.start()

    def _fill(self, step: int) -> None:
        while not self._stop.is_set():
            try:
                item: tuple = (step, self.make(step), None)
            except Exception as e:  # handed to the training thread, which re-raises it
                item = (step, None, e)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[2] is not None:
                return
            step += 1

    def __next__(self):
        start = time.perf_counter()
        if self.depth == 0:
            batch = self.make(self.next_step)
        else:
            step, batch, error = self._queue.get()
            if error is not None:
                raise error
            assert step == self.next_step, (step, self.next_step)
        self.wait_seconds += time.perf_counter() - start
        self.next_step += 1
        return batch

    def __iter__(self):
        return self

    def close(self) -> None:
        if self.depth > 0:
            self._stop.set()
            self._thread.join()  # ends within the batch it is making: none outlives the run
