"""Training-loop overhead: the engine's loop against a minimal hand-written JAX loop.

Both loops train the same model on the same data with the same global batch, on one CPU
device, in one process:

  engine        `build_run(cfg)` once, then `engine.trainer.fit(cfg, run)` itself for each
                timing (a fresh workdir, no periodic checkpoints). Its steps/s is fit's own
                mean step time: the loop between log lines, including waits for data, the
                metric windows and the writers, excluding the final eval and save.
  hand-written  `jax.jit(train_step, donate_argnums=0)` around an optax update, host numpy
                batches sliced from `run.dataset.train` beforehand, `jax.device_put` per step;
                the step returns the loss, which is never fetched.

For `--model mlp` there are two hand-written loops: one around a plain flax MLP (Dense 128
relu → Dropout 0.2 → Dense 10 with `nn.Dropout`, mean cross-entropy), and one around the
engine's own flax module and loss (`run.module`, `engine.step.make_loss_fn`). The engine
draws each example's dropout mask from its position in the global batch and returns metric
sums, which costs a little compute; the second loop separates that model cost from the
loop cost. For `--model transformer` (the small GPT of tests/test_parallel.py) the
hand-written loop always uses the engine's module and loss.

Every loop is compiled and warmed up first, then the loops are timed in turn (engine,
hand-written, engine, hand-written, …) for `--rounds` rounds of `--steps` steps, each
timing ending when the final state is ready. The table gives the median steps/s per loop;
`engine / hand-written` is the engine's share of the hand-written loop's speed (1.0 = no
overhead, 0.5 = half as fast), and the overhead in microseconds per step is the difference
of the two median step times. With tiny models the step itself takes tens of microseconds,
so this is a near worst case for loop overhead; it shrinks relative to step time as the
model grows.

    python benchmarks/loop_overhead.py                        # MLP on digits, 2000 steps x 3
    python benchmarks/loop_overhead.py --model transformer --steps 1000
"""
from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = ""  # one device: this measures the loop, not collectives
os.environ["JAX_PLATFORMS"] = "cpu"

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.config import load_config  # noqa: E402
from engine.setup import build_run  # noqa: E402
from engine.step import make_loss_fn  # noqa: E402
from engine.trainer import fit  # noqa: E402

QUIET = ["log.progress=false", "log.tensorboard=false", "mesh.num_devices=1"]
# The small GPT of tests/test_parallel.py, on the same base config.
GPT = ["model.name=transformer", "data.name=synthetic_text", "data.seq_len=16", "data.num_examples=512",
       "data.vocab_size=64", "model.num_layers=2", "model.d_model=32", "model.num_heads=4", "model.mlp_dim=64",
       "model.dropout_rate=0.1", "train.global_batch_size=16"]


# --- the engine's loop ---------------------------------------------------------------------

class EngineLoop:
    """The real `engine.trainer.fit` on a built run; its steps/s is fit's own mean step time
    (the loop between log lines, waits for data included, eval and checkpoint saves excluded)."""

    def __init__(self, run):
        self.run, self.name = run, f"engine (fit, prefetch={run.cfg.data.prefetch})"
        self.steps_per_sec: list[float] = []
        self.workdirs = tempfile.TemporaryDirectory()

    def run_steps(self, steps: int) -> float:
        workdir = tempfile.mkdtemp(dir=self.workdirs.name)
        cfg = dataclasses.replace(self.run.cfg, workdir=workdir, train=dataclasses.replace(
            self.run.cfg.train, steps=steps), checkpoint=dataclasses.replace(self.run.cfg.checkpoint, every_steps=0))
        return 1.0 / fit(cfg, self.run).summary["mean_step_seconds"]

    @property
    def median(self) -> float:
        return statistics.median(self.steps_per_sec)


# --- the hand-written loop -----------------------------------------------------------------

class PlainMLP(nn.Module):
    """The tutorial MLP as one would write it directly in flax."""

    hidden: int
    num_classes: int
    dropout_rate: float

    @nn.compact
    def __call__(self, x, train: bool):
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(self.hidden)(x))
        x = nn.Dropout(self.dropout_rate, deterministic=not train)(x)
        return nn.Dense(self.num_classes)(x)


def plain_mlp_loss(run):
    """(loss, init params) of PlainMLP sized like the run's model."""
    info = run.dataset.info
    model = PlainMLP(run.cfg.model.hidden_sizes[0], info.num_classes, run.cfg.model.dropout_rate)

    def loss(params, batch, key):
        logits = model.apply({"params": params}, batch["image"], train=True, rngs={"dropout": key})
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    params = model.init(jax.random.key(run.cfg.seed), np.zeros((1, *info.input_shape), np.float32),
                        train=False)["params"]
    return loss, params


