"""A run alone: claims its workdir, builds (compiles) the run, restores, and lets the loop
(engine/run/loop.py) train it as a `Job` whose logs, evaluations and saves are its workdir's."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import jax
import numpy as np

from engine.checkpoint.store import Checkpointer, load_base, open_checkpoints
from engine.config import Config
from engine.config.objective import objective_rows
from engine.data.chat_data import with_model
from engine.errors import UsageError
from engine.lm.finetune import base_workdir, with_frozen
from engine.observe.perf import Goodput, Throughput, Window, summary_text
from engine.parallel.sync import Syncing
from engine.run.best import Verdict, check_names
from engine.run.data_record import checked_record, own_meta
from engine.run.evaluator import evaluate
from engine.run.loop import Started, fit_job
from engine.run.outputs import NonFiniteLoss, RunOutputs, eval_metric_names
from engine.run.reference_logps import fill_run, record, trained_digest
from engine.run.setup import Run, build_run, with_config_hparams
from engine.run.startup import startup_lines
from engine.runtime.preemption import Preempted, starting
from engine.runtime.processes import RunProcesses, current, running
from engine.runtime.recovery import Recovery
from engine.runtime.restart_protocol import job_so_far
from engine.runtime.rundir import METRICS
from engine.runtime.watchdog import Watchdog
from engine.state.train_state import FROZEN, REFERENCE

__all__ = ["fit", "FitResult", "NonFiniteLoss", "Preempted", "initial_state"]


@dataclass
class FitResult:
    state: Any  # the final TrainState
    losses: dict[int, float] = field(default_factory=dict)  # step → train loss of that step
    eval_metrics: dict[str, float] = field(default_factory=dict)  # the last evaluation
    summary: dict = field(default_factory=dict)  # time, goodput and MFU of this run
    steps: int = 0  # the step training ended at: train.steps or an early stop's (0: it had already finished)


def fit(
    cfg: Config, run: Optional[Run] = None, started: Optional[float] = None, devices: Optional[Sequence] = None
) -> FitResult:
    """Trains to cfg.train.steps from the newest checkpoint (or from scratch), logging and evaluating.
    `devices`: the run's own devices (a sweep trial's sub-mesh: engine/sweep/submesh.py)."""
    result = FitResult(None)

    def open_job(closing: contextlib.ExitStack, watchdog: Watchdog, goodput: Goodput) -> Started:
        return _open(cfg, run, started, result, closing, watchdog, goodput, devices)

    with running(RunProcesses.for_run(devices, cfg.workdir)):  # (a sub-mesh's trial: the processes of its devices)
        result.state = fit_job(open_job, cfg, started, [Path(cfg.workdir)]).state
    return result


class Sampled:
    """A run whose batches it samples (train.objective=grpo): each batch of prompts' rollouts at the
    first of its grpo.num_iterations steps (rollouts.rollout_key(state.rng, step): a resumed run,
    which saved on a multiple of num_iterations, samples the same), the update on them at each; the
    host's metrics (rewards/<fn>/mean, seconds sampling and updating), their means over a log window."""

    def __init__(self, run: Run):
        self.run, self.rollouts = run, run.rollouts
        self.iterations = run.cfg.grpo.num_iterations if self.rollouts is not None else 1
        self.batch: Any = None  # the rollouts on the device, for the steps of one batch of prompts
        self.sums: dict[str, float] = {}
        self.count = 0

    def step(self, state, prompts: dict, done: int):
        if self.batch is None or done % self.iterations == 0:
            batch, host = self.rollouts.sample(state, prompts, done)  # (the whole batch's rows: this process's put)
            rows = self.run.compiled.rows(len(batch["advantages"]))
            self.batch = self.run.compiled.put_block({name: value[rows][None] for name, value in batch.items()})
            self.add(host)
        began, train_step = time.perf_counter(), self.run.compiled.train_step
        assert train_step is not None  # (a run built to train)
        state, metrics = train_step(state, self.batch)
        jax.block_until_ready(metrics)
        self.add({"seconds/updating": time.perf_counter() - began})
        return state, metrics

    def add(self, host: dict) -> None:
        self.count += "seconds/updating" not in host
        for name, value in host.items():
            self.sums[name] = self.sums.get(name, 0.0) + value

    def fields(self) -> dict:
        """The host metrics' means since the last record (seconds: per step), then cleared."""
        if self.rollouts is None or not self.count:
            return {}
        fields = {
            name: value / self.count
            for name, value in self.sums.items()
            if name.startswith("rewards/") or name.startswith("seconds/sampling")
        }
        updates = self.sums.get("seconds/updating", 0.0)
        fields["seconds/updating"] = updates / self.count
        self.sums, self.count = {}, 0
        return fields


