"""Vectorised runs: several runs whose configs differ only in numbers that do not change the
compiled program, trained as one program with a leading trial axis over the train state
(a sweep's `vectorize:`).

What may differ within a group (VECTOR_KEYS): the seed, the learning-rate schedule's
numbers, weight decay, momentum, Adam's betas and epsilon, the gradient-clipping norm, and
the model family's hyperparameters (dropout). These are arrays in the train state already
(engine/optim.py, setup.run_hparams), so the group's step is the run's own step under
`jax.vmap`: each trial's losses are those of the same config trained alone. Where there
are several devices, a `trial` mesh axis spreads the trials over them (each trial keeps the
run's own layout on its share of the devices). Trials with one seed read the same batches;
trials with different seeds each read their own data order, as they would alone.

Each trial keeps what a run has: its own workdir, config.yaml, metrics.jsonl, TensorBoard
events and checkpoints (ordinary checkpoints of one run: `launch.py train` resumes them
alone too). A trial whose loss becomes NaN stops alone; the others go on.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from engine import sharding
from engine.backends import _abstract, _replicated_arrays
from engine.checkpoint import Checkpointer, InBackground
from engine.config import MESH_AXES, Config, check_vectorizable, shape_differences, to_yaml
from engine.data import Prefetcher, eval_batches
from engine.errors import UsageError
from engine.hlo import human_bytes
from engine.mesh import mesh_shape, num_devices
from engine.metrics import MetricWriter
from engine.perf import Goodput, StepCost, Throughput, Window, compiled_flops, summary_text
from engine.preemption import Preempted, PreemptionWatch, end_startup, starting
from engine.rundir import METRICS, drop_records_after, storage_errno, storage_error
from engine.setup import Plan, device_memory_bytes, plan_run, run_hparams, train_batches, with_config_hparams
from engine.step import TRAIN_METRICS
from engine.trainer import NonFiniteLoss, _claim, _due, _log_train, _paused, _write_run_files
from engine.watchdog import Watchdog
from models import constrained_activations

TRIAL = "trial"  # the mesh axis over trials
MEMORY_FRACTION = 0.9  # of one device's memory that a group's compiled steps may plan to use


def group_mesh(cfg: Config, trials: int) -> Mesh:
    """The devices as a (trial, *MESH_AXES) mesh: the most trials side by side that divide both
    the trials and the devices while each trial's share still takes the config's mesh."""
    count = num_devices(cfg.mesh)
    for split in sorted((d for d in range(1, math.gcd(count, trials) + 1) if count % d == 0 == trials % d),
                        reverse=True):
        try:
            sizes = mesh_shape(cfg.mesh, count // split)
        except UsageError:
            if split == 1:
                raise
            continue
        return jax.make_mesh((split, *(sizes[a] for a in MESH_AXES)), (TRIAL, *MESH_AXES),
                             (AxisType.Auto,) * (len(MESH_AXES) + 1), devices=jax.devices()[:count])
    raise AssertionError("split=1 always returns or raises")


def _stack(trees: list):
    return jax.tree.map(lambda *leaves: np.stack([np.asarray(leaf) for leaf in leaves]), *trees)


@dataclass
class Group:
    """K runs of one compiled program: the vmapped steps and their inputs."""
    cfgs: list[Config]
    plan: Plan  # the first run's plan, on the group's mesh
    mesh: Mesh
    train_step: Callable  # (stacked states, block) → (states, metrics [steps_per_call, K, len(TRAIN_METRICS)])
    eval_step: Callable  # (stacked states, eval batch) → metric sums, each [K]
    trial_shardings: Any  # the TrainState's shardings with the trial axis in front
    batches: list  # one TrainBatches per trial, or one shared by all (one seed)
    resident: Any  # the train split on the devices (data.placement), or None
    compile_seconds: float
    cost: StepCost
    slot_shardings: dict = dataclasses.field(default_factory=dict)  # trial slot → a trial's shardings there

    @property
    def steps_per_block(self) -> int:
        return self.plan.shapes.steps_per_block

    def block_sharding(self) -> NamedSharding:
        trial = (TRIAL,) if len(self.batches) > 1 else ()
        return NamedSharding(self.mesh, PartitionSpec(*trial, None, sharding.BATCH_AXES))

    def train_block(self, block: int):
        """The device input for the steps of `block`: each trial's batches (or the shared ones)."""
        steps = self.steps_per_block
        hosts = [b.block(block, steps) for b in self.batches]
        host = hosts[0] if len(hosts) == 1 else _stack(hosts)
        put = jax.device_put(host, self.block_sharding())
        return (self.resident, put) if self.resident is not None else put

    def init_states(self):
        """Fresh states, one per trial (each as its config alone would make it), stacked."""
        seeds = np.array([cfg.seed for cfg in self.cfgs], np.int32)
        hparams = _stack([run_hparams(cfg) for cfg in self.cfgs])
        return jax.jit(jax.vmap(self.plan.state.init), out_shardings=self.trial_shardings)(seeds, hparams)

    def stack_states(self, states: list):
        """Single-run states (a restore) → the group's stacked state."""
        return jax.jit(lambda *s: jax.tree.map(lambda *x: jax.numpy.stack(x), *s),
                       out_shardings=self.trial_shardings)(*states)

    def take(self, states, index: int):
        """Trial `index`'s state (for a save), laid out as a run alone would be on the devices
        that hold the trial: copying it from the other trial slots' devices too only made
        orbax handle replicas (a third slower on 2 CPU devices)."""
        state = self._take(states, np.int32(index))
        slots = self.mesh.shape[TRIAL]
        return state if slots == 1 else jax.device_put(state, self._slot_shardings(index * slots // len(self.cfgs)))

    def _slot_shardings(self, slot: int):
        if slot not in self.slot_shardings:
            devices = Mesh(self.mesh.devices[slot], MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
            self.slot_shardings[slot] = jax.tree.map(lambda s: NamedSharding(devices, s.spec),
                                                     self.plan.state.shardings)
        return self.slot_shardings[slot]

    @functools.cached_property
    def _take(self):  # one compiled program for every trial: the index is an argument
        return jax.jit(lambda s, i: jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), s),
                       out_shardings=self.plan.state.shardings)


def build_group(cfgs: list[Config]) -> Group:
    """Plans the first run on a mesh with a trial axis and compiles its steps under vmap."""
    if jax.process_count() > 1:
        raise UsageError("vectorize trains a group in one process; run the sweep without --local-processes")
    first = cfgs[0]
    for cfg in cfgs:
        check_vectorizable(cfg, f"run {cfg.workdir}")
        differs = shape_differences(first, cfg)
        if differs:
            raise UsageError(f"runs {first.workdir} and {cfg.workdir} differ in {', '.join(differs)}, which change "
                             "the compiled program; they cannot be vectorised together")
    mesh = group_mesh(first, len(cfgs))
    plan = plan_run(first, mesh)
    trial_shardings = jax.tree.map(lambda s: NamedSharding(mesh, PartitionSpec(TRIAL, *s.spec)),
                                   plan.state.shardings)
    shared = len({cfg.seed for cfg in cfgs}) == 1  # one data order
    replicated, batch_sharding = sharding.replicated(mesh), sharding.batch_sharding(mesh)
    rows = np.arange(first.train.global_batch_size)
    batches = [train_batches(cfg, plan, rows) for cfg in (cfgs[:1] if shared else cfgs)]
    shapes, resident = plan.shapes, None
    block_shape = (shapes.steps_per_block, shapes.global_batch) if shared else (
        len(cfgs), shapes.steps_per_block, shapes.global_batch)
    group = Group(cfgs, plan, mesh, None, None, trial_shardings, batches, None, 0.0, StepCost(0.0, ""))
    block_sharding = group.block_sharding()
    if shapes.resident:
        resident = _replicated_arrays(shapes.train_arrays, replicated)
        arrays = _abstract(shapes.train_arrays, (len(next(iter(shapes.train_arrays.values()))),), replicated)
        block = (arrays, {"index": jax.ShapeDtypeStruct(block_shape, np.int32, sharding=block_sharding)})
        block_axes = (None, None if shared else 0)
    else:
        block = _abstract(shapes.train_arrays, block_shape, block_sharding)
        block_axes = None if shared else 0
    states = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct((len(cfgs), *x.shape), x.dtype, sharding=s),
                          plan.state.abstract, trial_shardings)
    step = jax.vmap(plan.train_step, in_axes=(0, block_axes), out_axes=(0, 1), spmd_axis_name=TRIAL)
    evaluate = jax.vmap(plan.eval_step, in_axes=(0, None), spmd_axis_name=TRIAL)
    eval_batch = {**_abstract(shapes.train_arrays, (shapes.eval_batch,), batch_sharding),
                  "mask": jax.ShapeDtypeStruct((shapes.eval_batch,), np.float32, sharding=batch_sharding)}
    began = time.perf_counter()
    with constrained_activations(sharding.activation_constrainer(mesh)):
        group.train_step = jax.jit(step, in_shardings=(trial_shardings, jax.tree.map(lambda a: a.sharding, block)),
                                   out_shardings=(trial_shardings, replicated),
                                   donate_argnums=0).lower(states, block).compile()
        group.compile_seconds = time.perf_counter() - began
        group.eval_step = jax.jit(evaluate, out_shardings=replicated).lower(states, eval_batch).compile()
    group.resident = resident
    group.cost = StepCost(compiled_flops(group.train_step), f"XLA cost analysis of the group's step ({len(cfgs)} "
                                                            "trials)")
    return group


