"""How much of the hardware a run turns into training: throughput and MFU against a table of peak
rates (Throughput), and goodput (productive step time ÷ wall time) with its badput broken down.
The model FLOPs of a step (StepCost) are counted in engine/run/cost.py."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from engine.runtime.caches import cache_path
from engine.state.columns import MetricColumns, fetch_rows

# Dense peak FLOP/s per chip from vendor data sheets: (bfloat16, float32). float32 on NVIDIA
# is the non-tensor-core rate; TPUs run float32 matmuls at their bf16 rate in multiple passes,
# listed here as the bf16 rate / 3 (XLA's default precision for f32 is three bf16 passes).
PEAK_FLOPS = {
    "TPU v4": (275e12, 275e12 / 3),
    "TPU v5 lite": (197e12, 197e12 / 3),  # v5e
    "TPU v5e": (197e12, 197e12 / 3),
    "TPU v5p": (459e12, 459e12 / 3),
    "TPU v5": (459e12, 459e12 / 3),
    "TPU v6 lite": (918e12, 918e12 / 3),  # v6e (Trillium)
    "TPU v6e": (918e12, 918e12 / 3),
    "A100": (312e12, 19.5e12),
    "H100": (989e12, 67e12),  # SXM
    "H200": (989e12, 67e12),
}
PEAK_TABLE_VERSION = "vendor dense peaks (engine/observe/perf.py PEAK_FLOPS)"

_cpu_peak: Optional[float] = None


@dataclass(frozen=True)
class StepCost:
    """The model FLOPs of one train step, and where the count comes from."""

    flops_per_device_step: float  # model FLOPs per device per step (0 = unknown, e.g. eager)
    source: str  # which program or formula the count comes from
    analytic_per_device_step: float = 0.0  # the model family's formula (0 = it has none)
    analytic_formula: str = ""


def enable_compilation_cache(directory: str) -> None:
    """JAX's persistent compilation cache in `directory` ("" = off): a relaunch of the same
    program, or a sweep run that differs only in hyperparameters, skips XLA compilation."""
    if not directory:
        return
    jax.config.update("jax_compilation_cache_dir", str(cache_path(directory)))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # cache even quick compiles
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def measured_cpu_peak() -> float:
    """FLOP/s of a large float32 matmul on this CPU device, measured once per process."""
    global _cpu_peak
    if _cpu_peak is None:
        n = 1024
        a = jnp.ones((n, n), jnp.float32)
        matmul = jax.jit(lambda x: x @ x)
        matmul(a).block_until_ready()
        repeats, start = 5, time.perf_counter()
        for _ in range(repeats):
            matmul(a).block_until_ready()
        _cpu_peak = 2 * n**3 * repeats / (time.perf_counter() - start)
    return _cpu_peak


def peak_flops(device, dtype: str) -> tuple[float, str]:
    """(peak FLOP/s of one device for this compute dtype, where the figure comes from)."""
    if device.platform == "cpu":
        return measured_cpu_peak(), "measured float32 matmul on this CPU"
    kind = device.device_kind
    for name, (bf16, fp32) in PEAK_FLOPS.items():
        if name.lower() in kind.lower():
            low_precision = dtype in ("bfloat16", "float16")
            return (
                bf16 if low_precision else fp32
            ), f"{PEAK_TABLE_VERSION}: {name} {'bf16' if low_precision else 'fp32'}"
    return 0.0, f"no peak known for {kind}"


@dataclass
class Goodput:
    """Wall-clock accounting of a run, from process start to the end of training."""

    started: float  # time.time() when the process started
    compile_seconds: float = 0.0
    first_step_at: Optional[float] = None
    data_wait_seconds: float = 0.0
    checkpoint_seconds: float = 0.0  # time the loop was blocked on saves
    eval_seconds: float = 0.0
    loop_seconds: float = 0.0  # time in the training loop, waits for data included, eval and saves not
    steps_run: int = 0
    redone_steps: int = 0  # steps run again after a restart (logged before, lost since the checkpoint)
    dispatch_seconds: float = 0.0  # in the loop: handing calls to the runtime (host time)
    device_wait_seconds: float = 0.0  # in the loop: waiting for the device's results (log lines, syncs)
    recovery_seconds: float = 0.0  # fault.elastic: from each failure (or stop to grow back) to the next start
    earlier_seconds: float = 0.0  # fault.elastic: the job's earlier starts, from the job's start (not recovery)

    def summary(self, ended: float) -> dict[str, float]:
        # (an elastic job's last start covers the whole job: its earlier starts, and each gap between them)
        wall = ended - self.started + self.recovery_seconds + self.earlier_seconds
        mean_step = self.loop_seconds / self.steps_run if self.steps_run else 0.0
        redone = min(self.redone_steps * mean_step, self.loop_seconds - self.data_wait_seconds)
        badput = {
            "compile": self.compile_seconds,
            "data_wait": self.data_wait_seconds,
            "checkpoint_blocking": self.checkpoint_seconds,
            "eval": self.eval_seconds,
            "redone_steps": redone,
            "recovery": self.recovery_seconds,  # stopping the job and starting it again; its start-up is `other`
            "earlier_starts": self.earlier_seconds,  # (their steps up to the checkpoint restored are not told apart)
        }
        productive = max(self.loop_seconds - self.data_wait_seconds - redone, 0.0)
        other = max(wall - productive - sum(badput.values()), 0.0)
        return {
            "wall_seconds": wall,
            "time_to_first_step": (self.first_step_at - self.started) if self.first_step_at else 0.0,
            "compile_seconds": self.compile_seconds,
            "mean_step_seconds": mean_step,
            "data_wait_seconds": self.data_wait_seconds,
            "checkpoint_blocking_seconds": self.checkpoint_seconds,
            "eval_seconds": self.eval_seconds,
            "redone_steps": self.redone_steps,
            "recovery_seconds": self.recovery_seconds,
            "goodput": productive / wall if wall > 0 else 0.0,
            **{f"badput_{name}": seconds / wall if wall > 0 else 0.0 for name, seconds in badput.items()},
            "badput_other": other / wall if wall > 0 else 0.0,  # start-up, restore, logging
            # where the training loop's time went, sampled on the host
            "loop_dispatch": self.dispatch_seconds / self.loop_seconds if self.loop_seconds else 0.0,
            "loop_data_wait": self.data_wait_seconds / self.loop_seconds if self.loop_seconds else 0.0,
            "loop_device_wait": self.device_wait_seconds / self.loop_seconds if self.loop_seconds else 0.0,
        }


class StepTrace:
    """log.profile_steps=[a, b]: a jax.profiler trace of the calls that run steps a..b after
    this process's first step (from the call that holds step a: with train.steps_per_call > 1
    the trace is of whole calls around the window), into <workdir>/profile/process_<i>
    (TensorBoard's profile plugin or XProf read it)."""

    def __init__(self, window, start: int, workdir: Path, steps_per_call: int = 1):
        self.first: Optional[int] = start + window[0] if window else None
        self.last: int = start + window[1] if window else 0
        self.steps_per_call = steps_per_call
        self.directory = Path(workdir) / "profile" / f"process_{jax.process_index()}"
        self.active = False
        self.traced: Optional[tuple[int, int]] = None

    def before(self, step: int) -> None:
        """Called before the call that starts at `step`."""
        holds_first = self.first is not None and step + self.steps_per_call > self.first
        if holds_first and self.traced is None and not self.active and step < self.last:
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory))
            self.active, self.began = True, step

    def after(self, done: int, outputs) -> Optional[tuple[int, int]]:
        """Called after the call that ends at `done`; → (first, last) step once the trace is written."""
        if self.active and done >= self.last:
            jax.block_until_ready(outputs)
            jax.profiler.stop_trace()
            self.active, self.traced = False, (self.began, done)
            return self.traced
        return None

    def message(self) -> str:
        first, last = self.traced or (0, 0)
        return (
            f"profile: steps {first}..{last} traced into {self.directory} (tensorboard "
            f"--logdir {self.directory}, Profile tab; or xprof)"
        )

    def close(self) -> None:
        if self.active:  # the loop ended early (preempted, failed): keep what was traced
            jax.profiler.stop_trace()
            self.active = False


