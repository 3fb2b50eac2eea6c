"""The training loop, once. A run alone (engine/run/single.py) and a vectorised group of runs
(engine/run/group.py) are two implementations of `Job`: the loop asks them for blocks of
batches, steps, and to log, evaluate, save, wait and summarise; everything else (prefetch,
the watchdog, preemption, profiling, the log/eval/save schedule, "already finished", the
end-of-run barrier, goodput) happens here, for both alike."""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Protocol

import jax
import numpy as np

from engine.data import Prefetcher
from engine.errors import UsageError
from engine.observe.perf import Goodput, StepTrace, Throughput, Window
from engine.parallel.strategies import strategy_of
from engine.run.best import Verdict
from engine.runtime.preemption import Preempted, PreemptionWatch, end_startup
from engine.runtime.processes import current
from engine.runtime.recovery import GrowBack, GrowWatch
from engine.runtime.rundir import storage_errno, storage_error
from engine.runtime.watchdog import Watchdog


class Job(Protocol):
    """What the loop drives. `cfg` gives the loop's settings (train.steps, the *.every_steps,
    data.prefetch, log.profile_steps); a group's runs share them."""

    cfg: Any
    workdir: Path  # where a profile trace goes
    steps_per_block: int  # batches per host-to-device transfer
    steps_per_call: int  # optimizer steps per step() call
    sync_each_step: bool  # wait for each call before dispatching the next (CPU collectives)
    rates: Throughput

    def block(self, index: int) -> Any:
        """The device input of the steps of block `index`."""
        ...

    def step(self, state, block) -> tuple[Any, Any]:
        """One call: (state, packed metrics still on the device)."""
        ...

    def fetch(self, arrays: list) -> np.ndarray:
        """Packed metrics of several calls → the host's [steps, columns] (perf.fetch_rows, or
        combined over copies first: engine/parallel/sync.py)."""
        ...

    def log(self, host: np.ndarray, window: Window, done: int) -> None:
        """Writes the window's train records from its metrics fetched to the host."""
        ...

    def evaluate(self, state, done: int) -> Verdict:
        """Evaluates `state` at step `done`; the verdict says whether to save now or end the run."""
        ...

    def save(self, step: int, state, window: Window, local: bool = False) -> None:
        """Starts a checkpoint of `state` at `step` (with the log window in progress); `local`: to
        the local tier (checkpoint.local_dir), else the persistent one."""
        ...

    def wait(self) -> None:
        """Every save started is complete."""
        ...

    def summary(self, summary: dict) -> None: ...

    def message(self, text: str) -> None: ...

    def advance(self, steps: int) -> None:
        """Progress: `steps` more steps dispatched."""
        ...

    def stopped(self) -> bool:
        """Nothing left to train (a group whose every run stopped alone)."""
        ...

    def leaving(self) -> None:
        """The process leaves mid-run (an elastic job stopping to grow back): records still owed
        (a restarted job's recovery records, written at its first log) are written now."""
        ...


@dataclasses.dataclass
class Started:
    """A job ready to train: its state and where it resumes."""

    job: Job
    state: Any
    start: int
    window: Window  # the log window, with the steps a checkpoint carried
    end: Optional[int] = None  # where training ends: train.steps, or the step an early stop recorded


def fit_job(
    open_job: Callable[[contextlib.ExitStack, Watchdog, Goodput], Started],
    cfg,
    started: Optional[float],
    workdirs: list[Path],
) -> Started:
    """Opens the job (claiming its workdirs, compiling, restoring) under the watchdog, then trains
    it to train.steps; the job's files are closed however it ends. A full, read-only or
    unwritable workdir is one StorageError (exit 2): unfinished saves are removed, the newest
    complete checkpoints kept, and a re-run resumes from them."""
    goodput = Goodput(started or time.time())
    processes = current()
    with storage_failures(workdirs), contextlib.ExitStack() as closing:  # closed in reverse order
        watchdog = closing.enter_context(
            contextlib.closing(
                Watchdog(dataclasses.asdict(cfg.watchdog), workdirs[0], processes.index, processes=processes.count)
            )
        )
        ready = open_job(closing, watchdog, goodput)
        watchdog.enter("step")
        end_startup()  # from here a signal is noted, and the loop saves and exits
        ready.state = train(ready, goodput, watchdog, closing)
    return ready


