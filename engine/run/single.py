"""A run alone: claims its workdir, builds (compiles) the run, restores, and lets the loop
(engine/run/loop.py) train it as a `Job` whose logs, evaluations and saves are its workdir's."""

from __future__ import annotations

import contextlib
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import jax
import numpy as np

from engine.checkpoint.store import Checkpointer, load_base, open_checkpoints
from engine.config import Config, save_config, to_yaml
from engine.data.recorded import PREPROCESSING, check_preprocessing
from engine.errors import UsageError
from engine.lm.finetune import base_workdir, with_frozen
from engine.lm.tokenizer import TOKENIZER, carry_model_files, check_data_tokenizer, model_tokenizer_file
from engine.observe.metrics import MetricWriter
from engine.observe.perf import Goodput, Throughput, Window, fetch_rows, summary_text
from engine.observe.trackers import open_trackers
from engine.parallel.diloco import REPLICA, Layout, param_count
from engine.plan.dryrun import startup_lines
from engine.run.best import Monitor, Verdict, check_names
from engine.run.evaluator import evaluate
from engine.run.loop import NonFiniteLoss, Started, fit_job, nonfinite_eval, nonfinite_loss, step_losses, train_record
from engine.run.setup import Run, build_run, with_config_hparams
from engine.run.step import FROZEN, TRAIN_METRICS
from engine.runtime.distributed import barrier
from engine.runtime.preemption import Preempted, starting
from engine.runtime.rundir import (
    LOCK,
    METRICS,
    WorkdirLock,
    drop_records_after,
    storage_errno,
    storage_error,
    write_atomic,
)
from engine.runtime.watchdog import Watchdog
from engine.sweep.judge import Judged

__all__ = ["fit", "FitResult", "NonFiniteLoss", "Preempted", "initial_state", "claim", "write_run_files"]


@dataclass
class FitResult:
    state: Any  # the final TrainState
    losses: dict[int, float] = field(default_factory=dict)  # step → train loss of that step
    eval_metrics: dict[str, float] = field(default_factory=dict)  # the last evaluation
    summary: dict = field(default_factory=dict)  # time, goodput and MFU of this run
    steps: int = 0  # the step training ended at: train.steps or an early stop's (0: it had already finished)


def fit(cfg: Config, run: Optional[Run] = None, started: Optional[float] = None) -> FitResult:
    """Trains to cfg.train.steps from the newest checkpoint (or from scratch), logging and evaluating."""
    result = FitResult(None)

    def open_job(closing: contextlib.ExitStack, watchdog: Watchdog, goodput: Goodput) -> Started:
        return _open(cfg, run, started, result, closing, watchdog, goodput)

    result.state = fit_job(open_job, cfg, started, [Path(cfg.workdir)]).state
    return result


