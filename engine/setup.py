"""Everything a run is built from, in the order of the one-way flow: config → mesh → data →
model → shardings → train state created already sharded → compiled steps.

`build_run` returns a `Run`; the trainer only drives it. The jit and pmap backends differ
only inside `_compile_jit` and `_compile_pmap`; nothing else asks which one is in use.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from engine import sharding
from engine.config import Config
from engine.data import Dataset, TrainBatches, load_dataset, process_rows
from engine.errors import UsageError
from engine.mesh import make_mesh
from engine.perf import compile_cache_events, enable_compilation_cache
from engine.optim import make_optimizer, optimizer_hparams, schedule_hparams
from engine.step import TrainState, make_block_step, make_eval_step, make_loss_fn, make_train_step
from models import REGISTRY

PMAP_AXIS = "batch"
TASK_DATA = {"classification": "image", "lm": "tokens"}


@dataclass
class Run:
    cfg: Config
    mesh: Mesh
    dataset: Dataset
    module: Any  # the flax module
    abstract_state: TrainState  # ShapeDtypeStructs carrying their target NamedShardings
    init_state: Callable  # () → a fresh TrainState, created already sharded
    to_step_layout: Callable  # TrainState → what train_step takes (pmap: one copy per device)
    from_step_layout: Callable  # the inverse, e.g. for saving a checkpoint
    param_layouts: list  # sharding.ParamLayout per parameter
    train_batches: TrainBatches  # step → this process's host batch
    put_batch: Callable  # (host batch, global batch size) → global device batch (eval)
    put_block: Callable  # host block of steps_per_block batches → the device input of train_step
    eval_rows: Any  # positions in each eval batch this process loads
    train_step: Callable  # (state, device block) → (state, metrics [steps_per_call, ...]); from batch step % block
    eval_step: Callable  # (state, device batch) → metric sums
    sync_each_step: bool  # wait for each step before dispatching the next (CPU collectives)
    compile_seconds: float
    flops_per_device_step: float  # model FLOPs per device per step, from XLA's cost analysis (0 if unknown)
    flops_source: str  # which program that count comes from (see _model_flops)
    flops_are_model_flops: bool  # False: the count includes recomputation, or misses loops and custom calls
    memory_analysis: Any  # the compiled step's memory estimate (None in eager mode)
    eval_batch_size: int
    compile_cache: dict  # persistent-cache {"hits": n, "misses": m} while building this run
    steps_per_block: int  # training batches moved to the device together (see block_steps)
    steps_per_call: int  # optimizer steps per train_step call (train.steps_per_call)

    def train_block(self, block: int):
        """The device input for steps [block * steps_per_block, (block + 1) * steps_per_block)."""
        return self.put_block(self.train_batches.block(block, self.steps_per_block))

    def train_input(self, step: int):
        """The device input that train_step needs at `step` (its whole block)."""
        return self.train_block(step // self.steps_per_block)


def block_steps(cfg: Config) -> int:
    """Training batches per host-to-device copy: data.steps_per_transfer, raised to the next
    multiple of train.steps_per_call so that one call's batches always travel together."""
    per_call = cfg.train.steps_per_call
    return per_call * math.ceil(cfg.data.steps_per_transfer / per_call)


