"""Collective communication per training step, by mesh layout, read from the compiled HLO.

Runs on 8 simulated CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8, set
below before jax is imported). For each model (the MNIST MLP of configs/mnist_mlp.yaml and
the small GPT of tests/integration/test_parallel.py) and each layout (data=8; fsdp=8; data=4,tensor=2;
fsdp=4,tensor=2) it builds the run, times the step (median over --steps steps after
--warmup, each step waited on: CPU collectives deadlock if steps overlap), and lists every
all-reduce, all-gather, reduce-scatter, all-to-all and collective-permute in
`run.compiled.train_step.as_text()`.

How bytes are counted (per device, per step):
  bytes       the size of the buffer the collective produces, from the HLO result shape
              (a tuple result counts every element; f32 = 4 bytes, bf16 = 2, s32 = 4, …).
              For reduce-scatter the full input is counted (result x group size), so that a
              gradient reduce-scatter and a gradient all-reduce both count the gradient once.
  ring bytes  an estimate of what each device sends with ring algorithms over a group of n:
              all-reduce 2(n-1)/n x bytes; all-gather, reduce-scatter, all-to-all
              (n-1)/n x bytes; collective-permute 1 x bytes.
Ops are counted as they appear in the program text: an op inside a loop counts once.
Async pairs (-start/-done) count once, with the -done result.

Theoretical minimum, from each parameter's PartitionSpec (P = the bytes of a parameter's
gradient that one tensor-parallel shard holds, i.e. its bytes / mesh.tensor if it is split
over `tensor`, else its bytes):
  data parallel    all-reduce of the gradients                           = 1 x P
  fsdp             all-gather the params for the forward pass, again for
                   the backward pass, reduce-scatter the gradients        = 2 x P + 1 x P = 3 x P
                   (a parameter fsdp cannot split stays replicated: an all-reduce, 1 x P;
                   with data > 1 as well, the fsdp gradient shards are also all-reduced
                   over data: + P / fsdp)
  tensor parallel  depends on the activations, not the parameters. Megatron-style estimate
                   with B = the global batch / (data x fsdp), S = sequence length, D = d_model,
                   c = bytes of the compute dtype, L = layers:
                     transformer: (4 L + 2) all-reduces of [B, S, D] (2 per block forward,
                       2 per block backward, the vocab-split embedding forward and the
                       vocab-split head backward) + 3 all-reduces of [B, S] f32 for the
                       softmax over the vocab-split logits;
                     mlp: for a Dense whose input dimension is split over tensor, a forward
                       all-reduce of its output [B, out]; for one whose output dimension is
                       split (other than the first layer), a backward all-reduce of its input
                       gradient [B, in].
The minimum also omits the few scalar all-reduces the metrics need (loss, count, grad norm).

Reading the output: the measured bytes at or near the minimum mean XLA's SPMD partitioner
found the textbook communication; more means extra collectives (e.g. re-sharding
activations with all-to-all, or all-reducing q, k and v input gradients separately).
Less than the fsdp minimum usually means XLA kept the parameters gathered in the forward
pass alive for the backward pass (one all-gather instead of two), trading memory for
communication. XLA:CPU has no reduce-scatter creation pass: on CPU the fsdp gradient
reduce-scatter appears as an all-reduce whose result is then sliced to the local shard.
It counts the same bytes here, but moves about 2x the data of a reduce-scatter (see the
ring column). CPU step times say how the layouts compare on this machine only; they are
no guide to accelerator speed.

    python benchmarks/collectives.py
    python benchmarks/collectives.py --models transformer --layouts fsdp=8 "fsdp=4,tensor=2"
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.config import load_config  # noqa: E402
from engine.plan.hlo import OPS, Collective, hlo_collectives  # noqa: E402
from engine.run.setup import build_run  # noqa: E402
from engine.runtime.units import human_bytes  # noqa: E402

QUIET = ["log.progress=false", "log.tensorboard=false"]
MODELS = {
    "mlp": [],  # configs/mnist_mlp.yaml as shipped
    # the small GPT of tests/integration/test_parallel.py
    "transformer": [
        "model.name=transformer",
        "data.name=synthetic_text",
        "data.seq_len=16",
        "data.num_examples=512",
        "data.vocab_size=64",
        "model.num_layers=2",
        "model.d_model=32",
        "model.num_heads=4",
        "model.mlp_dim=64",
        "model.dropout_rate=0.1",
        "train.global_batch_size=16",
    ],
}
LAYOUTS = {
    "data=8": ["mesh.data=8"],
    "fsdp=8": ["mesh.data=1", "mesh.fsdp=8"],
    "data=4,tensor=2": ["mesh.data=4", "mesh.tensor=2"],
    "fsdp=4,tensor=2": ["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"],
}
# --- the theoretical minimum ---------------------------------------------------------------


def entry_axes(entry) -> set[str]:
    """Mesh axes one PartitionSpec entry splits a dimension over (None, 'fsdp' or ('data', 'fsdp'))."""
    if entry is None:
        return set()
    return {entry} if isinstance(entry, str) else set(entry)


def spec_axes(spec) -> set[str]:
    return set().union(*(entry_axes(entry) for entry in spec))


def parameter_minimum(run) -> list[Collective]:
    """Gradient all-reduces (data) or param all-gathers + gradient reduce-scatters (fsdp)."""
    mesh = run.mesh.shape
    batch_ways = mesh["data"] * mesh["fsdp"]
    needed = []
    for layout in run.model.param_layouts:
        axes = spec_axes(layout.spec)
        local = layout.nbytes // (mesh["tensor"] if "tensor" in axes else 1)
        if "fsdp" in axes:
            needed += [Collective("all-gather", local, mesh["fsdp"])] * 2
            needed.append(Collective("reduce-scatter", local, mesh["fsdp"]))
            if mesh["data"] > 1:
                needed.append(Collective("all-reduce", local // mesh["fsdp"], mesh["data"]))
        elif batch_ways > 1:
            needed.append(Collective("all-reduce", local, batch_ways))
    return needed


def activation_minimum(run) -> list[Collective]:
    """Megatron-style tensor-parallel activation all-reduces (see the module docstring)."""
    cfg, mesh = run.cfg, run.mesh.shape
    tensor = mesh["tensor"]
    if tensor == 1:
        return []
    rows = cfg.train.global_batch_size // (mesh["data"] * mesh["fsdp"])
    itemsize = np.dtype(cfg.train.compute_dtype).itemsize
    if cfg.model.name == "transformer":
        seq, width = run.dataset.info.seq_len, cfg.model.d_model
        residual = Collective("all-reduce", rows * seq * width * itemsize, tensor)
        softmax = Collective("all-reduce", rows * seq * 4, tensor)
        return [residual] * (4 * cfg.model.num_layers + 2) + [softmax] * 3
    layouts = {layout.path: layout for layout in run.model.param_layouts}
    names = [f"hidden_{i}" for i in range(len(cfg.model.hidden_sizes))] + ["logits"]
    needed = []
    for index, name in enumerate(names):
        kernel = layouts[f"{name}/kernel"]
        fan_in, fan_out = kernel.shape
        split_in, split_out = (entry_axes(entry) for entry in kernel.spec)
        if "tensor" in split_in:  # row-parallel: partial sums of the output
            needed.append(Collective("all-reduce", rows * fan_out * itemsize, tensor))
        if "tensor" in split_out and index > 0:  # column-parallel: partial sums of the input gradient
            needed.append(Collective("all-reduce", rows * fan_in * itemsize, tensor))
    return needed


# --- driver --------------------------------------------------------------------------------


def median_step_seconds(run, steps: int, warmup: int) -> float:
    state = run.compiled.to_step_layout(run.init_state())
    times = []
    for step in range(warmup + steps):
        batch = run.train_block(step)
        start = time.perf_counter()
        state, metrics = run.compiled.train_step(state, batch)
        jax.block_until_ready((state, metrics))  # never let two CPU multi-device steps overlap
        times.append(time.perf_counter() - start)
    return statistics.median(times[warmup:])


def totals(collectives: list[Collective], op: str | None = None) -> tuple[int, int, float]:
    chosen = [c for c in collectives if op is None or c.op == op]
    return len(chosen), sum(c.bytes for c in chosen), sum(c.ring_bytes for c in chosen)


def report(model: str, layout: str, run, seconds: float, measured: list[Collective], minimum: list[Collective]) -> None:
    mesh = run.mesh.shape
    params = sum(layout.nbytes for layout in run.model.param_layouts)
    print(
        f"\n{model} | {layout}  (mesh data={mesh['data']} fsdp={mesh['fsdp']} tensor={mesh['tensor']}, "
        f"global batch {run.cfg.train.global_batch_size})"
    )
    print(f"step {seconds * 1e3:.2f} ms (median)   parameters {human_bytes(params)}")
    print(f"  {'op':<20}{'count':>6}{'bytes':>12}{'ring bytes':>12}   |{'minimum bytes':>15}{'ring bytes':>12}")
    for op in OPS:
        count, size, ring = totals(measured, op)
        _, low, low_ring = totals(minimum, op)
        if count or low:
            print(_row(op, count, size, ring, low, low_ring))
    count, size, ring = totals(measured)
    _, low, low_ring = totals(minimum)
    print(_row("total", count, size, ring, low, low_ring))


def _row(name: str, count: int, size: float, ring: float, low: float, low_ring: float) -> str:
    measured = f"{count:>6}{human_bytes(size):>12}{human_bytes(ring):>12}"
    return f"  {name:<20}{measured}   |{human_bytes(low):>15}{human_bytes(low_ring):>12}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--steps", type=int, default=20, help="timed steps per layout")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    parser.add_argument("--batch-size", type=int, help="train.global_batch_size (default: the model's)")
    args = parser.parse_args()

    print(
        f"{jax.device_count()} {jax.devices()[0].platform} devices. Bytes per device per step, from the "
        f"compiled HLO result shapes (reduce-scatter: its full input)."
    )
    print(
        "minimum: data parallel 1 x P (all-reduce grads); fsdp 2 x P all-gather params (fwd + bwd) + 1 x P "
        "reduce-scatter grads = 3 x P; tensor: Megatron activation all-reduces (see the docstring)."
    )
    print("ring bytes: what each device sends, all-reduce 2(n-1)/n x bytes, gather/scatter/all-to-all (n-1)/n x.")
    print(
        "ratio = bytes / minimum; below 1 under fsdp when XLA gathers each parameter once and keeps it for the "
        "backward pass."
    )
    if jax.default_backend() == "cpu":
        print(
            "note: XLA:CPU has no reduce-scatter pass: the fsdp gradient reduce-scatter shows as an all-reduce "
            "(same bytes here, 2x the ring bytes of a reduce-scatter)."
        )
    summary = []
    for model in args.models:
        for layout in args.layouts:
            overrides = QUIET + MODELS[model] + LAYOUTS[layout]
            if args.batch_size:
                overrides.append(f"train.global_batch_size={args.batch_size}")
            with tempfile.TemporaryDirectory() as workdir:  # required by the config; build_run writes nothing there
                cfg = load_config(ROOT / "configs" / "mnist_mlp.yaml", overrides, workdir)
            run = build_run(cfg)
            measured = hlo_collectives(run.compiled.train_step.as_text(), run.mesh.size)
            minimum = parameter_minimum(run) + activation_minimum(run)
            seconds = median_step_seconds(run, args.steps, args.warmup)
            report(model, layout, run, seconds, measured, minimum)
            summary.append((model, layout, seconds, totals(measured), totals(minimum)))

    print(
        f"\n{'model':<12}{'layout':<17}{'step ms':>8}{'ops':>5}{'bytes':>12}{'minimum':>12}{'ratio':>7}"
        f"{'ring bytes':>12}{'ring min':>11}"
    )
    for model, layout, seconds, (count, size, ring), (_, low, low_ring) in summary:
        print(
            f"{model:<12}{layout:<17}{seconds * 1e3:>8.2f}{count:>5}{human_bytes(size):>12}{human_bytes(low):>12}"
            f"{size / low:>7.2f}{human_bytes(ring):>12}{human_bytes(low_ring):>11}"
        )


if __name__ == "__main__":
    main()
