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
from engine.errors import UsageError
from engine.metrics import MetricWriter, read_records
from engine.perf import Goodput, peak_flops, transformer_flops
from engine.setup import Run, build_run, with_config_hparams
from engine.step import unpack_metrics


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or Inf (train.nan_policy=stop)."""


class Preempted(Exception):
    """SIGTERM arrived; a checkpoint at `step` was saved and completed (exit code 143)."""

    def __init__(self, step: int):
        super().__init__(f"preempted by SIGTERM: saved a checkpoint at step {step}; re-run the same command "
                         f"to resume")
        self.step = step


class PreemptionWatch:
    """Notes SIGTERM; with several processes all agree on the step through JAX's sync point.

    With several processes, jax.distributed's own SIGTERM notifier feeds that sync point, so
    no Python handler is installed over it."""

    def __init__(self):
        self.requested = False
        self.multi_process = jax.process_count() > 1
        self._previous = None
        if not self.multi_process and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame):
        self.requested = True

    def should_stop(self, first: int, last: int) -> bool:
        """After steps first..last (one call): stop now? JAX's sync point is one exact step,
        so every step of the call is reported to it (several with train.steps_per_call)."""
        if self.multi_process:
            return any([multihost_utils.reached_preemption_sync_point(step) for step in range(first, last + 1)])
        return self.requested

    def close(self):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


@dataclass
class FitResult:
    state: object  # the final TrainState
    losses: dict[int, float] = field(default_factory=dict)  # step → train loss of that step
    eval_metrics: dict[str, float] = field(default_factory=dict)  # the last evaluation
    summary: dict = field(default_factory=dict)  # time, goodput and MFU of this run


def _summarise(step_metrics: list[dict[str, float]]) -> dict[str, float]:
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
        return restored[0], restored[2]
    if cfg.checkpoint.restore_from:
        source = Checkpointer(cfg.checkpoint.restore_from, cfg.checkpoint.keep, read_only=True)
        if cfg.checkpoint.restore_mode == "all":
            restored = source.restore(run.abstract_state)
            if restored is None:
                raise UsageError(f"checkpoint.restore_from={cfg.checkpoint.restore_from} holds no complete checkpoint")
            return restored[0], restored[2]
        params, _ = source.restore_params(run.abstract_state.params)
        return run.init_state().replace(params=params), 0
    return run.init_state(), 0


def drop_records_after(path: Path, step: int) -> int:
    """On resume, forget metrics logged after the checkpoint: those steps run again, identically.

    Returns how many logged training steps will be redone (badput of the restart)."""
    if not path.exists():
        return 0
    records = read_records(path)
    logged = max((r["step"] for r in records if r["split"] == "train"), default=step)
    kept = [r for r in records if r["step"] <= step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, path)
    return max(logged - step, 0)


def fit(cfg: Config, run: Run | None = None, started: float | None = None) -> FitResult:
    """Trains to cfg.train.steps from the newest checkpoint (or from scratch), logging and evaluating."""
    goodput = Goodput(started or time.time())
    built_here = run is None
    run = run or build_run(cfg)
    if built_here or started is not None:  # a run built before the clock started was not compiled on it
        goodput.compile_seconds = run.compile_seconds
    workdir = Path(cfg.workdir)
    is_chief = jax.process_index() == 0
    if is_chief:
        workdir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, workdir / "config.yaml")
    timeout = cfg.distributed.barrier_timeout
    checkpointer = Checkpointer(workdir / "checkpoints", cfg.checkpoint.keep, timeout_seconds=timeout,
                                staging=cfg.checkpoint.staging)
    state, start = initial_state(run, checkpointer)
    per_call = run.steps_per_call
    if start % per_call:
        checkpointer.close()
        raise UsageError(f"the run resumes at step {start}, which is not a multiple of train.steps_per_call="
                         f"{per_call}; set train.steps_per_call to a divisor of {start} (e.g. 1) for this run")
    state = run.to_step_layout(with_config_hparams(state, cfg))
    barrier(f"restored_step_{start}", timeout)  # every process starts from the same checkpoint
    if is_chief:
        goodput.redone_steps = drop_records_after(workdir / "metrics.jsonl", start)
    total = cfg.train.steps
    writer = MetricWriter(workdir, enabled=is_chief, total_steps=total, start_step=start,
                          progress=cfg.log.progress, tensorboard=cfg.log.tensorboard)
    per_block = run.steps_per_block
    batches = Prefetcher(run.train_block, start // per_block, cfg.data.prefetch)  # yields blocks of batches
    block = None
    preemption = PreemptionWatch()
    rates = Rates(run)
    result = FitResult(state)
    window = Window(start)
    last_saved = start if start else None

    def save(step):
        began = time.perf_counter()
        meta = {"step": step, "data": {"next_step": step, "seed": cfg.seed}, "config": to_yaml(cfg)}
        checkpointer.save(step, run.from_step_layout(state), meta)  # returns once copied off the devices
        window.pause(time.perf_counter() - began)
        goodput.checkpoint_seconds += time.perf_counter() - began

    try:
        for step in range(start, total, per_call):
            if block is None or step % per_block == 0:
                block = next(batches)
            # Steps [step, step + per_call), from batches step % per_block, … of the block.
            state, metrics = run.train_step(state, block)
            if run.sync_each_step or goodput.first_step_at is None:
                jax.block_until_ready(metrics)
                goodput.first_step_at = goodput.first_step_at or time.time()
            window.add(metrics, per_call)
            writer.advance(per_call)
            done = step + per_call
            if done % cfg.log.every_steps == 0 or done == total:
                host = window.to_host()  # the loop's only regular host sync
                _check_finite(host, window.start, cfg.train.nan_policy, writer)
                seconds_per_step = window.seconds() / window.steps
                goodput.loop_seconds += window.seconds()
                result.losses.update(_step_losses(host, window.start))
                writer.write(done, "train", {**_summarise(host), **rates.per_step(seconds_per_step)})
                window = Window(done)
            if (cfg.eval.every_steps and done % cfg.eval.every_steps == 0) or done == total:
                began = time.perf_counter()
                result.eval_metrics = evaluate(run, state)
                writer.write(done, "eval", result.eval_metrics)
                window.pause(time.perf_counter() - began)  # eval time is not training throughput
                goodput.eval_seconds += time.perf_counter() - began
            if (cfg.checkpoint.every_steps and done % cfg.checkpoint.every_steps == 0) or done == total:
                save(done)
                last_saved = done
            if preemption.should_stop(step + 1, done):
                if last_saved != done:
                    save(done)
                checkpointer.wait()
                raise Preempted(done)
        if start >= total:
            writer.message(f"already finished: the newest checkpoint is at step {start} of {total}")
        began = time.perf_counter()
        checkpointer.wait()  # the last save is complete before the run reports success
        goodput.checkpoint_seconds += time.perf_counter() - began
        barrier("finished", timeout)
        goodput.steps_run, goodput.data_wait_seconds = total - start, batches.wait_seconds  # waits are in the loop
        if total > start:
            timing = goodput.summary(time.time())
            result.summary = {**timing, **rates.summary(timing["mean_step_seconds"])}
            writer.write(total, "summary", result.summary)
            writer.message(_summary_text(result.summary))
    finally:
        preemption.close()
        batches.close()
        writer.close()
        checkpointer.close()
    result.state = state
    return result


class Window:
    """The steps between two log lines, and the time they took (less pauses for eval/saves)."""

    def __init__(self, start: int):
        self.start, self.metrics, self.steps = start, [], 0
        self.began, self.paused = time.perf_counter(), 0.0

    def add(self, metrics, steps: int) -> None:
        """One call's packed metrics ([steps, len(TRAIN_METRICS)], still on the device)."""
        self.metrics.append(metrics)
        self.steps += steps

    def to_host(self) -> list[dict[str, float]]:
        """Each step's metrics on the host (the window's arrays fetched together)."""
        return unpack_metrics(np.concatenate(jax.device_get(self.metrics)))

    def pause(self, seconds: float) -> None:
        self.paused += seconds

    def seconds(self) -> float:
        """Wall time of the window's steps, waits for data included (they slow training down)."""
        return max(time.perf_counter() - self.began - self.paused, 1e-9)


