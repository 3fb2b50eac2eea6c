"""Diagnosis of checkpoints that do not fit the train state (shapes, structure, shardings); the grad_clip_norm shim.

A checkpoint of other parameter shapes, of a full model under LoRA, or of another optimizer's
state is a UsageError that names the settings to use; a checkpoint saved before the
gradient-clipping norm became a state number is read without it and the norm filled in.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import jax
import numpy as np

from engine.errors import UsageError
from engine.lm.finetune import adapters_only
from engine.parallel.sharding import path_name

TREE_MISMATCH = "tree structures do not match"  # orbax's error reading into a target of another structure


def param_mismatches(saved_params, abstract_params) -> list[str]:
    """'path: saved (shape), expected (shape)' for each parameter the checkpoint's metadata
    (`saved_params`) and the model disagree on."""
    saved_shapes = {path_name(p): tuple(m.shape) for p, m in jax.tree_util.tree_leaves_with_path(saved_params)}
    want = {path_name(p): tuple(a.shape) for p, a in jax.tree_util.tree_leaves_with_path(abstract_params)}
    return [
        f"{name}: saved {saved_shapes.get(name, 'absent')}, expected {want.get(name, 'absent')}"
        for name in sorted(saved_shapes.keys() | want.keys())
        if saved_shapes.get(name) != want.get(name)
    ]


def check_compatible(saved_params, abstract_params, directory: Path, step: int) -> None:
    """UsageError unless the parameters of checkpoint `directory`/`step` (its metadata,
    `saved_params`) fit the model's: it names the settings to use instead."""
    problems = param_mismatches(saved_params, abstract_params)
    if problems and adapters_only(abstract_params) and not adapters_only(saved_params, any_of=True):
        workdir = directory.parent
        raise UsageError(
            f"{workdir} holds a model's full weights (checkpoint {step}), and finetune.lora trains "
            f"adapters on a frozen base: fine-tune in a new workdir with finetune.base={workdir}"
        )
    if problems:
        raise UsageError(
            f"checkpoint {directory}/{step} does not fit this model's config: "
            + "; ".join(problems)
            + ". Use the model settings it was saved with, or a new workdir"
        )


def other_structure(directory: Path, step: int) -> UsageError:
    """The error for a readable checkpoint of another train state (orbax's TREE_MISMATCH)."""
    return UsageError(
        f"checkpoint {directory}/{step} holds a train state of another structure than this "
        f"config makes: the optimizer (or a setting that changes its state) differs from the one it "
        f"was saved with. Resume with the settings it was saved with ({directory.parent}/"
        f"config.yaml), or start a new workdir from its parameters with checkpoint.restore_from="
        f"{directory} checkpoint.restore_mode=params"
    )


def without_clip_norm(abstract_state) -> Optional[Any]:
    """The target to read a checkpoint saved before the gradient-clipping norm became a state
    number (engine/optim/optimizer.py) into: `abstract_state` without the norm; None when
    `abstract_state` has none (the mismatch is another one)."""
    hyperparams = getattr(getattr(abstract_state, "opt_state", None), "hyperparams", None)
    if "grad_clip_norm" not in (hyperparams or {}):
        return None
    assert hyperparams is not None
    older = {k: v for k, v in hyperparams.items() if k != "grad_clip_norm"}
    return abstract_state.replace(opt_state=abstract_state.opt_state._replace(hyperparams=older))


def with_zero_clip_norm(state, abstract_state):
    """`state`, read into without_clip_norm's target, with the norm put back as 0 (in its target
    sharding) for the caller to set from its config (the trainer does: setup.with_config_hparams)."""
    norm = abstract_state.opt_state.hyperparams["grad_clip_norm"]
    filled = {
        **state.opt_state.hyperparams,
        "grad_clip_norm": jax.device_put(np.zeros(norm.shape, norm.dtype), norm.sharding),
    }
    return state.replace(opt_state=state.opt_state._replace(hyperparams=filled))


def check_shardings(state, abstract_state) -> None:
    """RuntimeError unless every restored array carries its target sharding (a restore that
    kept the saved layout would silently change the memory plan)."""
    for (path, array), target in zip(jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(abstract_state)):
        if not array.sharding.is_equivalent_to(target.sharding, array.ndim):
            raise RuntimeError(
                f"restored {path_name(path)} has sharding {array.sharding}, not the target {target.sharding}"
            )
