"""What a run says once at its start: model, mesh and batch, and its mode (the sync strategy's
lines, a pipeline's stages and bubble, a fine-tuning base and adapters)."""

from __future__ import annotations

import math

import jax

from engine.parallel.sharding import per_device_bytes
from engine.parallel.stages import describe as describe_pipeline
from engine.parallel.sync import parts_of
from engine.run.setup import Run
from engine.runtime.units import human_bytes
from engine.state.train_state import FROZEN
from models.family import stacked_layers


def startup_lines(run: Run) -> list[str]:
    """What is running, said once at a run's start: model, mesh and batch, and the mode (a
    pipeline's stages and bubble, DiLoCo's replicas and H, a fine-tuning base and adapters)."""
    cfg, state = run.cfg, run.abstract_state
    mesh = " ".join(f"{axis}={size}" for axis, size in run.mesh.shape.items() if size > 1) or "one device"
    params = sum(math.prod(x.shape) for x in jax.tree.leaves(state.params))
    lines = [
        f"run: {cfg.model.name}, {params:,} trained parameters, on {run.mesh.size} "
        f"{run.mesh.devices.flat[0].platform} device(s) ({mesh}); global batch {cfg.train.global_batch_size}, "
        f"{cfg.train.steps} steps"
    ]
    lines += parts_of(cfg).startup_lines(cfg, run, params)  # (DiLoCo: its replicas and H)
    plan = run.blueprint.stages  # the pipeline the run was built with
    if plan.stages > 1:
        lines.append(describe_pipeline(plan, stacked_layers(run.model.family, cfg.model)))
    if cfg.finetune.lora.rank or cfg.finetune.base:
        frozen = per_device_bytes(state.model_state.get(FROZEN, {}))
        dtype = cfg.finetune.base_dtype if cfg.finetune.base_dtype != "none" else cfg.train.param_dtype
        lines.append(
            f"fine-tuning: base {cfg.finetune.base or '(seeded initialisation)'} frozen in {dtype} "
            f"({human_bytes(frozen)} per device); LoRA rank {cfg.finetune.lora.rank} on "
            f"{', '.join(cfg.finetune.lora.targets)}"
        )
    return lines