class _TooBig(Exception):
    """The group's step does not fit in a device's memory: `fits` trials would."""

    def __init__(self, fits: int, text: str):
        super().__init__(text)
        self.fits = fits


def _program_bytes(program) -> int:
    """A compiled program's memory per device: arguments, outputs and temporaries, less what
    donation reuses (0 where the backend does not say)."""
    m = program.memory_analysis()
    return 0 if m is None else (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                                - m.alias_size_in_bytes)


def check_fits(group: Group) -> None:
    """_TooBig unless the group's compiled steps (train, and eval on the same states), plus a
    copy of the states for checkpoint.staging=device saves, fit in MEMORY_FRACTION of a
    device's memory. Its `fits` is the largest smaller group that would, from that figure:
    each trial's state and activations take their share of a device (trials over the `trial`
    mesh axis: a device holds trials / its size of them), the train split on the devices
    (data.placement) is the same for any number of trials."""
    trials = len(group.cfgs)
    if trials == 1:  # one run is trained as it would be alone
        return
    need = max(_program_bytes(group.train_step), _program_bytes(group.eval_step))
    if group.cfgs[0].checkpoint.staging == "device":  # _Saves takes every trial's slice at once
        need += sharding.per_device_bytes(jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct((trials, *x.shape), x.dtype, sharding=s),
            group.plan.state.abstract, group.trial_shardings))
    room = MEMORY_FRACTION * device_memory_bytes(group.mesh)
    if need <= room:
        return
    shared = 0 if group.resident is None else sharding.per_device_bytes(group.resident)
    per_trial = max(need - shared, 1) * group.mesh.shape[TRIAL] / trials  # one trial's bytes on a device
    fits = next((k for k in range(trials - 1, 1, -1)
                 if shared + per_trial * k / group_mesh(group.cfgs[0], k).shape[TRIAL] <= room), 1)
    raise _TooBig(fits, f"the group of {trials} runs needs {human_bytes(need)} per device, more than "
                        f"{MEMORY_FRACTION:.0%} of a device's {human_bytes(room / MEMORY_FRACTION)}")


