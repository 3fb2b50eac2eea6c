"""The performance issue's seed workload in TensorFlow 2 with `tf.distribute.MirroredStrategy`
and `model.fit`: what a tf.distribute user runs today, to compare with the engine.

Workload: 784 → Dense 128 relu → Dropout 0.2 → Dense 10, Adam 1e-3, softmax cross-entropy,
global batch 128, float32, on 64,000 × 784 float32 examples in host memory: the same
learnable random data as `loop_overhead.py --models seed_mlp` (the same generator, seed 0).
One CPU device in the strategy (the engine's benchmarks use one CPU device too). Prints
steps/s per timed round and their median.

TensorFlow is not a dependency of the engine and does not share its environment (it pins
its own numpy and protobuf): install it in a virtualenv of its own, and interleave rounds
with the engine's by running the two scripts in turn:

    python -m venv /tmp/tf && /tmp/tf/bin/pip install -r benchmarks/requirements-tf.txt
    for round in 1 2 3; do
      /tmp/tf/bin/python benchmarks/tf_mirrored_mlp.py --rounds 1
      python benchmarks/loop_overhead.py --models seed_mlp --rounds 1 --steps 2000
    done
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402


def seed_data() -> tuple[np.ndarray, np.ndarray]:
    """64,000 examples of 784 float32 features, labelled by a fixed random linear map
    (benchmarks/loop_overhead.py's seed_npz, train split)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((74_000, 784), dtype=np.float32)
    y = np.argmax(x @ rng.standard_normal((784, 10), dtype=np.float32), axis=1).astype(np.int64)
    return x[:64_000], y[:64_000]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4, help="epochs of 500 steps per timed round")
    args = parser.parse_args()
    import tensorflow as tf

    x, y = seed_data()
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        model = tf.keras.Sequential(
            [
                tf.keras.Input((784,)),
                tf.keras.layers.Dense(128, activation="relu"),
                tf.keras.layers.Dropout(0.2),
                tf.keras.layers.Dense(10),
            ]
        )
        model.compile(
            optimizer=tf.keras.optimizers.Adam(1e-3),
            loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    steps = args.epochs * (len(x) // 128)
    model.fit(x, y, batch_size=128, epochs=1, verbose=0, shuffle=True)  # trace, compile, warm up
    rates = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        model.fit(x, y, batch_size=128, epochs=args.epochs, verbose=0, shuffle=True)
        rates.append(steps / (time.perf_counter() - start))
    print(
        f"TensorFlow {tf.__version__} MirroredStrategy (1 CPU device) + model.fit, {steps} steps x {args.rounds}: "
        f"{statistics.median(rates):.1f} steps/s (rounds: {', '.join(f'{r:.0f}' for r in rates)})"
    )


if __name__ == "__main__":
    main()
