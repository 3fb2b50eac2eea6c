"""The objectives' step parts (train.objective; their jax-free records and the table are
engine/config/objective.py's): each objective's loss and its reference pass, built with jax.
A record names its part as "module:function" (lm.py, dpo_part.py here); `objective_part`
imports it when a run is built."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Optional, Union

from engine.config.objective import objective_of


@dataclasses.dataclass(frozen=True)
class StepPart:
    """An objective's part built with jax."""

    # (module, family, number of data sources) → loss(params, model_state, batch, rng, train, hparams)
    # → (loss, (metric sums, new model_state)), as engine/objectives/lm.py make_loss_fn's
    loss_fn: Callable
    # (module, task) → reference(params, model_state, batch): the pre-pass's values of a batch
    reference_fn: Optional[Callable] = None
    # an objective that trains on its own samples (GRPO: engine/objectives/grpo_driver.py): the run
    # fits its data, compiles the update for `spec`'s rows and builds the sampler beside it
    rollouts: Optional["RolloutPart"] = None


@dataclasses.dataclass(frozen=True)
class RolloutPart:
    """What the run asks of an objective whose batches it samples (engine/run/setup.py, single.py)."""

    # (cfg, dataset, mesh shape) → the dataset the run reads (GRPO: prompts padded to the decode's
    # widths), or UsageError for a layout it does not run on
    data: Callable
    spec: Callable  # (cfg) → the update batch's arrays, zero-length stand-ins (data.pipeline example_spec)
    rows: Callable  # (cfg) → the update batch's rows
    build: Callable  # (cfg, family, dataset, abstract state, data sharding) → the sampler (grpo_driver.Rollouts)


def objective_part(cfg) -> StepPart:
    """The config's objective's step part, built (its module imported here: it uses jax)."""
    part: Union[str, Callable] = objective_of(cfg).part
    build = part if callable(part) else getattr(importlib.import_module(part.partition(":")[0]), part.partition(":")[2])
    return build(cfg)


__all__ = ["RolloutPart", "StepPart", "objective_part"]