class Window:
    """The steps between two log lines, and the time they took (less pauses for eval/saves)."""

    def __init__(self, start: int):
        self.start, self.steps = start, 0
        self.metrics: list = []  # one packed array per call, still on the device
        self.began, self.paused = time.perf_counter(), 0.0
        self.timed_steps = 0  # steps run in this process (a resumed window also holds earlier ones)

    @classmethod
    def resumed(cls, start: int, carried: Optional[dict], columns: MetricColumns) -> "Window":
        """The window a checkpoint saved part of (carried()), or a new one from `start`: the log
        record at its end then covers the same steps as in a run that never stopped. `columns`:
        this run's packed metrics (a run resumed with other data sources starts anew)."""
        carried = carried or {}
        rows = carried.get("metrics") or []
        fits = bool(rows) and carried.get("start", -1) + len(rows) == start and columns.fits(rows)
        if not fits:
            return cls(start)
        window = cls(carried["start"])
        window.metrics.append(np.asarray(rows, np.float32))
        window.steps = len(rows)
        return window

    def carried(self, fetch: Optional[Callable] = None) -> Optional[dict]:
        """The window's steps so far, for a checkpoint's meta (None when it holds none);
        `fetch`: the job's, for metrics that need combining on the way to the host."""
        if not self.steps:
            return None
        return {"start": self.start, "metrics": (fetch or fetch_rows)(self.metrics).tolist()}

    def add(self, metrics, steps: int) -> None:
        """One call's packed metrics ([steps, columns], still on the device)."""
        self.metrics.append(metrics)
        self.steps += steps
        self.timed_steps += steps

    def pause(self, seconds: float) -> None:
        self.paused += seconds

    def seconds(self) -> float:
        """Wall time of the window's steps, waits for data included (they slow training down)."""
        return max(time.perf_counter() - self.began - self.paused, 1e-9)


