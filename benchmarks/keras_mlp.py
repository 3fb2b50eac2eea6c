"""The performance issue's seed workload in Keras 3 on JAX (`model.fit`) against the engine,
in one process, rounds interleaved.

Workload: 784 → Dense 128 relu → Dropout 0.2 → Dense 10, Adam 1e-3, softmax cross-entropy,
global batch 128, float32, on 64,000 × 784 float32 examples in host memory (the same
learnable random data as `loop_overhead.py --models seed_mlp`). Keras trains with
`model.fit` (its defaults: jit-compiled, one step per dispatch; `--steps-per-execution N`
sets Keras's own knob); the engine is `fit` with the default job's config on that data.

    pip install -r benchmarks/requirements-keras.txt   # Keras is not a dependency of the engine
    python benchmarks/keras_mlp.py [--rounds 3] [--epochs 4] [--steps-per-execution 1]
"""

from __future__ import annotations

import os

os.environ["KERAS_BACKEND"] = "jax"
os.environ["XLA_FLAGS"] = ""
os.environ["JAX_PLATFORMS"] = "cpu"

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loop_overhead import MODELS, QUIET, ROOT, EngineLoop, build_run, load_config, seed_npz  # noqa: E402


def keras_model(steps_per_execution: int):
    import keras

    model = keras.Sequential(
        [
            keras.Input((784,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dropout(0.2),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=steps_per_execution,
    )
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4, help="epochs of 500 steps per timed round")
    parser.add_argument("--steps-per-execution", type=int, default=1, help="Keras's steps_per_execution")
    args = parser.parse_args()
    import keras

    with tempfile.TemporaryDirectory() as work:
        path = seed_npz(work)
        with np.load(path) as data:
            x, y = data["x_train"], data["y_train"]
        config, extra = MODELS["seed_mlp"]
        cfg = load_config(
            ROOT / "configs" / config,
            QUIET + extra + [f"data.path={path}", f"train.compilation_cache_dir={work}/xla"],
            work,
        )
        engine = EngineLoop(build_run(cfg))
        model = keras_model(args.steps_per_execution)
        steps = args.epochs * (len(x) // 128)
        model.fit(x, y, batch_size=128, epochs=1, verbose=0, shuffle=True)  # compile and warm up
        engine.run_steps(100)
        keras_rates, engine_rates = [], []
        for _ in range(args.rounds):
            start = time.perf_counter()
            model.fit(x, y, batch_size=128, epochs=args.epochs, verbose=0, shuffle=True)
            keras_rates.append(steps / (time.perf_counter() - start))
            engine_rates.append(engine.run_steps(steps))
        keras_median, engine_median = statistics.median(keras_rates), statistics.median(engine_rates)
        print(
            f"seed workload, {steps} steps x {args.rounds} interleaved rounds, 1 CPU device, Keras {keras.__version__}"
            f" (steps_per_execution={args.steps_per_execution}), engine {engine.name}"
        )
        print(
            f"  Keras 3 on JAX, model.fit: {keras_median:.1f} steps/s (rounds: "
            f"{', '.join(f'{r:.0f}' for r in keras_rates)})"
        )
        print(
            f"  engine, default job config:  {engine_median:.1f} steps/s (rounds: "
            f"{', '.join(f'{r:.0f}' for r in engine_rates)})"
        )
        print(f"  engine / Keras: {engine_median / keras_median:.2f}")


if __name__ == "__main__":
    main()
