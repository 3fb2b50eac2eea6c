"""Which configs share one compiled program (vectorised runs, engine/run/vectorize.py): everything
but the numbers that are arrays in the train state (VECTOR_KEYS, the family's hparams) and
the workdir."""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.config.objective import objective_of, vector_keys
from engine.config.optimizers import state_number_fields
from engine.errors import UsageError
from engine.parallel.strategies import strategy_of
from models.configs import CONFIGS

# config keys whose values are numbers in the train state (plus the model family's hparams)
# (and the objectives' step inputs: DPO's dpo.beta, engine/config/objective.py)
VECTOR_KEYS = ("seed", *(f"optimizer.{name}" for name in state_number_fields()), *vector_keys())


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def program_settings(cfg) -> dict[str, Any]:
    """The settings that make a run's compiled program: the whole config but its VECTOR_KEYS,
    the family's hyperparameters and the workdir (clipping on or off stays: it is a program)."""
    flat = _flat(dataclasses.asdict(cfg))
    hparams: tuple[str, ...] = CONFIGS[cfg.model.name].hparams  # type: ignore[attr-defined]
    vector = set(VECTOR_KEYS) | {f"model.{name}" for name in hparams} | {"workdir"}
    settings = {key: value for key, value in flat.items() if key not in vector}
    settings["optimizer.grad_clip"] = bool(cfg.optimizer.grad_clip_norm)
    return settings


def shape_differences(a, b) -> list[str]:
    """The program settings in which two configs differ (empty: they can share one program)."""
    sa, sb = program_settings(a), program_settings(b)
    return sorted(key for key in sa.keys() | sb.keys() if sa.get(key) != sb.get(key))


def check_vectorizable(cfg, where: str) -> None:
    if cfg.mesh.backend != "jit" or cfg.train.eager:
        raise UsageError(
            f"{where}: vectorize trains runs as one jit-compiled program; set mesh.backend=jit and "
            f"train.eager=false, or remove vectorize"
        )
    if cfg.mesh.pipeline != 1:
        raise UsageError(
            f"{where}: vectorize trains runs side by side over the devices; a pipeline "
            f"(mesh.pipeline={cfg.mesh.pipeline}) is not vectorised: remove vectorize, or set mesh.pipeline=1"
        )
    if not strategy_of(cfg).vectorised:
        raise UsageError(
            f"{where}: vectorize trains runs side by side over the devices; train.sync={cfg.train.sync} "
            f"keeps replicas over them already: remove vectorize, or set train.sync=every_step"
        )
    if cfg.eval.generate.num_prompts:
        raise UsageError(
            f"{where}: eval.generate (completions at each eval) is not vectorised; set eval.generate.num_prompts=0, "
            "or run the sweep without vectorize (each trial trains in its own process)"
        )
    if cfg.finetune.base:  # (each trial would hold a copy of the base; not built)
        raise UsageError(
            f"{where}: finetune.base is not vectorised; run the sweep without vectorize "
            f"(each trial trains in its own process)"
        )
    objective_of(cfg).check_vectorised(cfg, where)  # (DPO's precomputed reference: one dataset, each trial's)
    if cfg.checkpoint.restore_from:
        raise UsageError(
            f"{where}: vectorized runs start from scratch or their own checkpoints, not "
            f"checkpoint.restore_from; remove vectorize to start each run from "
            f"{cfg.checkpoint.restore_from}"
        )
