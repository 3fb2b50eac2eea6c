"""The mesh axes, one declaration each: what the axis splits, the checks it needs, and the model
capability it requires. Everything else (the `mesh.*` config keys, the default sharding rules,
activation layouts, batch splitting, setup checks, `--dry-run` and `plan`) reads this table.

This module imports no jax: a sweep's process reads configs with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from engine.errors import UsageError


@dataclass(frozen=True)
class AxisContext:
    """What an axis check sees: the config, the axis sizes, the data's shapes, the model family."""

    cfg: Any  # engine.config.Config
    sizes: dict[str, int]  # mesh axis → devices
    info: Any  # engine.data.DataInfo
    family: Any  # models.family.ModelFamily

    @property
    def model(self):
        return self.cfg.model


@dataclass(frozen=True)
class MeshAxis:
    name: str
    doc: str  # the mesh.<name> key's meaning (derived axes: what makes them)
    configured: bool = True  # a mesh.<name> (and mesh.dcn_<name>) key sets its size; else the engine derives it
    default: int = 1
    batch: bool = False  # the batch dimension is split over it (outside the layers that split it otherwise)
    # logical parameter axes it may shard, tried in the order of `priority` across axes (lower first)
    params: tuple[str, ...] = ()
    priority: int = 0
    strict: bool = False  # must divide every dimension the rules ask it to shard (else an error)
    activations: tuple[str, ...] = ()  # logical activation axes split over it (models' constrain())
    needs: str = ""  # the model capability it requires, in words ("" = none)
    # the engine vmaps the step over it (spmd_axis_name): the layers inside never name it
    vmapped: bool = False
    supported: Callable[[AxisContext], bool] = field(default=lambda ctx: True)
    check: Callable[[AxisContext, int], None] = field(default=lambda ctx, size: None)


def _check_context(ctx: AxisContext, size: int) -> None:
    if ctx.info.seq_len % size:
        raise UsageError(
            f"data.seq_len={ctx.info.seq_len} is not divisible by mesh.context={size}; choose a "
            f"sequence length that is a multiple of {size}, or another mesh.context"
        )


def _check_pipeline(ctx: AxisContext, size: int) -> None:
    from engine.parallel.stages import check_pipeline  # (jax: only a run being built checks its axes)

    check_pipeline(ctx, size)


def _experts(ctx: AxisContext) -> int:
    """Routed experts per layer of the model (0: none; models/family.py Experts)."""
    return ctx.family.experts.count(ctx.model) if ctx.family.experts else 0


def _check_expert(ctx: AxisContext, size: int) -> None:
    experts = _experts(ctx)
    if experts % size:
        raise UsageError(
            f"model.num_experts={experts} is not divisible by mesh.expert={size}; choose a mesh.expert "
            f"that divides {experts}"
        )


