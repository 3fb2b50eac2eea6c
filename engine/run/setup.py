"""Building a run, in the order of the one-way flow: config → mesh → data → blueprint (the pure
plan: engine/run/blueprint.py) → model → shardings → train state created already sharded →
compiled steps.

`build_run` returns a `Run` of a few named parts; the trainer only drives it. The model is
known only through its family's declaration (models/family.py); the jit and pmap backends
differ only inside engine/run/backends.py.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from contract.activations import ONE_STAGE, Constrainer, StagePlan
from engine.config import Config
from engine.config.objective import config_value, objective_of
from engine.data import Dataset, TrainBatches, example_spec
from engine.data.chat_data import with_model
from engine.data.placement import resident_bytes
from engine.errors import UsageError
from engine.lm import finetune
from engine.objectives import objective_part
from engine.observe.perf import StepCost, enable_compilation_cache
from engine.optim.optimizer import make_optimizer, optimizer_hparams, schedule_hparams
from engine.parallel.mesh import make_mesh
from engine.parallel.sharding import ActivationLayout, batch_sharding, batch_shards
from engine.parallel.stages import layouts as pipeline_layouts
from engine.parallel.stages import storage_order
from engine.parallel.sync import compile_sync, parts_of
from engine.run import reference_logps
from engine.run.backends import Compiled, Shapes, compile_jit, compile_pmap
from engine.run.blueprint import Blueprint, blueprint, replicas_from
from engine.run.cost import step_cost
from engine.run.data_record import load_rendered
from engine.run.state import StatePlan, check_fits, state_plan, state_plan_of
from engine.run.step import make_block_step, make_eval_step, make_train_step
from engine.runtime.memory import device_memory_bytes
from engine.runtime.settings import compile_cache_events
from engine.state.train_state import TrainState
from models import REGISTRY, ModelFamily
from models.configs import ModelError, check_attention
from models.family import BuildOptions, projections, stacked_layers
from models.layers import LossChunk


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
    steps_per_block: int  # training batches moved to the device together (blueprint.block_steps)
    steps_per_call: int  # optimizer steps per train_step call (train.steps_per_call)
    resident_bytes: int = 0  # >0: the train split lives on the devices (data.placement), this many bytes each


@dataclass
class Run:
    blueprint: Blueprint  # what the config builds (engine/run/blueprint.py); its cfg is the run's
    mesh: Mesh
    dataset: Dataset
    model: Model
    abstract_state: TrainState  # ShapeDtypeStructs carrying their target NamedShardings
    init_state: Callable  # (params=None) → a fresh TrainState, created already sharded (with these parameters)
    compiled: Compiled
    inputs: Inputs
    cost: StepCost  # model FLOPs per step (run/cost.py step_cost)
    compile_cache: dict  # persistent-cache {"hits": n, "misses": m} while building this run
    sync_each_step: bool  # wait for each step before dispatching the next (CPU collectives)
    rollouts: Any = None  # an objective that samples its batches (GRPO): its sampler, the blocks its prompts

    @property
    def cfg(self) -> Config:
        """The config the run was built from (the steps per call fitted: Blueprint.cfg)."""
        return self.blueprint.cfg

    def train_block(self, block: int):
        """The device input for steps [block * steps_per_block, (block + 1) * steps_per_block)."""
        steps = self.inputs.steps_per_block
        return self.compiled.put_block(self.inputs.train.block(block, steps))


def run_hparams(cfg: Config) -> dict:
    """The shape-independent numbers of a run, as float32 scalars the compiled programs take:
    the schedule's and the model family's (in the state's `hparams`), the optimizer's."""
    schedule = schedule_hparams(cfg.optimizer, cfg.train.steps)
    schedule.update(
        {name: np.float32(value) for name, value in REGISTRY[cfg.model.name].hparam_values(cfg.model).items()}
    )
    for name, key in objective_of(cfg).step_hparams.items():  # (DPO's β: a step input, as the schedule's)
        schedule[name] = np.float32(config_value(cfg, key))
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


def build_model(
    cfg: Config,
    info,
    pmap_axis: Optional[str] = None,
    stages: StagePlan = ONE_STAGE,
    layout: Optional[Constrainer] = None,
):
    """(family, flax module) of cfg.model, its layer stack run as the pipeline `stages`, its
    activations pinned by `layout`; a model's ValueError is the user's (exit 2)."""
    family = REGISTRY[cfg.model.name]
    try:
        options = BuildOptions(pmap_axis, stages, finetune.adaptation(cfg, projections(family)), layout)
        module = family.build(
            cfg.model, info, jnp.dtype(cfg.train.compute_dtype), jnp.dtype(cfg.train.param_dtype), options
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
    return family, module


@dataclass(frozen=True)
class Traced:
    """A run traced up to its compiled programs (nothing compiled; not `launch.py plan`, which
    compiles them for a pod: engine/plan/): what build_run compiles, and what a vectorised group
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
    blueprint: Blueprint  # what the config builds on this mesh (engine/run/blueprint.py)
    sync_step: Optional[Callable] = None  # train.sync=diloco: the outer step (engine/parallel/diloco.py), not compiled
    trained: Any = None  # the module the train step traces (its activations pinned to the mesh: step_modules)
    rollouts: Any = None  # objectives.RolloutPart: the run samples its batches (GRPO)

    @property
    def cfg(self) -> Config:
        """The config the run was traced from (the steps per call fitted: Blueprint.cfg)."""
        return self.blueprint.cfg

    @property
    def stages(self) -> StagePlan:
        return self.blueprint.stages


def trace_run(
    cfg: Config, mesh: Optional[Mesh] = None, devices: Optional[Sequence] = None, dataset: Optional[Dataset] = None
) -> Traced:
    """Mesh, data, model, blueprint, train-state plan and the pure steps of a run; nothing compiled.
    `mesh`: another mesh than the config's (a vectorised group's, with a trial axis);
    `devices`: the config's mesh over these (a TPU topology's, for `launch.py plan`);
    `dataset`: in place of the config's data (a reader's stand-in: engine/data/recorded.py)."""
    enable_compilation_cache(cfg.train.compilation_cache_dir)
    mesh = mesh or make_mesh(cfg.mesh, devices, replicas_from(cfg))
    try:  # (cuDNN's attention on a CPU run or a TPU target: one line before the data, not JAX's failure)
        check_attention(cfg.model, mesh.devices.flat[0].platform)
    except ModelError as e:
        raise UsageError(str(e)) from None
    if dataset is None:
        # (chat: its template, with the time of the run's start)
        dataset = load_rendered(cfg, with_model(cfg.data, finetune.base_workdir(cfg) or cfg.workdir))
    dataset = reference_logps.with_slots(cfg, dataset)  # (dpo.precompute_reference: filled before training)
    objective = objective_part(cfg)  # the config's train.objective's loss (engine/objectives)
    rollouts = objective.rollouts  # (GRPO: the update trains on the completions the run samples)
    dataset = rollouts.data(cfg, dataset, dict(mesh.shape)) if rollouts else dataset  # (its layouts checked)
    packed = "segments" in example_spec(dataset.train)
    bp = blueprint(cfg, dict(mesh.shape), dataset.info, packed, REGISTRY[cfg.model.name], jax.default_backend())
    cfg = bp.cfg
    family, module = build_model(cfg, dataset.info, bp.pmap_axis)  # whole, unconstrained: init, export
    tx = make_optimizer(cfg.optimizer)
    state = state_plan(cfg, mesh, family, module, dataset.info, tx, run_hparams(cfg))
    sync = parts_of(cfg)  # train.sync's members (engine/parallel/sync.py)
    replica_axes = sync.replica_axes
    trained, evaluated = step_modules(cfg, dataset.info, bp, mesh, module, replica_axes)
    loss_fn = objective.loss_fn(trained, family, len(dataset.info.sources))
    resident = 0 if rollouts else resident_bytes(cfg, dataset, lambda: device_memory_bytes(mesh))
    steps = 1 if rollouts else bp.steps_per_block(resident > 0)  # (rollouts: each step's batch sampled)
    one_step = make_train_step(loss_fn, tx, cfg.optimizer.schedule, cfg.train.grad_accum_steps, bp.pmap_axis)
    # (DiLoCo: the step taken by every replica alone, the outer step, the replicas' stacked state)
    one_step, sync_step, functions = sync.step_and_state(cfg, mesh, one_step, state)
    if functions is not None:
        init, with_params, shardings = functions
        state = state_plan_of(init, with_params, shardings, state.param_layouts, state.seed, state.hparams)
    train_step = make_block_step(one_step, steps, bp.steps_per_call, resident > 0, objective_of(cfg).sums)
    shapes = Shapes(
        state.abstract,
        state.shardings,
        rollouts.spec(cfg) if rollouts else example_spec(dataset.train),
        rollouts.rows(cfg) if rollouts else cfg.train.global_batch_size,
        steps,
        bp.eval_batch_size,
        resident=resident > 0,
        vmapped=replica_axes,
        metrics_axes=replica_axes,
    )
    eval_loss_fn = objective.loss_fn(evaluated, family, len(dataset.info.sources))
    eval_step = make_eval_step(eval_loss_fn, bp.pmap_axis)
    traced = Traced(
        mesh, dataset, family, module, tx, state, train_step, eval_step, shapes, resident, bp, sync_step, trained
    )
    return dataclasses.replace(traced, rollouts=rollouts)


def step_modules(cfg: Config, info, bp: Blueprint, mesh: Mesh, module, vmapped: tuple[str, ...]) -> tuple[Any, Any]:
    """The modules the train and eval steps trace: the layer stack run as the pipeline (eager
    steps run it whole) and, where jit compiles them, the activations pinned to `mesh` (the
    train step's not over the mesh axes it is vmapped over); `module` itself where neither."""
    piped = bp.stages.stages > 1 and not cfg.train.eager
    pinned = cfg.mesh.backend != "pmap" and not cfg.train.eager
    stages = bp.stages if piped else ONE_STAGE

    def built(layout: Optional[Constrainer]):
        return build_model(cfg, info, bp.pmap_axis, stages, layout)[1]

    if pinned:
        return built(ActivationLayout(mesh, vmapped)), built(ActivationLayout(mesh))
    stepped = built(None) if piped else module
    return stepped, stepped


def train_batches(cfg: Config, traced: Traced, rows: np.ndarray) -> TrainBatches:
    """The run's host batches (this process's `rows` of each), in the run's data order."""
    return TrainBatches(
        traced.dataset.train,
        cfg.train.global_batch_size,
        cfg.seed,
        cfg.data.shuffle,
        rows,
        indices_only=traced.resident_bytes > 0,
    )


def compile_traced(cfg: Config, traced: Traced, compile_train: bool = True) -> Compiled:
    """The traced steps compiled for its mesh by the config's backend (jit or pmap)."""
    train_step = traced.train_step if compile_train else None
    if cfg.mesh.backend == "pmap":
        compiled = compile_pmap(traced.mesh, traced.shapes, train_step, traced.eval_step)
    else:
        compiled = compile_jit(traced.mesh, traced.shapes, train_step, traced.eval_step, eager=cfg.train.eager)
    if compile_train:  # train.sync's programs beside the step (engine/parallel/sync.py)
        compiled = compile_sync(cfg, compiled, traced)
    order = storage_order(traced.stages, stacked_layers(traced.family, cfg.model))
    if order is None:
        return compiled
    # a circular pipeline stores its layers stage-major; checkpoints keep the layers' order
    flags = functools.partial(_stacked_leaves, traced.state.param_layouts, traced.tx)
    to_step, from_step = pipeline_layouts(order, flags, traced.state.shardings)
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


def train_loss_chunk(program) -> Optional[LossChunk]:
    """The loss chunk the train step traces (models/layers.py choose_loss_chunk): from a
    micro-batch (one trial's in a vectorised group) of the data's sequences, split as the mesh
    splits the batch and the sequence; None for a model without model.loss_chunk."""
    cfg, mesh, language_model = program.cfg, program.mesh, program.family.language_model
    if language_model is None or language_model.loss_chunk is None:
        return None
    # (rows to the module: a DPO pair is two)
    micro = cfg.train.global_batch_size // cfg.train.grad_accum_steps * objective_of(cfg).rows_per_example(cfg)
    batch_splits = batch_shards(mesh)
    return language_model.loss_chunk(cfg.model, program.dataset.info, micro, batch_splits, mesh.shape["context"])


def traced_cost(cfg: Config, traced: Traced, compiled: Compiled, copies: int = 1) -> StepCost:
    """The model FLOPs of one step of the traced run's compiled program, per device (cost.step_cost;
    a loss the budget splits, model.loss_chunk=0, is a loop XLA counts once, as a set chunk is)."""
    chunk = train_loss_chunk(traced)
    return step_cost(
        cfg,
        traced.family,
        traced.trained if traced.trained is not None else traced.module,  # (as the step traced it)
        traced.dataset,
        traced.tx,
        traced.state.abstract,
        traced.mesh.size,
        compiled.program,
        copies,
        chunk.chunk if chunk is not None and chunk.auto else 0,
        objective_of(cfg),
    )


def build_run(
    cfg: Config,
    compile_train: bool = True,
    check_memory: bool = True,
    dataset: Optional[Dataset] = None,
    devices: Optional[Sequence] = None,
) -> Run:
    """Builds and compiles a run from shapes alone; no state is allocated until init_state().

    compile_train=False (the evaluator, export) skips compiling the train step: train_step is None.
    check_memory=False (--dry-run, which reports sizes) builds a state too large for a device.
    dataset: in place of the config's data (sample and export: the run's recorded data.json).
    devices: the run's own devices (a sweep trial's sub-mesh), in place of the first mesh.num_devices."""
    cache_before = dict(compile_cache_events)
    traced = trace_run(cfg, dataset=dataset, devices=devices)
    cfg, mesh, shapes = traced.cfg, traced.mesh, traced.shapes  # (the steps per call fitted: Blueprint.cfg)
    if check_memory:  # (a plan for a pod reports what does not fit itself)
        check_fits(traced.state.abstract, device_memory_bytes(mesh))
    compiled = compile_traced(cfg, traced, compile_train)
    inputs = Inputs(
        train=train_batches(cfg, traced, compiled.rows(cfg.train.global_batch_size)),
        eval_rows=compiled.rows(shapes.eval_batch),
        eval_batch_size=shapes.eval_batch,
        steps_per_block=shapes.steps_per_block,
        steps_per_call=cfg.train.steps_per_call,
        resident_bytes=traced.resident_bytes,
    )
    return Run(
        blueprint=traced.blueprint,
        mesh=mesh,
        dataset=traced.dataset,
        model=Model(traced.family, traced.module, traced.state.param_layouts),
        abstract_state=traced.state.abstract,
        init_state=traced.state.create,
        compiled=compiled,
        inputs=inputs,
        cost=traced_cost(cfg, traced, compiled),
        compile_cache={k: v - cache_before.get(k, 0) for k, v in compile_cache_events.items()},
        # XLA:CPU collectives can deadlock when a second multi-device step is dispatched
        # before the first has finished; accelerators keep asynchronous dispatch.
        sync_each_step=jax.default_backend() == "cpu" and mesh.size > 1,
        rollouts=_sampler(cfg, traced) if compile_train else None,
    )


def _sampler(cfg: Config, traced: Traced):
    """The objective's sampler compiled beside the train step (GRPO's decode program), or None."""
    if traced.rollouts is None:
        return None
    return traced.rollouts.build(cfg, traced.family, traced.dataset, traced.state.abstract, batch_sharding(traced.mesh))