ANALYTIC_FORMULA = "6*N*tokens + 12*layers*d_model*seq_len*tokens"


class Rates:
    """Throughput figures of one step: steps/s, examples/s, tokens/s, TFLOP/s per device, MFU."""

    def __init__(self, run: Run):
        cfg, info = run.cfg, run.dataset.info
        self.batch = cfg.train.global_batch_size
        self.tokens = self.batch * info.seq_len if info.kind == "tokens" else 0
        self.flops, self.flops_source = run.flops_per_device_step, run.flops_source
        self.cache = run.compile_cache
        device = run.mesh.devices.flat[0]
        self.peak, self.peak_source = peak_flops(device, cfg.train.compute_dtype)
        self.analytic = 0.0
        if cfg.model.name == "transformer":
            num_params = sum(math.prod(p.shape) for p in run.param_layouts)
            self.analytic = transformer_flops(num_params, cfg.model.num_layers, cfg.model.d_model, info.seq_len,
                                              self.tokens) / run.mesh.size
        if not run.flops_are_model_flops and self.analytic:  # XLA's count is not the model's; the formula is
            self.flops = self.analytic
            self.flops_source = f"analytic formula ({ANALYTIC_FORMULA}); {run.flops_source} is not the model's"

    def per_step(self, seconds: float) -> dict[str, float]:
        values = {"steps_per_sec": 1.0 / seconds, "examples_per_sec": self.batch / seconds}
        if self.tokens:
            values["tokens_per_sec"] = self.tokens / seconds
        if self.flops:
            values["tflops_per_device"] = self.flops / seconds / 1e12
            if self.peak:
                values["mfu"] = self.flops / seconds / self.peak
        return values

    def summary(self, mean_step_seconds: float) -> dict:
        return {**self.per_step(max(mean_step_seconds, 1e-9)), "flops_per_device_step": self.flops,
                "compile_cache_hits": self.cache.get("hits", 0), "compile_cache_misses": self.cache.get("misses", 0),
                "flops_source": self.flops_source,
                "analytic_flops_per_device_step": self.analytic or None,
                "analytic_flops_formula": ANALYTIC_FORMULA if self.analytic else None,
                "peak_flops_per_device": self.peak, "peak_source": self.peak_source}


def _step_losses(host_window: list[dict], first_step: int) -> dict[int, float]:
    return {first_step + offset + 1: float(m["loss_sum"]) / float(m["count"]) for offset, m in enumerate(host_window)}


def _summary_text(summary: dict) -> str:
    badput = ", ".join(f"{k.removeprefix('badput_')} {v:.1%}" for k, v in summary.items() if k.startswith("badput_"))
    mfu = f", MFU {summary['mfu']:.1%} ({summary['peak_source']})" if summary.get("mfu") is not None else ""
    return (f"summary: time to first step {summary['time_to_first_step']:.1f}s (compile "
            f"{summary['compile_seconds']:.1f}s), mean step {summary['mean_step_seconds'] * 1e3:.2f} ms, data wait "
            f"{summary['data_wait_seconds']:.2f}s, checkpoint blocking {summary['checkpoint_blocking_seconds']:.2f}s; "
            f"goodput {summary['goodput']:.1%} (badput: {badput}){mfu}")


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