def _check_layout(cfg: Config, mesh: Mesh, dataset: Dataset, task: str) -> int:
    """Batch-size and backend checks that need the mesh; returns the eval batch size."""
    want = TASK_DATA[task]
    if dataset.info.kind != want:
        raise UsageError(f"model.name={cfg.model.name} needs {want} data but data.name={cfg.data.name} gives "
                         f"{dataset.info.kind}; pick a matching data.name")
    shards = sharding.batch_shards(mesh)
    layout = f"data*fsdp={mesh.shape['data']}*{mesh.shape['fsdp']}={shards}"
    batch, accum = cfg.train.global_batch_size, cfg.train.grad_accum_steps
    if batch % shards:
        raise UsageError(f"train.global_batch_size={batch} is not divisible by {layout}; "
                         f"use a multiple of {shards}")
    if (batch // accum) % shards:
        raise UsageError(f"the microbatch train.global_batch_size / train.grad_accum_steps = {batch // accum} is not "
                         f"divisible by {layout}; use a global batch that is a multiple of {shards * accum}")
    if cfg.mesh.backend == "pmap" and (mesh.shape["fsdp"] > 1 or mesh.shape["tensor"] > 1):
        raise UsageError("mesh.backend=pmap is replicated data parallel only; set mesh.fsdp=1 mesh.tensor=1 "
                         "or use mesh.backend=jit")
    eval_batch = cfg.eval.batch_size or batch
    if eval_batch % shards:
        raise UsageError(f"eval.batch_size={eval_batch} is not divisible by {layout}; use a multiple of {shards}")
    return eval_batch


def run_hparams(cfg: Config) -> dict:
    """The shape-independent numbers of a run, as float32 scalars the compiled programs take."""
    schedule = schedule_hparams(cfg.optimizer, cfg.train.steps)
    if hasattr(cfg.model, "dropout_rate"):
        schedule["dropout_rate"] = np.float32(cfg.model.dropout_rate)
    return {"schedule": schedule,
            "optimizer": {k: np.float32(v) for k, v in optimizer_hparams(cfg.optimizer).items()}}


def with_config_hparams(state: TrainState, cfg: Config) -> TrainState:
    """The state with the config's hyperparameters (a resumed run follows its current config)."""
    hparams = run_hparams(cfg)

    def put(value, like):
        return jax.device_put(jnp.asarray(value, like.dtype), like.sharding)

    schedule = {k: put(v, state.hparams[k]) for k, v in hparams["schedule"].items()}
    optimizer = {k: put(hparams["optimizer"].get(k, v), v) if k != "learning_rate" else v
                 for k, v in state.opt_state.hyperparams.items()}
    return state.replace(hparams=schedule, opt_state=state.opt_state._replace(hyperparams=optimizer))


def _sample_inputs(info, task: str):
    if task == "lm":
        return jnp.zeros((1, info.seq_len), jnp.int32)
    return jnp.zeros((1, *info.input_shape), jnp.float32)


def build_run(cfg: Config, compile_train: bool = True) -> Run:
    """Builds and compiles a run from shapes alone; no state is allocated until init_state().

    compile_train=False (the evaluator, export) skips compiling the train step: train_step is None."""
    enable_compilation_cache(cfg.train.compilation_cache_dir)
    cache_before = dict(compile_cache_events)
    mesh = make_mesh(cfg.mesh)
    dataset = load_dataset(cfg.data)
    spec = REGISTRY[cfg.model.name]
    eval_batch_size = _check_layout(cfg, mesh, dataset, spec.task)
    pmap_axis = PMAP_AXIS if cfg.mesh.backend == "pmap" else None
    module = spec.build(cfg.model, dataset.info, jnp.dtype(cfg.train.compute_dtype), jnp.dtype(cfg.train.param_dtype),
                        pmap_axis)
    loss_fn = make_loss_fn(module, spec.task)
    tx = make_optimizer(cfg.optimizer)
    sample = _sample_inputs(dataset.info, spec.task)

    def init_state(seed, hparams) -> TrainState:
        """Seed and hyperparameters are traced inputs: one compiled init serves every value."""
        init_key, train_key = jax.random.split(jax.random.key(seed))
        variables = module.init({"params": init_key, "dropout": init_key}, sample, train=False)
        variables = sharding.unbox(variables)
        params = variables.pop("params")
        opt_state = tx.init(params)
        opt_state = opt_state._replace(hyperparams={k: jnp.asarray(hparams["optimizer"][k], v.dtype)
                                                    for k, v in opt_state.hyperparams.items()})
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, model_state=variables, opt_state=opt_state,
                          rng=jax.random.key_data(train_key), hparams=hparams["schedule"])

    # Shapes first, no allocation: the logical axes on the abstract parameters give the layout.
    abstract_vars = jax.eval_shape(lambda: module.init({"params": jax.random.key(0), "dropout": jax.random.key(0)},
                                                       sample, train=False))
    param_layouts = sharding.layouts(abstract_vars["params"], cfg.mesh.rules, mesh)
    replicated = sharding.replicated(mesh)
    param_shardings = sharding.tree_shardings(abstract_vars["params"], param_layouts, mesh)
    abstract_opt = jax.eval_shape(tx.init, sharding.unbox(abstract_vars["params"]))
    opt_shardings = optax.tree_map_params(tx, lambda _, s: s, abstract_opt, param_shardings,
                                          transform_non_params=lambda _: replicated)
    model_state = {k: v for k, v in sharding.unbox(abstract_vars).items() if k != "params"}
    hparams = run_hparams(cfg)
    state_shardings = TrainState(step=replicated, params=param_shardings,
                                 model_state=jax.tree.map(lambda _: replicated, model_state),
                                 opt_state=opt_shardings, rng=replicated,
                                 hparams=jax.tree.map(lambda _: replicated, hparams["schedule"]))
    seed = np.int32(cfg.seed)
    abstract_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                  jax.eval_shape(init_state, seed, hparams), state_shardings)
    # Created inside jit with output shardings: no device ever holds the whole state.
    create_state = jax.jit(init_state, out_shardings=state_shardings)

    train_step = make_block_step(make_train_step(loss_fn, tx, cfg.optimizer.schedule, cfg.train.grad_accum_steps,
                                                 pmap_axis), block_steps(cfg), cfg.train.steps_per_call)
    eval_step = make_eval_step(loss_fn, pmap_axis)
    compile_fn = _compile_pmap if pmap_axis else _compile_jit
    compiled = compile_fn(cfg, mesh, abstract_state, state_shardings, dataset.train,
                          train_step if compile_train else None, eval_step, eval_batch_size)
    train_batches = TrainBatches(dataset.train, cfg.train.global_batch_size, cfg.seed, cfg.data.shuffle,
                                 compiled["rows"](cfg.train.global_batch_size))
    flops, flops_source, model_flops = compiled["flops"], "XLA cost analysis of the compiled step", True
    differs = ", ".join(_differs_from_reference(cfg, module))
    if flops and differs:
        reference = _model_flops(cfg, spec, dataset, tx, abstract_state, mesh.size)
        if reference is not None:
            flops, flops_source = reference, f"XLA cost analysis of the same step without {differs}"
        else:  # plugin backends (GPU, TPU) may not analyse an uncompiled program
            flops_source, model_flops = f"XLA cost analysis of the compiled step, with {differs}", False
    return Run(cfg=cfg, mesh=mesh, dataset=dataset, module=module, abstract_state=abstract_state,
               init_state=lambda: create_state(seed, hparams), to_step_layout=compiled["to_step_layout"],
               from_step_layout=compiled["from_step_layout"], param_layouts=param_layouts,
               train_batches=train_batches,
               put_batch=compiled["put_batch"], put_block=compiled["put_block"], train_step=compiled["train_step"],
               eval_step=compiled["eval_step"],
               # XLA:CPU collectives can deadlock when a second multi-device step is dispatched
               # before the first has finished; accelerators keep asynchronous dispatch.
               sync_each_step=jax.default_backend() == "cpu" and mesh.size > 1,
               compile_seconds=compiled["compile_seconds"], flops_per_device_step=flops, flops_source=flops_source,
               flops_are_model_flops=model_flops,
               memory_analysis=compiled["memory"], eval_batch_size=eval_batch_size,
               eval_rows=compiled["rows"](eval_batch_size),
               compile_cache={k: v - cache_before.get(k, 0) for k, v in compile_cache_events.items()},
               steps_per_block=block_steps(cfg), steps_per_call=cfg.train.steps_per_call)


