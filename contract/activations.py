"""Activation layout hints and the pipeline plan: models name the logical axes of an activation;
while the engine traces a step it installs a function that pins them to its mesh. Models stay
mesh-free. A layer stack's pipeline (StagePlan) reaches the model as a build option."""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Protocol


class Constrainer(Protocol):
    """(activation, logical axes) → the activation pinned to its layout; `splits` says how many
    devices each logical activation axis is split over ("seq": the context axis). For code that
    runs per device (jax.shard_map): `mesh`, `spec(shape, logical)` the PartitionSpec an
    activation gets, and `vmapped` the mesh axes (size > 1) the step is vmapped over, under
    which such code cannot run."""

    splits: dict[str, int]
    mesh: Any
    vmapped: tuple[str, ...]

    def __call__(self, x, logical: tuple[Optional[str], ...]): ...

    def spec(self, shape: tuple[int, ...], logical: tuple[Optional[str], ...]) -> Any: ...


@dataclass(frozen=True)
class StagePlan:
    """How a layer stack runs as a pipeline (the engine's `pipeline` axis): `stages` groups of
    devices, each holding `repeats` groups of layers (circular schedule when > 1), fed
    `microbatches` pieces of the batch. Layers are stored stage-major when repeats > 1:
    stage s's groups are consecutive (see models/pipeline.py)."""

    stages: int = 1
    repeats: int = 1
    microbatches: int = 1


ONE_STAGE = StagePlan()  # no pipeline
_constrainer: contextvars.ContextVar[Optional[Constrainer]] = contextvars.ContextVar("constrainer", default=None)


@contextlib.contextmanager
def constrained_activations(apply: Constrainer) -> Iterator[None]:
    """While tracing inside this, `constrain(x, axes)` calls `apply(x, axes)`."""
    token = _constrainer.set(apply)
    try:
        yield
    finally:
        _constrainer.reset(token)


def constrain(x, axes: tuple[Optional[str], ...]):
    """Asks that activation `x` be laid out by its logical axes, e.g. ("batch", "seq", "embed")."""
    apply = _constrainer.get()
    return x if apply is None else apply(x, axes)


def current_layout() -> Optional[Constrainer]:
    """The layout of the step being traced; None outside one (eager calls, generation)."""
    return _constrainer.get()


def activation_splits(logical: str) -> int:
    """Devices the step being traced splits this logical activation axis over; 1 outside one."""
    apply = _constrainer.get()
    return apply.splits.get(logical, 1) if apply is not None else 1
