"""Training-loop overhead: the engine's loop against a minimal hand-written JAX loop.

Both loops train the same model on the same data with the same global batch and the same
optimizer, on one CPU device, in one process:

  engine        `build_run(cfg)` once, then `engine.run.single.fit(cfg, run)` itself for each
                timing (a fresh workdir, no periodic checkpoints). Its steps/s is fit's own
                mean step time: the loop between log lines, including waits for data, the
                metric windows and the writers, excluding the final eval and save. It is
                timed as configured (one step per call) and, with `--steps-per-call N`,
                again with `train.steps_per_call=N` (N steps per dispatch, a device loop).
  hand-written  `jax.jit(train_step, donate_argnums=0)` around an optax update (the config's
                optimizer written directly with optax), host numpy batches sliced from
                `run.dataset.train` beforehand, `jax.device_put` per step; the step
                returns the loss, which is never fetched.

Models (`--models`): `mlp` (the default job: configs/mnist_mlp.yaml), `transformer` (the
2-layer, d_model 32 GPT of tests/integration/test_parallel.py on synthetic tokens: a worst case, its
step is a couple of milliseconds of tiny kernels) and `gpt_small` (configs/gpt_small.yaml
as it is). For `mlp` there are two hand-written loops: one around a plain flax MLP (Dense
128 relu → Dropout 0.2 → Dense 10 with `nn.Dropout`, mean cross-entropy), and one around
the engine's own flax module and loss (`run.model.module`, `engine.run.step.make_loss_fn`), which
separates the model's cost (per-example dropout masks, metric sums) from the loop's; and a
third around that module and loss with no per-step host work at all (`--device-loop N`: the
split on the device, rows drawn there, N steps per `lax.scan` dispatch): the floor a
hand-written loop reaches on this step. The transformers' hand-written loops use the
engine's module and loss.

Every loop is compiled and warmed up first, then the loops are timed in turn (engine,
hand-written, engine, hand-written, …) for `--rounds` rounds of `--steps` steps, each
timing ending when the final state is ready. The table gives the median steps/s per loop;
`engine / hand-written` is the engine's share of the hand-written loop's speed (1.0 = no
overhead, 0.5 = half as fast), and the overhead in microseconds per step is the difference
of the two median step times.

Per model it also prints: the train step's compile time cold (empty persistent
compilation cache) and cached (the same config built again in this process, served from
the cache this script filled), MFU (the run's model FLOPs per step against the peak the
trainer uses: on CPU a measured float32 matmul) for every loop, and the engine's
data-wait fraction (time the loop waited for input ÷ loop time, from fit's summary).

    python benchmarks/loop_overhead.py                          # mlp, transformer, gpt_small
    python benchmarks/loop_overhead.py --models gpt_small --steps 200 --steps-per-call 1
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = ""  # one device: this measures the loop, not collectives
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # JAX_PLATFORMS=cuda for a GPU

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import io  # noqa: E402
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

from engine.config import load_config, validate  # noqa: E402
from engine.errors import UsageError  # noqa: E402
from engine.observe.perf import peak_flops  # noqa: E402
from engine.run.setup import build_run  # noqa: E402
from engine.run.single import fit  # noqa: E402
from engine.run.step import make_loss_fn  # noqa: E402
from engine.runtime import settings as process  # noqa: E402

process.install()  # as launch.py does: counts compilation-cache hits

QUIET = ["log.progress=false", "log.tensorboard=false", "mesh.num_devices=1"]
# model → (config file, overrides). "transformer" is the small GPT of tests/integration/test_parallel.py
# on the default job's config: a worst case, its step is a couple of milliseconds of tiny
# kernels. "gpt_small" is configs/gpt_small.yaml (4 layers, d_model 128, 128 tokens) as is.
GPT = [
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
]
# "seed_mlp" is the workload of the performance issue: the default job's MLP (784 → Dense
# 128 relu → Dropout 0.2 → Dense 10, Adam 1e-3) on 64,000 × 784 float32 examples in an .npz
# (written by this script; learnable random data), global batch 128.
SEED_MLP = ["data.name=npz", "train.global_batch_size=128"]
# "resnet18" is ResNet-18 (CIFAR stem) on 32x32x3 Gaussian images labelled by a random linear
# map (data.name=synthetic), batch 128, batch norm statistics as model state.
RESNET18 = [
    "model.name=resnet",
    "model.depth=18",
    "data.name=synthetic",
    "data.image_shape=[32,32,3]",
    "data.num_examples=12800",
    "train.global_batch_size=128",
    "optimizer.name=adam",
]
MODELS = {
    "mlp": ("mnist_mlp.yaml", []),
    "seed_mlp": ("mnist_mlp.yaml", SEED_MLP),
    "transformer": ("mnist_mlp.yaml", GPT),
    "gpt_small": ("gpt_small.yaml", []),
    "llama_tiny": ("llama_tiny.yaml", []),
    "resnet18": ("mnist_mlp.yaml", RESNET18),
}
DEFAULT_STEPS = {"mlp": 2000, "seed_mlp": 2050, "transformer": 2000, "gpt_small": 100, "llama_tiny": 40, "resnet18": 20}


def seed_npz(directory: str) -> str:
    """64,000 + 10,000 examples of 784 float32 features, labelled by a fixed random linear map."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((74_000, 784), dtype=np.float32)
    y = np.argmax(x @ rng.standard_normal((784, 10), dtype=np.float32), axis=1).astype(np.int64)
    path = str(Path(directory) / "seed.npz")
    np.savez(path, x_train=x[:64_000], y_train=y[:64_000], x_test=x[64_000:], y_test=y[64_000:])
    return path


