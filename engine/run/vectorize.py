"""Vectorised runs: several runs whose configs differ only in numbers that do not change the
compiled program, trained as one program with a leading trial axis over the train state
(a sweep's `vectorize:`).

What may differ within a group (VECTOR_KEYS): the seed, the learning-rate schedule's
numbers, weight decay, momentum, Adam's betas and epsilon, the gradient-clipping norm, and
the model family's hyperparameters (dropout), DPO's dpo.beta. These are arrays in the train state already
(engine/optim/optimizer.py, setup.run_hparams), so the group's step is the run's own step under
`jax.vmap`: each trial's losses are those of the same config trained alone. Where there
are several devices, a `trial` mesh axis spreads the trials over them (each trial keeps the
run's own layout on its share of the devices). Trials with one seed read the same batches;
trials with different seeds each read their own data order, as they would alone.

Each trial keeps what a run has: its own workdir, config.yaml, metrics.jsonl, TensorBoard
events and checkpoints (ordinary checkpoints of one run: `launch.py train` resumes them
alone too). A trial whose loss becomes NaN stops alone; the others go on.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from engine.config import Config, check_vectorizable, shape_differences
from engine.errors import UsageError
from engine.observe.perf import StepCost
from engine.parallel.axes import MESH_AXES
from engine.parallel.mesh import build_mesh, mesh_shape, num_devices
from engine.parallel.sharding import per_device_bytes
from engine.run.backends import Compiled, compile_jit
from engine.run.setup import Traced, run_hparams, trace_run, traced_cost, train_batches
from engine.runtime.memory import device_memory_bytes
from engine.runtime.processes import RunProcesses
from engine.runtime.units import human_bytes

TRIAL = "trial"  # the mesh axis over trials
MEMORY_FRACTION = 0.9  # of one device's memory that a group's compiled steps may plan to use


def group_mesh(cfg: Config, trials: int, devices: Optional[Sequence] = None) -> Mesh:
    """The devices (this host's in use, or `devices`: a TPU topology's) as a mesh with a trial
    axis: the most trials side by side that divide both the trials and the devices while each
    trial's share still takes the config's mesh."""
    devices = list(devices) if devices is not None else jax.devices()[: num_devices(cfg.mesh)]
    count = len(devices)
    for split in sorted(
        (d for d in range(1, math.gcd(count, trials) + 1) if count % d == 0 == trials % d), reverse=True
    ):
        try:
            sizes = mesh_shape(cfg.mesh, count // split)
        except UsageError:
            if split == 1:
                raise
            continue
        return build_mesh({TRIAL: split, **sizes}, {}, devices)
    raise AssertionError("split=1 always returns or raises")


def stack(trees: list):
    """Trees of host values → one tree of numpy arrays with a leading axis over them."""
    return jax.tree.map(lambda *leaves: np.stack([np.asarray(leaf) for leaf in leaves]), *trees)


@dataclass
class Group:
    """K runs of one compiled program: the vmapped steps and their inputs."""

    cfgs: list[Config]  # the runs' configs, with the plan's steps per call
    traced: Traced  # the first run traced, on the group's mesh
    mesh: Mesh
    compiled: Compiled  # train_step: (stacked states, block) → (states, metrics [steps_per_call, K, ...])
    trial_shardings: Any  # the TrainState's shardings with the trial axis in front
    batches: list  # one TrainBatches per trial, or one shared by all (one seed)
    cost: StepCost
    slot_shardings: dict = dataclasses.field(default_factory=dict)  # trial slot → a trial's shardings there

    @property
    def steps_per_block(self) -> int:
        return self.traced.shapes.steps_per_block

    def train_block(self, block: int):
        """The device input for the steps of `block`: each trial's batches (or the shared ones)."""
        hosts = [b.block(block, self.steps_per_block) for b in self.batches]
        return self.compiled.put_block(hosts[0] if len(hosts) == 1 else stack(hosts))

    def init_states(self):
        """Fresh states, one per trial (each as its config alone would make it), stacked."""
        seeds = np.array([cfg.seed for cfg in self.cfgs], np.int32)
        hparams = stack([run_hparams(cfg) for cfg in self.cfgs])
        return jax.jit(jax.vmap(self.traced.state.init), out_shardings=self.trial_shardings)(seeds, hparams)

    def stack_states(self, states: list):
        """Single-run states (a restore) → the group's stacked state."""
        return jax.jit(lambda *s: jax.tree.map(lambda *x: jax.numpy.stack(x), *s), out_shardings=self.trial_shardings)(
            *states
        )

    def take(self, states, index: int):
        """Trial `index`'s state (for a save), laid out as a run alone would be on the devices
        that hold the trial: copying it from the other trial slots' devices too only made
        orbax handle replicas (a third slower on 2 CPU devices)."""
        state = self._take(states, np.int32(index))
        slots = self.mesh.shape[TRIAL]
        return state if slots == 1 else jax.device_put(state, self._slot_shardings(index * slots // len(self.cfgs)))

    def _slot_shardings(self, slot: int):
        if slot not in self.slot_shardings:
            devices = Mesh(self.mesh.devices[slot : slot + 1], MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
            self.slot_shardings[slot] = jax.tree.map(
                lambda s: NamedSharding(devices, s.spec), self.traced.state.shardings
            )
        return self.slot_shardings[slot]

    @functools.cached_property
    def _take(self):  # one compiled program for every trial: the index is an argument
        return jax.jit(
            lambda s, i: jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), s),
            out_shardings=self.traced.state.shardings,
        )


def _check_group(cfgs: list[Config], devices: Optional[Sequence] = None) -> None:
    if jax.process_count() > 1 and (devices is None or RunProcesses.of(devices).count > 1):
        raise UsageError(
            "vectorize trains a group in one process; run the sweep without --local-processes, or with "
            "--devices-per-trial at most a process's devices (each process packs groups on its sub-meshes)"
        )
    for cfg in cfgs:
        check_vectorizable(cfg, f"run {cfg.workdir}")  # (finetune.base, precompute_reference included)
        differs = shape_differences(cfgs[0], cfg)
        if differs:
            raise UsageError(
                f"runs {cfgs[0].workdir} and {cfg.workdir} differ in {', '.join(differs)}, which "
                "change the compiled program; they cannot be vectorised together"
            )


def build_group(cfgs: list[Config], devices: Optional[Sequence] = None) -> Group:
    """Plans the first run on a mesh with a trial axis and compiles its steps under vmap
    (`devices`: a TPU topology's, for `launch.py sweep --plan`, or a sweep's sub-mesh)."""
    _check_group(cfgs, devices)
    first, trials = cfgs[0], len(cfgs)
    mesh = group_mesh(first, trials, devices)
    traced = trace_run(first, mesh)
    per_call = traced.blueprint.steps_per_call  # (the traced run's: one per call for some families on CPU)
    cfgs = [dataclasses.replace(c, train=dataclasses.replace(c.train, steps_per_call=per_call)) for c in cfgs]
    first = cfgs[0]
    trial_shardings = jax.tree.map(lambda s: NamedSharding(mesh, PartitionSpec(TRIAL, *s.spec)), traced.state.shardings)
    shared = len({cfg.seed for cfg in cfgs}) == 1  # one data order
    rows = np.arange(first.train.global_batch_size)
    batches = [train_batches(cfg, traced, rows) for cfg in (cfgs[:1] if shared else cfgs)]
    states = _stacked(traced.state.abstract, trial_shardings, trials)
    lead: dict[str, Any] = {} if shared else {"block_lead": (trials,), "block_lead_axes": (TRIAL,)}
    shapes = dataclasses.replace(traced.shapes, state=states, state_shardings=trial_shardings, **lead)
    block_axes = None if shared else 0
    step = jax.vmap(
        traced.train_step,
        in_axes=(0, (None, block_axes) if shapes.resident else block_axes),
        out_axes=(0, 1),
        spmd_axis_name=TRIAL,
    )
    evaluate = jax.vmap(traced.eval_step, in_axes=(0, None), spmd_axis_name=TRIAL)
    compiled = compile_jit(mesh, shapes, step, evaluate)
    cost = traced_cost(first, traced, compiled, copies=trials)
    return Group(cfgs, traced, mesh, compiled, trial_shardings, batches, cost)


def stacked_states(group: Group):
    """The group's train states as one abstract tree: the trial axis in front."""
    return _stacked(group.traced.state.abstract, group.trial_shardings, len(group.cfgs))


def _stacked(abstract, trial_shardings, trials: int):
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct((trials, *x.shape), x.dtype, sharding=s), abstract, trial_shardings
    )