@dataclass
class Trial:
    """One run of a group: its files, and whether it still trains."""
    cfg: Config
    writer: MetricWriter
    checkpointer: Checkpointer
    losses: dict = dataclasses.field(default_factory=dict)  # step → train loss (this process's steps)
    eval_metrics: dict = dataclasses.field(default_factory=dict)
    error: Optional[str] = None  # why it stopped alone (a non-finite loss), else None
    config_text: str = ""  # the config as a checkpoint's meta holds it (made once: it takes ~0.1 s)
    on_stop: Optional[Callable] = None  # (cfg, why) when it stops alone, at once (a sweep records it)

    @property
    def live(self) -> bool:
        return self.error is None

    def stop(self, text: str) -> None:
        self.error = text
        self.writer.message(f"error: training stopped: {text}")
        if self.on_stop is not None:
            self.on_stop(self.cfg, text)


def _trial_host(window: Window) -> np.ndarray:
    """The window's packed metrics on the host: [steps, trials, len(TRAIN_METRICS) (+ sources)]."""
    return np.concatenate(jax.device_get(window.metrics))


def _view(window: Window, rows: np.ndarray) -> Window:
    """One trial's window: the group's times and steps, the trial's metrics."""
    view = copy.copy(window)
    view.metrics = [rows]
    return view


