"""Helpers of tests/**/test_vectorize*.py that other test files (or its other tiers) share."""

import yaml

from support.configs import ROOT


def _sweep_file(path, directory, **extra):
    spec = {
        "base": str(ROOT / "configs" / "mnist_mlp.yaml"),
        "directory": str(directory),
        "overrides": {
            "train.steps": 100,
            "train.steps_per_call": 5,
            "log.every_steps": 25,
            "eval.every_steps": 50,
            "checkpoint.every_steps": 10,
            "train.global_batch_size": 32,
            "log.tensorboard": False,
            "optimizer.name": "adamw",
        },
        "grid": {"optimizer.learning_rate": [0.001, 0.003], "optimizer.weight_decay": [0.0, 0.1]},
        "vectorize": "auto",
        **extra,
    }
    path.write_text(yaml.safe_dump(spec))
    return path
