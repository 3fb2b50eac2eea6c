"""Helpers of tests/**/test_context_experts*.py that other test files (or its other tiers) share."""

import jax
import numpy as np

from engine.run.setup import build_run
from support.configs import TINY_LLAMA
from support.parallel import train_losses

MOE = ["model.num_experts=8", "model.experts_per_token=2"]


LLAMA = [*TINY_LLAMA, "optimizer.warmup_steps=1"]


def assert_same_training(make_config, args, layouts, steps=4):
    """Each layout's losses and final weights equal one device's (rtol 1e-5)."""
    reference, state = train_losses(build_run(make_config("llama_tiny", *args, "mesh.num_devices=1")), steps)
    assert reference[-1] < reference[0]
    weights = jax.device_get(state.params)
    for layout in layouts:
        losses, state = train_losses(build_run(make_config("llama_tiny", *args, *layout)), steps)
        np.testing.assert_allclose(losses, reference, rtol=1e-5, err_msg=str(layout))
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=str(layout)),
            jax.device_get(state.params),
            weights,
        )
