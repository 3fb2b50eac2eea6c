"""The two dispatches of a mixture-of-experts layer (model.moe_dispatch) on the CPU: seconds of
one jitted train step (forward and backward: the gradients of a loss of the layer's output
with respect to its parameters and input) of one MoE layer, one-hot at capacity factor 1.25,
one-hot dropless (capacity = seq_len) and ragged, at 8 and 64 experts.

The variants of one expert count run interleaved (A, B, C, A, B, C, ...) after a compile and a
warm-up call each, so drifts of a shared machine fall on all of them; the table gives the
median of each and its ratio to ragged. One device, float32.

    python benchmarks/moe_dispatch.py [--experts 8 64] [--batch 4] [--seq 256] [--d-model 256]
        [--hidden 512] [--top-k 2] [--repeats 7]
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from engine.parallel.sharding import unbox  # noqa: E402
from models.configs import LlamaConfig  # noqa: E402
from models.moe import MoE, expert_capacity  # noqa: E402

VARIANTS = {  # name → (moe_dispatch, expert_capacity_factor)
    "onehot 1.25": ("onehot", 1.25),
    "onehot dropless": ("onehot", 0.0),
    "ragged": ("ragged", 0.0),
}


def train_step(cfg: LlamaConfig, x):
    """A jitted forward and backward of one MoE layer, and its parameters."""
    module = MoE(cfg, jnp.float32, jnp.float32)
    params = unbox(module.init(jax.random.key(0), x))["params"]

    def loss(params, x):
        y, sown = module.apply({"params": params}, x, mutable=["aux"])
        return jnp.mean(y * y) + sown["aux"]["aux_loss"][0]

    return jax.jit(jax.grad(loss, argnums=(0, 1))), params


def seconds(step, params, x) -> float:
    start = time.perf_counter()
    jax.block_until_ready(step(params, x))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    x = jax.random.normal(jax.random.key(1), (args.batch, args.seq, args.d_model), jnp.float32)
    print(
        f"{jax.devices()[0].device_kind}, {os.cpu_count()} cores; batch {args.batch} x seq {args.seq}, "
        f"d_model {args.d_model}, expert width {args.hidden}, top-{args.top_k}; median of {args.repeats}"
    )
    print(f"{'experts':>8} {'dispatch':>16} {'capacity':>9} {'step (s)':>10} {'/ ragged':>9}")
    for experts in args.experts:
        base = LlamaConfig(d_model=args.d_model, mlp_dim=args.hidden, num_experts=experts, experts_per_token=args.top_k)
        steps = {}
        for name, (dispatch, factor) in VARIANTS.items():
            cfg = dataclasses.replace(base, moe_dispatch=dispatch, expert_capacity_factor=factor)
            step, params = train_step(cfg, x)
            seconds(step, params, x)  # compile
            seconds(step, params, x)  # warm-up
            steps[name] = (step, params, "-" if dispatch == "ragged" else expert_capacity(cfg, args.seq))
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for _ in range(args.repeats):
            for name, (step, params, _) in steps.items():
                times[name].append(seconds(step, params, x))
        ragged = statistics.median(times["ragged"])
        for name, (_, _, capacity) in steps.items():
            median = statistics.median(times[name])
            print(f"{experts:>8} {name:>16} {capacity:>9} {median:>10.4f} {median / ragged:>8.2f}x")


if __name__ == "__main__":
    main()
