"""The sidecar evaluator (tf.distribute's evaluator task): evaluates each checkpoint of a
training run as it appears, appending `split: "eval"` records to the run's metrics."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from pathlib import Path

import jax

from engine.checkpoint.store import Checkpointer, open_checkpoints
from engine.config import Config, read_yaml_mapping
from engine.data import eval_batches
from engine.data.recorded import recorded_preprocessing
from engine.errors import UsageError
from engine.observe.metrics import MetricWriter
from engine.run.best import stopped_at
from engine.run.setup import Run, build_run
from engine.run.step import weights_of
from engine.runtime.rundir import METRICS, lock_holder, read_records
from engine.runtime.watchdog import Watchdog

SOURCE = "evaluator"


def evaluate(run: Run, state) -> dict[str, float]:
    """Loss and accuracy over the eval split (padding masked out)."""
    totals = {"loss_sum": 0.0, "correct": 0.0, "count": 0.0}
    inputs, compiled = run.inputs, run.compiled
    for host_batch in eval_batches(
        run.dataset.eval, inputs.eval_batch_size, run.cfg.eval.max_batches, inputs.eval_rows
    ):
        batch = compiled.put_batch(host_batch, inputs.eval_batch_size)
        sums = jax.device_get(compiled.eval_step(weights_of(state), batch))
        for name in totals:  # device_get above is a host sync per batch
            totals[name] += float(sums[name])
    loss = totals["loss_sum"] / totals["count"]
    return {
        "loss": loss,
        "accuracy": totals["correct"] / totals["count"],
        **run.model.family.task.eval_metrics(loss, run.dataset.info),
    }


def evaluated_steps(metrics_path: Path) -> set[int]:
    """Steps an evaluator already wrote (so a restarted evaluator does not repeat them)."""
    return {r["step"] for r in read_records(metrics_path) if r.get("source") == SOURCE}


def run_evaluator(
    cfg: Config, watch: bool, poll_seconds: float = 2.0, idle_timeout: float = 3600.0, dead_after: float = 60.0
) -> int:
    """Evaluates the newest checkpoint (or, with watch, every new one until training ends).

    Watching, it says which step it waits for, and stops when the run it watches is finished
    or dead: no trainer holds the workdir's lock and no checkpoint came for `dead_after` s."""
    workdir = Path(cfg.workdir)
    directory = workdir / "checkpoints"
    waited = 0.0
    while watch and not directory.is_dir():  # the trainer may not have saved yet
        if waited > idle_timeout:
            raise UsageError(f"no checkpoints appeared in {directory} within {idle_timeout:.0f}s")
        time.sleep(poll_seconds)
        waited += poll_seconds
    with contextlib.ExitStack() as closing:
        watchdog = closing.enter_context(
            contextlib.closing(
                Watchdog(  # no silent hang either
                    dataclasses.asdict(cfg.watchdog), workdir, who="evaluator"
                )
            )
        )
        checkpointer = closing.enter_context(contextlib.closing(open_checkpoints(directory, cfg)))
        run = build_run(cfg, compile_train=False)  # evaluation only: no train step to compile
        recorded_preprocessing(workdir, run.dataset.info, "evaluate")  # (a table: the data it trained on)
        watchdog.enter("wait")  # waiting for checkpoints has no limit here: --dead-after decides
        writer = closing.enter_context(
            contextlib.closing(
                MetricWriter(
                    workdir, enabled=True, total_steps=cfg.train.steps, start_step=0, progress=False, tensorboard=False
                )
            )
        )
        summary = None
        if cfg.log.tensorboard:  # a subdirectory of its own: two writers must not share an event file
            from tensorboardX import SummaryWriter

            summary = closing.enter_context(contextlib.closing(SummaryWriter(str(workdir / "evaluator"))))
        return _watch(cfg, run, checkpointer, writer, summary, watchdog, watch, poll_seconds, idle_timeout, dead_after)


def _watch(
    cfg: Config,
    run: Run,
    checkpointer: Checkpointer,
    writer: MetricWriter,
    summary,
    watchdog: Watchdog,
    watch: bool,
    poll_seconds: float,
    idle_timeout: float,
    dead_after: float,
) -> int:
    """Evaluates each checkpoint not yet evaluated, as they come; the exit code."""
    workdir = Path(cfg.workdir)
    done = evaluated_steps(workdir / METRICS)
    idle_since = alive_at = time.monotonic()
    said, stopped, read_at = None, None, None
    while True:
        steps = checkpointer.steps()
        pending = [s for s in steps if s not in done] if watch else steps[-1:]
        if not watch and not pending:
            raise UsageError(f"no complete checkpoint in {checkpointer.directory} to evaluate")
        for step in pending:
            with watchdog.phase("eval"):  # restore and evaluate
                _evaluate_step(run, checkpointer, step, writer, summary)
            done.add(step)
            idle_since = alive_at = time.monotonic()
        newest = max(steps, default=0)
        if newest and newest != read_at:  # a run that train.early_stop ended: its last checkpoint says so
            readable, stopped = stopped_at(checkpointer, newest)
            read_at = newest if readable else None  # (unreadable yet: read again at the next poll)
        total = stopped if stopped is not None else target_steps(cfg)
        if not watch or (newest >= total and not pending):
            return 0
        if lock_holder(workdir) is not None:
            alive_at = time.monotonic()
        elif time.monotonic() - alive_at > dead_after:
            print(
                f"error: the training run in {workdir} is not running (no trainer holds its workdir, and no "
                f"checkpoint came for {dead_after:.0f}s); its newest checkpoint is step {newest} of "
                f"{total}. Restart training, then the evaluator",
                file=sys.stderr,
            )
            return 1
        if not pending and time.monotonic() - idle_since > idle_timeout:
            print(
                f"error: no new checkpoint in {checkpointer.directory} for {idle_timeout:.0f}s; is training running?",
                file=sys.stderr,
            )
            return 1
        if said != newest:
            print(f"waiting for a checkpoint after step {newest} (training runs to step {total})", flush=True)
            said = newest
        time.sleep(poll_seconds)


def target_steps(cfg: Config) -> int:
    """The step the watched run trains to: its own config.yaml's train.steps once the run has
    written one (an evaluator started before the run holds --config's), else the config's."""
    written = Path(cfg.workdir) / "config.yaml"
    if not written.is_file():
        return cfg.train.steps
    steps = (read_yaml_mapping(written, "the run's config").get("train") or {}).get("steps", cfg.train.steps)
    return steps if isinstance(steps, int) else cfg.train.steps


def _evaluate_step(run: Run, checkpointer: Checkpointer, step: int, writer: MetricWriter, summary) -> None:
    try:
        restored = checkpointer.restore(run.abstract_state, step=step)
    except UsageError as e:  # deleted by checkpoint.keep, or unreadable: note it, go on
        print(f"warning: skipping step {step}: {e}", file=sys.stderr)
        return
    if restored is None:
        print(f"warning: skipping step {step}: it is no longer in {checkpointer.directory}", file=sys.stderr)
        return
    state = restored.state
    metrics = evaluate(run, run.compiled.to_step_layout(state))
    writer.write(step, "eval", {**metrics, "source": SOURCE})
    if summary is not None:
        for name, value in metrics.items():
            summary.add_scalar(f"eval/{name}", value, step)
        summary.flush()