def _restore(group: Group, trials: list[Trial]):
    """(stacked states, start step, the log window carried): every trial from its newest
    checkpoint, which must be at one step (the sweep groups runs by where they resume)."""
    restored = [t.checkpointer.restore(group.plan.state.abstract) for t in trials]
    steps = {r.step if r else 0 for r in restored}
    if len(steps) > 1:
        where = ", ".join(f"{t.cfg.workdir}: {r.step if r else 0}" for t, r in zip(trials, restored))
        raise UsageError(f"the runs of a vectorised group resume from different steps ({where}: a checkpoint was "
                         f"set aside as unreadable, or another process saved meanwhile); run the sweep again with "
                         f"--retry-failed: it groups runs by the step they resume from")
    start = steps.pop()
    if start % group.cfgs[0].train.steps_per_call:
        raise UsageError(f"the runs resume at step {start}, which is not a multiple of train.steps_per_call")
    if all(restored):  # (a step-0 checkpoint too: `import-hf` writes one)
        states = group.stack_states([with_config_hparams(r.state, t.cfg) for r, t in zip(restored, trials)])
    else:
        states = group.init_states()
    carried = [(r.meta.get("window") if r else None) or {} for r in restored]
    window = Window(start)
    rows = [c.get("metrics") or [] for c in carried]
    width = len(TRAIN_METRICS) + len(group.plan.dataset.info.sources)
    if rows[0] and all(c.get("start", -1) + len(r) == start and len(r) == len(rows[0]) and all(
            len(m) == width for m in r) for c, r in zip(carried, rows)):
        window = Window(carried[0]["start"])
        window.metrics.append(np.stack([np.asarray(r, np.float32) for r in rows], axis=1))
        window.steps = len(rows[0])
    return states, start, window


def fit_group(cfgs: list[Config], started: Optional[float] = None, on_stop: Optional[Callable] = None) -> list[Trial]:
    """Trains the group to train.steps from the trials' newest checkpoints (or from scratch);
    each trial logs, evaluates and saves into its own workdir as a run alone does. A trial
    with a non-finite loss (train.nan_policy=stop) stops alone (on_stop(cfg, why) is called);
    a signal saves every live trial and raises Preempted. A full, read-only or unwritable
    workdir is one StorageError, as for a run alone (trainer.fit). A group whose compiled
    step would not fit in a device's memory (check_fits) trains as smaller groups, in turn."""
    try:
        return _fit_group(cfgs, started, on_stop)
    except _TooBig as big:  # (nothing was written: the check comes before the trials' files)
        fits, why = big.fits, str(big)  # (the group itself is freed with the exception, before the parts train)
    except Exception as e:
        workdirs = [Path(cfg.workdir) for cfg in cfgs]
        number = next((n for n in (storage_errno(e, w) for w in workdirs) if n is not None), None)
        if number is None or isinstance(e, UsageError):
            raise
        for workdir in workdirs:  # the unfinished saves; each run's newest complete checkpoint stays
            for partial in (workdir / "checkpoints").glob("*.orbax-checkpoint-tmp*"):
                shutil.rmtree(partial, ignore_errors=True)
        doing = "saving a checkpoint" if "checkpoint" in str(e) else "writing the runs' files"
        raise storage_error(workdirs[0].parent, number, doing) from None
    parts = [cfgs[i:i + fits] for i in range(0, len(cfgs), fits)]
    print(f"vectorize: {why}; training its runs as {len(parts)} groups of up to {fits}", flush=True)
    # each later group's goodput counts from its own start, not from the groups before it
    return [trial for i, part in enumerate(parts) for trial in fit_group(part, started if i == 0 else None, on_stop)]


def _fit_group(cfgs: list[Config], started: Optional[float], on_stop: Optional[Callable]) -> list[Trial]:
    goodput = Goodput(started or time.time())
    first = cfgs[0]
    with contextlib.ExitStack() as closing:
        watchdog = closing.enter_context(contextlib.closing(Watchdog(
            dataclasses.asdict(first.watchdog), Path(first.workdir), 0)))
        for cfg in cfgs:
            _claim(Path(cfg.workdir), closing)
        starting("loading data and compiling")
        group = build_group(cfgs)
        check_fits(group)
        goodput.compile_seconds = group.compile_seconds
        trials = [_open_trial(group, cfg, closing, on_stop) for cfg in cfgs]
        watchdog.enter("restore")
        starting("restoring")
        states, start, window = _restore(group, trials)
        goodput.redone_steps = max(drop_records_after(Path(cfg.workdir) / METRICS, start) for cfg in cfgs)
        watchdog.enter("step")
        end_startup()
        _train(group, trials, states, start, window, goodput, watchdog, closing)
    return trials


