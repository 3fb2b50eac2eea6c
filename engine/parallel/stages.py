"""The `pipeline` mesh axis: a model's layer stack split into stages over it (the model runs
it: models/pipeline.py). Here: the checks the axis needs, the StagePlan a run traces its step
with, the stage-major storage of a circular schedule's layers (checkpoints keep the layers'
own order, so they restore under any pipeline layout), and the description --dry-run and
`plan` print."""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from contract.activations import ONE_STAGE, StagePlan
from engine.errors import UsageError
from models.family import num_experts, stacked_layers


def stage_plan(cfg, stages: int) -> StagePlan:
    """The pipeline a run with `stages` stages on its mesh traces its layer stack as."""
    if stages == 1:
        return ONE_STAGE
    repeats = cfg.pipeline.repeats if cfg.pipeline.schedule == "circular" else 1
    return StagePlan(stages, repeats, cfg.train.microbatches or stages)


def check_pipeline(ctx, stages: int) -> None:
    """The layers divide into stages x repeats, enough micro-batches of a whole number of rows,
    and the combinations the pipeline supports (data, fsdp and tensor parallel beside it)."""
    cfg, family = ctx.cfg, ctx.family
    plan = stage_plan(cfg, stages)
    layers = stacked_layers(family, cfg.model)
    if layers % (stages * plan.repeats):
        raise UsageError(
            f"the model's {layers} layers do not divide into mesh.pipeline={stages} stages x "
            f"pipeline.repeats={plan.repeats}; choose stages x repeats that divide {layers}"
        )
    if plan.microbatches < stages:
        raise UsageError(
            f"train.microbatches={plan.microbatches} is fewer than mesh.pipeline={stages} stages; "
            f"use at least {stages} (stages idle otherwise)"
        )
    for axis in ("context", "expert"):
        if ctx.sizes.get(axis, 1) > 1:
            raise UsageError(
                f"mesh.pipeline={stages} with mesh.{axis}={ctx.sizes[axis]} is not supported; the "
                f"pipeline composes with mesh.data, mesh.fsdp and mesh.tensor: set mesh.{axis}=1"
            )
    if num_experts(family, cfg.model):
        raise UsageError(
            f"mesh.pipeline={stages} with model.num_experts={num_experts(family, cfg.model)} is not "
            "supported (the experts' routing statistics do not cross stages); set mesh.pipeline=1"
        )
    shards = int(np.prod([ctx.sizes.get(a, 1) for a in ("data", "fsdp", "expert")]))
    micro = cfg.train.global_batch_size // cfg.train.grad_accum_steps
    for key, rows in (
        ("train.global_batch_size / train.grad_accum_steps", micro),
        ("eval.batch_size", cfg.eval.batch_size or cfg.train.global_batch_size),
    ):
        if rows % (plan.microbatches * shards):
            raise UsageError(
                f"{key} = {rows} does not split into train.microbatches={plan.microbatches} "
                f"micro-batches of a multiple of the {shards} batch shards; use a multiple of "
                f"{plan.microbatches * shards}"
            )


def bubble(plan: StagePlan) -> float:
    """The share of stage-iterations idle while the pipeline fills and drains."""
    return (plan.stages - 1) / (plan.repeats * plan.microbatches + plan.stages - 1)


def describe(plan: StagePlan, layers: int) -> str:
    """Which layers each stage holds, and the schedule's bubble."""
    per = layers // (plan.stages * plan.repeats)
    held = []
    for stage in range(plan.stages):
        groups = [
            range(r * plan.stages * per + stage * per, r * plan.stages * per + (stage + 1) * per)
            for r in range(plan.repeats)
        ]
        held.append(f"stage {stage}: layers " + ", ".join(f"{g.start}-{g.stop - 1}" for g in groups))
    schedule = f"circular, {plan.repeats} repeats" if plan.repeats > 1 else "GPipe"
    return (
        f"pipeline: {plan.stages} stages ({schedule}), {plan.microbatches} micro-batches, bubble "
        f"{bubble(plan):.1%}; " + "; ".join(held)
    )


def storage_order(plan: StagePlan, layers: int) -> Optional[np.ndarray]:
    """For each stored layer position, the layer it holds (None: the layers' own order)."""
    if plan.repeats == 1:
        return None
    per = layers // (plan.stages * plan.repeats)
    s, r, j = np.meshgrid(np.arange(plan.stages), np.arange(plan.repeats), np.arange(per), indexing="ij")
    return (r * plan.stages * per + s * per + j).reshape(-1)


def layouts(order: Optional[np.ndarray], stacked, state_shardings) -> tuple[Callable, Callable]:
    """(to the step's layout, back to the checkpoints'): a circular schedule's stacked layers
    permuted into stage-major storage and back; `stacked(state)` says which leaves are stacked."""
    if order is None:
        return _same, _same
    back = np.argsort(order)

    def permute(state, index):
        flags = stacked(state)
        return jax.tree.map(lambda leaf, flag: jnp.take(leaf, index, axis=0) if flag else leaf, state, flags)

    to_step = jax.jit(lambda state: permute(state, order), out_shardings=state_shardings)
    from_step = jax.jit(lambda state: permute(state, back), out_shardings=state_shardings)
    return to_step, from_step


def _same(state):
    return state
