"""Helpers of tests/**/test_parallel*.py that other test files (or its other tiers) share."""

import jax
import numpy as np

from engine.state.columns import unpack_metrics


def train_losses(run, steps):
    state, losses = jax.block_until_ready(run.compiled.to_step_layout(run.init_state())), []  # (CPU collectives)
    for step in range(steps):
        state, metrics = jax.block_until_ready(
            run.compiled.train_step(state, run.train_block(step // run.inputs.steps_per_block))
        )
        (metrics,) = unpack_metrics(jax.device_get(metrics))  # (CPU collectives must not overlap steps)
        losses.append(metrics["loss_sum"] / metrics["count"])
    return np.array(losses), run.compiled.from_step_layout(
        state
    )  # (a circular pipeline stores layers in its own order)


def addressable_bytes(tree, device):
    return sum(
        shard.data.nbytes
        for leaf in jax.tree.leaves(tree)
        for shard in leaf.addressable_shards
        if shard.device == device
    )
