"""How much of the hardware a run turns into training: the model FLOPs of a step (StepCost),
throughput and MFU against a table of peak rates (Throughput), and goodput (productive step
time ÷ wall time) with its badput broken down."""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from engine.data import example_spec
from engine.run.step import make_loss_fn, make_train_step
from engine.runtime.caches import cache_path
from engine.state.columns import MetricColumns, fetch_rows
from engine.state.train_state import FROZEN, TrainState, split_variables

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


@dataclass(frozen=True)
class StepCost:
    """The model FLOPs of one train step, and where the count comes from."""

    flops_per_device_step: float  # model FLOPs per device per step (0 = unknown, e.g. eager)
    source: str  # which program or formula the count comes from
    analytic_per_device_step: float = 0.0  # the model family's formula (0 = it has none)
    analytic_formula: str = ""


def compiled_flops(compiled) -> float:
    """XLA's FLOP count of a compiled program (0 where it gives none)."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else {}
    return float((analysis or {}).get("flops", 0.0))


def lowered_flops(lowered) -> Optional[float]:
    """XLA's FLOP count of a lowered program; None where the backend gives none."""
    analysis = lowered.cost_analysis()
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else None
    return float(analysis["flops"]) if analysis and "flops" in analysis else None


def step_cost(
    cfg, family, module, dataset, tx, abstract_state, devices, compiled, copies: int = 1, auto_chunk=0, objective=None
) -> StepCost:
    """The model FLOPs of one train step per device.

    XLA's cost analysis of the compiled step counts them, except where the run's settings
    change the compiled work but not the model's: the family's FLOPs `work_settings` (remat
    recomputes, a chunked loss is a loop XLA counts once, fused attention a custom call it
    cannot count) and gradient accumulation or several steps per call (loops). Then the
    same step is lowered (a trace, no compile) without them and counted; where the backend
    cannot analyse a lowered program (GPU and TPU plugins may not), the family's formula.
    `copies`: runs the compiled program steps at once (a vectorised group's trials; XLA's count
    of the program already holds them all); `auto_chunk`: the loss chunk model.loss_chunk=0 chose
    as the step was traced (0: the whole sequence at once); `objective`: the run's record
    (engine/config/objective.py; None: a language model's), which counts an example."""
    info = dataset.info
    accounting = family.flops  # None: no formula, and no settings XLA would miscount
    per_example, formula = (
        analytic_per_example(cfg, accounting, info, abstract_state, objective) if accounting else (0.0, "")
    )
    analytic = per_example * cfg.train.global_batch_size * copies / devices
    formula = formula if analytic else ""
    flops = compiled_flops(compiled) if compiled is not None else 0.0
    if not flops:
        return StepCost(0.0, "none (the step was not compiled)", analytic, formula)
    reason = accounting.formula_only(cfg.model) if accounting else ""
    if reason and analytic:
        return StepCost(analytic, f"analytic formula ({formula}): {reason}", analytic, formula)
    # as the module resolved them (an `auto` setting names what it chose)
    plain = accounting.work_settings if accounting else {}
    resolved = accounting.settings_used(cfg.model, module) if accounting else {}
    differs = [f"{key}={resolved[key]}" for key, value in plain.items() if resolved[key] != value]
    differs += [f"loss_chunk={auto_chunk} (auto)"] if auto_chunk else []
    differs += [
        f"{key}={getattr(cfg.train, key)}"
        for key in ("grad_accum_steps", "steps_per_call")
        if getattr(cfg.train, key) > 1
    ]
    if not differs:
        return StepCost(flops, "XLA cost analysis of the compiled step", analytic, formula)
    settings = ", ".join(differs)
    reference = _reference_flops(cfg, family, dataset, tx, abstract_state, objective)
    if reference is not None:
        return StepCost(
            reference * copies / devices, f"XLA cost analysis of the same step without {settings}", analytic, formula
        )
    compiled_source = f"XLA cost analysis of the compiled step, with {settings}"
    if analytic:
        return StepCost(
            analytic, f"analytic formula ({formula}); {compiled_source} is not the model's", analytic, formula
        )
    return StepCost(flops, compiled_source, analytic, formula)


def analytic_per_example(cfg, accounting, info, abstract_state, objective=None) -> tuple[float, str]:
    """(the model FLOPs of one example of a train step by the family's formula, in words).

    The formula is a full training step's: forward, backward through the activations and the
    weights' gradients, 2 + 2 + 2 per parameter and token. LoRA (a FROZEN base in the model
    state): the base's weights get no gradient, so its parameters count 4 (forward and backward
    through the activations), the adapters 6. The objective's record counts an example from
    that (`objective`, engine/config/objective.py: a DPO pair is two rows through the policy and the reference's)."""
    trained = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(abstract_state.params))
    frozen_tree = abstract_state.model_state.get(FROZEN, {}) if isinstance(abstract_state.model_state, dict) else {}
    frozen = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(frozen_tree))
    full = accounting.per_example(cfg.model, info, trained + frozen)  # every parameter trained
    # the base's weight gradients, 2 of the formula's 6 per parameter (it is linear in them; an
    # embedding table the formula takes as a lookup is counted too: a slight undercount), at most
    # a third of the whole: never a negative count
    base_weight_grads = min((full - accounting.per_example(cfg.model, info, trained)) / 3, full / 3)
    policy = full - base_weight_grads
    formula = accounting.formula + (" (LoRA: the frozen base 4*N_base*tokens)" if frozen else "")
    if objective is None:
        return policy, formula
    return objective.flops(cfg, policy, full, formula)  # (DPO's pair: engine/config/dpo_objective.py)


def _reference_flops(cfg, family, dataset, tx, abstract_state, objective=None) -> Optional[float]:
    """FLOPs of one whole train step with the family's reference work settings and no
    gradient accumulation, from the lowered (not compiled) program; None if not analysable.
    The reference model's parameters may be laid out differently (unscanned layers): its
    state's shapes come from its own init."""
    if objective is not None and not objective.plain_step:  # (the plain step is a language model's, not DPO's)
        return None
    plain = {**family.flops.work_settings, **family.flops.reference_settings} if family.flops else {}
    model_cfg = dataclasses.replace(cfg.model, **plain)
    module = family.build(model_cfg, dataset.info, jnp.dtype(cfg.train.compute_dtype), jnp.dtype(cfg.train.param_dtype))
    step = make_train_step(
        make_loss_fn(module, family.task, family.hparams, len(dataset.info.sources)), tx, cfg.optimizer.schedule
    )
    batch = {
        name: jax.ShapeDtypeStruct((cfg.train.global_batch_size, *a.shape[1:]), a.dtype)
        for name, a in example_spec(dataset.train).items()
    }
    variables = jax.eval_shape(
        lambda: nn.meta.unbox(module.init(jax.random.key(0), family.task.sample_input(dataset.info), train=False))
    )
    params, variables = split_variables(variables)
    strip = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
    state = TrainState(  # (a DiLoCo state's step, rng and hparams are a run's)
        step=strip(abstract_state.step),
        params=params,
        model_state=variables,
        opt_state=jax.eval_shape(tx.init, params),
        rng=strip(abstract_state.rng),
        hparams=jax.tree.map(strip, abstract_state.hparams),
    )
    return lowered_flops(jax.jit(step).lower(state, batch))


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
