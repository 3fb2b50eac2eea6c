"""A run's outputs, built once (RunOutputs): its workdir claimed, its run files, metric writer,
checkpointer and checkpoint metadata, the NaN policy, and the eval record with the best and
early-stop monitor. A run alone holds one, a vectorised group one per trial, and the sidecar
evaluator one that reads the checkpoints and adds eval records (RunOutputs, TrialOutputs,
SidecarOutputs: one class per role); all evaluate with `eval_metrics`."""

from __future__ import annotations

import contextlib
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import jax
import numpy as np

from engine.checkpoint.store import Checkpointer, open_checkpoints
from engine.config import Config, save_config, to_yaml
from engine.config.objective import LM, Objective, objective_of
from engine.data import eval_batches, example_spec
from engine.data.chat_data import MODEL_TEXT_SOURCES
from engine.data.recorded import PREPROCESSING, check_preprocessing, record_shape
from engine.lm.finetune import base_workdir
from engine.lm.tokenizer import TOKENIZER, carry_model_files, check_data_tokenizer, model_tokenizer_file
from engine.observe.metrics import MetricWriter
from engine.observe.perf import Throughput, Window
from engine.observe.trackers import open_trackers
from engine.run import generation_eval
from engine.run.best import Monitor, Verdict
from engine.run.step import weights_of
from engine.runtime.judged import Judged
from engine.runtime.preemption import starting
from engine.runtime.rundir import (
    LOCK,
    METRICS,
    WorkdirLock,
    drop_records_after,
    storage_errno,
    storage_error,
    write_atomic,
)
from engine.state.columns import MetricColumns