# Settings that change the work a step does, or what XLA can count of it, but not the model's
# FLOPs: rematerialisation recomputes, a chunked loss and gradient accumulation are loops
# whose body XLA's cost analysis counts once, and fused attention is a custom call it cannot
# count at all. MFU is measured against the step without them.
REFERENCE_MODEL = {"remat": "none", "loss_chunk": 0, "attention": "xla"}


def _differs_from_reference(cfg: Config, module) -> list[str]:
    """The settings of this run that make its compiled FLOP count differ from the model's."""
    differs = [f"{key}={getattr(module, key)}" for key, value in REFERENCE_MODEL.items()
               if getattr(module, key, value) != value]
    return differs + [f"{key}={getattr(cfg.train, key)}" for key in ("grad_accum_steps", "steps_per_call")
                      if getattr(cfg.train, key) > 1]


def _lowered_flops(lowered) -> float | None:
    """XLA's FLOP count of a lowered program; None where the backend gives none."""
    analysis = lowered.cost_analysis()
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else None
    return float(analysis["flops"]) if analysis and "flops" in analysis else None


def _model_flops(cfg: Config, spec, dataset: Dataset, tx, state: TrainState, devices: int) -> float | None:
    """FLOPs per device of one train step with REFERENCE_MODEL settings and no gradient
    accumulation, from XLA's cost analysis of the lowered (not compiled) program: a trace,
    no compilation. None where the backend cannot analyse a lowered program."""
    model_cfg = dataclasses.replace(cfg.model, **{k: v for k, v in REFERENCE_MODEL.items() if hasattr(cfg.model, k)})
    module = spec.build(model_cfg, dataset.info, jnp.dtype(cfg.train.compute_dtype), jnp.dtype(cfg.train.param_dtype))
    step = make_train_step(make_loss_fn(module, spec.task), tx, cfg.optimizer.schedule)
    batch = {name: jax.ShapeDtypeStruct((cfg.train.global_batch_size, *a.shape[1:]), a.dtype)
             for name, a in dataset.train.items()}
    unsharded = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    flops = _lowered_flops(jax.jit(step).lower(unsharded, batch))
    return None if flops is None else flops / devices