def train(ready: Started, goodput: Goodput, watchdog: Watchdog, closing: contextlib.ExitStack):
    """The loop: steps [start, train.steps), logging, evaluating and saving when due, ending at an
    early stop; a signal saves the step reached and raises Preempted. Returns the final state."""
    job, state, start, window = ready.job, ready.state, ready.start, ready.window
    cfg = job.cfg
    total, per_call, per_block = ready.end or cfg.train.steps, job.steps_per_call, job.steps_per_block
    batches = closing.enter_context(contextlib.closing(Prefetcher(job.block, start // per_block, cfg.data.prefetch)))
    preemption = closing.enter_context(contextlib.closing(PreemptionWatch(current())))
    grow = GrowWatch.begin(cfg) if cfg.fault.elastic else None
    trace = StepTrace(cfg.log.profile_steps, start, job.workdir, per_call)
    closing.enter_context(contextlib.closing(trace))
    watchdog.watch(window.metrics)
    block, last_saved = None, start or None
    for step in range(start, total, per_call):
        if block is None or step % per_block == 0:
            block = next(batches)
        trace.before(step)
        watchdog.beat(step + 1)
        state, metrics = _dispatch(job, state, block, goodput)  # steps [step, step + per_call)
        window.add(metrics, per_call)
        job.advance(per_call)
        done = step + per_call
        if trace.after(done, metrics):
            job.message(trace.message())
        if _due(cfg.log.every_steps, done, total):
            _log(job, window, done, goodput)
            window = Window(done)
            watchdog.watch(window.metrics)
        verdict = Verdict()
        if _due(cfg.eval.every_steps, done, total):
            with paused(window, goodput, "eval_seconds"), watchdog.phase("eval"):  # not training throughput
                verdict = job.evaluate(state, done)
        if verdict.stop:  # an early end: here as at train.steps, the window in progress is logged and saved
            total = done
            if window.steps:
                _log(job, window, done, goodput)
                window = Window(done)
        stop = preemption.should_stop(step + 1, done)  # (every process asks at every call: a sync point)
        if _due(cfg.checkpoint.every_steps, done, total) or verdict.save or (stop and last_saved != done):
            with paused(window, goodput, "checkpoint_seconds"), watchdog.phase("save"):
                job.save(done, state, window)  # returns once its copy is dispatched
            last_saved = done
        local_due = _due(cfg.checkpoint.local_every_steps, done, 0) and not stop  # (stop: saved persistently)
        if cfg.checkpoint.local_dir and done < total and local_due:
            with paused(window, goodput, "checkpoint_seconds"), watchdog.phase("save"):
                job.save(done, state, window, local=True)
        if stop:
            job.wait()
            raise Preempted(done, preemption.signum)
        persistent = _due(cfg.checkpoint.every_steps, done, total) and done < total
        if grow is not None and persistent and _round_ends(cfg, done) and grow.asked():  # (asked to grow back)
            job.wait()
            job.leaving()
            raise GrowBack(done, grow.processes)
        if verdict.stop or job.stopped():
            break
    _finish(job, start, total, window, goodput, watchdog, batches, trace)
    if preemption.requested and total > start:  # a signal during the final save: it completed, and so did the run
        raise Preempted(total, preemption.signum)
    return state


def _finish(
    job: Job,
    start: int,
    total: int,
    window: Window,
    goodput: Goodput,
    watchdog: Watchdog,
    batches: Prefetcher,
    trace: StepTrace,
) -> None:
    """After the last step (`total`: train.steps, or where an early stop ended the run): every save
    complete, the processes met, the run's summary written."""
    cfg = job.cfg
    if start >= total and total < cfg.train.steps:
        job.message(
            f"already finished: the run stopped early at step {start} of {cfg.train.steps} (train.early_stop); to "
            f'train on raise train.early_stop.patience or set train.early_stop.metric="", to train again from '
            f"scratch give another --workdir"
        )
    elif start >= total:
        job.message(
            f"already finished: the newest checkpoint is at step {start} of {total}; to train again from "
            f"scratch give another --workdir, to train longer raise train.steps"
        )
    with paused(window, goodput, "checkpoint_seconds"), watchdog.phase("save"):
        job.wait()  # the last save is complete before the run reports success
    current().barrier("finished", cfg.distributed.barrier_timeout)
    goodput.steps_run, goodput.data_wait_seconds = total - start, batches.wait_seconds  # waits are in the loop
    if total > start:
        timing = goodput.summary(time.time())
        job.summary(
            {
                **timing,
                **job.rates.summary(timing["mean_step_seconds"]),
                **({"profile_dir": str(trace.directory)} if trace.traced else {}),
            }
        )


def _dispatch(job: Job, state, block, goodput: Goodput):
    """One call of the train step, its host time sampled: dispatch, and any wait for the device."""
    began = time.perf_counter()
    state, metrics = job.step(state, block)
    dispatched = time.perf_counter()
    goodput.dispatch_seconds += dispatched - began
    if job.sync_each_step:  # the whole call, the state too: its metrics may be ready before it
        jax.block_until_ready((state, metrics))
    if job.sync_each_step or goodput.first_step_at is None:
        jax.block_until_ready(metrics)
        goodput.device_wait_seconds += time.perf_counter() - dispatched
        goodput.first_step_at = goodput.first_step_at or time.time()
    return state, metrics


def _log(job: Job, window: Window, done: int, goodput: Goodput) -> None:
    """The window's metrics fetched to the host (the loop's only regular host sync), then logged."""
    waited = time.perf_counter()
    host = job.fetch(window.metrics)
    goodput.device_wait_seconds += time.perf_counter() - waited
    goodput.loop_seconds += window.seconds()
    job.log(host, window, done)


def _round_ends(cfg, done: int) -> bool:
    """Whether train.sync's round ends at `done` (every step but DiLoCo's): a job resized mid-round
    trains the round again from its start (engine/parallel/diloco_shrink.py), so it grows back only
    at a round's end, where nothing is dropped."""
    return done % strategy_of(cfg).round_steps(cfg) == 0


def _due(every: int, done: int, total: int) -> bool:
    """Is an every-N-steps action due after step `done`? (0 = only at the end)"""
    return bool(every and done % every == 0) or done == total


@contextlib.contextmanager
def paused(window: Window, goodput: Goodput, account: str) -> Iterator[None]:
    """Time spent inside is taken out of the window's step time and charged to goodput's `account`."""
    began = time.perf_counter()
    try:
        yield
    finally:
        seconds = time.perf_counter() - began
        window.pause(seconds)
        setattr(goodput, account, getattr(goodput, account) + seconds)


@contextlib.contextmanager
def storage_failures(workdirs: list[Path]) -> Iterator[None]:
    """A storage fault (disk full, read-only) → one StorageError; the unfinished saves are removed."""
    try:
        yield
    except Exception as e:
        number = next((n for n in (storage_errno(e, w) for w in workdirs) if n is not None), None)
        if number is None or isinstance(e, UsageError):
            raise
        if current().chief:  # the lock holder: the unfinished saves are its own
            for workdir in workdirs:
                for partial in (workdir / "checkpoints").glob("*.orbax-checkpoint-tmp*"):
                    shutil.rmtree(partial, ignore_errors=True)
        doing = "saving a checkpoint" if "checkpoint" in str(e) else "writing the run's files"
        raise storage_error(workdirs[0] if len(workdirs) == 1 else workdirs[0].parent, number, doing) from None