AXES: tuple[MeshAxis, ...] = (  # outer to inner: the innermost axes get the closest devices
    MeshAxis("trial", "vectorised runs side by side (a sweep's `vectorize:`)", configured=False, vmapped=True),
    MeshAxis(
        "replica",
        "DiLoCo's replicas (train.sync=diloco): taken from mesh.data or mesh.dcn_data (diloco.replica_axis); "
        "each trains on its share of the batch alone between exchanges",
        configured=False,
        batch=True,
        vmapped=True,
    ),
    MeshAxis(
        "pipeline",
        "pipeline stages: the layer stack split into consecutive groups of layers, micro-batches flowing "
        "through them (pipeline.schedule, train.microbatches)",
        params=("layers",),
        activations=("stage",),
        needs="a layer stack (llama with model.scan_layers=true)",
        supported=lambda ctx: bool(ctx.family.layer_stack and ctx.family.layer_stack.layers(ctx.model)),
        check=lambda ctx, size: _check_pipeline(ctx, size),
    ),
    MeshAxis("data", "data-parallel replicas (-1 = all remaining devices)", default=-1, batch=True),
    MeshAxis(
        "fsdp",
        "devices parameters and optimizer state are sharded over (ZeRO-3); the batch splits too",
        batch=True,
        params=("embed", "mlp", "heads", "vocab", "conv_in"),
        priority=2,
    ),
    MeshAxis(
        "expert",
        "a mixture of experts' experts split over these devices (tokens reach them by "
        "all-to-all); the batch splits over it too",
        batch=True,
        params=("expert",),
        priority=1,
        activations=("expert",),
        needs="a mixture of experts (model.num_experts > 0)",
        supported=lambda ctx: _experts(ctx) > 0,
        check=_check_expert,
    ),
    MeshAxis(
        "context",
        "each sequence split over these devices (attention gathers keys and values)",
        activations=("seq",),
        needs="a model that splits its sequence (llama)",
        supported=lambda ctx: bool(ctx.family.language_model and ctx.family.language_model.splits_sequence),
        check=_check_context,
    ),
    MeshAxis(
        "tensor",
        "tensor-parallel (Megatron) devices",
        params=("mlp", "heads", "kv_heads", "vocab", "conv_out"),
        priority=0,
        strict=True,
        activations=("heads", "kv_heads", "mlp", "vocab"),
    ),
)
BY_NAME = {axis.name: axis for axis in AXES}
MESH_AXES = tuple(axis.name for axis in AXES)  # every mesh has every axis (size 1 where unused)
CONFIG_AXES = tuple(axis.name for axis in AXES if axis.configured)
BATCH_AXES = tuple(axis.name for axis in AXES if axis.batch)
ACTIVATION_AXES = {logical: axis.name for axis in AXES for logical in axis.activations}
VMAPPED_AXES = tuple(axis.name for axis in AXES if axis.vmapped)
STRICT_AXES = tuple(axis.name for axis in AXES if axis.strict)
# grouped-query K/V heads fewer than the tensor devices are replicated (as Megatron does), not refused
LENIENT_LOGICAL = ("kv_heads",)
# logical parameter axes no axis shards by default (users may add rules for them)
UNSHARDED_LOGICAL = ("kv", "classes", "lora")  # lora: an adapter's rank (models/projection.py)


def default_rules() -> dict[str, list[str]]:
    """mesh.rules' default: each logical parameter axis → the mesh axes that may shard it, in order."""
    rules: dict[str, list[str]] = {}
    for axis in sorted((a for a in AXES if a.params), key=lambda a: a.priority):
        for logical in axis.params:
            rules.setdefault(logical, []).append(axis.name)
    for logical in UNSHARDED_LOGICAL:
        rules.setdefault(logical, [])
    return rules


def check_axes(ctx: AxisContext) -> None:
    """Each axis larger than 1: the model has what it needs, and the axis's own checks pass."""
    for axis in AXES:
        size = ctx.sizes.get(axis.name, 1)
        if size == 1:
            continue
        if not axis.supported(ctx):
            raise UsageError(
                f"mesh.{axis.name}={size} needs {axis.needs}, which model.name={ctx.cfg.model.name} "
                f"with these settings does not have; set mesh.{axis.name}=1"
            )
        axis.check(ctx, size)


def expert_batch_axes() -> tuple[str, ...]:
    """The batch axes a mixture-of-experts layer keeps its tokens over once they reach their experts."""
    return tuple(a for a in BATCH_AXES if "expert" not in BY_NAME[a].activations)


def describe(sizes: dict[str, int], dcn: Optional[dict[str, int]] = None) -> str:
    """'data=2 x fsdp=4 (dcn 2)': the axes larger than 1, and how much of each crosses slices."""
    dcn = dcn or {}
    parts = [
        f"{name}={size}" + (f" (dcn {dcn[name]})" if dcn.get(name, 1) > 1 else "")
        for name, size in sizes.items()
        if size > 1
    ]
    return " x ".join(parts) or "one device"
