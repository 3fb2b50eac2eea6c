"""Everything a run is built from, in the order of the one-way flow: config → mesh → data →
model → shardings → train state created already sharded → compiled steps.

`build_run` returns a `Run` of a few named parts; the trainer only drives it. The model is
known only through its family's declaration (models/family.py); the jit and pmap backends
differ only inside engine/run/backends.py.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from contract.activations import ONE_STAGE, StagePlan
from contract.adapters import adapting
from engine.config import Config
from engine.data import Dataset, TrainBatches, example_spec, load_dataset
from engine.errors import UsageError
from engine.lm import finetune
from engine.observe.perf import StepCost, enable_compilation_cache, step_cost
from engine.parallel import diloco, sharding
from engine.parallel.axes import BY_NAME, CONFIG_AXES, AxisContext, check_axes
from engine.parallel.mesh import make_mesh
from engine.parallel.stages import layouts as pipeline_layouts
from engine.parallel.stages import stage_plan, storage_order
from engine.plan.tpu import chip_of
from engine.run.backends import PMAP_AXIS, Compiled, Shapes, compile_jit, compile_pmap
from engine.run.optimizer import make_optimizer, optimizer_hparams, schedule_hparams
from engine.run.state import StatePlan, check_fits, state_plan, state_plan_of
from engine.run.step import TrainState, make_block_step, make_eval_step, make_loss_fn, make_train_step
from engine.runtime.settings import compile_cache_events
from models import REGISTRY, ModelFamily


@dataclass(frozen=True)
class Model:
    family: ModelFamily  # what the engine knows of the model (models/family.py)
    module: Any  # the flax module
    param_layouts: list  # sharding.ParamLayout per parameter


@dataclass(frozen=True)
class Inputs:
    """Where the steps' batches come from."""

    train: TrainBatches  # step → this process's host batch
    eval_rows: Any  # positions in each eval batch this process loads
    eval_batch_size: int
    steps_per_block: int  # training batches moved to the device together (see block_steps)
    steps_per_call: int  # optimizer steps per train_step call (train.steps_per_call)
    resident_bytes: int = 0  # >0: the train split lives on the devices (data.placement), this many bytes each


@dataclass
class Run:
    cfg: Config
    mesh: Mesh
    dataset: Dataset
    model: Model
    abstract_state: TrainState  # ShapeDtypeStructs carrying their target NamedShardings
    init_state: Callable  # (params=None) → a fresh TrainState, created already sharded (with these parameters)
    compiled: Compiled
    inputs: Inputs
    cost: StepCost  # model FLOPs per step (perf.step_cost)
    compile_cache: dict  # persistent-cache {"hits": n, "misses": m} while building this run
    sync_each_step: bool  # wait for each step before dispatching the next (CPU collectives)

    def train_block(self, block: int):
        """The device input for steps [block * steps_per_block, (block + 1) * steps_per_block)."""
        steps = self.inputs.steps_per_block
        return self.compiled.put_block(self.inputs.train.block(block, steps))

    def train_input(self, step: int):
        """The device input that train_step needs at `step` (its whole block)."""
        return self.train_block(step // self.inputs.steps_per_block)


RESIDENT_BLOCK = 64  # with the data on the devices a block is indices alone: at least this many steps


def block_steps(cfg: Config, resident: bool = False) -> int:
    """Training batches per host-to-device copy: data.steps_per_transfer (at least
    RESIDENT_BLOCK steps of indices when the data lives on the devices), raised to the next
    multiple of train.steps_per_call so that one call's batches always travel together."""
    per_call = cfg.train.steps_per_call
    wanted = max(cfg.data.steps_per_transfer, RESIDENT_BLOCK) if resident else cfg.data.steps_per_transfer
    return per_call * math.ceil(wanted / per_call)


def device_memory_bytes(mesh: Mesh) -> int:
    """One device's memory: what the runtime says (accelerators); for a TPU topology's devices
    (a plan: no runtime) the chip's published HBM; else this host's memory shared by its
    devices (CPU)."""
    device = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())  # one of this process's
    chip = chip_of(device)
    if chip is not None and not device.client.local_device_count():  # a topology's description: no chip here
        return chip.hbm_bytes // chip.devices_per_chip
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(jax.local_device_count(), 1)


