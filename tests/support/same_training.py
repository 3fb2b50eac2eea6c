"""Helpers of tests/integration/test_context_experts.py: assert_same_training that hands back each
layout's run and final state, for checks of the sharded run beside its losses and weights."""

import jax
import numpy as np

from engine.run.setup import build_run
from support.parallel import train_losses


def same_training_runs(make_config, args, layouts, steps=4) -> list:
    """Each layout's losses and final weights equal one device's (rtol 1e-5, as
    support.context_experts.assert_same_training); returns [(run, final state)] by layout."""
    reference, state = train_losses(build_run(make_config("llama_tiny", *args, "mesh.num_devices=1")), steps)
    assert reference[-1] < reference[0]
    weights, runs = jax.device_get(state.params), []
    for layout in layouts:
        run = build_run(make_config("llama_tiny", *args, *layout))
        losses, state = train_losses(run, steps)
        np.testing.assert_allclose(losses, reference, rtol=1e-5, err_msg=str(layout))
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=str(layout)),
            jax.device_get(state.params),
            weights,
        )
        runs.append((run, state))
    return runs
