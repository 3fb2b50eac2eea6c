"""Rows per second on the shipped table (configs/penguins_wide_deep.yaml): the engine's input
pipeline (read, fit the feature columns, transform) and its training, against Keras 3 with
its preprocessing layers (`keras.utils.FeatureSpace`: adapt, then map over a tf.data
pipeline) and `model.fit`, rounds interleaved in one run.

The table: the 344 Palmer penguins tiled `--copies` times (default 300: 103,200 rows) into
one CSV. The features are the shipped config's: four z-scored numerics (missing: mean), the
categorical island, sex (missing: its own value) and year, flipper length in 4 quantile
buckets, island x sex crossed into 16 hash buckets. The engine's model is the config's wide &
deep (embeddings of sex and year, indicators of island and the bucket, the cross in the wide
part, one hidden layer of 16). Keras's FeatureSpace concatenates one-hot categoricals, the
numerics and the cross into one vector, read by a linear part and by Dense 16 relu (its
closest wide & deep). Both: Adam 3e-3, batch 32, float32, on this CPU.

- input rows/s: the table's rows / seconds to read the CSV, fit what the train split decides
  and transform every row (engine: load_dataset with its feature cache removed first; Keras:
  read_csv, FeatureSpace.adapt and one pass of the mapped tf.data pipeline);
- train rows/s: rows trained / seconds of training after the first step (engine: the run's
  summary; Keras: the second epoch of model.fit over the preprocessed rows).

Keras needs TensorFlow (FeatureSpace's lookups are TensorFlow layers), which is not a
dependency of the engine: give a Python that has it.

    python -m venv /tmp/tfvenv
    /tmp/tfvenv/bin/pip install -r benchmarks/requirements-tf.txt -r benchmarks/requirements-keras.txt
    python benchmarks/table_input.py --keras-python /tmp/tfvenv/bin/python [--rounds 3] [--copies 300]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "penguins_wide_deep.yaml"

ENGINE_INPUT = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from engine.config import load_config
from engine.data import load_dataset
from engine.data.table import CACHE
path = sys.argv[2]
cfg = load_config(sys.argv[3], [f"data.path={path}"], "/tmp/unused")
for cache in __import__("pathlib").Path(path).parent.glob(".*.features-*.json"):
    cache.unlink()
start = time.perf_counter()
data = load_dataset(cfg.data)
seconds = time.perf_counter() - start
print(json.dumps({"rows": data.info.num_train + data.info.num_eval, "seconds": seconds}))
"""

KERAS = """
import json, os, sys, time
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
import numpy as np, tensorflow as tf, keras
from keras.utils import FeatureSpace as F
path, steps_epochs = sys.argv[1], int(sys.argv[2])
start = time.perf_counter()
ds = tf.data.experimental.make_csv_dataset(path, batch_size=1024, label_name="species", num_epochs=1,
    shuffle=False, column_defaults=["", "", *[float("nan")] * 4, "", ""], na_value="NA")
numeric = ["bill_length_mm", "bill_depth_mm", "flipper_length_mm", "body_mass_g"]
def fill(x, y):  # FeatureSpace has no fill rule: a missing measurement is 0 (2 of the 344 birds)
    x = dict(x)
    for name in numeric:
        x[name] = tf.where(tf.math.is_nan(x[name]), tf.zeros_like(x[name]), x[name])
    x["flipper_bucket"] = x["flipper_length_mm"]
    hot = tf.cast(tf.equal(y[:, None], ["Adelie", "Chinstrap", "Gentoo"]), tf.int32)
    return x, tf.cast(tf.argmax(hot, 1), tf.int32)
ds = ds.map(fill)
features = {n: F.float_normalized() for n in numeric}
features.update(island=F.string_categorical(), sex=F.string_categorical(), year=F.string_categorical(),
                flipper_bucket=F.float_discretized(num_bins=4))
space = F(features=features, crosses=[F.cross(("island", "sex"), crossing_dim=16)], output_mode="concat")
space.adapt(ds.map(lambda x, y: x))
pre = ds.map(lambda x, y: (space(x), y), num_parallel_calls=tf.data.AUTOTUNE)
xs, ys = [], []
for x, y in pre:
    xs.append(x.numpy()); ys.append(y.numpy())
x, y = np.concatenate(xs), np.concatenate(ys)
input_seconds = time.perf_counter() - start
inputs = keras.Input(shape=(x.shape[1],))
wide = keras.layers.Dense(3)(inputs)
deep = keras.layers.Dense(3)(keras.layers.Dense(16, activation="relu")(inputs))
model = keras.Model(inputs, keras.layers.Add()([wide, deep]))
model.compile(optimizer=keras.optimizers.Adam(3e-3), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(x, y, batch_size=32, epochs=1, verbose=0)  # compiles
start = time.perf_counter()
model.fit(x, y, batch_size=32, epochs=1, verbose=0)
train_seconds = time.perf_counter() - start
print(json.dumps({"rows": len(x), "input_seconds": input_seconds, "train_seconds": train_seconds}))
"""