class RunJob:
    """The loop's Job for a run alone; process 0 writes the records, every process saves."""

    def __init__(
        self,
        cfg: Config,
        run: Run,
        checkpointer: Checkpointer,
        writer: MetricWriter,
        result: FitResult,
        start: int,
        monitor: Monitor,
    ):
        self.cfg, self.run, self.checkpointer, self.writer, self.result, self.start = (
            cfg,
            run,
            checkpointer,
            writer,
            result,
            start,
        )
        self.workdir = Path(cfg.workdir)
        self.steps_per_block, self.steps_per_call = run.inputs.steps_per_block, run.inputs.steps_per_call
        self.sync_each_step = run.sync_each_step
        tokens = cfg.train.global_batch_size * run.model.family.task.tokens_per_example(run.dataset.info)
        self.rates = Throughput(
            run.cost,
            cfg.train.global_batch_size,
            tokens,
            run.mesh.devices.flat[0],
            cfg.train.compute_dtype,
            run.compile_cache,
        )
        self.config_text = to_yaml(cfg)  # once: it takes ~0.1 s
        self.done = start  # steps dispatched
        self.outer = None  # DiLoCo: the last outer step's metrics (still on the device)
        self.warned_drops = False  # a mixture of experts' dropped assignments: said once on the console
        self.monitor = monitor  # checkpoint.keep_best's and train.early_stop's metrics, saved in each meta

    def block(self, index: int):
        return self.run.train_block(index)

    def step(self, state, block):
        compiled = self.run.compiled
        state, metrics = compiled.train_step(state, block)
        self.done += self.steps_per_call
        if compiled.sync_step is not None and self.done % self.cfg.diloco.inner_steps == 0:
            if self.sync_each_step:  # (CPU collectives: one program's must end before the next's start)
                jax.block_until_ready(state)
            state, self.outer = compiled.sync_step(state)  # the end of a DiLoCo round
        return state, metrics

    def fetch(self, arrays: list) -> np.ndarray:
        combine = self.run.compiled.combine_metrics
        return fetch_rows([combine(a) for a in arrays] if combine is not None else arrays)

    def log(self, host, window: Window, done: int) -> None:
        losses = step_losses(host, window.start)
        self._nonfinite(nonfinite_loss(losses))
        record = train_record(host, window, self.run.dataset.info.sources, self.rates)
        if record.get("moe_dropped_tokens") and not self.warned_drops:  # said once a run: metrics.jsonl has each
            self.warned_drops = True
            self.writer.message(
                f"warning: the experts dropped {record['moe_dropped_tokens']:.0f} token-to-expert assignments "
                f"({record['moe_dropped_fraction']:.1%}) by step {done}: they skip their expert (model."
                "expert_capacity_factor for onehot, model.expert_buffer_factor for ragged; 0 drops nothing)"
            )
        if self.run.compiled.sync_step is not None:
            record.update(self._outer_record(done))
        self.writer.write(done, "train", record)
        self.result.losses.update({s: loss for s, loss in losses.items() if s > self.start})  # this process's steps

    def _outer_record(self, done: int) -> dict:
        """DiLoCo's figures: outer steps so far, the replicas' drift from the global parameters
        and the outer gradient's norm at the last exchange, the bytes exchanged per step."""
        inner = self.cfg.diloco.inner_steps
        layout = Layout(self.run.mesh.shape[REPLICA], inner, param_count(self.run.abstract_state.params))
        record = {"outer_step": done // inner, "exchanged_bytes_per_step": layout.bytes_per_round / inner}
        if self.outer is not None:
            record.update({k: float(v) for k, v in jax.device_get(self.outer).items()})
        return record

    def evaluate(self, state, done: int) -> Verdict:
        metrics = evaluate(self.run, state)
        self.writer.write(done, "eval", metrics)
        self.result.eval_metrics = metrics
        self._nonfinite(nonfinite_eval(metrics, done))
        verdict = self.monitor.evaluated(metrics, done)
        if verdict.stop:
            self.writer.message(self.monitor.why())
        return verdict

    def _nonfinite(self, problem: Optional[str]) -> None:
        if problem and self.cfg.train.nan_policy == "stop":
            raise NonFiniteLoss(problem)
        if problem:
            self.writer.message(f"warning: {problem}")

    def save(self, step: int, state, window: Window) -> None:
        meta = {
            "step": step,
            "data": {"next_step": step, "seed": self.cfg.seed},
            "config": self.config_text,
            "window": window.carried(self.fetch),
            **self.monitor.record(),
        }
        self.checkpointer.save(step, self.run.compiled.from_step_layout(state), meta, self.monitor.metrics(step))

    def wait(self) -> None:
        self.checkpointer.wait()

    def summary(self, summary: dict) -> None:
        self.result.summary, self.result.steps = summary, self.done  # (train.steps, or an early stop's step)
        self.writer.write(self.done, "summary", summary)
        self.writer.message(summary_text(summary))

    def message(self, text: str) -> None:
        self.writer.message(text)

    def advance(self, steps: int) -> None:
        self.writer.advance(steps)

    def stopped(self) -> bool:
        return False


def _open(
    cfg: Config,
    run: Optional[Run],
    started: Optional[float],
    result: FitResult,
    closing: contextlib.ExitStack,
    watchdog: Watchdog,
    goodput: Goodput,
) -> Started:
    """Claims the workdir, builds (compiles) the run, restores. A SIGTERM or SIGINT meanwhile ends
    the process at once (launched from the command line: engine.runtime.preemption.note_signals);
    there is nothing new to save."""
    workdir, is_chief = Path(cfg.workdir), jax.process_index() == 0
    starting("loading data and compiling")  # named first: the lock file is the sign it started
    if is_chief:  # one job per workdir: claimed before compiling and before anything is written
        claim(workdir, closing)
    if run is None or started is not None:  # a run built before the clock started was not compiled on it
        run = run or build_run(cfg)
        goodput.compile_seconds = run.compiled.compile_seconds
    check_names(cfg, {"loss", "accuracy", *run.model.family.task.eval_metrics(1.0, run.dataset.info)})
    if is_chief:
        write_run_files(cfg, run.dataset.info, workdir)
    checkpointer = closing.enter_context(contextlib.closing(_checkpointer(cfg)))
    watchdog.enter("restore")
    starting("restoring")
    state, start, meta = initial_state(run, checkpointer)
    monitor = Monitor.resumed(cfg, meta)
    end = monitor.stopped_at or cfg.train.steps
    state = run.compiled.to_step_layout(with_config_hparams(state, cfg))
    if run.sync_each_step:  # XLA:CPU collectives: the init program must end before a step starts
        jax.block_until_ready(state)
    barrier(f"restored_step_{start}", cfg.distributed.barrier_timeout)  # every process starts from one checkpoint
    if is_chief:
        goodput.redone_steps = drop_records_after(workdir / METRICS, start)
    writer = closing.enter_context(contextlib.closing(_writer(cfg, start, end)))
    window = Window.resumed(
        start,
        meta.get("window"),  # the log window a checkpoint cut in two
        len(TRAIN_METRICS) + len(run.dataset.info.sources),
    )
    if start < end:
        for line in startup_lines(run):
            writer.message(line)
    if run.inputs.resident_bytes and start < end:
        writer.message(
            f"data: the train split ({run.inputs.resident_bytes / 2**20:.1f} MiB) lives on every device "
            f"(data.placement={cfg.data.placement}); each step gathers its rows on the device"
        )
    return Started(RunJob(cfg, run, checkpointer, writer, result, start, monitor), state, start, window, end)


def _checkpointer(cfg: Config) -> Checkpointer:
    return open_checkpoints(Path(cfg.workdir) / "checkpoints", cfg, write=True)


def _writer(cfg: Config, start: int, end: int) -> MetricWriter:
    """Process 0's console, metrics.jsonl and TensorBoard (a search trial's also its pipe to the sweep)."""
    chief = jax.process_index() == 0
    return MetricWriter(
        cfg.workdir,
        enabled=chief,
        total_steps=cfg.train.steps,
        start_step=start,
        progress=cfg.log.progress,
        tensorboard=cfg.log.tensorboard,
        judged=Judged.from_env() if chief else None,
        trackers=open_trackers(cfg) if chief and start < end else (),  # (finished, or stopped early: nothing to log)
    )


def write_run_files(cfg: Config, info, workdir: Path) -> None:
    """config.yaml, the model files of the run it starts from (finetune.base, restore_from), and the
    tokenizer the run's text is read back with (sample, export); a UsageError first when the
    model reads another tokenizer's ids (an imported model)."""
    base = base_workdir(cfg)
    check_data_tokenizer(model_tokenizer_file(workdir, base), info, f"data (data.name={cfg.data.name})")
    check_preprocessing(workdir / PREPROCESSING, info)
    save_config(cfg, workdir / "config.yaml")
    carry_model_files(base, workdir)  # its context, special tokens, chat template: for sample and export
    if info.preprocessing_data:
        write_atomic(workdir / PREPROCESSING, info.preprocessing_data)
    if info.tokenizer:
        shutil.copyfile(info.tokenizer, workdir / TOKENIZER)


def initial_state(run: Run, checkpointer: Checkpointer):
    """(state, step, meta): the workdir's newest readable checkpoint, else checkpoint.restore_from,
    else fresh (meta: the checkpoint's JSON, {} for a fresh or another run's state)."""
    cfg = run.cfg
    restored = checkpointer.restore(run.abstract_state)
    if restored is None and cfg.checkpoint.restore_from:
        source = open_checkpoints(cfg.checkpoint.restore_from, cfg, frozen_base=False)
        if cfg.checkpoint.restore_mode == "params":
            params, _ = source.restore_params(run.abstract_state.params)
            _say(f"starting from the parameters in {cfg.checkpoint.restore_from} at step 0")
            return run.init_state(params), 0, {}
        restored = source.restore(run.abstract_state)
        if restored is None:
            raise UsageError(f"checkpoint.restore_from={cfg.checkpoint.restore_from} holds no complete checkpoint")
        _say(f"starting from {cfg.checkpoint.restore_from} at step {restored.step}")
    elif restored is not None:
        _say(f"resuming from step {restored.step} (checkpoint {checkpointer.directory / str(restored.step)})")
    state, start, meta = (restored.state, restored.step, restored.meta) if restored else (run.init_state(), 0, {})
    if restored is None and checkpointer.base is not None:  # a fresh fine-tuning run: its frozen base
        state = with_frozen(state, load_base(checkpointer.base, run.abstract_state.model_state[FROZEN]))
        step = checkpointer.base.identity["step"]
        _say(f"fine-tuning LoRA adapters on the frozen base {cfg.finetune.base} (its step {step})")
    if start % run.inputs.steps_per_call:
        per_call = run.inputs.steps_per_call
        raise UsageError(
            f"the run resumes at step {start}, which is not a multiple of train.steps_per_call="
            f"{per_call}; set train.steps_per_call to a divisor of {start} (e.g. 1) for this run"
        )
    return state, start, meta


def _say(line: str) -> None:
    """One line of the run's start, from the chief process."""
    if jax.process_index() == 0:
        print(line, flush=True)


def claim(workdir: Path, closing: contextlib.ExitStack, **lock) -> None:
    """Takes the workdir's lock for the life of `closing` (`lock`: WorkdirLock's settings); a
    workdir created here is removed again if the job stops before writing anything into it (a
    bad config or bad data)."""
    created = not workdir.exists()
    if created:

        def unused() -> None:
            if [p.name for p in workdir.iterdir()] == [LOCK]:
                shutil.rmtree(workdir)

        # also when a signal ends start-up: registered before the lock file can be seen
        starting(None, cleanup=unused)
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        closing.enter_context(WorkdirLock(workdir, **lock))
    except OSError as e:  # a read-only or unwritable place: said before anything is compiled
        number = storage_errno(e, workdir)
        if number is None:
            raise
        raise storage_error(workdir, number, "claiming the workdir") from None
    if created:
        closing.callback(unused)