# --- the engine's loop ---------------------------------------------------------------------


class EngineLoop:
    """The real `engine.run.single.fit` on a built run; its steps/s is fit's own mean step time
    (the loop between log lines, waits for data included, eval and checkpoint saves excluded)."""

    def __init__(self, run):
        per_call = run.cfg.train.steps_per_call
        self.run, self.name = run, "engine (fit)" + (f", {per_call} steps per call" if per_call > 1 else "")
        self.steps_per_sec: list[float] = []
        self.data_wait: list[float] = []  # fraction of fit's loop time spent waiting for input, per timing
        self.workdirs = tempfile.TemporaryDirectory()

    def run_steps(self, steps: int) -> float:
        workdir = tempfile.mkdtemp(dir=self.workdirs.name)
        cfg = dataclasses.replace(
            self.run.cfg,
            workdir=workdir,
            train=dataclasses.replace(self.run.cfg.train, steps=steps),
            checkpoint=dataclasses.replace(self.run.cfg.checkpoint, every_steps=0),
        )
        with contextlib.redirect_stdout(io.StringIO()):  # fit's eval lines and summary
            summary = fit(cfg, self.run).summary
        self.data_wait.append(summary["data_wait_seconds"] / (summary["mean_step_seconds"] * steps))
        return 1.0 / summary["mean_step_seconds"]

    @property
    def data_wait_fraction(self) -> float:
        return statistics.median(self.data_wait)

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

    def loss(params, model_state, batch, key):
        logits = model.apply({"params": params}, batch["image"], train=True, rngs={"dropout": key})
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean(), model_state

    params = model.init(jax.random.key(run.cfg.seed), np.zeros((1, *info.input_shape), np.float32), train=False)[
        "params"
    ]
    return loss, params, {}


def engine_model_loss(run):
    """(loss, init params) of the engine's own module and loss function."""
    loss_fn = make_loss_fn(run.model.module, run.model.family.task)

    def loss(params, model_state, batch, key):  # model state: ResNet's batch statistics
        value, (_, new_model_state) = loss_fn(params, model_state, batch, key, True)
        return value, new_model_state

    state = run.init_state()
    return loss, state.params, state.model_state


def handwritten_step(loss, tx):
    """train_step(state, batch) → (state, loss), not yet jitted."""

    def train_step(state, batch):
        params, model_state, opt_state, key = state
        key, dropout_key = jax.random.split(key)
        (value, model_state), grads = jax.value_and_grad(loss, has_aux=True)(params, model_state, batch, dropout_key)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), model_state, opt_state, key), value

    return train_step


def make_handwritten_step(loss, tx):
    return jax.jit(handwritten_step(loss, tx), donate_argnums=0)


def handwritten_loop(train_step, host_batches: list, state, start: int, steps: int):
    for step in range(start, start + steps):
        state, _ = train_step(state, jax.device_put(host_batches[step % len(host_batches)]))
    return jax.block_until_ready(state)