def _global_arrays(host_batch: dict[str, np.ndarray], array_sharding: NamedSharding,
                   global_rows: tuple[int, ...]) -> dict[str, jax.Array]:
    """This process's rows (see data.process_rows) → one global array per key."""
    if jax.process_count() == 1:  # the rows are the whole batch: one transfer of the tree is cheapest
        return jax.device_put(host_batch, array_sharding)
    return {name: jax.make_array_from_process_local_data(array_sharding, value, (*global_rows, *value.shape[
        len(global_rows):])) for name, value in host_batch.items()}


def _identity(state):
    return state


def _compile_jit(cfg, mesh, state, state_shardings, train_arrays, train_step, eval_step, eval_batch_size) -> dict:
    batch_sharding = sharding.batch_sharding(mesh)
    common = dict(to_step_layout=_identity, from_step_layout=_identity,
                  rows=lambda global_batch: process_rows(batch_sharding, global_batch))

    def put_batch(host_batch, global_batch):
        return _global_arrays(host_batch, batch_sharding, (global_batch,))

    # Training batches travel in blocks of K steps ([K, batch, ...]): one transfer per block,
    # and the step picks its own batch, so the host's per-step work is a dispatch alone.
    steps = block_steps(cfg)
    block_sharding = NamedSharding(mesh, PartitionSpec(None, sharding.BATCH_AXES))

    def put_block(host_block):
        return _global_arrays(host_block, block_sharding, (steps, cfg.train.global_batch_size))

    common["put_block"] = put_block
    if cfg.train.eager:
        def eager(fn):
            def run(*args):
                with jax.disable_jit():
                    return fn(*args)
            return run
        return dict(put_batch=put_batch, train_step=eager(train_step), eval_step=eager(eval_step),
                    compile_seconds=0.0, flops=0.0, memory=None, **common)
    # The state is donated: its buffers are reused for the new state instead of copied.
    jitted = train_step and jax.jit(train_step, in_shardings=(state_shardings, block_sharding),
                                    out_shardings=(state_shardings, sharding.replicated(mesh)), donate_argnums=0)
    start = time.perf_counter()
    abstract_block = {name: jax.ShapeDtypeStruct((steps, cfg.train.global_batch_size, *array.shape[1:]), array.dtype,
                                                 sharding=block_sharding) for name, array in train_arrays.items()}
    with sharding.activation_layout(mesh):  # traced here: the models' activation constraints apply
        compiled = jitted.lower(state, abstract_block).compile() if train_step else None
        compile_seconds = time.perf_counter() - start
        eval_batch = {**{name: jax.ShapeDtypeStruct((eval_batch_size, *a.shape[1:]), a.dtype, sharding=batch_sharding)
                         for name, a in train_arrays.items()},
                      "mask": jax.ShapeDtypeStruct((eval_batch_size,), jnp.float32, sharding=batch_sharding)}
        eval_jit = jax.jit(eval_step, in_shardings=(state_shardings, batch_sharding),
                           out_shardings=sharding.replicated(mesh)).lower(state, eval_batch).compile()
    return dict(put_batch=put_batch, train_step=compiled, eval_step=eval_jit, compile_seconds=compile_seconds,
                flops=_flops(compiled) if compiled else 0.0, memory=compiled and compiled.memory_analysis(), **common)