class RunJob:
    """The loop's Job for a run alone; process 0 writes the records, every process saves."""

    def __init__(
        self,
        run: Run,
        outputs: RunOutputs,
        result: FitResult,
        start: int,
        goodput: Optional[Goodput] = None,
        recovery: Optional[Recovery] = None,
    ):
        self.cfg, self.run, self.outputs, self.result, self.start = run.cfg, run, outputs, result, start
        self.goodput, self.recovery = goodput, recovery  # (a restarted elastic job's records, after its first step)
        self.workdir = Path(self.cfg.workdir)
        self.steps_per_block, self.steps_per_call = run.inputs.steps_per_block, run.inputs.steps_per_call
        self.sync_each_step = run.sync_each_step
        self.sync = Syncing(run.compiled.sync, run.sync_each_step)  # train.sync's part beside the step
        batch = self.cfg.train.global_batch_size
        tokens = batch * objective_rows(self.cfg) * run.model.family.task.tokens_per_example(run.dataset.info)
        device = run.mesh.devices.flat[0]
        self.rates = Throughput(run.cost, batch, tokens, device, self.cfg.train.compute_dtype, run.compile_cache)
        self.done = start  # steps dispatched
        self.warned_drops = False  # a mixture of experts' dropped assignments: said once on the console
        self.sampled = Sampled(run)

    def block(self, index: int):
        if self.sampled.rollouts is not None:  # (the prompts stay on the host: the step samples them)
            return self.run.inputs.train(index // self.sampled.iterations)
        return self.run.train_block(index)

    def step(self, state, block):
        if self.sampled.rollouts is not None:
            state, metrics = self.sampled.step(state, block, self.done)
        else:
            state, metrics = self.run.compiled.train_step(state, block)
        self.done += self.steps_per_call
        return self.sync.after(state, self.done), metrics

    def fetch(self, arrays: list) -> np.ndarray:
        return self.sync.fetch(arrays)

    def log(self, host, window: Window, done: int) -> None:
        self.leaving()  # (the first log comes after the first step)
        losses, record = self.outputs.train_record(host, window, self.rates)
        if record.get("moe_dropped_tokens") and not self.warned_drops:  # said once a run: metrics.jsonl has each
            self.warned_drops = True
            self.outputs.message(
                f"warning: the experts dropped {record['moe_dropped_tokens']:.0f} token-to-expert assignments "
                f"({record['moe_dropped_fraction']:.1%}) by step {done}: they skip their expert (model."
                "expert_capacity_factor for onehot, model.expert_buffer_factor for ragged; 0 drops nothing)"
            )
        self.outputs.write(done, "train", {**record, **self.sync.fields(done), **self.sampled.fields()})
        self.result.losses.update({s: loss for s, loss in losses.items() if s > self.start})  # this process's steps

    def evaluate(self, state, done: int) -> Verdict:
        metrics = evaluate(self.run, state)
        self.result.eval_metrics = metrics
        if self.sampled.rollouts is not None:  # (GRPO: eval/reward, no eval loss: checkpoint.keep_best and
            self.outputs.writer.write(done, "eval", metrics)  # train.early_stop do not watch it)
            return Verdict()
        return self.outputs.evaluated(done, metrics)

    def save(self, step: int, state, window: Window, local: bool = False) -> None:
        self.outputs.save(step, self.run.compiled.from_step_layout(state), window.carried(self.fetch), local)

    def wait(self) -> None:
        self.outputs.checkpointer.wait()

    def summary(self, summary: dict) -> None:
        self.result.summary, self.result.steps = summary, self.done  # (train.steps, or an early stop's step)
        self.outputs.write(self.done, "summary", summary)
        self.outputs.message(summary_text(summary))

    def message(self, text: str) -> None:
        self.outputs.message(text)

    def advance(self, steps: int) -> None:
        self.outputs.writer.advance(steps)

    def stopped(self) -> bool:
        return False

    def leaving(self) -> None:
        if self.recovery is not None:
            first_step_at = self.goodput.first_step_at if self.goodput else None
            self.recovery.write(self.outputs.writer, first_step_at or time.time())
            self.recovery = None


def _open(
    cfg: Config,
    run: Optional[Run],
    started: Optional[float],
    result: FitResult,
    closing: contextlib.ExitStack,
    watchdog: Watchdog,
    goodput: Goodput,
    devices: Optional[Sequence] = None,
) -> Started:
    """Claims the workdir, builds (compiles) the run, restores. A SIGTERM or SIGINT meanwhile ends
    the process at once (launched from the command line: engine.runtime.preemption.note_signals);
    there is nothing new to save."""
    starting("loading data and compiling")  # named first: the lock file is the sign it started
    outputs = RunOutputs(cfg, closing, chief=current().chief)
    if run is None or started is not None:  # a run built before the clock started was not compiled on it
        run = run or build_run(cfg, devices=devices)
        goodput.compile_seconds = run.compiled.compile_seconds
    check_names(cfg, eval_metric_names(cfg, run.model.family.task, run.dataset.info))
    outputs.open(run.dataset)
    watchdog.enter("restore")
    starting("restoring")
    state, start, meta = initial_state(run, outputs.checkpointer)
    own = own_meta(cfg, meta, bool(outputs.checkpointer.steps()))  # (None: a fresh run, or restore_from's state)
    data = with_model(cfg.data, base_workdir(cfg) or cfg.workdir)
    outputs.recorded.update(checked_record(cfg, data, run.dataset, own or {}, own is not None, outputs.chief))
    trained = trained_digest(own or {})  # (dpo.precompute_reference: the values the run trained with)
    for line in fill_run(run, state, resumed=bool(meta), trained=trained):
        _say(line)
    outputs.recorded.update(record(run))  # (the values filled: their checksum, in each checkpoint's meta)
    state = run.compiled.to_step_layout(with_config_hparams(state, cfg))
    if run.sync_each_step:  # XLA:CPU collectives: the init program must end before a step starts
        jax.block_until_ready(state)
    current().barrier(f"restored_step_{start}", cfg.distributed.barrier_timeout)  # the run starts from one checkpoint
    goodput.redone_steps = outputs.resume(meta, start)
    writer = outputs.open_writer(start)
    window = Window.resumed(start, meta.get("window"), outputs.columns)  # the log window a checkpoint cut in two
    if start < outputs.end:
        for line in [*startup_lines(run), *run.dataset.info.notes]:  # (notes: what the data source says, chat's counts)
            writer.message(line)
    if run.inputs.resident_bytes and start < outputs.end:
        writer.message(
            f"data: the train split ({run.inputs.resident_bytes / 2**20:.1f} MiB) lives on every device "
            f"(data.placement={cfg.data.placement}); each step gathers its rows on the device"
        )
    recovery = Recovery.begin(cfg, start, meta)
    if recovery is not None:
        goodput.recovery_seconds = recovery.seconds_before(goodput.started)
    goodput.recovery_seconds, goodput.earlier_seconds = job_so_far(goodput.started, goodput.recovery_seconds)
    return Started(RunJob(run, outputs, result, start, goodput, recovery), state, start, window, outputs.end)


def check_reference_saved(source: Checkpointer, abstract_state, directory: str) -> None:
    """UsageError when a full fine-tuning DPO state (its REFERENCE collection, the starting
    parameters) is to be restored whole from a checkpoint without one (an SFT run's)."""
    steps = source.steps()
    if REFERENCE not in abstract_state.model_state or not steps:
        return
    try:
        saved = source.saved_state(steps[-1])["model_state"]
    except (OSError, ValueError, KeyError):  # an unreadable newest step: the restore says why, or takes another
        return
    if REFERENCE not in saved:
        raise UsageError(
            f"checkpoint.restore_from={directory} (step {steps[-1]}) holds no DPO reference model (it is not a "
            f"train.objective=dpo run's full fine-tuning state), so checkpoint.restore_mode=all cannot restore "
            f"this run's state; set checkpoint.restore_mode=params to start DPO from its parameters (they become "
            f"the reference too)"
        )


def initial_state(run: Run, checkpointer: Checkpointer):
    """(state, step, meta): the workdir's newest readable checkpoint, else checkpoint.restore_from,
    else fresh (meta: the checkpoint's JSON, {} for a fresh or another run's state)."""
    cfg = run.cfg
    restore = run.compiled.sync.restore  # (train.sync's own, if it has one; not with a frozen base)
    if restore is not None and checkpointer.base is None:
        restored = restore(checkpointer, run.abstract_state)
    else:
        restored = checkpointer.restore(run.abstract_state)
    if restored is None and cfg.checkpoint.restore_from:
        source = open_checkpoints(cfg.checkpoint.restore_from, cfg, frozen_base=False)
        if cfg.checkpoint.restore_mode == "params":
            params, _ = source.restore_params(run.abstract_state.params)
            _say(f"starting from the parameters in {cfg.checkpoint.restore_from} at step 0")
            return run.init_state(params), 0, {}
        check_reference_saved(source, run.abstract_state, cfg.checkpoint.restore_from)
        restored = source.restore(run.abstract_state)
        if restored is None:
            raise UsageError(f"checkpoint.restore_from={cfg.checkpoint.restore_from} holds no complete checkpoint")
        _say(f"starting from {cfg.checkpoint.restore_from} at step {restored.step}")
    elif restored is not None:
        _say(f"resuming from step {restored.step} ({restored.meta['restored_from']})")
    elif (Path(cfg.workdir) / METRICS).is_file():  # an earlier attempt here saved no checkpoint (killed before one)
        _say(f"no checkpoint in {Path(cfg.workdir) / 'checkpoints'}: starting again from step 0")
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
    if current().chief:
        print(line, flush=True)