def _open_trial(group: Group, cfg: Config, closing: contextlib.ExitStack, on_stop: Optional[Callable]) -> Trial:
    workdir = Path(cfg.workdir)
    _write_run_files(cfg, group.plan, workdir)
    writer = closing.enter_context(contextlib.closing(MetricWriter(
        workdir, enabled=True, total_steps=cfg.train.steps, start_step=0, progress=False,
        tensorboard=cfg.log.tensorboard, name=workdir.name)))
    checkpointer = closing.enter_context(contextlib.closing(Checkpointer(
        workdir / "checkpoints", cfg.checkpoint.keep, timeout_seconds=cfg.distributed.barrier_timeout,
        staging="host_sync", verify=cfg.checkpoint.verify)))  # the slice saved is a copy already (_Saves)
    return Trial(cfg, writer, checkpointer, config_text=to_yaml(cfg), on_stop=on_stop)


def _train(group: Group, trials: list[Trial], states, start: int, window: Window, goodput: Goodput,
           watchdog: Watchdog, closing: contextlib.ExitStack) -> None:
    cfg = group.cfgs[0]
    total, per_call, per_block = cfg.train.steps, cfg.train.steps_per_call, group.steps_per_block
    batches = closing.enter_context(contextlib.closing(Prefetcher(group.train_block, start // per_block,
                                                                  cfg.data.prefetch)))
    preemption = closing.enter_context(contextlib.closing(PreemptionWatch()))
    info = group.plan.dataset.info
    rates = Throughput(group.cost, cfg.train.global_batch_size,
                       cfg.train.global_batch_size * group.plan.family.task.tokens_per_example(info),
                       group.mesh.devices.flat[0], cfg.train.compute_dtype, {})
    sync = jax.default_backend() == "cpu" and group.mesh.size > 1
    watchdog.watch(window.metrics)
    block, last_saved = None, start or None
    begins = f"resuming from step {start}" if start else "from scratch"
    print(f"group of {len(trials)} runs on {_layout(group)}, {begins}; {_data_text(group)}", flush=True)

    saves = closing.enter_context(contextlib.closing(_Saves(group, trials)))  # closed before the checkpointers

    def save(step):
        with _paused(window, goodput, "checkpoint_seconds"), watchdog.phase("save"):
            saves.start(step, states, window)

    for step in range(start, total, per_call):
        if block is None or step % per_block == 0:
            block = next(batches)
        watchdog.beat()
        began = time.perf_counter()
        states, metrics = group.train_step(states, block)
        goodput.dispatch_seconds += time.perf_counter() - began
        if sync or goodput.first_step_at is None:
            jax.block_until_ready(metrics)
            goodput.first_step_at = goodput.first_step_at or time.time()
        window.add(metrics, per_call)
        done = step + per_call
        if _due(cfg.log.every_steps, done, total):
            _log_trials(trials, window, done, start, rates, goodput, info.sources)
            window = Window(done)
            watchdog.watch(window.metrics)
        if _due(cfg.eval.every_steps, done, total):
            with _paused(window, goodput, "eval_seconds"), watchdog.phase("eval"):
                _evaluate_trials(group, trials, states, done)
        if _due(cfg.checkpoint.every_steps, done, total):
            save(done)
            last_saved = done
        if preemption.should_stop(step + 1, done):
            if last_saved != done:
                save(done)
            saves.wait()
            raise Preempted(done, preemption.signum)
        if not any(trial.live for trial in trials):
            break
    with _paused(window, goodput, "checkpoint_seconds"), watchdog.phase("save"):
        saves.wait()
    goodput.steps_run, goodput.data_wait_seconds = total - start, batches.wait_seconds
    if total > start:
        timing = goodput.summary(time.time())
        summary = {**timing, **rates.summary(timing["mean_step_seconds"]), "trials": len(trials)}
        for trial in trials:
            if trial.live:
                trial.writer.write(total, "summary", summary)
        print(f"group of {len(trials)} runs: {summary_text(summary)}", flush=True)