class Throughput:
    """Rates of one step: steps/s, examples/s, tokens/s, TFLOP/s per device, MFU."""

    def __init__(
        self, cost: StepCost, batch: int, tokens_per_step: int, device, compute_dtype: str, compile_cache: dict
    ):
        self.cost, self.batch, self.tokens, self.cache = cost, batch, tokens_per_step, compile_cache
        self.peak, self.peak_source = peak_flops(device, compute_dtype)

    def per_step(self, seconds: float) -> dict[str, float]:
        values = {"steps_per_sec": 1.0 / seconds, "examples_per_sec": self.batch / seconds}
        if self.tokens:
            values["tokens_per_sec"] = self.tokens / seconds
        flops = self.cost.flops_per_device_step
        if flops:
            values["tflops_per_device"] = flops / seconds / 1e12
            if self.peak:
                values["mfu"] = flops / seconds / self.peak
        return values

    def summary(self, mean_step_seconds: float) -> dict:
        cost = self.cost
        return {
            **self.per_step(max(mean_step_seconds, 1e-9)),
            "flops_per_device_step": cost.flops_per_device_step,
            "compile_cache_hits": self.cache.get("hits", 0),
            "compile_cache_misses": self.cache.get("misses", 0),
            "flops_source": cost.source,
            "analytic_flops_per_device_step": cost.analytic_per_device_step or None,
            "analytic_flops_formula": cost.analytic_formula or None,
            "peak_flops_per_device": self.peak,
            "peak_source": self.peak_source,
        }


def _short(summary: dict) -> str:
    """Why goodput is low in a short run: start-up and compilation are most of its time."""
    if summary["goodput"] >= 0.5 or summary["wall_seconds"] >= 120:
        return ""
    return " (a short run: start-up, compilation and evaluation weigh more than they will in a long one)"


def summary_text(summary: dict) -> str:
    """The run summary (Goodput.summary + Throughput.summary) as one paragraph for the console."""
    badput = ", ".join(f"{k.removeprefix('badput_')} {v:.1%}" for k, v in summary.items() if k.startswith("badput_"))
    mfu = f", MFU {summary['mfu']:.1%} ({summary['peak_source']})" if summary.get("mfu") is not None else ""
    other = max(1.0 - summary["loop_dispatch"] - summary["loop_data_wait"] - summary["loop_device_wait"], 0.0)
    profile = f"; profile trace in {summary['profile_dir']}" if summary.get("profile_dir") else ""
    return (
        f"summary: time to first step {summary['time_to_first_step']:.1f}s (compile "
        f"{summary['compile_seconds']:.1f}s), mean step {summary['mean_step_seconds'] * 1e3:.2f} ms, data wait "
        f"{summary['data_wait_seconds']:.2f}s, checkpoint blocking {summary['checkpoint_blocking_seconds']:.2f}s; "
        f"goodput {summary['goodput']:.1%}: {summary['goodput'] * summary['wall_seconds']:.1f}s of training "
        f"steps in a {summary['wall_seconds']:.1f}s process{_short(summary)} (badput: {badput}){mfu}; loop: "
        f"dispatch {summary['loop_dispatch']:.0%}, "
        f"waiting for data {summary['loop_data_wait']:.0%}, for the device {summary['loop_device_wait']:.0%}, "
        f"other {other:.0%}{profile}"
    )
