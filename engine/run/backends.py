"""The two ways to compile the same pure train step: `jit` over NamedShardings (any layout)
and `pmap` (replicated data parallel, one copy of the state per device). Each returns a
`Compiled` with the same fields; nothing outside this module asks which one is in use.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from engine.data import process_rows
from engine.parallel import sharding
from engine.parallel.sync import SyncPart
from engine.run.step import weights_of

PMAP_AXIS = "batch"


@dataclass(frozen=True)
class Compiled:
    """What a compile backend gives the trainer; jit and pmap give the same fields."""

    train_step: Optional[Callable]  # (state, device block) → (state, metrics [steps_per_call, ...]); None: not built
    eval_step: Callable  # (weights_of(state), device batch) → metric sums
    put_batch: Callable  # (host batch, global batch size) → global device batch (eval)
    put_block: Callable  # host block of steps_per_block batches → the device input of train_step
    to_step_layout: Callable  # TrainState → what train_step takes (pmap: one copy per device)
    from_step_layout: Callable  # the inverse, e.g. for saving a checkpoint
    rows: Callable  # global batch size → the positions in a batch this process loads
    compile_seconds: float
    program: Any  # the compiled train step, for XLA's cost and memory analysis (None: eager, or not built)
    sync: SyncPart = SyncPart()  # train.sync's programs beside the step (engine/parallel/sync.py)

    @property
    def memory(self):
        """The compiled step's memory estimate (None in eager mode)."""
        return self.program.memory_analysis() if self.program is not None else None


@dataclass(frozen=True)
class Shapes:
    """What a backend compiles for: the state and the batches, as shapes and shardings."""

    state: Any  # the abstract TrainState (ShapeDtypeStructs with target shardings)
    state_shardings: Any
    train_arrays: dict  # the training split's arrays (their per-example shapes and dtypes)
    global_batch: int
    steps_per_block: int
    eval_batch: int
    resident: bool = False  # data.placement=device: train_arrays live on every device; blocks carry indices
    # leading dimensions of a block before [steps, batch], and their mesh axes: a vectorised
    # group's trials (each its own data order), DiLoCo's replicas (each its own share of a batch)
    block_lead: tuple[int, ...] = ()
    block_lead_axes: tuple[str, ...] = ()
    vmapped: tuple[str, ...] = ()  # mesh axes the train step is vmapped over inside (DiLoCo's replicas)
    metrics_axes: tuple[str, ...] = ()  # mesh axes the packed metrics stay split over (one row per replica)


def _global_arrays(
    host_batch: dict[str, np.ndarray], array_sharding: NamedSharding, global_rows: tuple[int, ...]
) -> dict[str, jax.Array]:
    """This process's rows (see data.process_rows) → one global array per key."""
    if jax.process_count() == 1:  # the rows are the whole batch: one transfer of the tree is cheapest
        return jax.device_put(host_batch, array_sharding)
    return {
        name: jax.make_array_from_process_local_data(
            array_sharding, value, (*global_rows, *value.shape[len(global_rows) :])
        )
        for name, value in host_batch.items()
    }


def replicated_arrays(arrays: dict[str, np.ndarray], replicated: NamedSharding) -> dict[str, jax.Array]:
    """Host arrays → one copy on every device (each process supplies its own devices')."""
    if jax.process_count() == 1:
        return jax.device_put({k: np.ascontiguousarray(v) for k, v in arrays.items()}, replicated)
    return {k: jax.make_array_from_callback(v.shape, replicated, _reader(v)) for k, v in arrays.items()}


def _reader(array: np.ndarray) -> Callable:
    """index → that part of `array`, contiguous (what make_array_from_callback asks each device for)."""
    return lambda index: np.ascontiguousarray(array[index])


def _identity(state):
    return state


def abstract_arrays(arrays: dict, leading: tuple[int, ...], array_sharding) -> dict:
    return {
        name: jax.ShapeDtypeStruct((*leading, *a.shape[1:]), a.dtype, sharding=array_sharding)
        for name, a in arrays.items()
    }


