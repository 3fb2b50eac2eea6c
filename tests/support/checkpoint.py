"""Helpers of tests/**/test_checkpoint*.py that other test files (or its other tiers) share."""

import jax

from engine.run.single import fit


def saved_arrays(workdir, step):
    import orbax.checkpoint as ocp

    path = workdir / "checkpoints" / str(step) / "state"
    restored = ocp.PyTreeCheckpointer().restore(path)  # a dict keyed by TrainState's fields
    return [
        leaf
        for name in ("step", "params", "model_state", "opt_state", "rng")
        for leaf in jax.tree.leaves(restored.get(name, {}))
    ]


def train_briefly(make_config, workdir, *extra):
    cfg = make_config(
        "mnist_mlp.yaml",
        "mesh.num_devices=1",
        "train.steps=30",
        "checkpoint.every_steps=10",
        "checkpoint.keep=5",
        "log.every_steps=10",
        *extra,
        workdir=workdir,
    )
    fit(cfg)
    return cfg
