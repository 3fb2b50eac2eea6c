"""Model registry: `model.name` in a config → ModelSpec.

A model is a flax module called as `module(inputs, train=..., example_ids=..., dropout_rate=...)`
returning logits, whose parameters carry logical axis names. A language model ("lm" task)
also takes `targets=` [batch, seq] and then returns (per-token float32 cross-entropy,
argmax == target) instead, so it can fuse its output layer with the loss. To add one, write models/<name>.py
with a config dataclass (first field `name`) and a `build(cfg, data_info, dtype,
param_dtype, batch_axis_name)` function, and register it below.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from models import cnn, mlp, resnet, transformer


@dataclass(frozen=True)
class ModelSpec:
    config_cls: type  # dataclass of the model's config keys (the `model` section)
    build: Callable  # (cfg, DataInfo, dtype, param_dtype, batch_axis_name) -> flax module
    task: str  # "classification" (image → label) or "lm" (tokens → next token)


REGISTRY: dict[str, ModelSpec] = {
    "mlp": ModelSpec(mlp.MLPConfig, mlp.build, "classification"),
    "cnn": ModelSpec(cnn.CNNConfig, cnn.build, "classification"),
    "resnet": ModelSpec(resnet.ResNetConfig, resnet.build, "classification"),
    "transformer": ModelSpec(transformer.TransformerConfig, transformer.build, "lm"),
}