def _eager(fn):
    def run(*args):
        with jax.disable_jit():
            return fn(*args)

    return run


def compile_jit(
    mesh: Mesh,
    shapes: Shapes,
    train_step: Optional[Callable],
    eval_step: Callable,
    eager: bool = False,
) -> Compiled:
    batch_sharding = sharding.batch_sharding(mesh)
    put_block, block_abstract, in_block_sharding = _train_input(mesh, shapes, resident=shapes.resident and train_step)
    common: dict[str, Any] = dict(
        put_batch=functools.partial(_put_batch, batch_sharding),
        put_block=put_block,
        to_step_layout=_identity,
        from_step_layout=_identity,
        rows=lambda batch_size: process_rows(batch_sharding, batch_size),
    )
    if eager:
        return Compiled(
            train_step=train_step and _eager(train_step),
            eval_step=_eager(eval_step),
            compile_seconds=0.0,
            program=None,
            **common,
        )
    # The state is donated: its buffers are reused for the new state instead of copied.
    jitted = train_step and jax.jit(
        train_step,
        in_shardings=(shapes.state_shardings, in_block_sharding),
        out_shardings=(shapes.state_shardings, NamedSharding(mesh, PartitionSpec(None, *shapes.metrics_axes))),
        donate_argnums=0,
    )
    start = time.perf_counter()
    # (the steps' modules pin their activations to this mesh: setup.step_modules)
    program = jitted.lower(shapes.state, block_abstract).compile() if jitted else None
    compile_seconds = time.perf_counter() - start
    eval_batch = {
        **abstract_arrays(shapes.train_arrays, (shapes.eval_batch,), batch_sharding),
        "mask": jax.ShapeDtypeStruct((shapes.eval_batch,), jnp.float32, sharding=batch_sharding),
    }
    jitted_eval = jax.jit(
        eval_step,
        in_shardings=(weights_of(shapes.state_shardings), batch_sharding),
        out_shardings=sharding.replicated(mesh),
    )
    # compiled at its first use: a run that never evaluates (a plan's train step, a test's steps) skips it
    evaluate = OnFirstUse(lambda: jitted_eval.lower(weights_of(shapes.state), eval_batch).compile())
    return Compiled(train_step=program, eval_step=evaluate, compile_seconds=compile_seconds, program=program, **common)


class OnFirstUse:
    """A compiled program that is compiled when first called or asked about (memory_analysis, ...)."""

    def __init__(self, compile_program: Callable[[], Any]):
        self._compile, self._program = compile_program, None

    def program(self):
        if self._program is None:
            self._program = self._compile()
        return self._program

    def __call__(self, *args):
        return self.program()(*args)

    def __getattr__(self, name: str):
        if name.startswith("_"):  # (not the program's: this object's own, not yet set)
            raise AttributeError(name)
        return getattr(self.program(), name)


def compile_now(program) -> None:
    """Compiles an OnFirstUse program now (anything else is compiled already, or eager)."""
    if isinstance(program, OnFirstUse):
        program.program()


def _train_input(mesh: Mesh, shapes: Shapes, resident) -> tuple[Callable, Any, Any]:
    """(host block → device input, the input's abstract value, its sharding). Training batches
    travel in blocks of K steps ([K, batch, ...]): one transfer per block, and the step picks its
    own batch, so the host's per-step work is a dispatch alone."""
    lead = (*shapes.block_lead, shapes.steps_per_block, shapes.global_batch)
    block_sharding = NamedSharding(mesh, PartitionSpec(*shapes.block_lead_axes, None, sharding.BATCH_AXES))
    put_block = functools.partial(_put_host_block, block_sharding, lead)
    if not resident:
        return put_block, abstract_arrays(shapes.train_arrays, lead, block_sharding), block_sharding
    # The whole train split, replicated: each device gathers its own rows of each batch (the
    # indices are sharded like a batch), so the gather needs no communication. It is put on the
    # devices at the first block (never for a plan, which only compiles).
    data_sharding = sharding.replicated(mesh)
    arrays = functools.cache(functools.partial(replicated_arrays, shapes.train_arrays, data_sharding))
    examples = len(next(iter(shapes.train_arrays.values())))
    abstract = (
        abstract_arrays(shapes.train_arrays, (examples,), data_sharding),
        {"index": jax.ShapeDtypeStruct(lead, jnp.int32, sharding=block_sharding)},
    )
    return functools.partial(_with_resident, arrays, put_block), abstract, (data_sharding, block_sharding)