def engine_model_loss(run, task: str):
    """(loss, init params) of the engine's own module and loss function."""
    loss_fn = make_loss_fn(run.module, task)

    def loss(params, batch, key):
        return loss_fn(params, {}, batch, key, True)[0]  # mlp and transformer have no model state

    return loss, run.init_state().params


def make_handwritten_step(loss, tx):
    def train_step(state, batch):
        params, opt_state, key = state
        key, dropout_key = jax.random.split(key)
        value, grads = jax.value_and_grad(loss)(params, batch, dropout_key)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, key), value

    return jax.jit(train_step, donate_argnums=0)


def handwritten_loop(train_step, host_batches: list, state, start: int, steps: int):
    for step in range(start, start + steps):
        state, _ = train_step(state, jax.device_put(host_batches[step % len(host_batches)]))
    return jax.block_until_ready(state)


def slice_batches(train: dict[str, np.ndarray], batch_size: int) -> list[dict[str, np.ndarray]]:
    """One epoch of contiguous host batches, made once before timing."""
    count = len(next(iter(train.values()))) // batch_size
    return [{name: np.ascontiguousarray(array[i * batch_size:(i + 1) * batch_size]) for name, array in train.items()}
            for i in range(count)]


# --- driver --------------------------------------------------------------------------------

class Loop:
    """One loop under test: its state, the next step number and its timings."""

    def __init__(self, name: str, advance, state):
        self.name, self.advance, self.state = name, advance, state
        self.next_step = 0
        self.steps_per_sec: list[float] = []

    def run_steps(self, steps: int) -> float:
        start = time.perf_counter()
        self.state = self.advance(self.state, self.next_step, steps)
        seconds = time.perf_counter() - start
        self.next_step += steps
        return steps / seconds

    @property
    def median(self) -> float:
        return statistics.median(self.steps_per_sec)


def build_loops(run, task: str) -> list[Loop]:
    cfg = run.cfg
    tx = optax.adam(cfg.optimizer.learning_rate)
    host_batches = slice_batches(run.dataset.train, cfg.train.global_batch_size)
    loops = [EngineLoop(run)]
    variants = [("hand-written, engine module + loss", engine_model_loss(run, task))]
    if cfg.model.name == "mlp":
        variants.insert(0, ("hand-written, plain flax MLP", plain_mlp_loss(run)))
    for name, (loss, params) in variants:
        state = (params, tx.init(params), jax.random.key(cfg.seed))
        loops.append(Loop(name, partial(handwritten_loop, make_handwritten_step(loss, tx), host_batches), state))
    return loops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("mlp", "transformer"), default="mlp")
    parser.add_argument("--steps", type=int, default=2000, help="steps per timed repetition")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repetitions of every loop")
    parser.add_argument("--warmup", type=int, default=50, help="untimed steps per loop after compiling")
    parser.add_argument("--batch-size", type=int, help="train.global_batch_size (default: the config's)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="extra engine config overrides")
    args = parser.parse_args()

    overrides = QUIET + (GPT if args.model == "transformer" else [])
    if args.batch_size:
        overrides.append(f"train.global_batch_size={args.batch_size}")
    overrides += args.overrides
    with tempfile.TemporaryDirectory() as workdir:  # required by the config; build_run writes nothing there
        cfg = load_config(ROOT / "configs" / "mnist_mlp.yaml", overrides, workdir)
    run = build_run(cfg)
    task = "lm" if args.model == "transformer" else "classification"
    loops = build_loops(run, task)

    for loop in loops:  # compile (hand-written) and warm up
        loop.run_steps(args.warmup)
    for _ in range(args.rounds):
        for loop in loops:
            loop.steps_per_sec.append(loop.run_steps(args.steps))

    print(f"model {args.model}: data.name={cfg.data.name}, global batch {cfg.train.global_batch_size}, "
          f"{args.steps} steps x {args.rounds} rounds, 1 {jax.devices()[0].platform} device, "
          f"log.every_steps={cfg.log.every_steps}")
    print(f"{'loop':<40}{'steps/s (median)':>18}{'us/step':>10}   steps/s per round")
    for loop in loops:
        rounds = " ".join(f"{s:.0f}" for s in loop.steps_per_sec)
        print(f"{loop.name:<40}{loop.median:>18.1f}{1e6 / loop.median:>10.1f}   {rounds}")
    engine = loops[0]
    for other in loops[1:]:
        overhead = 1e6 / engine.median - 1e6 / other.median
        print(f"engine / {other.name}: {engine.median / other.median:.2f}  "
              f"(engine overhead {overhead:+.1f} us/step)")


if __name__ == "__main__":
    main()