class TooBig(Exception):
    """The group's step does not fit in a device's memory: `fits` trials would."""

    def __init__(self, fits: int, text: str):
        super().__init__(text)
        self.fits = fits


def program_bytes(program) -> int:
    """A compiled program's memory per device: arguments, outputs and temporaries, less what
    donation reuses (0 where the backend does not say)."""
    m = program.memory_analysis()
    return (
        0
        if m is None
        else (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)
    )


def check_fits(group: Group) -> None:
    """TooBig unless the group's compiled steps (train, and eval on the same states), plus a
    copy of the states for checkpoint.staging=device saves, fit in MEMORY_FRACTION of a
    device's memory. Its `fits` is the largest smaller group that would, from that figure:
    each trial's state and activations take their share of a device (trials over the `trial`
    mesh axis: a device holds trials / its size of them), the train split on the devices
    (data.placement) is the same for any number of trials."""
    trials = len(group.cfgs)
    if trials == 1:  # one run is trained as it would be alone
        return
    need = max(program_bytes(group.compiled.program), program_bytes(group.compiled.eval_step))
    if group.cfgs[0].checkpoint.staging == "device":  # the saves take every trial's slice at once
        need += per_device_bytes(stacked_states(group))
    room = MEMORY_FRACTION * device_memory_bytes(group.mesh)
    if need <= room:
        return
    shared = group.traced.resident_bytes
    per_trial = max(need - shared, 1) * group.mesh.shape[TRIAL] / trials  # one trial's bytes on a device
    fits = next(
        (
            k
            for k in range(trials - 1, 1, -1)
            if shared + per_trial * k / group_mesh(group.cfgs[0], k).shape[TRIAL] <= room
        ),
        1,
    )
    raise TooBig(
        fits,
        f"the group of {trials} runs needs {human_bytes(need)} per device, more than "
        f"{MEMORY_FRACTION:.0%} of a device's {human_bytes(room / MEMORY_FRACTION)}",
    )
