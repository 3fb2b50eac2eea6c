"""The training loop: wires the built Run to batches, metrics and evaluation."""
from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from engine.checkpoint import Checkpointer
from engine.config import Config, save_config, to_yaml
from engine.data import Prefetcher, eval_batches
from engine.distributed import barrier
from engine.metrics import MetricWriter
from engine.setup import Run, build_run


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or Inf (train.nan_policy=stop)."""


class Preempted(Exception):
    """SIGTERM arrived; a checkpoint at `step` was saved and completed (exit code 143)."""

    def __init__(self, step: int):
        super().__init__(f"preempted by SIGTERM: saved a checkpoint at step {step}; re-run the same command "
                         f"to resume")
        self.step = step


class PreemptionWatch:
    """Notes SIGTERM; with several processes all agree on the step through JAX's sync point."""

    def __init__(self):
        self.requested = False
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame):
        self.requested = True

    def should_stop(self, step: int) -> bool:
        if jax.process_count() > 1:
            return multihost_utils.reached_preemption_sync_point(step)
        return self.requested

    def close(self):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


@dataclass
class FitResult:
    state: object  # the final TrainState
    losses: dict[int, float] = field(default_factory=dict)  # step → train loss of that step
    eval_metrics: dict[str, float] = field(default_factory=dict)  # the last evaluation


def _summarise(step_metrics: list[dict[str, np.ndarray]]) -> dict[str, float]:
    """Per-step metric sums (already on host) → window means."""
    count = sum(float(m["count"]) for m in step_metrics)
    return {
        "loss": sum(float(m["loss_sum"]) for m in step_metrics) / count,
        "accuracy": sum(float(m["correct"]) for m in step_metrics) / count,
        "grad_norm": float(np.mean([m["grad_norm"] for m in step_metrics])),
        "learning_rate": float(step_metrics[-1]["learning_rate"]),
    }


def evaluate(run: Run, state) -> dict[str, float]:
    """Loss and accuracy over the eval split (padding masked out)."""
    totals = {"loss_sum": 0.0, "correct": 0.0, "count": 0.0}
    for host_batch in eval_batches(run.dataset.eval, run.eval_batch_size, run.cfg.eval.max_batches, run.eval_rows):
        sums = jax.device_get(run.eval_step(state, run.put_batch(host_batch, run.eval_batch_size)))  # host sync
        for name in totals:
            totals[name] += float(sums[name])
    return {"loss": totals["loss_sum"] / totals["count"], "accuracy": totals["correct"] / totals["count"]}


def initial_state(run: Run, checkpointer: Checkpointer):
    """(state, step): the workdir's newest readable checkpoint, else checkpoint.restore_from, else fresh."""
    cfg = run.cfg
    restored = checkpointer.restore(run.abstract_state)
    if restored is not None:
        state, meta, step = restored
        return state, step
    if cfg.checkpoint.restore_from:
        source = Checkpointer(cfg.checkpoint.restore_from, cfg.checkpoint.keep, read_only=True)
        if cfg.checkpoint.restore_mode == "all":
            restored = source.restore(run.abstract_state)
            if restored is None:
                raise_no_checkpoint(cfg.checkpoint.restore_from)
            return restored[0], restored[2]
        params, _ = source.restore_params(run.abstract_state.params)
        return run.init_state().replace(params=params), 0
    return run.init_state(), 0


def raise_no_checkpoint(path: str):
    from engine.errors import UsageError

    raise UsageError(f"checkpoint.restore_from={path} holds no complete checkpoint")


def drop_records_after(path: Path, step: int) -> None:
    """On resume, forget metrics logged after the checkpoint: those steps run again, identically."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def fit(cfg: Config, run: Run | None = None) -> FitResult:
    """Trains to cfg.train.steps from the newest checkpoint (or from scratch), logging and evaluating."""
    run = run or build_run(cfg)
    workdir = Path(cfg.workdir)
    is_chief = jax.process_index() == 0
    if is_chief:
        workdir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, workdir / "config.yaml")
    timeout = cfg.distributed.barrier_timeout
    checkpointer = Checkpointer(workdir / "checkpoints", cfg.checkpoint.keep, timeout_seconds=timeout)
    state, start = initial_state(run, checkpointer)
    barrier(f"restored_step_{start}", timeout)  # every process starts from the same checkpoint
    if is_chief:
        drop_records_after(workdir / "metrics.jsonl", start)
    state = run.to_step_layout(state)
    total = cfg.train.steps
    writer = MetricWriter(workdir, enabled=is_chief, total_steps=total, start_step=start,
                          progress=cfg.log.progress, tensorboard=cfg.log.tensorboard)
    batches = Prefetcher(lambda step: run.put_batch(run.train_batches(step), cfg.train.global_batch_size), start,
                         cfg.data.prefetch)
    preemption = PreemptionWatch()
    result = FitResult(state)
    window, window_start, window_time = [], start, time.perf_counter()
    last_saved = start if start else None

    def save(step):
        meta = {"step": step, "data": {"next_step": step, "seed": cfg.seed}, "config": to_yaml(cfg)}
        checkpointer.save(step, run.from_step_layout(state), meta)

    try:
        for step in range(start, total):
            state, metrics = run.train_step(state, next(batches))
            if run.sync_each_step:
                jax.block_until_ready(metrics)
            window.append(metrics)
            writer.advance()
            done = step + 1
            if done % cfg.log.every_steps == 0 or done == total:
                host = jax.device_get(window)  # the loop's only regular host sync
                _check_finite(host, window_start, cfg.train.nan_policy, writer)
                elapsed = time.perf_counter() - window_time
                values = _summarise(host)
                values["steps_per_sec"] = len(window) / elapsed
                values["examples_per_sec"] = values["steps_per_sec"] * cfg.train.global_batch_size
                for offset, m in enumerate(host):
                    result.losses[window_start + offset + 1] = float(m["loss_sum"]) / float(m["count"])
                writer.write(done, "train", values)
                window, window_start, window_time = [], done, time.perf_counter()
            if (cfg.eval.every_steps and done % cfg.eval.every_steps == 0) or done == total:
                result.eval_metrics = evaluate(run, state)
                writer.write(done, "eval", result.eval_metrics)
                window_time = time.perf_counter()  # eval time is not training throughput
            if (cfg.checkpoint.every_steps and done % cfg.checkpoint.every_steps == 0) or done == total:
                save(done)
                last_saved = done
            if preemption.should_stop(done):
                if last_saved != done:
                    save(done)
                checkpointer.wait()
                raise Preempted(done)
        if start >= total:
            writer.message(f"already finished: the newest checkpoint is at step {start} of {total}")
        checkpointer.wait()  # the last save is complete before the run reports success
        barrier("finished", timeout)
    finally:
        preemption.close()
        batches.close()
        writer.close()
        checkpointer.close()
    result.state = state
    return result


def _check_finite(host_window: list[dict], first_step: int, policy: str, writer: MetricWriter) -> None:
    for offset, metrics in enumerate(host_window):
        loss = float(metrics["loss_sum"]) / max(float(metrics["count"]), 1.0)
        if not math.isfinite(loss):
            step = first_step + offset + 1
            text = (f"loss is {loss} at step {step}; lower optimizer.learning_rate, set "
                    f"optimizer.grad_clip_norm, or check the data")
            if policy == "stop":
                raise NonFiniteLoss(text)
            writer.message(f"warning: {text}")
            return