def tiled_table(directory: Path, copies: int) -> Path:
    """The penguins CSV `copies` times over (one header)."""
    sys.path.insert(0, str(ROOT))
    from engine.data.table import table_files

    lines = table_files("palmerpenguins:data/penguins.csv")[0].read_text().splitlines()
    path = directory / "penguins_tiled.csv"
    path.write_text("\n".join([lines[0], *(lines[1:] * copies)]) + "\n")
    return path


def engine_round(path: Path, workdir: Path, steps: int) -> dict:
    probe = subprocess.run(
        [sys.executable, "-c", ENGINE_INPUT, str(ROOT), str(path), str(CONFIG)],
        capture_output=True,
        text=True,
        check=True,
    )
    data = json.loads(probe.stdout.strip().splitlines()[-1])
    overrides = [f"data.path={path}", f"train.steps={steps}", "eval.every_steps=0", "log.progress=false"]
    command = [sys.executable, str(ROOT / "launch.py"), "--config", str(CONFIG), "--workdir", str(workdir)]
    subprocess.run([*command, *overrides, "log.tensorboard=false"], capture_output=True, text=True, check=True)
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    summary = next(r for r in map(json.loads, lines) if r["split"] == "summary")
    train_seconds = summary["wall_seconds"] - summary["time_to_first_step"]
    return {"input": data["rows"] / data["seconds"], "train": 32 * (steps - 1) / train_seconds}


def keras_round(python: str, path: Path) -> dict:
    proc = subprocess.run([python, "-c", KERAS, str(path), "1"], capture_output=True, text=True, check=True)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"input": result["rows"] / result["input_seconds"], "train": result["rows"] / result["train_seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keras-python", required=True, help="a Python with tensorflow and keras 3")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--copies", type=int, default=300)
    parser.add_argument("--steps", type=int, default=3000, help="engine training steps per round")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = tiled_table(Path(tmp), args.copies)
        results: dict[str, list[dict]] = {"engine": [], "keras": []}
        for i in range(args.rounds):  # interleaved: engine, Keras, engine, Keras, ...
            results["engine"].append(engine_round(path, Path(tmp) / f"run{i}", args.steps))
            results["keras"].append(keras_round(args.keras_python, path))
            print(f"round {i}: engine {results['engine'][-1]}  keras {results['keras'][-1]}", flush=True)
    rows = 344 * args.copies
    print(f"\n{rows:,} rows; medians of {args.rounds} interleaved rounds (rows/s)")
    print(f"{'':12}{'engine':>12}{'keras':>12}{'ratio':>8}")
    for what in ("input", "train"):
        engine = statistics.median(r[what] for r in results["engine"])
        keras = statistics.median(r[what] for r in results["keras"])
        print(f"{what:12}{engine:12,.0f}{keras:12,.0f}{engine / keras:8.2f}")


if __name__ == "__main__":
    main()