def _put_batch(batch_sharding: NamedSharding, host_batch, batch_size: int):
    return _global_arrays(host_batch, batch_sharding, (batch_size,))


def _put_host_block(block_sharding: NamedSharding, lead: tuple[int, ...], host_block):
    return _global_arrays(host_block, block_sharding, lead)


def _with_resident(resident: Callable, put_block: Callable, host_block):
    """{"index": [steps, rows]} → (the resident split, global indices)."""
    return resident(), put_block(host_block)


def compile_pmap(mesh: Mesh, shapes: Shapes, train_step: Optional[Callable], eval_step: Callable) -> Compiled:
    """Classic replicated data parallelism (mesh.backend=pmap; it does not run eagerly)."""
    devices = mesh.devices.reshape(-1)
    count = len(devices)
    pmap_mesh = Mesh(devices, (PMAP_AXIS,))
    stacked = NamedSharding(pmap_mesh, PartitionSpec(PMAP_AXIS))
    # Classic replicated data parallel: a copy of the state per device on a leading axis.
    to_step_layout = jax.jit(
        lambda s: jax.tree.map(lambda x: jnp.broadcast_to(x, (count, *x.shape)), s), out_shardings=stacked
    )
    from_step_layout = jax.jit(lambda s: jax.tree.map(lambda x: x[0], s), out_shardings=shapes.state_shardings)
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct((count, *x.shape), x.dtype, sharding=stacked), shapes.state)
    steps, global_batch = shapes.steps_per_block, shapes.global_batch
    local = len(pmap_mesh.local_devices)

    def put_batch(host_batch, batch_size):  # [rows] → [devices, rows per device]
        return _global_arrays(
            {k: v.reshape(local, -1, *v.shape[1:]) for k, v in host_batch.items()},
            stacked,
            (count, batch_size // count),
        )

    def put_block(host_block):  # [steps, rows] → [devices, steps, rows per device]
        per_device = {k: v.reshape(steps, local, -1, *v.shape[2:]).swapaxes(0, 1) for k, v in host_block.items()}
        return _global_arrays(per_device, stacked, (count, steps, global_batch // count))

    pmapped = train_step and jax.pmap(train_step, axis_name=PMAP_AXIS, devices=list(devices), donate_argnums=0)
    pmapped_eval = jax.pmap(eval_step, axis_name=PMAP_AXIS, devices=list(devices))
    start = time.perf_counter()
    block = abstract_arrays(shapes.train_arrays, (count, steps, global_batch // count), stacked)
    program = pmapped.lower(state, block).compile() if pmapped else None
    compile_seconds = time.perf_counter() - start

    def step(state, batch):
        state, metrics = program(state, batch)
        return state, jax.tree.map(lambda x: x[0], metrics)  # psum'd: every replica holds the same

    def evaluate(state, batch):
        return jax.tree.map(lambda x: x[0], pmapped_eval(state, batch))

    return Compiled(
        train_step=step if train_step else None,
        eval_step=evaluate,
        put_batch=put_batch,
        put_block=put_block,
        to_step_layout=to_step_layout,
        from_step_layout=from_step_layout,
        rows=lambda batch_size: process_rows(stacked, batch_size, batch_size // count),
        compile_seconds=compile_seconds,
        program=program,
    )
