"""The packed train metrics' layout (MetricColumns), the one place that knows which column of a
step's row holds what: packing a step's metrics on the device, and every reading of the rows
on the host (a step's loss, a log line's record, a group's trial, replicas combined)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

# What a train step reports, in the order of the packed metrics array (engine/run/step.py's
# make_block_step); a mixture's per-source counted tokens (`source_tokens`) follow them.
TRAIN_METRICS = ("loss_sum", "correct", "count", "grad_norm", "learning_rate", "aux_loss", "routed", "dropped")
# how a column combines over copies that each took part of a step (DiLoCo's replicas): sums add,
# these do not (the learning rate is equal in all)
_ROOT_MEAN_SQUARE, _MEAN = TRAIN_METRICS.index("grad_norm"), TRAIN_METRICS.index("learning_rate")
EVAL_LIKE = ("loss_sum", "correct", "count")  # the sums an evaluation adds up too


def pack_metrics(metrics: dict, sums: tuple[str, ...] = ()) -> Any:
    """A step's metrics (device arrays) → one float32 array [..., columns]: TRAIN_METRICS, the
    objective's `sums` (engine/config/objective.py: its record's), then `source_tokens` (a mixture's). A
    leading axis on every metric (replicas) stays leading."""
    names = TRAIN_METRICS + tuple(sums)
    packed = jnp.stack([jnp.asarray(metrics[name], jnp.float32) for name in names], axis=-1)
    if "source_tokens" in metrics:
        packed = jnp.concatenate([packed, metrics["source_tokens"].astype(jnp.float32)], axis=-1)
    return packed


def unpack_metrics(packed, sums: tuple[str, ...] = ()) -> list[dict]:
    """Packed metrics on the host ([steps, columns]) → one dict per step (`sums`: the objective's columns)."""
    names = TRAIN_METRICS + tuple(sums)
    steps = []
    for row in packed:
        metrics: dict[str, Any] = dict(zip(names, map(float, row)))
        if len(row) > len(names):
            metrics["source_tokens"] = [float(v) for v in row[len(names) :]]
        steps.append(metrics)
    return steps


def combine_copies(packed):
    """[steps, copies, columns] → [steps, columns] (on the device): sums added over the copies,
    the gradient norm as their root mean square, the learning rate as their mean."""
    total = jnp.sum(packed, axis=1)
    rms = jnp.sqrt(jnp.mean(jnp.square(packed[:, :, _ROOT_MEAN_SQUARE]), axis=1))
    mean = jnp.mean(packed[:, :, _MEAN], axis=1)
    return total.at[:, _ROOT_MEAN_SQUARE].set(rms).at[:, _MEAN].set(mean)


@dataclass(frozen=True)
class MetricColumns:
    """A run's packed metrics: TRAIN_METRICS's columns, the objective's `sums`, then one per data
    source (a mixture's). `named`: the objective's record of the summed metrics (its names in place
    of loss and accuracy: DPO's TRL names; None: loss and accuracy), engine/config/objective.py."""

    sources: tuple[str, ...] = ()
    sums: tuple[str, ...] = ()
    named: Optional[Callable[[dict], dict]] = None

    @property
    def leading(self) -> int:
        """The columns before the sources'."""
        return len(TRAIN_METRICS) + len(self.sums)

    @property
    def width(self) -> int:
        return self.leading + len(self.sources)

    def fits(self, rows: list) -> bool:
        """Rows of this layout (a checkpoint's carried window of a run with other sources does not)."""
        return all(len(row) == self.width for row in rows)

    @staticmethod
    def trial(host: np.ndarray, index: int) -> np.ndarray:
        """A group's rows ([steps, trials, columns]) → trial `index`'s [steps, columns]."""
        return host[:, index]

    @staticmethod
    def stack_trials(rows: list[np.ndarray]) -> np.ndarray:
        """Each trial's [steps, columns] → a group's [steps, trials, columns]."""
        return np.stack(rows, axis=1)

    @staticmethod
    def losses(host: np.ndarray, first: int) -> dict[int, float]:
        """step → train loss of each step of a window starting after step `first`."""
        sums, counts = host[:, TRAIN_METRICS.index("loss_sum")], host[:, TRAIN_METRICS.index("count")]
        return {first + offset + 1: float(s / max(c, 1.0)) for offset, (s, c) in enumerate(zip(sums, counts))}

    def record(self, host: np.ndarray) -> dict:
        """A window's metrics as a train record: mean loss and accuracy, grad norm, learning
        rate, a mixture of experts' routing, each source's share of the trained tokens."""
        steps = unpack_metrics(host, self.sums)
        count = sum(m["count"] for m in steps)
        record = {
            "loss": sum(m["loss_sum"] for m in steps) / count,
            "accuracy": sum(m["correct"] for m in steps) / count,
            "grad_norm": sum(m["grad_norm"] for m in steps) / len(steps),
            "learning_rate": steps[-1]["learning_rate"],
        }
        if self.named is not None:  # the objective's names (DPO's: TRL's; its rewards/accuracies is the accuracy)
            del record["accuracy"]
            record.update(self.named({name: sum(m[name] for m in steps) for name in (*EVAL_LIKE, *self.sums)}))
        routed = sum(m["routed"] for m in steps)
        if routed:  # a mixture of experts: its load-balancing loss, and assignments over capacity
            dropped = sum(m["dropped"] for m in steps)
            record.update(
                moe_aux_loss=sum(m["aux_loss"] for m in steps) / count,
                moe_dropped_tokens=dropped,
                moe_dropped_fraction=dropped / routed,
            )
        if self.sources and host.shape[-1] > self.leading:
            per_source = host[:, self.leading :].sum(axis=0)
            record.update(
                {
                    f"share_{name}": float(tokens) / max(float(per_source.sum()), 1.0)
                    for name, tokens in zip(self.sources, per_source)
                }
            )
        return record


def fetch_rows(arrays: list) -> np.ndarray:
    """Packed metrics of several calls, still on the devices → one host array [steps, ...]."""
    return np.concatenate(jax.device_get(arrays))
