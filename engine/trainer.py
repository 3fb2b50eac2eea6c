"""The training loop: wires the built Run to batches, metrics and evaluation."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np

from engine.config import Config, save_config
from engine.data import Prefetcher, eval_batches
from engine.metrics import MetricWriter
from engine.setup import Run, build_run


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or Inf (train.nan_policy=stop)."""


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
    for host_batch in eval_batches(run.dataset.eval, run.eval_batch_size, run.cfg.eval.max_batches,
                                   jax.process_index(), jax.process_count()):
        sums = jax.device_get(run.eval_step(state, run.put_batch(host_batch)))  # one host sync per batch
        for name in totals:
            totals[name] += float(sums[name])
    return {"loss": totals["loss_sum"] / totals["count"], "accuracy": totals["correct"] / totals["count"]}


def fit(cfg: Config, run: Run | None = None) -> FitResult:
    """Trains cfg.train.steps steps from the run's current state, logging and evaluating."""
    run = run or build_run(cfg)
    workdir = Path(cfg.workdir)
    is_chief = jax.process_index() == 0
    if is_chief:
        workdir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, workdir / "config.yaml")
    state = run.state
    start = int(jax.device_get(state.step).reshape(-1)[0])
    total = cfg.train.steps
    writer = MetricWriter(workdir, enabled=is_chief, total_steps=total, start_step=start,
                          progress=cfg.log.progress, tensorboard=cfg.log.tensorboard)
    batches = Prefetcher(lambda step: run.put_batch(run.train_batches(step)), start, cfg.data.prefetch)
    result = FitResult(state)
    window, window_start, window_time = [], start, time.perf_counter()
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
    finally:
        batches.close()
        writer.close()
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
