"""What a model family tells the engine, so that the engine never asks which model it runs.

A family is one entry of `models.REGISTRY`: an object satisfying the `ModelFamily` protocol
below, a small core (config, task, build, hyperparameters) and capability records (FLOPs,
language model, layer stack, experts) that are None where unsupported. `Family` gives those
defaults; a family subclasses it and sets what it can do. Its config dataclass (the `model` section's keys, with a
`validate()` that raises ValueError) lives in models/configs.py.

Nothing here imports the engine; the engine reads these declarations and nothing else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Optional, Protocol, runtime_checkable

import jax.numpy as jnp
import optax

from contract.activations import ONE_STAGE, Constrainer, StagePlan
from contract.adapters import NO_ADAPTATION, Adaptation


class Classification:
    """Images → one label each. A batch holds `image` [batch, ...] and `label` [batch]."""

    data_kind = "image"  # the DataInfo.kind this task trains on

    def sample_input(self, info):
        """A one-example input for shape inference (init)."""
        return jnp.zeros((1, *info.input_shape), jnp.float32)

    def export_input(self, info) -> tuple[tuple[int | str, ...], str, tuple[str, ...]]:
        """(shape of one example, dtype, constraints) of what the exported forward function takes:
        a dimension given by name is symbolic (jax.export), bounded by the constraints; a task
        whose model takes several inputs gives a dict of them (models/tabular.py)."""
        return tuple(map(int, info.input_shape)), "float32", ()

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

    def eval_metrics(self, loss: float, info) -> dict[str, float]:
        """Eval metrics beyond loss and accuracy, from the eval loss."""
        return {}


class NextToken:
    """Language modelling: predict each next token. A batch holds `tokens` [batch, seq + 1];
    packed data also `segments` (1, 2, … per document, 0 = padding) and `positions` (the
    offset in the document), which the module gets as `segment_ids=` and `positions=`.

    The module takes `targets=` and returns (per-token float32 cross-entropy, argmax ==
    target) itself, so it can fuse its output projection with the loss."""

    data_kind = "tokens"

    def sample_input(self, info):
        return jnp.zeros((1, info.seq_len), jnp.int32)

    def export_input(self, info) -> tuple[tuple[int | str, ...], str, tuple[str, ...]]:
        # any length up to the context the model was trained at
        return ("seq",), "int32", (f"seq <= {int(info.seq_len)}",)

    def tokens_per_example(self, info) -> int:
        return int(info.seq_len)

    def model_inputs(self, batch) -> tuple[Any, Any, dict]:
        tokens = batch["tokens"].astype(jnp.int32)  # [batch, seq + 1]
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        if "segments" not in batch:
            return inputs, targets, {"targets": targets}
        return (
            inputs,
            targets,
            {
                "targets": targets,
                "segment_ids": batch["segments"][:, :-1].astype(jnp.int32),
                "positions": batch["positions"][:, :-1].astype(jnp.int32),
            },
        )

    def target_weights(self, batch):
        """Packed data: a target counts only within its input's document (not padding, not
        the first token of the next document), and, where the batch has a `loss_mask` (1 for
        each token to train on: conversations' assistant turns), only where it marks the target."""
        if "segments" not in batch:
            return None
        segments = batch["segments"]
        weights = ((segments[:, 1:] == segments[:, :-1]) & (segments[:, :-1] > 0)).astype(jnp.float32)
        if "loss_mask" in batch:
            weights = weights * batch["loss_mask"][:, 1:].astype(jnp.float32)
        return weights

    def losses(self, out, targets):
        return out  # (losses, hits) from the module's fused loss

    def eval_metrics(self, loss: float, info) -> dict[str, float]:
        """The eval loss (nats per token) as perplexity and, where the text's bytes per token are
        known (byte-level text; corpora tokenized by this version), bits per byte."""
        metrics = {"perplexity": math.exp(min(loss, 700.0))}
        if info.bytes_per_token:
            metrics["bits_per_byte"] = loss / (math.log(2) * info.bytes_per_token)
        return metrics


class Task(Protocol):
    """What a batch holds and how the loss is made from it (Classification, NextToken)."""

    data_kind: str  # the DataInfo.kind it trains on

    def sample_input(self, info) -> Any: ...
    def export_input(self, info) -> Any: ...
    def tokens_per_example(self, info) -> int: ...
    def model_inputs(self, batch) -> tuple[Any, Any, dict]: ...
    def target_weights(self, batch) -> Any: ...
    def losses(self, out, targets) -> tuple[Any, Any]: ...
    def eval_metrics(self, loss: float, info) -> dict[str, float]: ...


# Text generation: models/sampling.py's `generate`, called as it is, on a module the family's
# build made with `decode=True` (a key/value cache).
Generate = Callable[..., list[list[int]]]


class HFLayout(Protocol):
    """The family in Hugging Face's layout (see models/llama_hf.py)."""

    @property
    def ARCHITECTURES(self) -> tuple[str, ...]: ...  # Hugging Face's names of the model class

    def config_from_hf(self, hf: dict) -> dict: ...
    def config_to_hf(self, cfg, info, param_dtype: str) -> dict: ...
    def tensors(self, cfg) -> list: ...


@dataclass(frozen=True)
class BuildOptions:
    """What a run asks of the module beyond its config; a family reads the options it supports
    (`stages` a family with a LayerStack, `adaptation` one with projections, `layout` one that
    names its activations' logical axes)."""

    batch_axis: Optional[str] = None  # the pmap axis batch statistics reduce over (None: jit)
    stages: StagePlan = ONE_STAGE  # the layer stack run as this pipeline (one stage: not)
    adaptation: Adaptation = NO_ADAPTATION  # LoRA adapters and quantised matmuls of the projections
    layout: Optional[Constrainer] = None  # pins activations to the mesh of the step traced (None: unconstrained)


NO_OPTIONS = BuildOptions()


@dataclass(frozen=True)
class FlopsAccounting:
    """The model FLOPs from the architecture, and the settings that change the compiled work
    (recomputation, loops XLA counts once, custom calls it cannot count) but not those FLOPs."""

    formula: str  # per_example in words, for the run summary
    per_example: Callable[[Any, Any, int], float]  # (cfg, DataInfo, parameters) → training FLOPs of one example
    work_settings: Mapping[str, Any] = field(default_factory=dict)  # config field → its plain reference value
    # fields the reference step sets too, not compared with the run's: their effect is decided as
    # the step is traced (model.logits_budget_mib: whether loss_chunk=0 splits the loss)
    reference_settings: Mapping[str, Any] = field(default_factory=dict)
    formula_only: Callable[[Any], str] = lambda cfg: ""  # why XLA cannot count them ("": it can)

    def settings_used(self, cfg, module) -> dict[str, Any]:
        """The work settings as the built module resolved them (an `auto` setting names what it chose)."""
        return {key: getattr(module, key, getattr(cfg, key)) for key in self.work_settings}


@dataclass(frozen=True)
class LanguageModel:
    """A model of token sequences (the NextToken task)."""

    packed_documents: bool = False  # the module takes `segment_ids=` and `positions=` (attention within a document)
    splits_sequence: bool = False  # the module splits its sequence over the context axis (activations on "seq")
    generate: Optional[Generate] = None  # text generation (None: the family does not generate)
    hf_layout: Optional[HFLayout] = None  # Hugging Face interop (None: no Hugging Face layout)
    # (model cfg, data info, sequences, devices splitting them, devices splitting each sequence) →
    # how the fused loss makes its logits, models/layers.py LossChunk (None: the family has no such loss)
    loss_chunk: Optional[Callable[[Any, Any, int, int, int], Any]] = None
    # The named projections (models/projection.py) that take LoRA adapters, a quantised base and
    # quantised matmuls: name → (contracted input axes, output axes) of its kernel, which may have
    # a leading stacked-layers axis ({}: fine-tuning is not supported).
    projections: Mapping[str, tuple[int, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class LayerStack:
    """A stack of layers the pipeline axis splits into stages: build runs it as the pipeline its
    BuildOptions.stages describe."""

    layers: Callable[[Any], int]  # cfg → layers in the stack (0: this config stacks none)


@dataclass(frozen=True)
class Experts:
    """Routed mixture-of-experts layers, which the expert axis splits."""

    count: Callable[[Any], int]  # cfg → routed experts per layer (0: this config has none)


@runtime_checkable
class ModelFamily(Protocol):
    """What the engine may ask of a model family: a core every family answers, and capability
    records (flops, language_model, layer_stack, experts) that are None where unsupported."""

    @property
    def config_cls(self) -> type:
        """The `model` section's dataclass (models/configs.py)."""
        ...

    @property
    def task(self) -> Task: ...

    def build(self, cfg, info, dtype, param_dtype, options: BuildOptions = NO_OPTIONS) -> Any:
        """The flax module, called as module(inputs, train=..., example_ids=..., **hparams)."""
        ...

    @property
    def hparams(self) -> tuple[str, ...]: ...
    def hparam_values(self, cfg) -> dict[str, float]: ...
    def remat(self, cfg) -> Optional[str]: ...
    def loops_fast_on_cpu(self) -> bool: ...

    @property
    def flops(self) -> Optional[FlopsAccounting]: ...
    @property
    def language_model(self) -> Optional[LanguageModel]: ...
    @property
    def layer_stack(self) -> Optional[LayerStack]: ...
    @property
    def experts(self) -> Optional[Experts]: ...


class Family:
    """A ModelFamily whose capabilities all default to "not supported"; subclass and override."""

    config_cls: ClassVar[type]
    task: ClassVar[Task]
    build: Callable[..., Any]  # (cfg, DataInfo, dtype, param_dtype, BuildOptions) → flax module
    flops: ClassVar[Optional[FlopsAccounting]] = None  # None: no formula, XLA's count alone
    language_model: ClassVar[Optional[LanguageModel]] = None
    layer_stack: ClassVar[Optional[LayerStack]] = None  # None: the pipeline axis is unsupported
    experts: ClassVar[Optional[Experts]] = None

    @property
    def hparams(self) -> tuple[str, ...]:
        """Shape-independent config fields the compiled step takes as float32 inputs and passes to
        the module call by name (runs that differ only in them share one compiled program);
        declared on the config dataclass (models/configs.py), which a sweep reads without jax."""
        return self.config_cls.hparams  # type: ignore[attr-defined]

    def hparam_values(self, cfg) -> dict[str, float]:
        """The hparams' values in this model config."""
        return {name: float(getattr(cfg, name)) for name in self.hparams}

    def remat(self, cfg) -> Optional[str]:
        """The activation rematerialisation policy in use (model.remat: a name of models/remat.py,
        none, full, dots, minimal, ... offload); None when the family has no such setting."""
        return None

    def loops_fast_on_cpu(self) -> bool:
        """XLA:CPU runs its steps as fast inside a device-side loop (train.steps_per_call > 1)."""
        return True


# What the engine reads of a capability, "unsupported" where the family has none.


def projections(family: ModelFamily) -> Mapping[str, tuple[int, int]]:
    """The family's adaptable projections ({}: it cannot be fine-tuned)."""
    return family.language_model.projections if family.language_model else {}


def stacked_layers(family: ModelFamily, cfg) -> int:
    """Layers in the stack the pipeline axis splits into stages (0: no stack)."""
    return family.layer_stack.layers(cfg) if family.layer_stack else 0


def num_experts(family: ModelFamily, cfg) -> int:
    """Routed experts per mixture-of-experts layer (0: none)."""
    return family.experts.count(cfg) if family.experts else 0


def splits_sequence(family: ModelFamily) -> bool:
    """The module splits its sequence over the context axis."""
    return bool(family.language_model and family.language_model.splits_sequence)
