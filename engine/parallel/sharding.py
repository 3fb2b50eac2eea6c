"""Logical axis names on parameters → PartitionSpecs on the mesh, by the config's rules.

Each parameter's dimensions carry logical names (`embed`, `mlp`, `heads`, …) from the model.
For each dimension the rules list mesh axes to try in order; the first that is not yet used
by the parameter, has more than one device, and divides the dimension wins. A dimension
that no rule can shard is replicated, except that a tensor-parallel axis named by the
rules must divide: silently replicating it would change the memory plan the user asked for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from engine.errors import UsageError
from engine.parallel.axes import (
    ACTIVATION_AXES,
    BATCH_AXES,
    LENIENT_LOGICAL,
    STRICT_AXES,
    VMAPPED_AXES,
    expert_batch_axes,
)


@dataclass(frozen=True)
class ParamLayout:
    path: str  # e.g. params/hidden_0/kernel
    shape: tuple[int, ...]
    dtype: Any
    logical: tuple[Optional[str], ...]  # logical axis names, or () when the leaf has none
    spec: PartitionSpec

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def path_name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def resolve_spec(
    name: str, shape: tuple[int, ...], logical: tuple[Optional[str], ...], rules: dict[str, list[str]], mesh: Mesh
) -> PartitionSpec:
    """The PartitionSpec of one parameter under the rules (see the module docstring)."""
    used: set[str] = set()
    spec = []
    for dim, axis_name in zip(shape, logical):
        chosen = None
        for mesh_axis in rules.get(axis_name, []) if axis_name else []:
            size = mesh.shape[mesh_axis]
            if mesh_axis in used or size == 1:
                continue
            if dim % size:
                if mesh_axis in STRICT_AXES and axis_name not in LENIENT_LOGICAL:
                    raise UsageError(
                        f"parameter {name} {tuple(shape)}: its '{axis_name}' dimension of {dim} is not divisible by "
                        f"mesh.{mesh_axis}={size}; choose a mesh.{mesh_axis} that divides {dim}, "
                        "or change the model size"
                    )
                continue
            chosen = mesh_axis
            break
        if chosen:
            used.add(chosen)
        spec.append(chosen)
    return PartitionSpec(*spec)


def unbox(tree):
    """Strips flax's logical-partitioning boxes, leaving plain arrays."""
    return nn.meta.unbox(tree)


def _is_box(x) -> bool:
    return isinstance(x, nn.meta.AxisMetadata)


def layouts(abstract_boxed, rules: dict[str, list[str]], mesh: Mesh) -> list[ParamLayout]:
    """One ParamLayout per leaf of a boxed abstract tree (ShapeDtypeStructs in flax boxes)."""
    found = []

    def visit(path, leaf):
        logical = tuple(leaf.names) if _is_box(leaf) else ()
        value = leaf.value if _is_box(leaf) else leaf
        name = path_name(path)
        spec = resolve_spec(name, tuple(value.shape), logical, rules, mesh) if logical else PartitionSpec()
        found.append(ParamLayout(name, tuple(value.shape), value.dtype, logical, spec))

    jax.tree_util.tree_map_with_path(visit, abstract_boxed, is_leaf=_is_box)
    return found


def tree_shardings(abstract_boxed, param_layouts: list[ParamLayout], mesh: Mesh):
    """NamedShardings for the unboxed version of `abstract_boxed`, from its layouts (same order)."""
    specs = iter(layout.spec for layout in param_layouts)
    return jax.tree.map(lambda _: NamedSharding(mesh, next(specs)), abstract_boxed, is_leaf=_is_box)


def activation_spec(
    shape: tuple[int, ...], logical: tuple[Optional[str], ...], mesh: Mesh, exclude: tuple[str, ...] = ()
) -> PartitionSpec:
    """Activations: "batch" over the batch axes, each logical axis an axis declares
    (engine/parallel/axes.py: heads, mlp and vocab over tensor, the sequence over context, experts over
    expert) over it, the rest whole. "expert_batch": the batch axes a mixture-of-experts
    layer keeps its tokens over once they reach their experts. `exclude`: mesh axes the step is
    vmapped over (spmd_axis_name), which the layers inside must not name."""
    spec: list = []
    for dim, name in zip(shape, logical):
        if name in ("batch", "expert_batch"):
            axes = tuple(
                a
                for a in (BATCH_AXES if name == "batch" else expert_batch_axes())
                if mesh.shape[a] > 1 and a not in exclude
            )
            size = int(np.prod([mesh.shape[a] for a in axes]))
            spec.append(axes if axes and dim % size == 0 else None)
        elif (
            name in ACTIVATION_AXES
            and mesh.shape[ACTIVATION_AXES[name]] > 1
            and dim % mesh.shape[ACTIVATION_AXES[name]] == 0
        ):
            spec.append(ACTIVATION_AXES[name])
        else:
            spec.append(None)
    return PartitionSpec(*spec)


class ActivationLayout:
    """(activation, logical axes) → the activation pinned to its layout on `mesh`; the engine
    builds the modules of the steps it compiles with one (models.family.BuildOptions.layout)."""

    def __init__(self, mesh: Mesh, exclude: tuple[str, ...] = ()):
        self.mesh, self.exclude = mesh, exclude
        self.splits = {logical: mesh.shape[axis] for logical, axis in ACTIVATION_AXES.items()}
        # "batch": the batch axes the step is not vmapped over (activation_spec splits it over them)
        self.splits["batch"] = math.prod(mesh.shape[a] for a in BATCH_AXES if a not in exclude)
        self.vmapped = tuple(a for a in VMAPPED_AXES if mesh.shape.get(a, 1) > 1)

    def spec(self, shape, logical) -> PartitionSpec:
        return activation_spec(shape, logical, self.mesh, self.exclude)

    def __call__(self, x, logical):
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, self.spec(x.shape, logical)))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) dimension split over the batch axes; the rest replicated."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_shards(mesh: Mesh) -> int:
    return int(np.prod([mesh.shape[axis] for axis in BATCH_AXES]))


def per_device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded arrays or ShapeDtypeStructs (the largest shard)."""
    return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))