class _Saves:
    """The group's checkpoint saves, as `checkpoint.staging` says. `host` (the default): one
    trial's slice of the state at a time, each handed to orbax (which copies it to the host)
    before the next is taken, so a save needs no more device memory than a run alone's.
    `device`: the loop takes every live trial's slice (fresh arrays: one more group state on
    the devices until orbax has them) and goes on training; one background thread hands them
    to the trials' checkpointers, so orbax's host copies and bookkeeping overlap training. One
    group save at a time, in step order; a save's error is raised on the loop's thread."""

    def __init__(self, group: Group, trials: list[Trial]):
        self.group, self.trials = group, trials
        self.background = group.cfgs[0].checkpoint.staging == "device"
        self.thread = InBackground("group-save")

    def start(self, step: int, states, window: Window) -> None:
        self.thread.join()
        host = _trial_host(window) if window.steps else None
        work = []
        for index, trial in enumerate(self.trials):
            if trial.live:
                carried = {"start": window.start, "metrics": host[:, index].tolist()} if host is not None else None
                meta = {"step": step, "data": {"next_step": step, "seed": trial.cfg.seed},
                        "config": trial.config_text, "window": carried}
                if self.background:
                    work.append((trial.checkpointer, self.group.take(states, index), meta))
                else:
                    trial.checkpointer.save(step, self.group.take(states, index), meta)
        if work:
            self.thread.start(_save_each, step, work)

    def wait(self) -> None:
        """Every save written (and its checksums)."""
        self.thread.join()
        for trial in self.trials:
            trial.checkpointer.wait()

    def close(self) -> None:
        """Leaves no save half handed over (the checkpointers close next)."""
        self.thread.finish()


def _save_each(step: int, work: list) -> None:
    for checkpointer, state, meta in work:
        checkpointer.save(step, state, meta)


def _layout(group: Group) -> str:
    sizes = " x ".join(f"{axis}={size}" for axis, size in group.mesh.shape.items() if size > 1 or axis == TRIAL)
    return f"{group.mesh.size} device(s) ({sizes})"


def _data_text(group: Group) -> str:
    order = "one data order" if len(group.batches) == 1 else "each run its own data order (their seeds differ)"
    where = "the train split lives on every device" if group.resident is not None else "batches from the host"
    return f"{order}, {where}"


def _log_trials(trials: list[Trial], window: Window, done: int, start: int, rates: Throughput,
                goodput: Goodput, sources: tuple) -> None:
    """Each live trial's train record from the group's window (one fetch for all)."""
    waited = time.perf_counter()
    host = _trial_host(window)
    goodput.device_wait_seconds += time.perf_counter() - waited
    goodput.loop_seconds += window.seconds()
    for index, trial in enumerate(trials):
        if not trial.live:
            continue
        try:
            losses = _log_train(_view(window, host[:, index]), done, trial.cfg.train.nan_policy, trial.writer,
                                rates, Goodput(0.0), sources)
        except NonFiniteLoss as e:
            trial.stop(str(e))
            continue
        trial.losses.update({s: loss for s, loss in losses.items() if s > start})


def _evaluate_trials(group: Group, trials: list[Trial], states, step: int) -> None:
    """Every trial on the eval split (the batches shared, the states vmapped)."""
    cfg = group.cfgs[0]
    totals = np.zeros((3, len(trials)))
    size = group.plan.shapes.eval_batch
    batch_sharding = sharding.batch_sharding(group.mesh)
    for host_batch in eval_batches(group.plan.dataset.eval, size, cfg.eval.max_batches):
        sums = jax.device_get(group.eval_step(states, jax.device_put(host_batch, batch_sharding)))
        totals += np.array([sums["loss_sum"], sums["correct"], sums["count"]], np.float64)
    for index, trial in enumerate(trials):
        if not trial.live:
            continue
        loss_sum, correct, count = totals[:, index]
        trial.eval_metrics = {"loss": loss_sum / count, "accuracy": correct / count}
        trial.writer.write(step, "eval", trial.eval_metrics)
        if not math.isfinite(trial.eval_metrics["loss"]) and trial.cfg.train.nan_policy == "stop":
            trial.stop(f"eval loss is {trial.eval_metrics['loss']} at step {step}; lower optimizer.learning_rate")
