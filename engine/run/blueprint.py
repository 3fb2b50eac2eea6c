"""A run's pure plan: from the config, the mesh's shape, the data's description and the model
family, what will be built (steps per call and per host-to-device copy, eval batch, pipeline
stages, DiLoCo replicas, the pmap axis) and the layout checks, with nothing allocated or compiled.

engine/run/setup.py builds a run from it; `launch.py plan`, `--dry-run` and sweeps read the same
decisions. The config is never changed: a decision that differs from it (the steps per call)
is carried here, with the config the run is built from.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass
from typing import Optional

from contract.activations import StagePlan
from engine.config import Config
from engine.errors import UsageError
from engine.parallel.axes import BATCH_AXES, BY_NAME, CONFIG_AXES, AxisContext, check_axes
from engine.parallel.stages import stage_plan
from engine.parallel.strategies import strategy_of
from engine.run.backends import PMAP_AXIS
from models import ModelFamily

RESIDENT_BLOCK = 64  # with the data on the devices a block is indices alone: at least this many steps


@dataclass(frozen=True)
class Blueprint:
    """What a config builds on a mesh of `mesh_shape`, decided before anything is allocated."""

    cfg: Config  # the config the run is built from: the loaded one, or a copy with the steps per call fitted
    mesh_shape: dict  # mesh axis → size
    eval_batch_size: int
    stages: StagePlan  # how the model's layer stack runs as a pipeline (one stage: not)
    replicas_from: str  # train.sync=diloco: the axis whose indices become replicas ("" = no DiLoCo)
    pmap_axis: Optional[str]  # mesh.backend=pmap: the step's collective axis

    @property
    def steps_per_call(self) -> int:
        """Optimizer steps per call of the compiled train step."""
        return self.cfg.train.steps_per_call

    def steps_per_block(self, resident: bool) -> int:
        """Training batches per host-to-device copy (`resident`: the train split lives on the devices)."""
        return block_steps(self.cfg, resident)


def block_steps(cfg: Config, resident: bool = False) -> int:
    """Training batches per host-to-device copy: data.steps_per_transfer (at least
    RESIDENT_BLOCK steps of indices when the data lives on the devices), raised to the next
    multiple of train.steps_per_call so that one call's batches always travel together."""
    per_call = cfg.train.steps_per_call
    wanted = max(cfg.data.steps_per_transfer, RESIDENT_BLOCK) if resident else cfg.data.steps_per_transfer
    return per_call * math.ceil(wanted / per_call)


def replicas_from(cfg: Config) -> str:
    """train.sync=diloco: the mesh axis the replicas are taken from (diloco.replica_axis); else ""."""
    return strategy_of(cfg).replicas_from(cfg)


def pmap_axis(cfg: Config) -> Optional[str]:
    return PMAP_AXIS if cfg.mesh.backend == "pmap" else None


def fit_step_loop(cfg: Config, family: ModelFamily, backend: str) -> Config:
    """The config with one step per call for the families whose steps XLA:CPU runs slowly in a
    device loop (a note says so); else `cfg` itself."""
    if cfg.train.steps_per_call > 1 and not family.loops_fast_on_cpu() and backend == "cpu":
        print(
            f"note: train.steps_per_call={cfg.train.steps_per_call} runs 1 step per call: on CPU, XLA runs "
            f"model.name={cfg.model.name}'s convolutions several times slower inside a multi-step call",
            file=sys.stderr,
        )
        return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps_per_call=1))
    return cfg


def check_layout(cfg: Config, mesh_shape: dict, info, packed: bool, family: ModelFamily) -> int:
    """Data-kind, batch-size and backend checks that need the mesh's shape; the eval batch size.
    `packed`: the data gives packed documents (segment ids)."""
    want = family.task.data_kind
    if info.kind != want:
        raise UsageError(
            f"model.name={cfg.model.name} needs {want} data but data.name={cfg.data.name} gives "
            f"{info.kind}; pick a matching data.name"
        )
    if packed and not (family.language_model and family.language_model.packed_documents):
        raise UsageError(
            f"data.packing=true gives packed documents, which model.name={cfg.model.name} cannot mask; "
            "set data.packing=false, or use a model that takes segment ids (llama, transformer)"
        )
    check_axes(AxisContext(cfg, dict(mesh_shape), info, family))
    shards = math.prod(mesh_shape[axis] for axis in BATCH_AXES)
    axes = [a for a in BATCH_AXES if BY_NAME[a].configured or mesh_shape[a] > 1]  # (replica: DiLoCo's)
    layout = f"{'*'.join(axes)}={'*'.join(str(mesh_shape[a]) for a in axes)}={shards}"
    batch, accum = cfg.train.global_batch_size, cfg.train.grad_accum_steps
    if batch % shards:
        raise UsageError(f"train.global_batch_size={batch} is not divisible by {layout}; use a multiple of {shards}")
    if (batch // accum) % shards:
        raise UsageError(
            f"the microbatch train.global_batch_size / train.grad_accum_steps = {batch // accum} is not "
            f"divisible by {layout}; use a global batch that is a multiple of {shards * accum}"
        )
    others = [a for a in CONFIG_AXES if a != "data"]
    if cfg.mesh.backend == "pmap" and any(mesh_shape[a] > 1 for a in others):
        raise UsageError(
            f"mesh.backend=pmap is replicated data parallel only; set "
            f"{', '.join('mesh.' + a for a in others)} to 1, or use mesh.backend=jit"
        )
    eval_batch = cfg.eval.batch_size or batch
    if eval_batch % shards:
        raise UsageError(f"eval.batch_size={eval_batch} is not divisible by {layout}; use a multiple of {shards}")
    return eval_batch


def blueprint(cfg: Config, mesh_shape: dict, info, packed: bool, family: ModelFamily, backend: str) -> Blueprint:
    """What `cfg` builds on a mesh of `mesh_shape` over `backend`'s devices (jax.default_backend()),
    for data described by `info` (`packed`: with segment ids); UsageError for a layout it refuses."""
    fitted = fit_step_loop(cfg, family, backend)
    eval_batch = check_layout(fitted, mesh_shape, info, packed, family)
    stages = stage_plan(fitted, mesh_shape["pipeline"])
    return Blueprint(fitted, dict(mesh_shape), eval_batch, stages, replicas_from(fitted), pmap_axis(fitted))
