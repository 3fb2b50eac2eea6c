"""Model registry: `model.name` in a config → ModelFamily (see models/family.py).

A model is a flax module called as `module(inputs, train=..., example_ids=..., **hparams)`
whose parameters carry logical axis names. Each family declares what the engine needs to
know of it (task, FLOPs, settings, hyperparameters); see README "Adding a model".
"""
from __future__ import annotations

from models import cnn, llama, mlp, resnet, transformer
from models.family import Classification, ModelError, ModelFamily, NextToken
from models.layers import constrained_activations

REGISTRY: dict[str, ModelFamily] = {
    "mlp": mlp.FAMILY,
    "cnn": cnn.FAMILY,
    "resnet": resnet.FAMILY,
    "transformer": transformer.FAMILY,
    "llama": llama.FAMILY,
}

__all__ = ["REGISTRY", "ModelFamily", "ModelError", "Classification", "NextToken", "constrained_activations"]
