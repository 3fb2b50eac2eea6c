"""Helpers of tests/**/test_sweep*.py that other test files (or its other tiers) share."""

import yaml

from support.configs import ROOT

FAST = {
    "train.steps": 40,
    "log.every_steps": 20,
    "eval.every_steps": 20,
    "log.tensorboard": False,
    "checkpoint.every_steps": 20,
    "train.global_batch_size": 32,
}


def write_sweep(path, **spec):
    spec.setdefault("base", str(ROOT / "configs" / "mnist_mlp.yaml"))
    spec.setdefault("overrides", FAST)
    spec.setdefault("directory", str(path.parent / "out"))
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path