def _compile_pmap(cfg, mesh, state, state_shardings, train_arrays, train_step, eval_step, eval_batch_size) -> dict:
    devices = mesh.devices.reshape(-1)
    count = len(devices)
    pmap_mesh = Mesh(devices, (PMAP_AXIS,))
    stacked = NamedSharding(pmap_mesh, PartitionSpec(PMAP_AXIS))
    # Classic replicated data parallel: a copy of the state per device on a leading axis.
    to_step_layout = jax.jit(lambda s: jax.tree.map(lambda x: jnp.broadcast_to(x, (count, *x.shape)), s),
                             out_shardings=stacked)
    from_step_layout = jax.jit(lambda s: jax.tree.map(lambda x: x[0], s), out_shardings=state_shardings)
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct((count, *x.shape), x.dtype, sharding=stacked), state)

    def put_batch(host_batch, global_batch):  # [rows] → [devices, rows per device]
        local = len(pmap_mesh.local_devices)
        return _global_arrays({k: v.reshape(local, -1, *v.shape[1:]) for k, v in host_batch.items()}, stacked,
                              (count, global_batch // count))

    steps = block_steps(cfg)

    def put_block(host_block):  # [steps, rows] → [devices, steps, rows per device]
        local = len(pmap_mesh.local_devices)
        per_device = {k: v.reshape(steps, local, -1, *v.shape[2:]).swapaxes(0, 1) for k, v in host_block.items()}
        return _global_arrays(per_device, stacked, (count, steps, cfg.train.global_batch_size // count))

    pmapped = train_step and jax.pmap(train_step, axis_name=PMAP_AXIS, devices=list(devices), donate_argnums=0)
    pmapped_eval = jax.pmap(eval_step, axis_name=PMAP_AXIS, devices=list(devices))
    start = time.perf_counter()
    abstract_block = {name: jax.ShapeDtypeStruct((count, steps, cfg.train.global_batch_size // count,
                                                  *array.shape[1:]), array.dtype, sharding=stacked)
                      for name, array in train_arrays.items()}
    compiled = pmapped.lower(state, abstract_block).compile() if train_step else None
    compile_seconds = time.perf_counter() - start

    def step(state, batch):
        state, metrics = compiled(state, batch)
        return state, jax.tree.map(lambda x: x[0], metrics)  # psum'd: every replica holds the same

    def evaluate(state, batch):
        return jax.tree.map(lambda x: x[0], pmapped_eval(state, batch))

    return dict(put_batch=put_batch, put_block=put_block, train_step=step, eval_step=evaluate,
                compile_seconds=compile_seconds,
                flops=_flops(compiled) if compiled else 0.0, memory=compiled and compiled.memory_analysis(),
                to_step_layout=to_step_layout,
                from_step_layout=from_step_layout,
                rows=lambda global_batch: process_rows(stacked, global_batch, global_batch // count))


def _flops(compiled) -> float:
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else {}
    return float((analysis or {}).get("flops", 0.0))
