"""What a model family tells the engine, so that the engine never asks which model it runs.

A family is one entry of `models.REGISTRY`: an object satisfying the `ModelFamily` protocol
below. `Family` gives every capability its "not supported" default; a family subclasses it
and overrides what it can do. Its config dataclass (the `model` section's keys, with a
`validate()` that raises ValueError) lives in models/configs.py.

Nothing here imports the engine; the engine reads these declarations and nothing else.
"""

from __future__ import annotations

import math
from typing import Any, Callable, ClassVar, Mapping, Optional, Protocol, Sequence, runtime_checkable

import jax.numpy as jnp
import optax


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
        the first token of the next document)."""
        if "segments" not in batch:
            return None
        segments = batch["segments"]
        return ((segments[:, 1:] == segments[:, :-1]) & (segments[:, :-1] > 0)).astype(jnp.float32)

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


class Generate(Protocol):
    """Continuations of prompts, with a key/value cache."""

    def __call__(
        self,
        cfg,
        info,
        params,
        prompts: list[list[int]],
        max_tokens: int,
        temperature: float,
        top_p: float,
        seed: int,
        dtype,
        stop_ids: Sequence[int] = (),
        num_samples: int = 1,
        on_step: Optional[Callable[[list[int]], Optional[Sequence[bool]]]] = None,
    ) -> list[list[int]]:
        """`num_samples` lists of new ids per prompt, prompt by prompt (models/sampling.py
        generate: a sample ends after an id in `stop_ids`, or where `on_step`, seeing each
        step's ids, says so)."""
        ...


class HFLayout(Protocol):
    """The family in Hugging Face's layout (see models/llama_hf.py)."""

    ARCHITECTURES: tuple[str, ...]

    def config_from_hf(self, hf: dict) -> dict: ...
    def config_to_hf(self, cfg, info, param_dtype: str) -> dict: ...
    def tensors(self, cfg) -> list: ...


@runtime_checkable
class ModelFamily(Protocol):
    """What the engine may ask of a model family."""

    @property
    def config_cls(self) -> type:
        """The `model` section's dataclass (models/configs.py)."""
        ...

    @property
    def task(self) -> Task: ...

    @property
    def flops_formula(self) -> str:
        """flops_per_example in words, for the run summary ("" = none)."""
        ...

    def build(self, cfg, info, dtype, param_dtype, batch_axis: Optional[str] = None) -> Any:
        """The flax module, called as module(inputs, train=..., example_ids=..., **hparams)."""
        ...

    @property
    def hparams(self) -> tuple[str, ...]: ...
    def hparam_values(self, cfg) -> dict[str, float]: ...
    def flops_per_example(self, cfg, info, num_params: int) -> Optional[float]: ...
    def work_settings(self) -> Mapping[str, Any]: ...
    def work_settings_used(self, cfg, module) -> dict[str, Any]: ...
    def formula_only(self, cfg) -> str: ...
    def generator(self) -> Optional[Generate]: ...
    def hf_layout(self) -> Optional[HFLayout]: ...
    def remat(self, cfg) -> Optional[str]: ...
    def takes_packed_documents(self) -> bool: ...
    def splits_sequence(self) -> bool: ...
    def num_experts(self, cfg) -> int: ...
    def layer_stack(self, cfg) -> int: ...
    def loops_fast_on_cpu(self) -> bool: ...
    def projections(self) -> Mapping[str, tuple[int, int]]: ...


class Family:
    """A ModelFamily whose capabilities all default to "not supported"; subclass and override."""

    config_cls: ClassVar[type]
    task: ClassVar[Task]
    flops_formula: ClassVar[str] = ""
    build: Callable[..., Any]  # (cfg, DataInfo, dtype, param_dtype, batch_axis) → flax module

    @property
    def hparams(self) -> tuple[str, ...]:
        """Shape-independent config fields the compiled step takes as float32 inputs and passes to
        the module call by name (runs that differ only in them share one compiled program);
        declared on the config dataclass (models/configs.py), which a sweep reads without jax."""
        return self.config_cls.hparams  # type: ignore[attr-defined]

    def hparam_values(self, cfg) -> dict[str, float]:
        """The hparams' values in this model config."""
        return {name: float(getattr(cfg, name)) for name in self.hparams}

    def flops_per_example(self, cfg, info, num_params: int) -> Optional[float]:
        """Training FLOPs (forward + backward) of one example, from the architecture (None: no formula)."""
        return None

    def work_settings(self) -> Mapping[str, Any]:
        """Config fields that change the compiled work (recomputation, loops XLA counts once, custom
        calls it cannot count) but not the model FLOPs → their plain reference value."""
        return {}

    def work_settings_used(self, cfg, module) -> dict[str, Any]:
        """The work settings as the built module resolved them (an `auto` setting names what it chose)."""
        return {key: getattr(module, key, getattr(cfg, key)) for key in self.work_settings()}

    def formula_only(self, cfg) -> str:
        """Why the model FLOPs come from flops_per_example alone ("" = XLA counts them)."""
        return ""

    def generator(self) -> Optional[Generate]:
        """Text generation with a key/value cache (None: the family does not generate)."""
        return None

    def hf_layout(self) -> Optional[HFLayout]:
        """Hugging Face interop (None: no Hugging Face layout)."""
        return None

    def remat(self, cfg) -> Optional[str]:
        """The activation rematerialisation policy in use (model.remat: none, dots or full); None
        when the family has no such setting."""
        return None

    def takes_packed_documents(self) -> bool:
        """The module takes `segment_ids=` and `positions=` (attention within each document)."""
        return False

    def splits_sequence(self) -> bool:
        """The module splits its sequence over the context axis (activations on "seq")."""
        return False

    def num_experts(self, cfg) -> int:
        """Routed experts per mixture-of-experts layer (0: none)."""
        return 0

    def layer_stack(self, cfg) -> int:
        """Layers in the scanned stack the pipeline axis splits into stages (0: no stack)."""
        return 0

    def loops_fast_on_cpu(self) -> bool:
        """XLA:CPU runs its steps as fast inside a device-side loop (train.steps_per_call > 1)."""
        return True

    def projections(self) -> Mapping[str, tuple[int, int]]:
        """The named projections (models/projection.py) that take LoRA adapters, a quantised
        base and quantised matmuls: name → (contracted input axes, output axes) of its kernel,
        which may have a leading stacked-layers axis ({}: fine-tuning is not supported)."""
        return {}
