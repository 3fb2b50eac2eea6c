"""The sidecar evaluator (tf.distribute's evaluator task): evaluates each checkpoint of a
training run as it appears, appending `split: "eval"` records to the run's metrics."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from pathlib import Path

import jax

from engine.checkpoint.choice import stopped_at
from engine.config import Config, read_yaml_mapping
from engine.data.recorded import recorded_preprocessing
from engine.errors import UsageError
from engine.objectives import objective_part
from engine.parallel.sharding import batch_sharding
from engine.run.generation_eval import generated_metrics
from engine.run.outputs import SIDECAR, Evaluation, SidecarOutputs, eval_metrics
from engine.run.reference_logps import fill, precomputed
from engine.run.setup import Run, build_run
from engine.runtime.rundir import METRICS, lock_holder, read_records
from engine.runtime.watchdog import Watchdog


def evaluate(run: Run, state) -> dict[str, float]:
    """Loss, accuracy and the task's metrics of a run's state over the eval split (padding masked out),
    and eval.generate's scores of its completions (engine/run/generation_eval.py); a run that samples
    its batches (GRPO): eval/reward, the mean reward of completions sampled for the eval prompts
    with the run's own keys (the sidecar's equals the run's own eval of the same step)."""
    sampler = objective_part(run.cfg).rollouts
    if run.rollouts is None and sampler is not None:  # (built without the train step: the sidecar, once)
        run.rollouts = sampler.build(
            run.cfg, run.model.family, run.dataset, run.abstract_state, batch_sharding(run.mesh)
        )
    if run.rollouts is not None:  # (GRPO: the mean reward of completions sampled for the eval prompts)
        step = int(jax.device_get(state.step))
        sampled = run.rollouts.evaluate(state, run.dataset.eval, step) if len(run.dataset.eval["record_index"]) else {}
        return {**sampled, **generated_metrics(run, state)}
    return {**eval_metrics(Evaluation.of_run(run), state)[0], **generated_metrics(run, state)}


def evaluated_steps(metrics_path: Path) -> set[int]:
    """Steps an evaluator already wrote (so a restarted evaluator does not repeat them)."""
    return {r["step"] for r in read_records(metrics_path) if r.get("source") == SIDECAR}


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
        outputs = SidecarOutputs(cfg, closing)
        outputs.open()  # the checkpoints, read only
        run = build_run(cfg, compile_train=False)  # evaluation only: no train step to compile
        if precomputed(cfg):  # the trainer's cached reference log-probabilities
            fill(run, None)
        recorded_preprocessing(workdir, run.dataset.info, "evaluate")  # (a table: the data it trained on)
        watchdog.enter("wait")  # waiting for checkpoints has no limit here: --dead-after decides
        outputs.open_writer(0)
        return _watch(cfg, run, outputs, watchdog, watch, poll_seconds, idle_timeout, dead_after)


def _watch(
    cfg: Config,
    run: Run,
    outputs: SidecarOutputs,
    watchdog: Watchdog,
    watch: bool,
    poll_seconds: float,
    idle_timeout: float,
    dead_after: float,
) -> int:
    """Evaluates each checkpoint not yet evaluated, as they come; the exit code."""
    workdir, checkpointer = Path(cfg.workdir), outputs.checkpointer
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
                _evaluate_step(run, outputs, step)
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


def _evaluate_step(run: Run, outputs: SidecarOutputs, step: int) -> None:
    checkpointer = outputs.checkpointer
    try:
        restored = checkpointer.restore(run.abstract_state, step=step)
    except UsageError as e:  # deleted by checkpoint.keep, or unreadable: note it, go on
        print(f"warning: skipping step {step}: {e}", file=sys.stderr)
        return
    if restored is None:
        print(f"warning: skipping step {step}: it is no longer in {checkpointer.directory}", file=sys.stderr)
        return
    outputs.evaluated(step, evaluate(run, run.compiled.to_step_layout(restored.state)))
