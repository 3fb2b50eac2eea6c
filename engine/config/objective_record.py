"""An objective's record (engine/config/objective.py's table): jax-free, the config layer reads it."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Union


def _nothing(cfg) -> None:
    return None


def _never(cfg) -> bool:
    return False


def _one(cfg) -> int:
    return 1


def _vectorisable(cfg, where: str) -> None:
    return None


def _policy(cfg, policy: float, full: float, formula: str) -> tuple[float, str]:
    return policy, formula


@dataclasses.dataclass(frozen=True)
class Objective:
    """What a run asks of its objective (the defaults are a language model's: `lm`)."""

    name: str
    # "module:function": (cfg) → StepPart, imported when a run is built; or the function itself
    part: Union[str, Callable]
    # the data.name values it trains on, which no other objective may (None: any other source)
    data_sources: Optional[tuple[str, ...]] = None
    section: Optional[str] = None  # its config section (another objective's section set is refused)
    check: Callable[[Any], None] = _nothing  # (cfg) → None, or UsageError: its keys, the layouts it refuses
    check_vectorised: Callable[[Any, str], None] = _vectorisable  # (cfg, where) → None or UsageError
    # the state's hparams it takes as step inputs → their config keys (a vectorised sweep may differ in them)
    step_hparams: Mapping[str, str] = dataclasses.field(default_factory=dict)
    sums: tuple[str, ...] = ()  # its metric columns after engine/state/columns.py's train metrics (sums over a step)
    # the summed loss_sum, correct, count and `sums` of steps or an eval split → a record (None: loss, accuracy)
    record: Optional[Callable[[dict], dict]] = None
    console_keys: tuple[str, ...] = ()  # the record's names a plain train line shows
    brief_keys: tuple[str, ...] = ()  # the record's names a progress bar shows
    rows_per_example: Callable[[Any], int] = _one  # (cfg) → the module's rows per example (DPO: 2)
    # (cfg, one policy row's FLOPs, a full step's on a row, its formula) → (FLOPs per example, in words)
    flops: Callable[[Any, float, float, str], tuple[float, str]] = _policy
    keeps_reference: Callable[[Any], bool] = _never  # (cfg) → a full fine-tuning state keeps the start (REFERENCE)
    prepass: Callable[[Any], bool] = _never  # (cfg) → the reference pass runs once before training
    plain_step: bool = False  # its step is the family's own (perf.py's reference FLOPs count apply)