SIDECAR = "evaluator"  # the `source` of the sidecar evaluator's eval records (and its TensorBoard folder)
EVAL_SUMS = ("loss_sum", "correct", "count")


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or Inf (train.nan_policy=stop)."""


class RunOutputs:
    """One run's outputs. Built in the order a job starts: claimed (the chief, before compiling),
    `open` (run files, checkpoints), `resume` (from the checkpoint's meta), `open_writer`."""

    checkpointer: Checkpointer
    writer: MetricWriter
    claims = True  # the chief takes the workdir's lock (the sidecar evaluator does not)

    def __init__(self, cfg: Config, closing: contextlib.ExitStack, *, chief: bool = True):
        """chief: the process that claims the workdir and writes its files."""
        self.cfg, self.closing, self.chief = cfg, closing, chief
        self.workdir = Path(cfg.workdir)
        self.columns = MetricColumns()
        self.monitor = Monitor.resumed(cfg, {})  # checkpoint.keep_best's and train.early_stop's metrics
        self.config_text = ""  # the config as a checkpoint's meta holds it (made once: it takes ~0.1 s)
        self.recorded: dict = {}  # more of each checkpoint's meta: what a resume checks its inputs against
        if chief and self.claims:  # one job per workdir: claimed before compiling and before anything is written
            claim(self.workdir, closing)

    def open(self, dataset, **options) -> Checkpointer:
        """The run's files written (the chief; `dataset`: its data) and its checkpoints opened for
        saving (`options`: open_checkpoints's)."""
        directory = self.workdir / "checkpoints"
        info = dataset.info
        if self.chief:
            write_run_files(self.cfg, dataset, self.workdir)
        objective = objective_of(self.cfg)
        self.columns = MetricColumns(info.sources, objective.sums, objective.record)
        self.config_text = to_yaml(self.cfg)
        self.checkpointer = self._enter(open_checkpoints(directory, self.cfg, write=True, **options))
        return self.checkpointer

    def resume(self, meta: dict, start: int) -> int:
        """The watched metrics as the checkpoint's `meta` left them; the records after `start`
        dropped (the chief) → how many steps are run again."""
        self.monitor = Monitor.resumed(self.cfg, meta)
        return drop_records_after(self.workdir / METRICS, start) if self.chief else 0

    @property
    def end(self) -> int:
        """Where training ends: train.steps, or the step an early stop recorded."""
        return self.monitor.stopped_at or self.cfg.train.steps

    def open_writer(self, start: int) -> MetricWriter:
        """The chief's console, metrics.jsonl, TensorBoard and trackers (a search trial's also its
        pipe to the sweep)."""
        cfg, chief = self.cfg, self.chief
        trackers = open_trackers(cfg) if chief and start < self.end else ()  # (finished, or stopped early: none)
        judged = Judged.from_env() if chief else None
        options: dict[str, Any] = dict(start_step=start, progress=cfg.log.progress, judged=judged, trackers=trackers)
        self.writer = self._enter(MetricWriter(self.workdir, **self._writer_options(), **options))
        return self.writer

    def _writer_options(self) -> dict[str, Any]:
        """The writer's options every role shares (its objective's names a line shows: DPO's TRL names)."""
        objective, cfg = objective_of(self.cfg), self.cfg
        return dict(
            enabled=self.chief,
            total_steps=cfg.train.steps,
            tensorboard=cfg.log.tensorboard,
            console_keys=objective.console_keys,
            brief_keys=objective.brief_keys,
        )

    def _enter(self, thing):
        return self.closing.enter_context(contextlib.closing(thing))

    def message(self, text: str) -> None:
        self.writer.message(text)

    def write(self, step: int, split: str, record: dict) -> None:
        self.writer.write(step, split, record)

    def nonfinite(self, problem: Optional[str]) -> None:
        """train.nan_policy: `stop` raises NonFiniteLoss, else a warning."""
        if problem and self.cfg.train.nan_policy == "stop":
            raise NonFiniteLoss(problem)
        if problem:
            self.writer.message(f"warning: {problem}")

    def train_record(self, host: np.ndarray, window: Window, rates: Throughput) -> tuple[dict[int, float], dict]:
        """(each step's train loss, the window's train record) from its metrics on the host
        ([steps, columns]); a non-finite loss meets the NaN policy first."""
        losses = self.columns.losses(host, window.start)
        self.nonfinite(nonfinite_loss(losses))
        return losses, {**self.columns.record(host), **rates.per_step(window.seconds() / max(window.timed_steps, 1))}

    def evaluated(self, step: int, metrics: dict[str, float]) -> Verdict:
        """Writes the eval record of `step`; then the NaN policy, and the monitor's verdict."""
        self.writer.write(step, "eval", metrics)
        self.nonfinite(nonfinite_eval(metrics, step))
        verdict = self.monitor.evaluated(metrics, step)
        if verdict.stop:
            self.writer.message(self.monitor.why())
        return verdict

    def save(self, step: int, state, window: Optional[dict], local: bool = False) -> None:
        """Starts a checkpoint of `state` at `step` with its meta (the log window in progress,
        `Window.carried`, and the watched metrics); `local`: to the local tier (checkpoint.local_dir)."""
        more = {**self.monitor.record(), **self.recorded}
        meta = checkpoint_meta(self.cfg, step, self.config_text, window=window, **more)
        if local:
            self.checkpointer.save_local(step, state, meta)
        else:
            self.checkpointer.save(step, state, meta, self.monitor.metrics(step))


class TrialOutputs(RunOutputs):
    """A vectorised group's trial (engine/run/group.py): its workdir claimed as a run alone's, its
    lines named after it, no progress bar."""

    def open_writer(self, start: int) -> MetricWriter:
        options: dict[str, Any] = dict(
            start_step=0,
            progress=False,
            name=self.workdir.name,
            trackers=open_trackers(self.cfg),
            judged=Judged.on_thread(self.cfg.workdir),  # (a group on a sweep's sub-mesh: each trial's records shown)
        )
        self.writer = self._enter(MetricWriter(self.workdir, **self._writer_options(), **options))
        return self.writer


class SidecarOutputs(RunOutputs):
    """The sidecar evaluator's (engine/run/evaluator.py): it claims nothing, reads the checkpoints,
    and tags its eval records; its TensorBoard events go to a folder of its own."""

    claims = False

    def __init__(self, cfg: Config, closing: contextlib.ExitStack):
        super().__init__(cfg, closing)
        self.summary: Any = None

    def open(self, dataset=None, **options) -> Checkpointer:
        """The run's checkpoints opened for reading."""
        self.checkpointer = self._enter(open_checkpoints(self.workdir / "checkpoints", self.cfg))
        return self.checkpointer

    def open_writer(self, start: int) -> MetricWriter:
        options = {**self._writer_options(), "start_step": 0, "progress": False, "tensorboard": False}
        self.writer = self._enter(MetricWriter(self.workdir, **options))
        if self.cfg.log.tensorboard:  # a folder of its own: two writers must not share an event file
            from tensorboardX import SummaryWriter

            self.summary = self._enter(SummaryWriter(str(self.workdir / SIDECAR)))
        return self.writer

    def evaluated(self, step: int, metrics: dict[str, float]) -> Verdict:
        """Its eval record, tagged, and its TensorBoard events; no NaN policy, no monitor."""
        self.writer.write(step, "eval", {**metrics, "source": SIDECAR})
        if self.summary is not None:
            for name, value in metrics.items():
                self.summary.add_scalar(f"eval/{name}", value, step)
            self.summary.flush()
        return Verdict()


def checkpoint_meta(cfg: Config, step: int, config_text: str = "", **more) -> dict:
    """A checkpoint's meta: its step, where the data order goes on from, the config (as
    to_yaml gives it), and `more` (the log window, the watched metrics, an import's source)."""
    return {"step": step, "data": {"next_step": step, "seed": cfg.seed}, "config": config_text or to_yaml(cfg), **more}


@dataclass(frozen=True)
class Evaluation:
    """How a state is evaluated: the compiled eval step, a pass over the eval split's host
    batches, how a batch goes to the devices, and the task and data that name the metrics."""

    eval_step: Callable  # (weights_of(state), device batch) → metric sums (one per trial: a group's)
    batches: Callable[[], Iterable]
    put: Callable  # host batch → device batch
    task: Any
    info: Any
    objective: Objective = LM  # its metric columns and record (engine/config/objective.py)

    @classmethod
    def of_run(cls, run) -> "Evaluation":
        """A run's (setup.Run): its rows of each eval batch, padding masked out."""
        inputs, compiled, size = run.inputs, run.compiled, run.inputs.eval_batch_size

        def batches():
            return eval_batches(run.dataset.eval, size, run.cfg.eval.max_batches, inputs.eval_rows)

        return cls(
            compiled.eval_step,
            batches,
            lambda batch: compiled.put_batch(batch, size),
            run.model.family.task,
            run.dataset.info,
            objective_of(run.cfg),
        )


def eval_metric_names(cfg: Config, task, info) -> set[str]:
    """The names in a run's eval records (eval_metrics'): its objective's record's (a DPO run's
    TRL names), else loss, accuracy and the task's."""
    generated = generation_eval.metric_names(cfg)  # (eval.generate's: its reward functions are loaded here)
    objective = objective_of(cfg)
    if objective.record is not None:
        return set(objective.record({name: 0.0 for name in (*EVAL_SUMS, *objective.sums)})) | generated
    return {"loss", "accuracy", *task.eval_metrics(1.0, info)} | generated


def eval_metrics(evaluation: Evaluation, state, trials: int = 0) -> list[dict[str, float]]:
    """Loss, accuracy and the task's metrics over the eval split: one dict for a run's state,
    one per trial (`trials`) for a group's stacked states."""
    totals = {name: np.zeros(trials or (), np.float64) for name in EVAL_SUMS}
    objective = evaluation.objective
    weights = weights_of(state)
    for host_batch in evaluation.batches():
        sums = jax.device_get(evaluation.eval_step(weights, evaluation.put(host_batch)))  # a host sync per batch
        for name in (*EVAL_SUMS, *objective.sums):
            if name in sums:
                totals[name] = totals.get(name, 0.0) + np.asarray(sums[name], np.float64)
    metrics = []
    for index in range(trials) if trials else [()]:
        if objective.record is not None:  # its names (DPO's: TRL's)
            metrics.append(objective.record({name: total[index] for name, total in totals.items()}))
            continue
        loss_sum, correct, count = (float(totals[name][index]) for name in EVAL_SUMS)
        loss = loss_sum / count
        metrics.append(
            {"loss": loss, "accuracy": correct / count, **evaluation.task.eval_metrics(loss, evaluation.info)}
        )
    return metrics


def nonfinite_loss(losses: dict[int, float]) -> Optional[str]:
    """The message for the first non-finite train loss, or None."""
    for step, loss in losses.items():
        if not math.isfinite(loss):
            return (
                f"loss is {loss} at step {step}; lower optimizer.learning_rate, set optimizer.grad_clip_norm, "
                f"or check the data"
            )
    return None


def nonfinite_eval(metrics: dict[str, float], step: int) -> Optional[str]:
    if math.isfinite(metrics["loss"]):
        return None
    return (
        f"eval loss is {metrics['loss']} at step {step}; check the eval data for NaN or infinite values, "
        f"or lower optimizer.learning_rate"
    )


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


def _data_model_dir(data) -> Optional[Path]:
    """The model directory of data.tokenizer where the data is a model's text (chat, preferences):
    the directory it names, or its file's; None for other data."""
    if data.name not in MODEL_TEXT_SOURCES or not data.tokenizer:
        return None
    given = Path(data.tokenizer).expanduser()
    return given if given.is_dir() else given.parent


def write_run_files(cfg: Config, dataset, workdir: Path) -> None:
    """config.yaml, the model files of the run it starts from (finetune.base, restore_from), the
    tokenizer the run's text is read back with and the data's shape (data.json), for sample and
    export; a UsageError first when the model reads another tokenizer's ids (an imported model)."""
    info, base = dataset.info, base_workdir(cfg)
    check_data_tokenizer(model_tokenizer_file(workdir, base), info, f"data (data.name={cfg.data.name})")
    check_preprocessing(workdir / PREPROCESSING, info)
    save_config(cfg, workdir / "config.yaml")
    # its context, special tokens, chat template: for sample and export (a run from scratch on chat
    # data: the files of the model directory data.tokenizer names, whose template the data is in)
    carry_model_files(base or _data_model_dir(cfg.data), workdir)
    if info.preprocessing_data:
        write_atomic(workdir / PREPROCESSING, info.preprocessing_data)
    record_shape(workdir, info, example_spec(dataset.train), example_spec(dataset.eval))
    if info.tokenizer and Path(info.tokenizer).resolve() != (workdir / TOKENIZER).resolve():  # (chat: maybe its own)
        shutil.copyfile(info.tokenizer, workdir / TOKENIZER)
