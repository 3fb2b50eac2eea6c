"""Activation layout hints and the pipeline plan: models name the logical axes of an activation,
and the layout the engine builds a traced step's module with (a build option) pins them to its
mesh. Models stay mesh-free. A layer stack's pipeline (StagePlan) is a build option too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol


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


def constrain(layout: Optional[Constrainer], x, axes: tuple[Optional[str], ...]):
    """Activation `x` laid out by its logical axes, e.g. ("batch", "seq", "embed"), as `layout`
    (the module's build option) pins them; unchanged without one (eager calls, generation)."""
    return x if layout is None else layout(x, axes)


def activation_splits(layout: Optional[Constrainer], logical: str) -> int:
    """Devices `layout` splits this logical activation axis over; 1 without one."""
    return layout.splits.get(logical, 1) if layout is not None else 1
