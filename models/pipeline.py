"""A layer stack run as a pipeline, SPMD-style: the stages are one vmapped computation over a
`stage` dimension (which the engine lays over its `pipeline` mesh axis), stepped by a scan
over iterations; each iteration every stage applies its layers to the micro-batch in front of
it, and the results shift one stage on (a collective permute between neighbouring devices).

Micro-batch m of repeat r reaches stage s at iteration r*M + m + s (M micro-batches, S
stages, R repeats): GPipe's order with R = 1; with R > 1 (circular) each stage holds R groups
of layers and a micro-batch goes round the stages R times, which shrinks the bubble (stages
idle while the pipeline fills and drains) to (S - 1) / (R*M + S - 1).

The stacked parameters [layers, ...] are stored stage-major: stage s's groups of layers are
consecutive, so with the layer dimension split over the stages each device already holds its
own. With R = 1 that is the layers' own order; with R > 1 the engine permutes checkpoints
in and out of it (engine/parallel/stages.py), so they stay in the layers' order on disk.

Every example goes through the same layers in the same order as without a pipeline; only the
order in which micro-batches are computed changes. Gradients come from differentiating the
scan (all forwards, then all backwards: GPipe's activation memory, bounded by model.remat)."""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

from contract.activations import Constrainer, StagePlan, constrain


def _micro(a, count: int):
    """[batch, ...] → [count, batch / count, ...]: micro-batch k takes rows k, k + count, ... (each
    micro-batch draws on every shard of a batch split over devices, as gradient accumulation does)."""
    return a.reshape(a.shape[0] // count, count, *a.shape[1:]).swapaxes(0, 1)


def _unmicro(a):
    return a.swapaxes(0, 1).reshape(a.shape[0] * a.shape[1], *a.shape[2:])


def run_pipeline(
    layer: Callable, params, x, positions, segment_ids, plan: StagePlan, layout: Optional[Constrainer] = None
):
    """x [batch, seq, embed] through the stacked layers `params` (leading dimension: layers,
    stored stage-major) as the pipeline `plan` describes; `layer(one layer's params, x,
    positions, segment_ids) → x`. segment_ids may be None; `layout` pins the stages' activations."""
    stages, repeats, count = plan.stages, plan.repeats, plan.microbatches
    stacked = jax.tree.map(lambda a: a.reshape(stages, repeats, -1, *a.shape[1:]), params)  # [S, R, per, ...]
    inputs = _micro(x, count)  # [M, mb, seq, embed]
    side = [None if a is None else _micro(a, count) for a in (positions, segment_ids)]

    def stage(group_params, repeat, h, pos, seg):
        """One stage: its `per` layers of repeat `repeat` on h [mb, seq, embed]."""
        layers = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, repeat, keepdims=False), group_params)
        return jax.lax.scan(lambda carry, p: (layer(p, carry, pos, seg), None), h, layers)[0]

    def iteration(carry, t):
        held, store = carry  # held [S, mb, ...]: what each stage computed last; store [M, mb, ...]
        item = t - jnp.arange(stages)  # which (repeat, micro-batch) each stage works on now
        clipped = jnp.clip(item, 0, repeats * count - 1)
        repeat, micro = clipped // count, clipped % count
        first = jnp.where(t < count, inputs[t % count], store[t % count])  # a new micro-batch, or one going round
        h = constrain(layout, jnp.concatenate([first[None], held[:-1]]), ("stage", "batch", "seq", None))
        pos, seg = (None if a is None else a[micro] for a in side)
        out = jax.vmap(stage)(stacked, repeat, h, pos, seg)
        out = constrain(layout, out, ("stage", "batch", "seq", None))
        done = (item[-1] >= 0) & (item[-1] < repeats * count)  # the last stage finished a micro-batch's repeat
        store = jax.lax.dynamic_update_index_in_dim(store, jnp.where(done, out[-1], store[micro[-1]]), micro[-1], 0)
        return (out, store), None

    held = jnp.zeros((stages, *inputs.shape[1:]), x.dtype)
    steps = jnp.arange(repeats * count + stages - 1)
    (_, store), _ = jax.lax.scan(iteration, (held, jnp.zeros_like(inputs)), steps)
    return _unmicro(store)
