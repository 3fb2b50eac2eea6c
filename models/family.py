"""What a model family tells the engine, so that the engine never asks which model it runs.

A family is one entry of `models.REGISTRY`: its config dataclass (the `model` section's
keys, with a `validate()` that raises ValueError), a `build` function that makes the flax
module, its task (what a batch holds and how the loss is made from it), its model FLOPs,
the settings that change the compiled work but not the model FLOPs, and the
shape-independent hyperparameters the compiled step takes as inputs.

Nothing here imports the engine; the engine reads these declarations and nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import jax.numpy as jnp
import optax


@dataclass(frozen=True)
class Classification:
    """Images → one label each. A batch holds `image` [batch, ...] and `label` [batch]."""

    data_kind: str = "image"  # the DataInfo.kind this task trains on

    def sample_input(self, info):
        """A one-example input for shape inference (init)."""
        return jnp.zeros((1, *info.input_shape), jnp.float32)

    def export_input(self, info) -> tuple[tuple[int, ...], str]:
        """(shape of one example, dtype) of what the exported forward function takes."""
        return tuple(map(int, info.input_shape)), "float32"

    def tokens_per_example(self, info) -> int:
        return 0

    def model_inputs(self, batch) -> tuple[Any, Any, dict]:
        """(inputs, targets, extra keyword arguments of the module call)."""
        return batch["image"], batch["label"], {}

    def target_weights(self, batch):
        """Per-target weights beyond the batch's example mask (None: every target counts)."""
        return None

    def losses(self, out, targets):
        """The module's output → (float32 loss per target, argmax == target)."""
        logits = out.astype(jnp.float32)  # the loss is always computed in float32
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets), jnp.argmax(logits, -1) == targets


@dataclass(frozen=True)
class NextToken:
    """Language modelling: predict each next token. A batch holds `tokens` [batch, seq + 1];
    packed data also `segments` (1, 2, … per document, 0 = padding) and `positions` (the
    offset in the document), which the module gets as `segment_ids=` and `positions=`.

    The module takes `targets=` and returns (per-token float32 cross-entropy, argmax ==
    target) itself, so it can fuse its output projection with the loss."""

    data_kind: str = "tokens"

    def sample_input(self, info):
        return jnp.zeros((1, info.seq_len), jnp.int32)

    def export_input(self, info) -> tuple[tuple[int, ...], str]:
        return (int(info.seq_len),), "int32"

    def tokens_per_example(self, info) -> int:
        return int(info.seq_len)

    def model_inputs(self, batch) -> tuple[Any, Any, dict]:
        tokens = batch["tokens"].astype(jnp.int32)  # [batch, seq + 1]
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        if "segments" not in batch:
            return inputs, targets, {"targets": targets}
        return inputs, targets, {"targets": targets, "segment_ids": batch["segments"][:, :-1].astype(jnp.int32),
                                 "positions": batch["positions"][:, :-1].astype(jnp.int32)}

    def target_weights(self, batch):
        """Packed data: a target counts only within its input's document (not padding, not
        the first token of the next document)."""
        if "segments" not in batch:
            return None
        segments = batch["segments"]
        return ((segments[:, 1:] == segments[:, :-1]) & (segments[:, :-1] > 0)).astype(jnp.float32)

    def losses(self, out, targets):
        return out  # (losses, hits) from the module's fused loss


@dataclass(frozen=True)
class ModelFamily:
    config_cls: type  # the `model` section's dataclass; first field `name`; validate() raises ValueError
    build: Callable  # (cfg, DataInfo, dtype, param_dtype, batch_axis_name) → flax module
    task: Any  # Classification() or NextToken(): batch keys, loss, sample and export inputs
    # (cfg, DataInfo, number of parameters) → training FLOPs (forward + backward) of one
    # example, from the architecture; used where XLA cannot count the model's work
    flops_per_example: Optional[Callable] = None
    flops_formula: str = ""  # flops_per_example in words, for the run summary
    # config fields that change the compiled work (recomputation, loops XLA counts once,
    # custom calls it cannot count) but not the model FLOPs → their plain reference value
    work_settings: Mapping[str, Any] = field(default_factory=dict)
    # (cfg, DataInfo, params, prompt token ids, max_tokens, temperature, top_p, seed, dtype) →
    # generated token ids, with a key/value cache (None: the family does not generate)
    generate: Optional[Callable] = None
    # Hugging Face interop: a module with ARCHITECTURES, config_from_hf, config_to_hf and
    # tensors (see models/llama_hf.py); None: no Hugging Face layout
    hf: Any = None
    # the module takes `segment_ids=` and `positions=` (packed token data: attention within
    # each document, positions restarting)
    packing: bool = False
    # XLA:CPU runs this family's convolutions several times slower inside a device-side loop
    # (train.steps_per_call > 1) than called a step at a time: on CPU it runs one step per call
    cpu_step_loop: bool = True
    # the module splits its sequence over mesh.context (activations constrained on "seq",
    # attention gathering keys and values)
    context_parallel: bool = False
    # (model cfg) → why the model FLOPs come from flops_per_example alone ("" = XLA counts them)
    formula_only: Optional[Callable] = None

    @property
    def hparams(self) -> tuple[str, ...]:
        """Shape-independent config fields the compiled step takes as float32 inputs and passes
        to the module call by name (runs that differ only in them share one compiled program);
        declared on the config dataclass (models/configs.py), which a sweep reads without jax."""
        return self.config_cls.hparams
