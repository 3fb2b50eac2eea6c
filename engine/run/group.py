"""A vectorised group of runs (engine/run/vectorize.py builds its program) as the loop's `Job`:
each trial keeps what a run alone has (its workdir, config.yaml, metrics.jsonl, TensorBoard
events and checkpoints, which `launch.py train` resumes alone too), and a trial whose loss
becomes NaN stops alone while the others go on."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import jax
import numpy as np

from engine.checkpoint.store import InBackground
from engine.config import Config
from engine.config.objective import objective_of, objective_rows
from engine.data import eval_batches
from engine.data.chat_data import with_model
from engine.errors import UsageError
from engine.observe.perf import Goodput, Throughput, Window, summary_text
from engine.parallel import sharding
from engine.run.best import Verdict
from engine.run.data_record import checked_record, own_meta
from engine.run.loop import Started, fit_job
from engine.run.outputs import Evaluation, NonFiniteLoss, RunOutputs, TrialOutputs, eval_metrics
from engine.run.setup import with_config_hparams
from engine.run.vectorize import Group, TooBig, build_group, check_fits
from engine.runtime.preemption import starting
from engine.runtime.processes import RunProcesses, running
from engine.runtime.watchdog import Watchdog
from engine.state.columns import MetricColumns, fetch_rows


@dataclass
class Trial:
    """One run of a group: its outputs, and whether it still trains."""

    cfg: Config
    outputs: RunOutputs
    losses: dict = dataclasses.field(default_factory=dict)  # step → train loss (this process's steps)
    eval_metrics: dict = dataclasses.field(default_factory=dict)
    error: Optional[str] = None  # why it stopped alone (a non-finite loss), else None
    on_stop: Optional[Callable] = None  # (cfg, why) when it stops alone, at once (a sweep records it)

    @property
    def live(self) -> bool:
        return self.error is None

    def stop(self, text: str) -> None:
        self.error = text
        self.outputs.message(f"error: training stopped: {text}")
        if self.on_stop is not None:
            self.on_stop(self.cfg, text)

    @contextlib.contextmanager
    def policed(self) -> Iterator[None]:
        """A non-finite loss (the NaN policy's NonFiniteLoss) stops this trial alone."""
        try:
            yield
        except NonFiniteLoss as e:
            self.stop(str(e))


def fit_group(
    cfgs: list[Config],
    started: Optional[float] = None,
    on_stop: Optional[Callable] = None,
    devices: Optional[Sequence] = None,
) -> list[Trial]:
    """Trains the group to train.steps from the trials' newest checkpoints (or from scratch);
    each trial logs, evaluates and saves into its own workdir as a run alone does. A trial
    with a non-finite loss (train.nan_policy=stop) stops alone (on_stop(cfg, why) is called);
    a signal saves every live trial and raises Preempted. A full, read-only or unwritable
    workdir is one StorageError, as for a run alone. A group whose compiled step would not
    fit in a device's memory (check_fits) trains as smaller groups, in turn. `devices`: the
    group's own (a sweep's sub-mesh within one process: engine/sweep/submesh.py)."""
    _refuse_watched(cfgs)
    trials: list[Trial] = []

    def open_job(closing: contextlib.ExitStack, watchdog: Watchdog, goodput: Goodput) -> Started:
        return _open(cfgs, on_stop, trials, closing, watchdog, goodput, devices)

    try:
        # (on a sub-mesh of one of a job's processes: that process alone)
        with running(RunProcesses.for_run(devices, cfgs[0].workdir)):
            fit_job(open_job, cfgs[0], started, [Path(cfg.workdir) for cfg in cfgs])
        return trials
    except TooBig as big:  # (nothing was written: the check comes before the trials' files)
        fits, why = big.fits, str(big)  # (the group itself is freed with the exception, before the parts train)
    parts = [cfgs[i : i + fits] for i in range(0, len(cfgs), fits)]
    print(f"vectorize: {why}; training its runs as {len(parts)} groups of up to {fits}", flush=True)
    # each later group's goodput counts from its own start, not from the groups before it
    return [
        trial
        for i, part in enumerate(parts)
        for trial in fit_group(part, started if i == 0 else None, on_stop, devices)
    ]


def _refuse_watched(cfgs: list[Config]) -> None:
    """checkpoint.keep_best, train.early_stop and the local tier (checkpoint.local_dir) are a run
    alone's: a group's trials share one program and one schedule of saves, and would each stop or
    keep a step at their own time."""
    no_local = 'checkpoint.local_dir="" checkpoint.local_every_steps=0'  # (the two come together: validate.py)
    for cfg in cfgs:
        for key, value, off in (
            ("checkpoint.keep_best", cfg.checkpoint.keep_best, 'checkpoint.keep_best=""'),
            ("train.early_stop.metric", cfg.train.early_stop.metric, 'train.early_stop.metric=""'),
            ("checkpoint.local_dir", cfg.checkpoint.local_dir, no_local),
        ):
            if value:
                raise UsageError(
                    f"run {cfg.workdir}: {key}={value} is not supported by a vectorised group; remove vectorize "
                    f"(each run trains in its own process), or set {off}"
                )


def _open(
    cfgs: list[Config],
    on_stop: Optional[Callable],
    trials: list[Trial],
    closing: contextlib.ExitStack,
    watchdog: Watchdog,
    goodput: Goodput,
    devices: Optional[Sequence] = None,
) -> Started:
    starting("loading data and compiling")
    outputs = [TrialOutputs(cfg, closing) for cfg in cfgs]  # each workdir claimed
    group = build_group(cfgs, devices)
    check_fits(group)
    goodput.compile_seconds = group.compiled.compile_seconds
    for cfg, output in zip(cfgs, outputs):
        output.open(group.traced.dataset, staging="host_sync")  # (the slice saved is a copy already: Saves)
        trials.append(Trial(cfg, output, on_stop=on_stop))
    watchdog.enter("restore")
    starting("restoring")
    states, start, window, metas = _restore(group, trials)
    for cfg, output, meta in zip(cfgs, outputs, metas):  # (chat and preference data: checked as a run's, single.py)
        own = own_meta(cfg, meta, bool(output.checkpointer.steps()))
        data = with_model(cfg.data, cfg.workdir)
        output.recorded.update(
            checked_record(cfg, data, group.traced.dataset, own or {}, own is not None, output.chief)
        )
    goodput.redone_steps = max(output.resume(meta, start) for output, meta in zip(outputs, metas))
    for output in outputs:
        output.open_writer(start)
    job = GroupJob(group, trials, start)
    closing.enter_context(contextlib.closing(job.saves))  # closed before the checkpointers
    begins = f"resuming from step {start}" if start else "from scratch"
    job.message(f"on {_layout(group)}, {begins}; {_data_text(group)}")
    return Started(job, states, start, window)


class GroupJob:
    """The loop's Job for a group: one program, each live trial's records and saves its own."""

    def __init__(self, group: Group, trials: list[Trial], start: int):
        self.group, self.trials, self.start = group, trials, start
        self.cfg = group.cfgs[0]  # the loop's settings are every trial's (they share one program)
        self.workdir = Path(self.cfg.workdir)
        self.steps_per_block, self.steps_per_call = group.steps_per_block, self.cfg.train.steps_per_call
        self.sync_each_step = jax.default_backend() == "cpu" and group.mesh.size > 1
        info = group.traced.dataset.info
        self.rates = Throughput(
            group.cost,
            self.cfg.train.global_batch_size,
            self.cfg.train.global_batch_size
            * objective_rows(self.cfg)
            * group.traced.family.task.tokens_per_example(info),
            group.mesh.devices.flat[0],
            self.cfg.train.compute_dtype,
            {},
        )
        self.saves = Saves(group, trials)
        size, batch_sharding = group.traced.shapes.eval_batch, sharding.batch_sharding(group.mesh)
        self.evaluation = Evaluation(  # every trial on the eval split: the batches shared, the states vmapped
            group.compiled.eval_step,
            lambda: eval_batches(group.traced.dataset.eval, size, self.cfg.eval.max_batches),
            lambda batch: jax.device_put(batch, batch_sharding),
            group.traced.family.task,
            info,
            objective_of(self.cfg),
        )

    def _live(self):
        return [(index, trial) for index, trial in enumerate(self.trials) if trial.live]

    def block(self, index: int):
        return self.group.train_block(index)

    def fetch(self, arrays: list) -> np.ndarray:
        return fetch_rows(arrays)

    def step(self, state, block):
        return self.group.compiled.train_step(state, block)

    def log(self, host: np.ndarray, window: Window, done: int) -> None:
        """host: [steps, trials, columns], one fetch for every trial."""
        for index, trial in self._live():
            with trial.policed():
                losses, record = trial.outputs.train_record(MetricColumns.trial(host, index), window, self.rates)
                trial.outputs.write(done, "train", record)
                trial.losses.update({s: loss for s, loss in losses.items() if s > self.start})

    def evaluate(self, state, done: int) -> Verdict:
        metrics = eval_metrics(self.evaluation, state, len(self.trials))
        for index, trial in self._live():
            trial.eval_metrics = metrics[index]
            with trial.policed():
                trial.outputs.evaluated(done, metrics[index])
        return Verdict()  # (no trial watches a metric: _refuse_watched)

    def save(self, step: int, state, window: Window, local: bool = False) -> None:
        assert not local, "a group has no local tier (_refuse_watched)"
        self.saves.start(step, state, window)

    def wait(self) -> None:
        self.saves.wait()

    def summary(self, summary: dict) -> None:
        for _, trial in self._live():
            trial.outputs.write(self.cfg.train.steps, "summary", summary)
        self.message(summary_text(summary))

    def message(self, text: str) -> None:
        print(f"group of {len(self.trials)} runs: {text}", flush=True)

    def advance(self, steps: int) -> None:
        return None  # the trials' writers show no progress bar (one output for all)

    def stopped(self) -> bool:
        return not self._live()

    def leaving(self) -> None:
        return None  # (a group is not an elastic job: it never stops to grow back)


def _restore(group: Group, trials: list[Trial]):
    """(stacked states, start step, the log window carried, each trial's checkpoint meta): every
    trial from its newest checkpoint, which must be at one step (the sweep groups runs by where
    they resume)."""
    restored = [t.outputs.checkpointer.restore(group.traced.state.abstract) for t in trials]
    steps = {r.step if r else 0 for r in restored}
    if len(steps) > 1:
        where = ", ".join(f"{t.cfg.workdir}: {r.step if r else 0}" for t, r in zip(trials, restored))
        raise UsageError(
            f"the runs of a vectorised group resume from different steps ({where}: a checkpoint was "
            f"set aside as unreadable, or another process saved meanwhile); run the sweep again with "
            f"--retry-failed: it groups runs by the step they resume from"
        )
    start = steps.pop()
    if start % group.cfgs[0].train.steps_per_call:
        raise UsageError(f"the runs resume at step {start}, which is not a multiple of train.steps_per_call")
    if all(restored):  # (a step-0 checkpoint too: `import-hf` writes one)
        states = group.stack_states(
            [
                with_config_hparams(r.state, t.cfg)  # type: ignore[union-attr]
                for r, t in zip(restored, trials)
            ]
        )
    else:
        states = group.init_states()
    metas = [r.meta if r else {} for r in restored]
    windows = [Window.resumed(start, meta.get("window"), t.outputs.columns) for meta, t in zip(metas, trials)]
    if all(w.steps and w.start == windows[0].start and w.steps == windows[0].steps for w in windows):
        window = Window(windows[0].start)
        window.metrics.append(MetricColumns.stack_trials([w.metrics[0] for w in windows]))
        window.steps = windows[0].steps
        return states, start, window, metas
    return states, start, Window(start), metas


class Saves:
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
        host = fetch_rows(window.metrics) if window.steps else None
        work = []
        for index, trial in enumerate(self.trials):
            if trial.live:
                rows = MetricColumns.trial(host, index).tolist() if host is not None else None
                carried = {"start": window.start, "metrics": rows} if rows is not None else None
                if self.background:
                    work.append((trial.outputs, self.group.take(states, index), carried))
                else:
                    trial.outputs.save(step, self.group.take(states, index), carried)
        if work:
            self.thread.start(_save_each, step, work)

    def wait(self) -> None:
        """Every save written (and its checksums)."""
        self.thread.join()
        for trial in self.trials:
            trial.outputs.checkpointer.wait()

    def close(self) -> None:
        """Leaves no save half handed over (the checkpointers close next)."""
        self.thread.finish()


def _save_each(step: int, work: list) -> None:
    for outputs, state, window in work:
        outputs.save(step, state, window)


def _layout(group: Group) -> str:
    sizes = " x ".join(f"{axis}={size}" for axis, size in group.mesh.shape.items() if size > 1 or axis == "trial")
    return f"{group.mesh.size} device(s) ({sizes})"


def _data_text(group: Group) -> str:
    order = "one data order" if len(group.batches) == 1 else "each run its own data order (their seeds differ)"
    where = "the train split lives on every device" if group.traced.resident_bytes else "batches from the host"
    return f"{order}, {where}"
