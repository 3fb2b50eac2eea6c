"""Model registry: `model.name` in a config → ModelFamily (see models/family.py).

A model is a flax module called as `module(inputs, train=..., example_ids=..., **hparams)`
whose parameters carry logical axis names. Each family declares what the engine needs to
know of it (task, FLOPs, settings, hyperparameters); see docs/extending.md.

`CONFIGS` (each family's `model.*` dataclass, models/configs.py) loads without jax or flax,
so a config can be read and checked by a process that never builds a model (a sweep's);
the families themselves (`REGISTRY` and the names below it) load on first use.
"""

from __future__ import annotations

import importlib

from models.configs import CONFIGS, ModelError

_LAZY = {
    "REGISTRY": "models.registry",
    "ModelFamily": "models.family",
    "Classification": "models.family",
    "NextToken": "models.family",
    "Family": "models.family",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'models' has no attribute {name!r}")


__all__ = ["CONFIGS", "REGISTRY", "ModelFamily", "ModelError", "Classification", "NextToken", "Family"]
