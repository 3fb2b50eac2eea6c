"""Helpers of tests/**/test_search*.py that other test files (or its other tiers) share."""

import yaml

from engine.config import load_config
from support.configs import QUIET, ROOT

OVERRIDES = {
    "train.steps": 40,
    "eval.every_steps": 10,
    "log.every_steps": 10,
    "checkpoint.every_steps": 10,
    "log.tensorboard": False,
    "mesh.num_devices": 1,
}


PARAMS = {"optimizer.learning_rate": {"log_uniform": [1.0e-5, 1.0e-1]}, "model.hidden_sizes": {"choice": [[16], [64]]}}


def sweep_file(tmp_path, trials, pruner=None, **search):
    spec = {
        "base": str(ROOT / "configs" / "mnist_mlp.yaml"),
        "overrides": OVERRIDES,
        "metric": "eval/loss",
        "mode": "min",
        "directory": str(tmp_path / "sweep"),
        "search": {"sampler": "tpe", "trials": trials, "seed": 0, "params": PARAMS, **search},
    }
    if pruner:
        spec["pruner"] = pruner
    path = tmp_path / "search.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def plan_config(tmp_path, base, *overrides):
    """The config and the override list it was loaded from (a candidate's overrides go after them)."""
    listed = [*QUIET, "data.steps_per_transfer=1", "train.steps_per_call=1", *overrides]
    return load_config(ROOT / "configs" / base, listed, str(tmp_path / "run")), listed