def make_device_loop(loss, tx, train: dict, batch_size: int, per_call: int):
    """The strongest loop one would write by hand: the train split on the device, each step's
    rows drawn there (uniformly, by `jax.random.randint`) and `per_call` steps per dispatch in
    a `lax.scan`. Returns advance(state, start, steps)."""
    arrays = jax.device_put(train)
    rows = len(next(iter(train.values())))
    train_step = handwritten_step(loss, tx)
    data_key = jax.random.key(1)

    def one_step(state, step):
        index = jax.random.randint(jax.random.fold_in(data_key, step), (batch_size,), 0, rows)
        return train_step(state, {name: array[index] for name, array in arrays.items()})

    @partial(jax.jit, donate_argnums=0)
    def call(state, start):
        return jax.lax.scan(one_step, state, start + jax.numpy.arange(per_call))[0]

    def advance(state, start: int, steps: int):
        for first in range(start, start + steps, per_call):
            state = call(state, first)
        return jax.block_until_ready(state)

    return advance


def slice_batches(train, batch_size: int) -> list[dict[str, np.ndarray]]:
    """One epoch of contiguous host batches, made once before timing (a token mixture: its
    first 64 batches, in the engine's order)."""
    if not isinstance(train, dict):  # engine.data.tokens.Mixture: windows read through Grain
        examples = train.examples(0, shuffle=True)
        count = min(len(examples) // batch_size, 64)
        return [examples.take(range(i * batch_size, (i + 1) * batch_size)) for i in range(count)]
    count = len(next(iter(train.values()))) // batch_size
    return [
        {name: np.ascontiguousarray(array[i * batch_size : (i + 1) * batch_size]) for name, array in train.items()}
        for i in range(count)
    ]


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


def handwritten_optimizer(cfg) -> optax.GradientTransformation:
    """The run's optimizer as one would write it with optax directly (constant numbers)."""
    opt = cfg.optimizer
    learning_rate = opt.learning_rate
    if opt.schedule == "warmup_cosine":
        learning_rate = optax.warmup_cosine_decay_schedule(
            0.0, opt.learning_rate, opt.warmup_steps, cfg.train.steps, opt.learning_rate * opt.end_learning_rate_factor
        )
    elif opt.schedule != "constant":
        raise SystemExit(f"the hand-written loop has no optimizer.schedule={opt.schedule}")
    if opt.name == "adam":
        tx = optax.adam(learning_rate, b1=opt.momentum, b2=opt.b2, eps=opt.eps)
    elif opt.name == "adamw":
        tx = optax.adamw(learning_rate, b1=opt.momentum, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay)
    else:
        raise SystemExit(f"the hand-written loop has no optimizer.name={opt.name}")
    return optax.chain(optax.clip_by_global_norm(opt.grad_clip_norm), tx) if opt.grad_clip_norm else tx


def build_loops(run, per_call_run=None, device_loop: int = 10) -> list[Loop]:
    cfg = run.cfg
    tx = handwritten_optimizer(cfg)
    host_batches = slice_batches(run.dataset.train, cfg.train.global_batch_size)
    loops = [EngineLoop(run)] + ([EngineLoop(per_call_run)] if per_call_run else [])
    variants = [("hand-written, engine module + loss", engine_model_loss(run))]
    if cfg.model.name == "mlp":
        variants.insert(0, ("hand-written, plain flax MLP", plain_mlp_loss(run)))
    for name, (loss, params, model_state) in variants:
        state = (params, model_state, tx.init(params), jax.random.key(cfg.seed))
        loops.append(Loop(name, partial(handwritten_loop, make_handwritten_step(loss, tx), host_batches), state))
    if cfg.model.name == "mlp" and device_loop > 1:  # the data on the device, several steps per dispatch
        loss, params, model_state = engine_model_loss(run)
        state = (params, model_state, tx.init(params), jax.random.key(cfg.seed))
        advance = make_device_loop(loss, tx, run.dataset.train, cfg.train.global_batch_size, device_loop)
        loops.append(Loop(f"hand-written, device data, {device_loop}/scan", advance, state))
    return loops


def benchmark(model: str, args, cache_dir: str) -> None:
    config, extra = MODELS[model]
    overrides = QUIET + extra + [f"train.compilation_cache_dir={cache_dir}"]
    if model == "seed_mlp":
        overrides.append(f"data.path={seed_npz(cache_dir)}")
    if args.batch_size:
        overrides.append(f"train.global_batch_size={args.batch_size}")
    overrides += args.overrides
    with tempfile.TemporaryDirectory() as workdir:  # required by the config; build_run writes nothing there
        cfg = load_config(ROOT / "configs" / config, overrides, workdir)
    cold = build_run(cfg)  # the programs are new to the cache: compiled and stored
    run = build_run(cfg)  # the same programs again: loaded from the persistent cache
    steps, per_call_run = args.steps or DEFAULT_STEPS[model], None
    if args.steps_per_call > 1:  # the engine again, several steps per dispatch (train.steps_per_call)
        per_call = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps_per_call=args.steps_per_call))
        try:
            validate(per_call)
            per_call_run = build_run(per_call)
        except UsageError as error:
            print(f"{model}: not timing train.steps_per_call={args.steps_per_call}: {error}")
    loops = build_loops(run, per_call_run, args.device_loop)

    for loop in loops:  # compile (hand-written) and warm up
        loop.run_steps(args.warmup)
    for _ in range(args.rounds):
        for loop in loops:
            loop.steps_per_sec.append(loop.run_steps(steps))

    engines = [loop for loop in loops if isinstance(loop, EngineLoop)]
    engine = engines[0]
    peak, peak_source = peak_flops(jax.devices()[0], cfg.train.compute_dtype)
    flops = run.cost.flops_per_device_step
    print(
        f"model {model}: data.name={cfg.data.name}, global batch {cfg.train.global_batch_size}, "
        f"{steps} steps x {args.rounds} rounds, 1 {jax.devices()[0].platform} device, "
        f"log.every_steps={cfg.log.every_steps}, data.steps_per_transfer={cfg.data.steps_per_transfer}"
    )
    print(f"{'loop':<40}{'steps/s (median)':>18}{'us/step':>10}{'MFU':>8}   steps/s per round")
    for loop in loops:
        rounds = " ".join(f"{s:.0f}" for s in loop.steps_per_sec)
        print(
            f"{loop.name:<40}{loop.median:>18.1f}{1e6 / loop.median:>10.1f}{flops * loop.median / peak:>8.1%}   "
            f"{rounds}"
        )
    for ours in engines:
        for other in loops[len(engines) :]:
            overhead = 1e6 / ours.median - 1e6 / other.median
            print(
                f"{ours.name} / {other.name}: {ours.median / other.median:.2f}  "
                f"(engine overhead {overhead:+.1f} us/step)"
            )
    print(f"MFU: {flops:.4g} model FLOPs per step ({run.cost.source}) against {peak:.4g} FLOP/s ({peak_source})")
    print(f"engine data wait: {engine.data_wait_fraction:.2%} of loop time (median over rounds)")
    print(
        f"train step compile: cold {cold.compiled.compile_seconds:.2f} s "
        f"({cold.compile_cache.get('misses', 0)} cache misses), "
        f"cached {run.compiled.compile_seconds:.2f} s ({run.compile_cache.get('hits', 0)} cache hits)\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=tuple(MODELS), default=["mlp", "transformer", "gpt_small"])
    parser.add_argument("--steps", type=int, help=f"steps per timed repetition (default: {DEFAULT_STEPS})")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repetitions of every loop")
    parser.add_argument("--warmup", type=int, default=50, help="untimed steps per loop after compiling (and caching)")
    parser.add_argument("--batch-size", type=int, help="train.global_batch_size (default: the config's)")
    parser.add_argument(
        "--steps-per-call",
        type=int,
        default=10,
        help="also time the engine with train.steps_per_call=N (1: skip); divides --steps, --warmup "
        "and log.every_steps",
    )
    parser.add_argument(
        "--device-loop",
        type=int,
        default=10,
        help="steps per lax.scan of the hand-written device-data loop (MLPs; 1: skip it); divides --steps and --warmup",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="extra engine config overrides")
    args = parser.parse_args()
    if args.device_loop > 1 and ((args.steps or 0) % args.device_loop or args.warmup % args.device_loop):
        parser.error(f"--device-loop {args.device_loop} must divide --steps and --warmup")
    with tempfile.TemporaryDirectory() as cache_dir:  # a fresh persistent compilation cache
        for model in args.models:
            benchmark(model, args, cache_dir)


if __name__ == "__main__":
    main()