def _resident_bytes(cfg: Config, dataset: Dataset, mesh: Mesh) -> int:
    """Bytes of the train split each device holds when it lives on the devices (data.placement
    device, or auto and it fits in data.device_memory_fraction of a device), else 0."""
    placement = cfg.data.placement
    if placement == "host":
        return 0
    why_not = (
        "its source reads examples from disk by index"
        if not isinstance(dataset.train, dict)
        else "mesh.backend=pmap takes host batches"
        if cfg.mesh.backend == "pmap"
        else "train.eager=true runs without jit"
        if cfg.train.eager
        else ""
    )
    if why_not:
        if placement == "device":
            raise UsageError(
                f"data.placement=device: data.name={cfg.data.name} cannot live on the devices here "
                f"({why_not}); use data.placement=auto or host"
            )
        return 0
    size = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in dataset.train.values())
    if placement == "auto" and size > cfg.data.device_memory_fraction * device_memory_bytes(mesh):
        return 0
    return max(size, 1)


def _check_layout(cfg: Config, mesh: Mesh, dataset: Dataset, family: ModelFamily) -> int:
    """Batch-size and backend checks that need the mesh; returns the eval batch size."""
    want = family.task.data_kind
    if dataset.info.kind != want:
        raise UsageError(
            f"model.name={cfg.model.name} needs {want} data but data.name={cfg.data.name} gives "
            f"{dataset.info.kind}; pick a matching data.name"
        )
    if "segments" in example_spec(dataset.train) and not family.takes_packed_documents():
        raise UsageError(
            f"data.packing=true gives packed documents, which model.name={cfg.model.name} cannot mask; "
            "set data.packing=false, or use a model that takes segment ids (llama, transformer)"
        )
    check_axes(AxisContext(cfg, dict(mesh.shape), dataset.info, family))
    shards = sharding.batch_shards(mesh)
    axes = [a for a in sharding.BATCH_AXES if BY_NAME[a].configured or mesh.shape[a] > 1]  # (replica: DiLoCo's)
    layout = f"{'*'.join(axes)}={'*'.join(str(mesh.shape[a]) for a in axes)}={shards}"
    batch, accum = cfg.train.global_batch_size, cfg.train.grad_accum_steps
    if batch % shards:
        raise UsageError(f"train.global_batch_size={batch} is not divisible by {layout}; use a multiple of {shards}")
    if (batch // accum) % shards:
        raise UsageError(
            f"the microbatch train.global_batch_size / train.grad_accum_steps = {batch // accum} is not "
            f"divisible by {layout}; use a global batch that is a multiple of {shards * accum}"
        )
    others = [a for a in CONFIG_AXES if a != "data"]
    if cfg.mesh.backend == "pmap" and any(mesh.shape[a] > 1 for a in others):
        raise UsageError(
            f"mesh.backend=pmap is replicated data parallel only; set "
            f"{', '.join('mesh.' + a for a in others)} to 1, or use mesh.backend=jit"
        )
    eval_batch = cfg.eval.batch_size or batch
    if eval_batch % shards:
        raise UsageError(f"eval.batch_size={eval_batch} is not divisible by {layout}; use a multiple of {shards}")
    return eval_batch


def run_hparams(cfg: Config) -> dict:
    """The shape-independent numbers of a run, as float32 scalars the compiled programs take:
    the schedule's and the model family's (in the state's `hparams`), the optimizer's."""
    schedule = schedule_hparams(cfg.optimizer, cfg.train.steps)
    schedule.update(
        {name: np.float32(value) for name, value in REGISTRY[cfg.model.name].hparam_values(cfg.model).items()}
    )
    return {"schedule": schedule, "optimizer": {k: np.float32(v) for k, v in optimizer_hparams(cfg.optimizer).items()}}


def with_config_hparams(state: TrainState, cfg: Config) -> TrainState:
    """The state with the config's hyperparameters (a resumed run follows its current config)."""
    hparams = run_hparams(cfg)

    def put(value, like):  # (DiLoCo's inner optimizer states hold one value per replica)
        return jax.device_put(jnp.broadcast_to(jnp.asarray(value, like.dtype), like.shape), like.sharding)

    schedule = {k: put(v, state.hparams[k]) for k, v in hparams["schedule"].items()}
    optimizer = {
        k: put(hparams["optimizer"].get(k, v), v) if k != "learning_rate" else v
        for k, v in state.opt_state.hyperparams.items()
    }
    return state.replace(hparams=schedule, opt_state=state.opt_state._replace(hyperparams=optimizer))


def build_model(cfg: Config, info, pmap_axis: Optional[str] = None):
    """(family, flax module) of cfg.model; a model's ValueError is the user's (exit 2)."""
    family = REGISTRY[cfg.model.name]
    try:
        with adapting(finetune.adaptation(cfg, family.projections())):
            module = family.build(
                cfg.model, info, jnp.dtype(cfg.train.compute_dtype), jnp.dtype(cfg.train.param_dtype), pmap_axis
            )
    except ValueError as e:
        raise UsageError(str(e)) from None
    return family, module


def _fit_cpu_step_loop(cfg: Config, family) -> None:
    """One step per call for the families whose steps XLA:CPU runs slowly in a device loop."""
    if cfg.train.steps_per_call > 1 and not family.loops_fast_on_cpu() and jax.default_backend() == "cpu":
        print(
            f"note: train.steps_per_call={cfg.train.steps_per_call} runs 1 step per call: on CPU, XLA runs "
            f"model.name={cfg.model.name}'s convolutions several times slower inside a multi-step call",
            file=sys.stderr,
        )
        cfg.train.steps_per_call = 1


@dataclass(frozen=True)
class Plan:
    """A run up to its compiled programs: what build_run compiles, and what a vectorised group
    of runs (engine/run/vectorize.py) compiles with a trial axis."""

    mesh: Mesh
    dataset: Dataset
    family: ModelFamily
    module: Any
    tx: optax.GradientTransformation
    state: StatePlan
    train_step: Callable  # make_block_step's (state, block) → (state, packed metrics), not compiled
    eval_step: Callable  # (state, batch) → metric sums, not compiled
    shapes: Shapes
    resident_bytes: int  # >0: the train split lives on the devices (data.placement)
    stages: StagePlan = ONE_STAGE  # how the model's layer stack runs as a pipeline (one stage: not)
    sync_step: Optional[Callable] = None  # train.sync=diloco: the outer step (engine/parallel/diloco.py), not compiled


def plan_run(cfg: Config, mesh: Optional[Mesh] = None, devices: Optional[Sequence] = None) -> Plan:
    """Mesh, data, model, train-state plan and the pure steps of a run; nothing compiled.
    `mesh`: another mesh than the config's (a vectorised group's, with a trial axis);
    `devices`: the config's mesh over these (a TPU topology's, for `launch.py plan`)."""
    enable_compilation_cache(cfg.train.compilation_cache_dir)
    replicas_from = cfg.diloco.replica_axis if cfg.train.sync == "diloco" else ""
    mesh = mesh or make_mesh(cfg.mesh, devices, replicas_from)
    dataset = load_dataset(cfg.data)
    pmap_axis = PMAP_AXIS if cfg.mesh.backend == "pmap" else None
    family, module = build_model(cfg, dataset.info, pmap_axis)
    _fit_cpu_step_loop(cfg, family)
    eval_batch_size = _check_layout(cfg, mesh, dataset, family)
    tx = make_optimizer(cfg.optimizer)
    state = state_plan(cfg, mesh, family, module, dataset.info, tx, run_hparams(cfg))
    loss_fn = make_loss_fn(module, family.task, family.hparams, len(dataset.info.sources))
    resident_bytes = _resident_bytes(cfg, dataset, mesh)
    steps = block_steps(cfg, resident=resident_bytes > 0)
    one_step = make_train_step(loss_fn, tx, cfg.optimizer.schedule, cfg.train.grad_accum_steps, pmap_axis)
    sync_step: Optional[Callable] = None
    replica_axes: tuple[str, ...] = ()
    if replicas_from:  # DiLoCo: the step taken by every replica alone, and the outer step
        one_step, sync_step = diloco.make_inner_step(one_step, mesh), diloco.make_sync_step(cfg.diloco)
        replica_axes = (diloco.REPLICA,)
        state = state_plan_of(*diloco.state_functions(state, mesh), state.param_layouts, state.seed, state.hparams)
    train_step = make_block_step(one_step, steps, cfg.train.steps_per_call, resident_bytes > 0)
    shapes = Shapes(
        state.abstract,
        state.shardings,
        example_spec(dataset.train),
        cfg.train.global_batch_size,
        steps,
        eval_batch_size,
        resident=resident_bytes > 0,
        vmapped=replica_axes,
        metrics_axes=replica_axes,
    )
    stages = stage_plan(cfg, mesh.shape["pipeline"])
    return Plan(
        mesh,
        dataset,
        family,
        module,
        tx,
        state,
        train_step,
        make_eval_step(loss_fn, pmap_axis),
        shapes,
        resident_bytes,
        stages,
        sync_step,
    )


def train_batches(cfg: Config, plan: Plan, rows: np.ndarray) -> TrainBatches:
    """The run's host batches (this process's `rows` of each), in the run's data order."""
    return TrainBatches(
        plan.dataset.train,
        cfg.train.global_batch_size,
        cfg.seed,
        cfg.data.shuffle,
        rows,
        indices_only=plan.resident_bytes > 0,
    )


def compile_plan(cfg: Config, plan: Plan, compile_train: bool = True) -> Compiled:
    """The plan's steps compiled for its mesh by the config's backend (jit or pmap)."""
    compile_fn = compile_pmap if cfg.mesh.backend == "pmap" else compile_jit
    train_step = plan.train_step if compile_train else None
    compiled = compile_fn(plan.mesh, plan.shapes, train_step, plan.eval_step, eager=cfg.train.eager, stages=plan.stages)
    if plan.sync_step is not None and compile_train:
        compiled = diloco.with_sync_step(compiled, plan)
    order = storage_order(plan.stages, plan.family.layer_stack(cfg.model))
    if order is None:
        return compiled
    # a circular pipeline stores its layers stage-major; checkpoints keep the layers' order
    flags = functools.partial(_stacked_leaves, plan.state.param_layouts, plan.tx)
    to_step, from_step = pipeline_layouts(order, flags, plan.state.shardings)
    return dataclasses.replace(compiled, to_step_layout=to_step, from_step_layout=from_step)


def _stacked_leaves(param_layouts: list, tx, state: TrainState) -> TrainState:
    """True for the leaves of `state` with a stacked-layers leading axis (parameters and their
    optimizer moments), False for the rest."""
    flags = iter(layout.logical[:1] == ("layers",) for layout in param_layouts)
    params = jax.tree.map(lambda _: next(flags), state.params)
    opt_state = optax.tree_map_params(
        tx, lambda _, flag: flag, state.opt_state, params, transform_non_params=lambda _: False
    )
    return TrainState(
        step=False,
        params=params,
        model_state=jax.tree.map(lambda _: False, state.model_state),
        opt_state=opt_state,
        rng=False,
        hparams=jax.tree.map(lambda _: False, state.hparams),
    )


def plan_cost(cfg: Config, plan: Plan, compiled: Compiled, copies: int = 1) -> StepCost:
    """The model FLOPs of one step of the plan's compiled program, per device (perf.step_cost)."""
    return step_cost(
        cfg,
        plan.family,
        plan.module,
        plan.dataset,
        plan.tx,
        plan.state.abstract,
        plan.mesh.size,
        compiled.program,
        copies,
    )


def build_run(cfg: Config, compile_train: bool = True, check_memory: bool = True) -> Run:
    """Builds and compiles a run from shapes alone; no state is allocated until init_state().

    compile_train=False (the evaluator, export) skips compiling the train step: train_step is None.
    check_memory=False (--dry-run, which reports sizes) builds a state too large for a device."""
    cache_before = dict(compile_cache_events)
    plan = plan_run(cfg)
    mesh, shapes = plan.mesh, plan.shapes
    if check_memory:  # (a plan for a pod reports what does not fit itself)
        check_fits(plan.state.abstract, device_memory_bytes(mesh))
    compiled = compile_plan(cfg, plan, compile_train)
    inputs = Inputs(
        train=train_batches(cfg, plan, compiled.rows(cfg.train.global_batch_size)),
        eval_rows=compiled.rows(shapes.eval_batch),
        eval_batch_size=shapes.eval_batch,
        steps_per_block=shapes.steps_per_block,
        steps_per_call=cfg.train.steps_per_call,
        resident_bytes=plan.resident_bytes,
    )
    return Run(
        cfg=cfg,
        mesh=mesh,
        dataset=plan.dataset,
        model=Model(plan.family, plan.module, plan.state.param_layouts),
        abstract_state=plan.state.abstract,
        init_state=plan.state.create,
        compiled=compiled,
        inputs=inputs,
        cost=plan_cost(cfg, plan, compiled),
        compile_cache={k: v - cache_before.get(k, 0) for k, v in compile_cache_events.items()},
        # XLA:CPU collectives can deadlock when a second multi-device step is dispatched
        # before the first has finished; accelerators keep asynchronous dispatch.
        sync_each_step=jax.default_backend() == "cpu" and mesh.size > 1,
    )
