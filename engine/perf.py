"""How much of the hardware a run turns into training: MFU against a table of peak rates,
and goodput (productive step time ÷ wall time) with its badput broken down."""
from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp

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
PEAK_TABLE_VERSION = "vendor dense peaks (engine/perf.py PEAK_FLOPS)"

_cpu_peak: Optional[float] = None

# Persistent compilation cache hits and misses in this process, from JAX's monitoring events.
compile_cache_events: Counter = Counter()


def _count_cache_event(event: str, **kwargs) -> None:
    if event in ("/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"):
        compile_cache_events[event.rsplit("_", 1)[-1]] += 1  # "hits" / "misses"


jax.monitoring.register_event_listener(_count_cache_event)


def enable_compilation_cache(directory: str) -> None:
    """JAX's persistent compilation cache in `directory` ("" = off): a relaunch of the same
    program, or a sweep run that differs only in hyperparameters, skips XLA compilation."""
    if not directory:
        return
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(directory))
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
            return (bf16 if low_precision else fp32), f"{PEAK_TABLE_VERSION}: {name} {'bf16' if low_precision else 'fp32'}"
    return 0.0, f"no peak known for {kind}"


def transformer_flops(num_params: int, num_layers: int, d_model: int, seq_len: int, tokens: int) -> float:
    """Training FLOPs of a decoder step: 6·N per token (forward + backward) plus attention's
    12·L·d·T per token (QKᵀ and AV, forward and backward, without causal savings)."""
    return 6.0 * num_params * tokens + 12.0 * num_layers * d_model * seq_len * tokens


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

    def summary(self, ended: float) -> dict[str, float]:
        wall = ended - self.started
        mean_step = self.loop_seconds / self.steps_run if self.steps_run else 0.0
        redone = min(self.redone_steps * mean_step, self.loop_seconds - self.data_wait_seconds)
        badput = {"compile": self.compile_seconds, "data_wait": self.data_wait_seconds,
                  "checkpoint_blocking": self.checkpoint_seconds, "eval": self.eval_seconds,
                  "redone_steps": redone}
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
            "goodput": productive / wall if wall > 0 else 0.0,
            **{f"badput_{name}": seconds / wall if wall > 0 else 0.0 for name, seconds in badput.items()},
            "badput_other": other / wall if wall > 0 else 0.0,  # start-up, restore, logging
        }
